"""Exactness: every lossless path must reproduce plain greedy NTP token for token."""

from __future__ import annotations

import random

import pytest
import torch

from agent_mtp.engine import DecodeConfig
from agent_mtp.engine.cost import CostCurve
from tests.tiny import tiny_engine

PROMPTS = [
    "The quick brown fox",
    "Thought: I should call a tool.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "- item one\n- item two",
    "Summarise the text: agents copy names",
]


LINEAR = CostCurve(((1, 1.0), (32, 2.55)), real=((1, 1.0), (32, 1.62)), draft=((1, 1.0), (2, 1.2), (32, 2.4)))
"""Costs whose steps do not depend on what a pass already holds: a prefix-cache hit (one pending token) and a full
prefill (the whole prompt pending) then see the same marginal costs, so the planner makes the same choices; a measured
curve bends, and the two could differ at the first pass on one machine and not on another."""


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine(adapter=True)
    engine.set_cost_curve(LINEAR)
    return engine


@pytest.fixture(scope="module")
def bare_engine():
    return tiny_engine(seed=3)


def _ntp(engine, prompt, n=40):
    return engine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=n)).token_ids


def _random_prompts(engine, count, seed=0):
    rng = random.Random(seed)
    vocab = len(engine.tokenizer) - 5
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


@pytest.mark.parametrize("drafts", [("mtp",), ("ngram",), ("mtp", "ngram")])
@pytest.mark.parametrize("k_max", [2, 4, 8])
def test_verified_equals_ntp_greedy(engine, drafts, k_max):
    for prompt in PROMPTS + _random_prompts(engine, 6, seed=k_max):
        cfg = DecodeConfig(mode="verified", k_max=k_max, drafts=drafts, max_new_tokens=40)
        result = engine.generate(prompt, cfg)
        assert result.token_ids == _ntp(engine, prompt), (prompt, drafts, k_max)


def test_verified_actually_accepts_drafts(engine):
    """Guard against a verified mode that is exact only because it never accepts anything."""
    accepted = 0
    for prompt in PROMPTS:
        stats = engine.generate(prompt, DecodeConfig(mode="verified", k_max=4, max_new_tokens=60)).stats
        accepted += sum(s["accepted"] for s in stats.draft_stats.values())
    assert accepted > 0


def test_verified_equals_ntp_without_adapter(bare_engine):
    for prompt in PROMPTS:
        result = bare_engine.generate(prompt, DecodeConfig(mode="verified", k_max=6, max_new_tokens=40))
        assert result.token_ids == _ntp(bare_engine, prompt)


def test_confadapt_threshold_one_is_ntp(engine):
    for prompt in PROMPTS:
        result = engine.generate(prompt, DecodeConfig(mode="confadapt", threshold=1.0, k_max=8, max_new_tokens=40))
        assert result.token_ids == _ntp(engine, prompt)
        assert result.stats.tokens_per_forward == 1.0


def test_static_k1_is_ntp(engine):
    for prompt in PROMPTS:
        result = engine.generate(prompt, DecodeConfig(mode="static", k_max=1, max_new_tokens=40))
        assert result.token_ids == _ntp(engine, prompt)


def test_ntp_equals_hf_generate(bare_engine):
    tok, model = bare_engine.tokenizer, bare_engine.model
    for prompt in PROMPTS[:3]:
        ids = bare_engine.encode_prompt(prompt)
        hf = model.generate(
            torch.tensor([ids]), max_new_tokens=30, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=0
        )[0, len(ids) :].tolist()
        ours = bare_engine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=30)).token_ids
        assert ours == hf


@pytest.mark.parametrize(
    "cfg",
    [
        DecodeConfig(mode="ntp", max_new_tokens=25),
        DecodeConfig(mode="static", k_max=4, max_new_tokens=25),
        DecodeConfig(mode="confadapt", threshold=0.05, k_max=6, max_new_tokens=25),
        DecodeConfig(mode="verified", k_max=5, max_new_tokens=25),
    ],
    ids=lambda c: c.mode,
)
def test_kv_cache_matches_cache_free_reference(engine, cfg):
    for prompt in PROMPTS[:3]:
        cached = engine.generate(prompt, cfg)
        reference = engine.generate(prompt, cfg, _reference=True)
        assert cached.token_ids == reference.token_ids
        assert cached.stats.forward_passes == reference.stats.forward_passes


def test_static_accepts_k_tokens_per_pass(engine):
    result = engine.generate(PROMPTS[0], DecodeConfig(mode="static", k_max=4, max_new_tokens=40, stop_token_ids=()))
    if result.finish_reason == "length":
        assert result.stats.tokens_per_forward == pytest.approx(4.0)


def test_confadapt_low_threshold_is_faster_than_ntp(engine):
    result = engine.generate(PROMPTS[0], DecodeConfig(mode="confadapt", threshold=0.0, k_max=4, max_new_tokens=40))
    assert result.stats.tokens_per_forward > 1.5
