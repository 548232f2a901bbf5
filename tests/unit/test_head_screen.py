"""Greedy rows of a Q8_0 output head screened on the 8-bit input grid (``q8_0_screened`` in kernels/blockq.cpp): the
outputs whose rigorous error bound lets them reach the row's maximum are recomputed exactly, so each screened row's
first maximum is the exact product's, bit for bit, whatever ties, near-ties, exception rows, coarse rows or non-finite
inputs the pass holds; and the fast runtime's greedy output does not change. Skipped where the CPU has no AVX-512
VNNI (the screen's exact recomputation runs on it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agent_mtp.engine import MTPEngine
from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.fast import FastModel, blockq
from tests.unit.test_fast_blockq import _engine, assert_greedy_equals_hf, q8_0
from tests.unit.test_fast_runtime import _random_ids

pytestmark = pytest.mark.skipif(
    not (blockq.kernels_available() and blockq.tiles_wanted() and torch.ops.agent_mtp_blockq.vnni_supported()),
    reason="no AVX-512 VNNI on this CPU (the screen's exact recomputation runs on it)",
)


@pytest.fixture(autouse=True)
def vnni_records() -> Iterator[None]:
    """Every test with the records on VNNI (AMX tiles off where the CPU has them: the screen serves VNNI only)."""
    with blockq.amx(False), blockq.vnni(True):
        assert blockq.vnni_active()
        yield


def _head(out: int, k: int, seed: int, *, exception: bool = False) -> tuple[torch.Tensor, blockq.BlockWeights]:
    gen = torch.Generator().manual_seed(seed)
    weight = q8_0(torch.randn(out, k, generator=gen))
    weight[1] = weight[0]  # an exact tie at every input: the first of them is the argmax
    weight[3] = weight[2]
    weight[3, 5] += weight[3, 5].abs().clamp(min=1e-3) * 2.0**-9  # a near-tie, then not a Q8_0 row: an exception
    if not exception:
        weight[3] = weight[2]
    block = weight[2, :32]  # row 4: row 2 one quantization step apart at its smallest weight (still Q8_0): a near-tie
    step = (block.abs().amax() / 127).half().float()
    weight[4] = weight[2]
    weight[4, int(block.abs().argmin())] += step
    weight = torch.cat([weight, torch.randn(1, k, generator=gen)]) if exception else weight  # a float32 row too
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.kind == "q8_0" and blocks.screen_bounds is not None and blocks.screens
    return weight, blocks


def _inputs(rows: int, k: int, seed: int, weight: torch.Tensor) -> torch.Tensor:
    """Rows that make ties and near-ties the maximum: aligned with the tied rows 0/1 and 2/3, heavy-tailed blocks, a
    zero row and tiny values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * (0.2 + 4 * torch.rand(rows, 1, generator=gen))
    x[0] = weight[0] * 3
    if rows > 1:
        x[1] = weight[2] * 3
    if rows > 2:
        x[2, : k // 2] *= 50
    if rows > 3:
        x[3] = 0.0
    if rows > 4:
        x[4] *= 1e-30
    return x


def _check_screened(
    blocks: blockq.BlockWeights, x: torch.Tensor, screen: list[int], coarse: list[int], grid_bits: int = 24
) -> int:
    exact = blocks(x, coarse=coarse, grid_bits=grid_bits)
    got, streams = blocks.screened(x, screen, coarse=coarse, grid_bits=grid_bits)
    flags = torch.zeros(x.shape[0], dtype=torch.bool)
    for a, b in zip(screen[::2], screen[1::2], strict=True):
        flags[a:b] = True
    for a, b in zip(coarse[::2], coarse[1::2], strict=True):
        flags[a:b] = False  # a coarse row stays coarse
    for r in range(x.shape[0]):
        if not flags[r]:
            assert torch.equal(got[r], exact[r]), r  # rows not screened: their own bits
            continue
        top = int(exact[r].argmax())
        assert int(got[r].argmax()) == top, r  # the first maximum, ties included
        assert torch.equal(got[r, top], exact[r, top]), r  # the exact value there
        assert bool((got[r] <= exact[r, top]).all()), r  # every other output an approximation below it
    return streams


@pytest.mark.parametrize("grid_bits", [24, 16])
@pytest.mark.parametrize(("out", "k"), [(200, 64), (1000, 96), (45, 160)])  # whole and partial records
def test_screened_rows_take_the_exact_argmax_and_its_bits(out: int, k: int, grid_bits: int) -> None:
    weight, blocks = _head(out, k, seed=out)
    recomputed = 0
    for rows in (1, 4, 9):
        x = _inputs(rows, k, seed=rows, weight=weight)
        recomputed += _check_screened(blocks, x, [0, rows], [], grid_bits)
    assert 0 < recomputed < 14 * -(-out // 16)  # some streams recomputed, far from every stream of every row


def test_the_screen_is_off_on_amx_tiles() -> None:
    if not torch.ops.agent_mtp_blockq.amx_supported():
        pytest.skip("no AMX-INT8 tiles on this CPU / OS")
    _, blocks = _head(64, 64, seed=3)
    with blockq.amx(True):
        assert not blocks.screens


def test_exception_rows_coarse_rows_and_unscreened_rows_in_one_pass() -> None:
    weight, blocks = _head(300, 64, seed=5, exception=True)
    assert blocks.exception_rows is not None and blocks.exception_rows.tolist() == [3, 300]
    x = _inputs(8, 64, seed=2, weight=weight)
    x[5] = weight[300] * 4  # the float32 exception row is this row's maximum
    _check_screened(blocks, x, [0, 3, 4, 8], [6, 7])  # row 3 exact, row 6 coarse
    exact = blocks(x)
    screened, _ = blocks.screened(x, [0, 8])
    assert int(screened[5].argmax()) == int(exact[5].argmax()) == 300


def test_non_finite_inputs_are_computed_exactly() -> None:
    _, blocks = _head(100, 64, seed=9)
    x = torch.randn(5, 64)
    x[1, 7] = float("inf")
    x[2, 40] = float("nan")
    x[3, 32:64] = 1e-38  # a block whose 8-bit grid would overflow (127 / peak)
    exact = blocks(x)
    got, streams = blocks.screened(x, [0, 5])
    torch.testing.assert_close(got[1:4], exact[1:4], equal_nan=True, rtol=0, atol=0)
    assert streams >= 3 * -(-100 // 16)  # the three rows recomputed whole


def test_a_norm_and_extra_rows_ride_along() -> None:
    _, blocks = _head(130, 96, seed=4)
    x = torch.randn(6, 96)
    norm = (torch.rand(96) + 0.5, 1e-5)
    extra = torch.randn(3, 96)
    exact = blocks(x, extra, norm)
    got, _ = blocks.screened(x, [0, 6], extra, norm)
    assert torch.equal(got[:, 130:], exact[:, 130:])  # the extra rows' products: exact for every row
    assert torch.equal(got[:, :130].argmax(-1), exact[:, :130].argmax(-1))


def test_the_screen_is_off_without_records_or_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    _, blocks = _head(64, 64, seed=1)
    x = torch.randn(4, 64)
    with blockq.avx_kernels():
        assert not blocks.screens
        got, streams = blocks.screened(x, [0, 4])
        assert streams == 0 and torch.equal(got, blocks(x))  # every row exact
    monkeypatch.setenv(blockq.SCREEN_ENV, "0")
    assert not blockq.screen_enabled()


@pytest.fixture(scope="module", params=[("plain-llama", False), ("plain-llama", True)], ids=str)
def engine(request: pytest.FixtureRequest) -> Iterator[MTPEngine]:
    """A tiny quantized model whose block weights serve passes of up to 64 rows (a model this small otherwise keeps
    the float32 GEMM past 4 rows)."""
    family, adapter = request.param
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(blockq.ROWS_ENV, "64")
        engine = _engine(family, adapter=adapter)
        engine._fast_model()
        yield engine


def test_argmax_only_items_are_screened_in_the_head_and_keep_their_argmax(
    monkeypatch: pytest.MonkeyPatch, engine: MTPEngine
) -> None:
    monkeypatch.setenv(blockq.ROWS_ENV, "64")
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    assert fast.lm_head.blocks is not None and fast.lm_head.blocks.screens
    fast.screen_rows = 2  # passes of 2+ greedy rows (the default model waits for 8)
    prompt = _random_ids(12, seed=4)
    caches = [fast.new_cache(), fast.new_cache()]
    for cache in caches:
        fast.forward(prompt, cache, 1)
    tokens = [5, 9, 3, 8, 2, engine.mask_token_id]
    exact = fast.forward(tokens, caches[0], len(tokens), coarse_masks=True)
    before = fast.screen_stats
    got = fast.forward(tokens, caches[1], len(tokens), coarse_masks=True, argmax_only=True)
    after = fast.screen_stats
    assert (after.passes, after.rows) == (before.passes + 1, before.rows + len(tokens) - 1)  # the mask row: not
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert torch.equal(got[-1], exact[-1])  # the coarse mask row: its own (8-bit) numbers
    for cache in caches:  # the mask row leaves the caches, as the decode loop drops it
        cache.truncate(cache.length - 1)
    exact_masks = fast.forward(tokens, caches[0], len(tokens))  # exact mask rows (ConfAdapt's): never screened
    got_masks = fast.forward(tokens, caches[1], len(tokens), argmax_only=True)
    assert torch.equal(got_masks[-1], exact_masks[-1])
    assert torch.equal(got_masks.argmax(-1), exact_masks.argmax(-1))
    after = fast.screen_stats
    fast.screen_rows = len(tokens) + 1  # fewer greedy rows in a pass than that: exact
    cache = fast.new_cache()
    fast.forward(prompt, cache, 1)
    assert torch.equal(fast.forward(tokens, cache, len(tokens), coarse_masks=True, argmax_only=True), exact)
    assert fast.screen_stats == after


@pytest.mark.parametrize("mode", ["ntp", "verified"])
def test_greedy_output_is_hfs_with_every_pass_screened(engine: MTPEngine, mode: str) -> None:
    fast = engine._fast_model()
    previous = fast.screen_rows
    fast.screen_rows = 1  # every greedy pass, one row included
    try:
        before = fast.screen_stats.passes
        assert_greedy_equals_hf(engine, mode)
        assert fast.screen_stats.passes > before
        sampled = engine.generate(_random_ids(9, seed=2), DecodeConfig(mode=mode, temperature=0.8, seed=3))
        assert sampled.token_ids  # sampling reads whole rows: never screened
    finally:
        fast.screen_rows = previous


def test_batched_greedy_runs_are_screened_and_give_each_sequence_its_tokens(engine: MTPEngine) -> None:
    from agent_mtp.engine.batching import BatchedEngine

    fast = engine._fast_model()
    previous = fast.screen_rows
    fast.screen_rows = 2
    prompts = [_random_ids(6 + 3 * i, seed=20 + i) for i in range(4)]
    cfg = DecodeConfig(mode="ntp", max_new_tokens=12)
    try:
        alone = [engine.generate(p, cfg).token_ids for p in prompts]
        batched = BatchedEngine(engine)
        try:
            before = fast.screen_stats.passes
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(prompts)) as pool:
                together = list(pool.map(lambda p: batched.generate(p, cfg).token_ids, prompts))
        finally:
            batched.close()
        assert together == alone
        assert fast.screen_stats.passes > before
    finally:
        fast.screen_rows = previous


def test_the_screen_threshold_is_measured_once_per_machine_and_read_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: MTPEngine
) -> None:
    """Whether screening pays depends on the machine (on Zen 4 it did from 6 greedy rows, on Zen 5, whose integer
    products are four times as fast, at no size): a model past the CPU caches times whole passes screened and exact
    once, stores the threshold beside its other kernel choices, and the next process reads it; timing leaves the
    model's setting and counters as they were. ``AGENT_MTP_SCREEN_HEAD=0`` times nothing."""
    from agent_mtp.engine.fast import model as fast_model
    from agent_mtp.engine.fast.choices import CHOICES_ENV

    monkeypatch.setenv("AGENT_MTP_CACHE", str(tmp_path))
    monkeypatch.delenv(CHOICES_ENV, raising=False)
    monkeypatch.setattr(fast_model, "CROSSOVER_BYTES", 0)  # time the tiny model as a large one
    # the kernel choices the model settles first: what the process already runs (no kernel setting changes)
    monkeypatch.setattr(fast_model, "measure_avx512", lambda linears: blockq.avx512_forms())
    monkeypatch.setattr(fast_model, "measure_buffered_rows", lambda linears: blockq.buffered_rows())
    monkeypatch.setattr(fast_model, "measure_tile_rows", lambda linears: blockq.tile_rows())
    monkeypatch.setattr(fast_model, "measure_block_rows", lambda linears: 64)
    timed: list[int] = []
    measure = fast_model.measure_screen_rows

    def counted(model: FastModel) -> int:
        stats = model.screen_stats
        chosen = measure(model)
        assert model.screen_rows == fast_model.SCREEN_ROWS and model.screen_stats == stats  # left as they were
        timed.append(chosen)
        return chosen

    monkeypatch.setattr(fast_model, "measure_screen_rows", counted)
    first = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    assert len(timed) == 1 and timed[0] in {0, *(t for _, t in fast_model.SCREEN_CANDIDATES)}
    assert first.screen_rows == timed[0]
    assert first.stored_choices is not None and first.stored_choices.values["screen_rows"] == timed[0]
    second = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    assert second.screen_rows == timed[0] and len(timed) == 1  # read back: nothing timed
    assert second.stored_choices is not None and "screen_rows" in second.stored_choices.read
    monkeypatch.setenv(blockq.SCREEN_ENV, "0")
    assert FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id).screen_rows == 0
    assert len(timed) == 1
