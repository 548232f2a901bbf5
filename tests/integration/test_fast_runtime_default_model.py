"""The fast runtime on the real default model: exact against HF generate, verified exact against its NTP, and the
llama.cpp peer (when llama-cpp-python is installed)."""

from __future__ import annotations

import pytest
import torch

from agent_mtp.bench.core import load_suite
from agent_mtp.bench.hf import BaselineModels, hf_generate
from agent_mtp.bench.llamacpp import unavailable_reason
from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.fast import blockq

PROMPTS = load_suite("quick")


def test_default_engine_runs_the_fast_runtime(default_engine: MTPEngine) -> None:
    assert default_engine.runtime == "fast"
    curve = default_engine.measure_cost_curve()
    assert curve.points[0] == (1, 1.0) and all(c >= 1.0 for _, c in curve.points)


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p.id for p in PROMPTS])
def test_fast_ntp_and_verified_equal_hf_generate(default_engine: MTPEngine, prompt) -> None:
    """Greedy, fp32, unconstrained: HF generate on the bare model == fast ntp == fast verified, token for token."""
    ids = default_engine.encode_prompt(prompt.prompt_messages())
    n = min(prompt.max_new_tokens, 48)
    with BaselineModels(default_engine).use(None) as model:
        expected = hf_generate(default_engine, model, ids, n).token_ids
    ntp = default_engine.generate(ids, DecodeConfig(mode="ntp", max_new_tokens=n)).token_ids
    verified = default_engine.generate(ids, DecodeConfig(mode="verified", k_max=4, max_new_tokens=n)).token_ids
    assert ntp == expected
    assert verified == expected


@pytest.mark.skipif(not blockq.kernels_available(), reason="block-weight kernels unavailable here")
def test_default_model_runs_on_its_gguf_blocks(default_engine: MTPEngine) -> None:
    """Every decoder GEMM and the lm_head of the default model are recovered as GGUF blocks (Q4_1 / Q8_0), and
    short passes (masks and the adapter included) match the float32 GEMM."""
    fast = default_engine.new_runner().model  # type: ignore[attr-defined]
    assert all(layer.gate_up.linear.blocks is not None for layer in fast.layers)
    assert {layer.qkv.linear.blocks.kind for layer in fast.layers} == {"q4_1"}
    assert fast.lm_head.blocks is not None and fast.lm_head.blocks.kind == "q8_0"
    dense = default_engine.with_runtime("fast", block_weights=False)
    m = default_engine.mask_token_id
    ids = default_engine.encode_prompt("List three fruits as a markdown list.")
    a, b = default_engine.new_runner(), dense.new_runner()
    torch.testing.assert_close(a.forward(ids, 1), b.forward(ids, 1), atol=1e-4, rtol=1e-4)
    for feed in ([ids[-1]], [5, m], [7, m, m, m]):
        torch.testing.assert_close(a.forward(feed, len(feed)), b.forward(feed, len(feed)), atol=5e-4, rtol=1e-4)


def test_fast_logits_close_to_hf_with_adapter(default_engine: MTPEngine) -> None:
    hf = default_engine.with_runtime("hf")
    m = default_engine.mask_token_id
    ids = default_engine.encode_prompt("List three fruits as a markdown list.")
    feed = [*ids, m, m, m]
    a = hf.new_runner().forward(feed, 4)
    b = default_engine.new_runner().forward(feed, 4)
    torch.testing.assert_close(b, a, atol=5e-4, rtol=1e-4)


@pytest.mark.skipif(unavailable_reason("default") is not None, reason=str(unavailable_reason("default")))
def test_llama_cpp_peer_generates_on_the_same_gguf(default_engine: MTPEngine) -> None:
    peer = BaselineModels(default_engine).llama_cpp()
    ids = default_engine.encode_prompt("Say hello.")
    out = peer.generate(ids, 12, default_engine.eos_token_ids)
    assert 1 <= len(out.token_ids) <= 12 and out.wall_s > 0
    assert default_engine.decode_tokens(out.token_ids).strip()
