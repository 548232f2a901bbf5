"""The prefix KV cache: the radix tree on its own, and engines whose output is the same with and without it."""

from __future__ import annotations

import random

import pytest
import torch

from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.loading import PREFIX_CACHE_ENV, LoadedModel, prefix_cache_mb
from agent_mtp.engine.prefix_cache import PrefixCache
from agent_mtp.errors import ConfigError
from tests.tiny import tiny_engine

TOKEN_BYTES = 4 * 2 * 3 * 5  # the fake payload below: 4 layers x (k, v) x 3 heads x 5 dims x 1 byte per token


def _payload(ids: list[int]) -> torch.Tensor:
    """A fake KV payload [4, 2, 3, n, 5] (uint8) whose values encode the token ids, to check what comes back."""
    t = torch.tensor(ids, dtype=torch.uint8)
    return t[None, None, None, :, None].expand(4, 2, 3, len(ids), 5).contiguous()


def _insert(cache: PrefixCache, ids: list[int]) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []

    def export(start: int, end: int) -> torch.Tensor:
        calls.append((start, end))
        return _payload(ids[start:end])

    cache.insert(ids, export)
    return calls


def _tokens_of(match) -> list[int]:
    return torch.cat(match.segments, dim=3)[0, 0, 0, :, 0].tolist() if match.segments else []


def test_longest_prefix_split_and_reuse() -> None:
    cache = PrefixCache(10**6)
    assert _insert(cache, [1, 2, 3, 4, 5]) == [(0, 5)]
    assert _insert(cache, [1, 2, 3, 9, 9, 9]) == [(3, 6)]  # only the new part is exported; the edge is split
    assert _insert(cache, [1, 2, 3, 4, 5]) == []  # identical: nothing new
    for ids, expected in [([1, 2, 3, 4, 5, 6], 5), ([1, 2, 3, 9, 8], 4), ([1, 2, 7], 2), ([5], 0)]:
        match = cache.match(ids)
        assert match.length == expected
        assert _tokens_of(match) == ids[:expected]
    assert cache.match([1, 2, 3, 4, 5], limit=4).length == 4
    assert cache.stats.hits == 4 and cache.stats.lookups == 5


def test_budget_is_never_exceeded_and_lru_goes_first() -> None:
    cache = PrefixCache(budget_bytes=10 * TOKEN_BYTES)
    _insert(cache, [1, 2, 3, 4])
    _insert(cache, [5, 6, 7, 8])
    assert cache.nbytes == 8 * TOKEN_BYTES
    cache.match([1, 2, 3])  # [1..4] is now the most recently used
    _insert(cache, [9, 10, 11])
    assert cache.nbytes <= 10 * TOKEN_BYTES
    assert cache.match([5, 6, 7, 8]).length == 0  # the least recently used went
    assert cache.match([1, 2, 3, 4]).length == 4
    _insert(cache, list(range(20, 40)))  # longer than the whole budget: kept only as far as it fits
    assert cache.nbytes <= 10 * TOKEN_BYTES
    assert cache.match(list(range(20, 40))).length == 10


def test_bind_clears_on_new_owner_and_zero_budget_stores_nothing() -> None:
    cache = PrefixCache(10**6)
    cache.bind("weights-1")
    _insert(cache, [1, 2, 3])
    cache.bind("weights-1")
    assert cache.match([1, 2, 3]).length == 3
    cache.bind("weights-2")
    assert cache.match([1, 2, 3]).length == 0
    off = PrefixCache(0)
    assert _insert(off, [1, 2, 3]) == [] and off.nbytes == 0


# -- the engine with the cache --------------------------------------------------------------------------------------
MODES = [
    DecodeConfig(mode="ntp", max_new_tokens=24),
    DecodeConfig(mode="verified", k_max=4, max_new_tokens=24),
    DecodeConfig(mode="confadapt", threshold=0.3, k_max=4, max_new_tokens=24),
    DecodeConfig(mode="static", k_max=3, max_new_tokens=24),
]


def _conversations(seed: int = 0) -> list[list[int]]:
    """Shared, diverging and identical prefixes, like agent steps."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(30)]
    step1 = system + [rng.randrange(3, 300) for _ in range(8)]
    step2 = step1 + [rng.randrange(3, 300) for _ in range(12)]
    other = system[:20] + [rng.randrange(3, 300) for _ in range(10)]
    return [step1, step2, step2, other, step1, system + step2[30:36]]


@pytest.fixture(scope="module", params=["fast", "fast-fp16", "hf"])
def engines(request: pytest.FixtureRequest) -> tuple[MTPEngine, MTPEngine]:
    """fast-fp16: float16 KV caches (the cache keeps their halves)."""
    base = tiny_engine(adapter=True)
    loaded = LoadedModel(base.model, base.tokenizer, "tiny", base.mask_token, base.mask_token_id, False)
    runtime, kv = ("fast", "fp16") if request.param == "fast-fp16" else (request.param, None)
    cached = MTPEngine(loaded, adapter=base.adapter, runtime=runtime, prefix_cache_mb=64, kv_cache=kv)
    plain = MTPEngine(loaded, adapter=base.adapter, runtime=runtime, prefix_cache_mb=0, kv_cache=kv)
    return cached, plain


@pytest.mark.parametrize("cfg", MODES, ids=[c.mode for c in MODES])
def test_outputs_equal_with_and_without_the_cache(engines: tuple[MTPEngine, MTPEngine], cfg: DecodeConfig) -> None:
    cached, plain = engines
    reused = 0
    for prompt in _conversations():
        with_cache = cached.generate(prompt, cfg)
        without = plain.generate(prompt, cfg)
        assert with_cache.token_ids == without.token_ids, prompt
        assert without.stats.cached_prompt_tokens == 0
        reused += with_cache.stats.cached_prompt_tokens
    assert reused > 0


def test_repeated_request_prefills_one_token(engines: tuple[MTPEngine, MTPEngine]) -> None:
    cached, _ = engines
    prompt = _conversations(seed=5)[1]
    cached.generate(prompt, MODES[0])
    again = cached.generate(prompt, MODES[1])
    assert again.stats.cached_prompt_tokens == len(prompt) - 1
    bypass = cached.generate(prompt, MODES[1].replace(prefix_cache=False))
    assert bypass.stats.cached_prompt_tokens == 0 and bypass.token_ids == again.token_ids


def test_output_is_cached_for_the_next_step(engines: tuple[MTPEngine, MTPEngine]) -> None:
    """An agent's next step re-sends prompt + the model's answer + more: all of prompt + answer is reused."""
    cached, plain = engines
    prompt = _conversations(seed=7)[0]
    first = cached.generate(prompt, MODES[1])
    follow = prompt + first.token_ids[:-1] + [17, 18, 19]
    second = cached.generate(follow, MODES[1])
    assert second.stats.cached_prompt_tokens >= len(prompt) + len(first.token_ids) - 2
    assert second.token_ids == plain.generate(follow, MODES[1]).token_ids


def test_eviction_keeps_outputs_exact_and_memory_within_budget() -> None:
    base = tiny_engine(adapter=True)
    loaded = LoadedModel(base.model, base.tokenizer, "tiny", base.mask_token, base.mask_token_id, False)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x fp32 bytes of the tiny model
    small = MTPEngine(loaded, adapter=base.adapter, prefix_cache_mb=60 * per_token / 2**20)
    plain = MTPEngine(loaded, adapter=base.adapter, prefix_cache_mb=0)
    for prompt in _conversations(seed=1) + _conversations(seed=2):
        assert small.generate(prompt, MODES[1]).token_ids == plain.generate(prompt, MODES[1]).token_ids
        assert small.prefix_cache.nbytes <= small.prefix_cache.budget_bytes
    assert small.prefix_cache.stats.evicted_tokens > 0


def test_weight_change_invalidates_the_cache() -> None:
    engine = tiny_engine(adapter=True)
    prompt = _conversations(seed=3)[0]
    engine.generate(prompt, MODES[0])
    with torch.no_grad():
        engine.model.model.layers[0].input_layernorm.weight.mul_(1.5)
    fresh = engine.generate(prompt, MODES[0])
    assert fresh.stats.cached_prompt_tokens == 0


def test_budget_settings_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREFIX_CACHE_ENV, raising=False)
    assert prefix_cache_mb() == 512.0
    monkeypatch.setenv(PREFIX_CACHE_ENV, "0")
    assert prefix_cache_mb() == 0.0
    assert tiny_engine().prefix_cache.budget_bytes == 0
    for bad in ("lots", "-1", "inf", "nan"):
        monkeypatch.setenv(PREFIX_CACHE_ENV, bad)
        with pytest.raises(ConfigError, match=PREFIX_CACHE_ENV):
            prefix_cache_mb()
    monkeypatch.delenv(PREFIX_CACHE_ENV)
    base = tiny_engine()
    loaded = LoadedModel(base.model, base.tokenizer, "tiny", base.mask_token, base.mask_token_id, False)
    with pytest.raises(ConfigError, match="prefix_cache_mb=-5"):
        MTPEngine(loaded, prefix_cache_mb=-5)
