"""Shared helpers of the AgentMTPChat unit tests (no tests here): a tiny random-weight Llama that uses the
default model's real tokenizer (SmolLM2, 49152 tokens + the <mask> row), built in about a second."""

from __future__ import annotations

import functools
from typing import Any

import torch

from agent_mtp.engine import MTPEngine, new_adapter
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.loading import ensure_default_model, ensure_mask_token


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
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = real_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    mask, mask_id, _ = ensure_mask_token(model, tokenizer, None)
    adapter = None
    if adapter_seed is not None:
        adapter = new_adapter(model, base_model="tiny", mask_token=mask, mask_token_id=mask_id, rank=4)
        gen = torch.Generator().manual_seed(adapter_seed)
        with torch.no_grad():
            for p in adapter.trainable_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        adapter.requires_grad_(False)
    engine = MTPEngine(
        model, tokenizer, model_id="tiny-smollm2-vocab", mask_token=mask, mask_token_id=mask_id, adapter=adapter
    )
    engine.set_cost_curve(CPU_LIKE_CURVE)
    return engine


CPU_LIKE_CURVE = CostCurve(((1, 1.0), (4, 1.5), (8, 1.9), (16, 2.1), (32, 2.5)))
"""The measured fp32 CPU shape from ARCHITECTURE.md, so no test measures timings."""
