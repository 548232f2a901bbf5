"""A float16 KV cache (``kv_cache="fp16"``): the kernel attends over half the bytes with the same float32 operations,
caches hold the float32 model's keys and values rounded to nearest, and the engine's modes stay consistent."""

from __future__ import annotations

import pytest
import torch

from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.engine import KV_CACHE_ENV, kv_cache_setting
from agent_mtp.engine.fast import BatchItem, FastRunner, blockq
from agent_mtp.engine.fast.cache import KVCache
from agent_mtp.errors import ConfigError
from tests.unit.test_fast_runtime import _engine, _loaded, _random_ids

kernels = pytest.mark.skipif(not blockq.kernels_available(), reason="block-weight kernels unavailable here")


def _halves(*shape: int, seed: int) -> torch.Tensor:
    """float32 values that float16 holds exactly."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).half().float()


@kernels
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 2, 128), (14, 2, 64)])
@pytest.mark.parametrize("wide", [False, True])
def test_attention_over_a_float16_cache_is_the_float32_attention_of_its_values(
    heads: int, kv_heads: int, d: int, wide: bool
) -> None:
    """Over values float16 holds exactly (and RoPE at angle 0), a float16 cache gives the float32 cache's bits, on the
    AVX2 and the AVX-512 loops: the halves are converted exactly and summed in the same order. Sequences of
    several lengths and rows in one call, one long enough for many key chunks and both threads, one attended in
    segments (past 1,024 positions)."""
    if wide and not blockq.avx512_forms():
        pytest.skip("no AVX-512 forms on this CPU")
    starts, rows = [0, 5, 37, 700, 1500], [3, 1, 6, 2, 2]
    width = (heads + 2 * kv_heads) * d
    qkv = _halves(sum(rows), width, seed=1)
    rope = torch.polar(torch.ones(sum(rows), 1, d // 2), torch.zeros(sum(rows), 1, d // 2))  # cos 1, sin 0
    full = [_halves(2, kv_heads, s + r + 3, d, seed=10 + s) for s, r in zip(starts, rows, strict=True)]
    half = [c.half() for c in full]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with blockq.avx512(wide):
            want = torch.ops.agent_mtp_blockq.attend(qkv.clone(), rope, full, starts, rows, heads, kv_heads, d, 0.125)
            got = torch.ops.agent_mtp_blockq.attend(qkv.clone(), rope, half, starts, rows, heads, kv_heads, d, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    for h, f in zip(half, full, strict=True):
        assert torch.equal(h.float(), f)  # the new rows' keys and values, stored as their exact halves


@kernels
def test_new_keys_and_values_are_rounded_as_torch_rounds_them() -> None:
    """The kernel writes each new key and value rounded to the nearest float16 (ties to even), as ``Tensor.half``."""
    heads, kv_heads, d = 4, 2, 32
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(5, width) * torch.logspace(-6, 4, width)  # tiny to large magnitudes (float16 subnormals too)
    rope = torch.polar(torch.ones(5, 1, d // 2), torch.randn(5, 1, d // 2))
    full, half = torch.zeros(2, kv_heads, 8, d), torch.zeros(2, kv_heads, 8, d, dtype=torch.float16)
    torch.ops.agent_mtp_blockq.attend(qkv.clone(), rope, [full], [0], [5], heads, kv_heads, d, 0.2)
    torch.ops.agent_mtp_blockq.attend(qkv.clone(), rope, [half], [0], [5], heads, kv_heads, d, 0.2)
    assert torch.equal(half[:, :, :5], full[:, :, :5].half())


@kernels
def test_attention_kernel_rejects_mixed_cache_dtypes() -> None:
    heads, kv_heads, d = 2, 1, 16
    qkv = torch.randn(2, (heads + 2 * kv_heads) * d)
    rope = torch.polar(torch.ones(2, 1, d // 2), torch.zeros(2, 1, d // 2))
    caches = [torch.zeros(2, kv_heads, 4, d), torch.zeros(2, kv_heads, 4, d, dtype=torch.float16)]
    with pytest.raises(RuntimeError, match="all of one dtype"):
        torch.ops.agent_mtp_blockq.attend(qkv, rope, caches, [0, 0], [1, 1], heads, kv_heads, d, 0.25)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def engines(request: pytest.FixtureRequest) -> tuple[MTPEngine, MTPEngine]:
    full = _engine(request.param, adapter=True)
    return full, full.with_runtime("fast", kv_cache="fp16")


def test_caches_hold_the_float32_models_keys_and_values_rounded(engines: tuple[MTPEngine, MTPEngine]) -> None:
    """A prefill (the Python loop and SDPA) and short passes (the attention kernel where it runs): every cached
    position of the float16 cache is the float32 cache's, rounded, as long as the inputs agree; the logits stay
    close to the float32 cache's through passes with masks and rollbacks."""
    full, half = engines
    a, b = full.new_runner(), half.new_runner()
    assert isinstance(a, FastRunner) and isinstance(b, FastRunner)
    assert b.cache.dtype == torch.float16 and a.cache.dtype == torch.float32
    m = full.mask_token_id
    prompt = _random_ids(40, 0)
    a.forward(prompt, 1)
    b.forward(prompt, 1)
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
        first = slice(0, 40)
        torch.testing.assert_close(lb[:, :, first].float(), la[:, :, first], atol=2e-2, rtol=1e-2)
    assert torch.equal(b.cache.layers[0][:, :, :40], a.cache.layers[0][:, :, :40].half())  # layer 0: same inputs
    for tokens, keep, drop in [([7], 1, 0), ([8, 9, m, m], 4, 2), ([10], 1, 0), ([*_random_ids(6, 1), m], 7, 1)]:
        torch.testing.assert_close(b.forward(tokens, keep), a.forward(tokens, keep), atol=2e-2, rtol=1e-2)
        a.drop(drop)
        b.drop(drop)
        assert a.length == b.length


def test_verified_equals_ntp_and_batches_equal_single_passes_on_a_float16_cache(
    engines: tuple[MTPEngine, MTPEngine],
) -> None:
    """Exactness against the engine's own NTP holds on a float16 cache (a position's cached values depend only on
    it), and a batched pass gives each sequence what its pass alone gives."""
    _, half = engines
    for seed in range(3):
        prompt = _random_ids(6 + 9 * seed, seed)
        ntp = half.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=24)).token_ids
        assert half.generate(prompt, DecodeConfig(mode="verified", k_max=4, max_new_tokens=24)).token_ids == ntp
    runner = half.new_runner()
    assert isinstance(runner, FastRunner)
    model = runner.model
    prompts = [_random_ids(12, 20), _random_ids(3, 21)]
    alone, batched = [model.new_cache() for _ in prompts], [model.new_cache() for _ in prompts]
    for feeds in [prompts, [[5], [6, 7]]]:
        expected = [model.forward(f, c, 1) for f, c in zip(feeds, alone, strict=True)]
        got = model.forward_batch([BatchItem(f, c, 1) for f, c in zip(feeds, batched, strict=True)])
        for x, y in zip(expected, got, strict=True):
            torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)
    assert all(isinstance(c, KVCache) and c.dtype == torch.float16 for c in batched)


def test_the_kv_cache_setting_is_validated(
    engines: tuple[MTPEngine, MTPEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    full, half = engines
    assert (full.kv_cache, half.kv_cache) == ("fp32", "fp16")
    assert half.with_runtime("fast") is half and full.with_runtime("fast", kv_cache="fp32") is full
    with pytest.raises(ConfigError, match=r"kv_cache='fp8'.*'fp16'"):
        kv_cache_setting("fp8", "fast")
    with pytest.raises(ConfigError, match="needs the fast runtime"):
        MTPEngine(_loaded(full), runtime="hf", kv_cache="fp16")
    assert half.with_runtime("hf").kv_cache == "fp32"  # an HF sibling keeps the model's own cache
    monkeypatch.setenv(KV_CACHE_ENV, "fp16")
    assert kv_cache_setting(None, "fast") == "fp16"
    assert kv_cache_setting(None, "hf") == "fp32"  # the environment's choice is for the fast runtime
    monkeypatch.setenv(KV_CACHE_ENV, "int4")
    with pytest.raises(ConfigError, match=f"{KV_CACHE_ENV}='int4'"):
        kv_cache_setting(None, "fast")


def test_a_server_setting_picks_the_kv_cache(
    engines: tuple[MTPEngine, MTPEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``agent-mtp serve --kv-cache fp16`` (``ServerSettings.kv_cache``) serves a float16-cache sibling of the shared
    engine; unset, the shared engine as loaded."""
    from agent_mtp import service
    from agent_mtp.server import app
    from agent_mtp.server.settings import ServerSettings

    full, _ = engines
    monkeypatch.setattr(service, "shared_engine", lambda *args, **kwargs: full)
    served = app.build_service(ServerSettings(kv_cache="fp16"))
    assert served.engine.kv_cache == "fp16" and served.engine.loaded is full.loaded
    assert app.build_service(ServerSettings()).engine is full
    with pytest.raises(ValueError, match="kv_cache"):
        ServerSettings(kv_cache="fp8")  # type: ignore[arg-type]
