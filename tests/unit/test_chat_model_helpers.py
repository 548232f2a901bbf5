"""Shared helpers of the AgentMTPChat unit tests (no tests here): a tiny random-weight Llama that uses the
default model's real tokenizer (SmolLM2, 49152 tokens + the <mask> row), built in about a second."""

from __future__ import annotations

import functools
from typing import Any

from agent_mtp.engine import MTPEngine
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.loading import ensure_default_model


@functools.lru_cache(maxsize=1)
def _tokenizer_dir() -> str:
    return str(ensure_default_model())


@functools.lru_cache(maxsize=1)
def _tokenizer_json_files() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_tokenizer_dir())


def real_tokenizer() -> Any:
    """A fresh copy of the default model's tokenizer (each engine adds its own <mask> token to it)."""
    import copy

    return copy.deepcopy(_tokenizer_json_files())


@functools.lru_cache(maxsize=4)
def shared_tiny_engine(seed: int = 0) -> MTPEngine:
    """One engine per seed for the whole test session (engines keep no state between generations)."""
    return tiny_real_vocab_engine(seed=seed)


def tiny_real_vocab_engine(*, seed: int = 0, adapter_seed: int | None = 1, hidden: int = 64) -> MTPEngine:
    """An MTPEngine over a 2-layer random LlamaForCausalLM with the default model's tokenizer and chat template.

    With ``adapter_seed`` a random gated MTP adapter makes the mask predictions differ from NTP (so multi-token
    blocks really get cut by the grammar and by verification). The cost curve is fixed, so verified mode plans
    without measuring anything.
    """
    from tests.tiny import tiny_engine

    engine = tiny_engine(
        seed=seed,
        adapter=adapter_seed is not None,
        adapter_seed=adapter_seed or 0,
        tokenizer=real_tokenizer(),
        model_id="tiny-smollm2-vocab",
        hidden=hidden,
        max_positions=2048,
    )
    engine.set_cost_curve(CPU_LIKE_CURVE)
    return engine


CPU_LIKE_CURVE = CostCurve(((1, 1.0), (4, 1.5), (8, 1.9), (16, 2.1), (32, 2.5)))
"""The measured fp32 CPU shape from ARCHITECTURE.md, so no test measures timings."""
