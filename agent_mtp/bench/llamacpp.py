"""The llama.cpp peer: what a local CPU user would run instead (``llama-cpp-python`` on the same GGUF, greedy).

Optional: ``pip install 'agent-mtp[peers]'`` (or a prebuilt ``llama-cpp-python`` wheel). It is fed the engine's own
prompt token ids (the GGUF holds the same vocabulary), decodes greedily with its KV cache cleared before every
prompt (no prefix reuse across runs, like the engine) and is timed from outside, like every variant. It runs without
the grammar constraint: on constrained prompts it may write a different (unparsed) answer, which the quality columns
show.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agent_mtp.bench.hf import HFOutput
from agent_mtp.engine.loading import DEFAULT_MODEL_ALIASES, find_default_gguf
from agent_mtp.errors import ConfigError

CONTEXT_TOKENS = 4096


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def gguf_for(model_id: str, gguf: str | Path | None = None) -> Path:
    """The GGUF file of the engine's model: ``gguf`` if given, the embedded one for the default model."""
    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise ConfigError(f"gguf={str(gguf)!r} is not a file; pass the GGUF of the benchmarked model.")
        return path
    if model_id.lower() in DEFAULT_MODEL_ALIASES or "smollm2-135m-instruct" in model_id.lower():
        return find_default_gguf()
    raise ConfigError(f"The llama-cpp variant needs the GGUF file of {model_id!r}; pass it with --gguf.")


def unavailable_reason(model_id: str, gguf: str | Path | None = None) -> str | None:
    """Why the llama-cpp variant cannot run here (None when it can)."""
    if not llama_cpp_available():
        return "llama-cpp-python is not installed (pip install 'agent-mtp[peers]')"
    try:
        gguf_for(model_id, gguf)
    except ConfigError as e:
        return str(e)
    return None


class LlamaCppPeer:
    """One ``llama_cpp.Llama`` on a GGUF file, with as many threads as torch uses."""

    def __init__(self, gguf: Path, *, threads: int | None = None, context_tokens: int = CONTEXT_TOKENS) -> None:
        if not llama_cpp_available():
            msg = "The llama-cpp variant needs llama-cpp-python: pip install 'agent-mtp[peers]'."
            raise ConfigError(msg)
        import llama_cpp

        n_threads = threads or torch.get_num_threads()
        self.gguf = gguf
        self.llm: Any = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=context_tokens, n_threads=n_threads, n_threads_batch=n_threads, verbose=False
        )

    def generate(self, ids: Sequence[int], max_new_tokens: int, eos_ids: frozenset[int]) -> HFOutput:
        """Greedy decoding of ``ids`` to EOS or ``max_new_tokens``: token ids, wall time, TTFT, forward passes."""
        self.llm.reset()  # no prefix reuse from an earlier run
        out: list[int] = []
        start = time.perf_counter()
        ttft = float("nan")
        for token in self.llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if not out:
                ttft = time.perf_counter() - start
            out.append(int(token))
            if token in eos_ids or len(out) >= max_new_tokens:
                break
        wall = time.perf_counter() - start
        return HFOutput(out, wall, ttft, len(out))
