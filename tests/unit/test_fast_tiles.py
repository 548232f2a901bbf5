"""Tile-record products of block weights, on AMX tiles or with AVX-512 VNNI (each path the CPU has, in turn): inputs
on a 24-bit grid per block, exact integer sums, float32 scaling. Close to the float32 GEMM, a row's numbers
independent of the rows beside it and of the pass size (and the same on both paths), and the fast runtime on records
still greedy-exact against HF. Skipped where the CPU (or the OS) gives neither AMX-INT8 nor AVX-512 VNNI."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from agent_mtp.engine import MTPEngine
from agent_mtp.engine.fast import FastModel, blockq
from tests.unit.test_fast_blockq import (
    _engine,
    assert_greedy_equals_hf,
    batched_against_single,
    q4_1,
    q8_0,
    same_bits_however_the_threads_split,
)
from tests.unit.test_fast_runtime import _random_ids

pytestmark = pytest.mark.skipif(
    not (blockq.kernels_available() and blockq.tiles_wanted()),
    reason="neither AMX-INT8 tiles nor AVX-512 VNNI on this CPU / OS",
)

QUANTIZE = {"q4_1": q4_1, "q8_0": q8_0}


def _paths() -> list[str]:
    if not blockq.kernels_available():
        return []
    ops = torch.ops.agent_mtp_blockq
    return [name for name, ok in (("amx", ops.amx_supported()), ("vnni", ops.vnni_supported())) if ok]


@pytest.fixture(autouse=True, params=_paths() or ["none"])
def path(request: pytest.FixtureRequest) -> Any:
    """Every test on each record path the CPU has: AMX tiles, or VNNI with the tiles off."""
    with blockq.amx(request.param == "amx") as amx_on, blockq.vnni(request.param == "vnni"):
        assert amx_on == (request.param == "amx") and blockq.records_active()
        yield request.param


def _blocks(kind: str, out: int, k: int, seed: int = 0) -> tuple[torch.Tensor, blockq.BlockWeights]:
    weight = QUANTIZE[kind](torch.randn(out, k, generator=torch.Generator().manual_seed(seed)))
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.kind == kind and blocks.tiles is not None
    return weight, blocks


def _error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float32-level error of a dot product: a few ulps of sum |w| |x| per output."""
    return 8 * 2.0**-24 * (x.abs().double() @ weight.abs().double().T) + 1e-30


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize(("out", "k"), [(64, 96), (40, 160), (200, 64)])  # whole, paired and partial records
def test_tile_products_are_float32_accurate_at_every_pass_size(kind: str, out: int, k: int) -> None:
    weight, blocks = _blocks(kind, out, k)
    for rows in (1, 2, 3, 7, 8, 9, 16, 17, 40):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        exact = x.double() @ weight.double().T
        assert ((blocks(x).double() - exact).abs() <= _error_bound(x, weight)).all(), (kind, out, rows)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_rows_tile_result_does_not_depend_on_the_pass(kind: str) -> None:
    """Every row alone, at any position of any pass size (VNNI: chunks of up to 16 rows; tiles: of 8, a 9th in a
    chunk of its own): the same bits. Batched and drafted passes therefore give each sequence what a one-token pass
    gives."""
    _, blocks = _blocks(kind, 48, 128)
    x = torch.randn(25, 128)
    together = blocks(x)
    for n in range(1, 26):
        assert torch.equal(blocks(x[:n]), together[:n]), n
        assert torch.equal(blocks(x[n - 1 : n]), together[n - 1 : n]), n


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_vnni_chunks_of_any_size_give_the_same_bits(kind: str, path: str) -> None:
    """VNNI multiplies passes of up to 16 rows in one chunk of their record streams and longer ones in chunks as
    equal as can be; each row's sums and scaling are its own, so chunks of up to 8 (as before), 5 or 1 give every
    row the same bits at every pass size."""
    if path != "vnni":
        pytest.skip("the chunks are VNNI's")
    ops = torch.ops.agent_mtp_blockq
    _, blocks = _blocks(kind, 48, 128)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(3))
    assert ops.vnni_chunk(-1) == 16
    sizes = (1, 8, 9, 12, 16, 17, 25, 33, 40)
    wide = {n: blocks(x[:n]) for n in sizes}
    try:
        for most in (8, 5, 1):
            assert ops.vnni_chunk(most) == most
            for n in sizes:
                assert torch.equal(blocks(x[:n]), wide[n]), (most, n)
    finally:
        ops.vnni_chunk(16)
    with pytest.raises(RuntimeError, match="vnni_chunk takes"):
        ops.vnni_chunk(17)


def test_tiles_serve_extra_rows_a_norm_a_residual_and_exception_rows() -> None:
    weight = torch.cat([q8_0(torch.randn(45, 64)), torch.randn(1, 64)])  # 46 outputs: one float32 exception row
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.tiles is not None and blocks.exception_rows is not None
    x, extra, gain = torch.randn(5, 64), torch.randn(3, 64), torch.randn(64) * 0.3 + 1
    torch.testing.assert_close(blocks(x), F.linear(x, weight), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(blocks(x, extra), F.linear(x, torch.cat([weight, extra])), atol=2e-5, rtol=1e-5)
    normed = F.rms_norm(x, (64,), gain, 1e-6)
    torch.testing.assert_close(blocks(x, norm=(gain, 1e-6)), F.linear(normed, weight), atol=2e-5, rtol=1e-5)
    q, q_blocks = _blocks("q4_1", 32, 64)
    residual = torch.randn(5, 32)
    expected = residual + F.linear(x, q)
    low = q_blocks.add_into(residual, x, extra)
    torch.testing.assert_close(residual, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(low, F.linear(x, extra), atol=2e-5, rtol=1e-5)


def test_q4_1_tiles_with_a_row_that_is_not_blocks() -> None:
    weight = torch.cat([q4_1(torch.randn(39, 64)), torch.randn(1, 64)])  # 40 outputs: a last partial record
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.kind == "q4_1" and blocks.tiles is not None
    assert blocks.exception_rows is not None and blocks.exception_rows.tolist() == [39]
    assert blocks.tiles.shape == (3, 2 * 320)  # 40 outputs -> 3 records of 16; per block 256 + 2 x 32 bytes
    assert blocks.nbytes == 3 * 2 * 320 + 64 * 4  # what a pass reads: the records and the float32 row
    x = torch.randn(3, 64)
    torch.testing.assert_close(blocks(x), F.linear(x, weight), atol=2e-5, rtol=1e-5)


def test_tile_grid_handles_zero_tiny_huge_and_non_finite_inputs() -> None:
    weight, blocks = _blocks("q4_1", 32, 96)
    x = torch.randn(6, 96)
    x[0] = 0.0  # every block zero
    x[1, :32] = 0.0  # one block zero
    x[2] *= 1e-30  # grid steps near the float32 minimum
    x[3] *= 1e30
    x[4, 5] = 1e-8  # one element far below its block's largest: rounded to the block's grid
    x[5, 32:] *= 1e-33  # a block whose grid step is subnormal (taken by the library's frexp / ldexp)
    exact = x.double() @ weight.double().T
    y = blocks(x).double()
    assert torch.equal(y[0], torch.zeros(32, dtype=torch.float64))
    assert ((y[1:] - exact[1:]).abs() <= _error_bound(x[1:], weight) + 1e-37).all()
    x[5, 7] = float("nan")
    assert torch.isnan(blocks(x)[5]).all() and torch.isfinite(blocks(x)[:5]).all()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_tile_products_scale_exactly_with_powers_of_two(kind: str) -> None:
    """Each block's grid is fixed by its largest input's exponent (read off the float's bits), so multiplying the
    inputs by 2^j multiplies every product by exactly 2^j wherever nothing is subnormal: an exponent read one off
    anywhere in the range would change a block's rounding and the bits."""
    _, blocks = _blocks(kind, 32, 128, seed=3)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    x[1, 32:64] *= 1e-3  # blocks of one row on different grids
    base = blocks(x)
    for j in (-100, -64, -17, -1, 1, 9, 40, 90):
        assert torch.equal(blocks(x * 2.0**j), base * 2.0**j), j


def test_tile_layout_holds_each_features_inputs_in_b_tile_order() -> None:
    q = torch.arange(16 * 32, dtype=torch.int64).reshape(16, 1, 32) % 251  # feature n, input i -> distinct bytes
    rows = blockq._tile_order(q.to(torch.uint8))  # [records, blocks, 8 tile rows, 64 bytes]
    assert rows.shape == (1, 1, 8, 64)
    for kk in range(8):
        for n in range(16):
            assert rows[0, 0, kk, 4 * n : 4 * n + 4].tolist() == q[n, 0, 4 * kk : 4 * kk + 4].tolist()


def test_record_switches_and_kernel_tag(path: str) -> None:
    tag = blockq.kernel_tag()
    if path == "amx":  # VNNI off (the fixture): the tiles serve every pass
        assert tag == "blockq8-amx"
        with blockq.tiles_from(blockq.TileRows(6, 24)):
            assert blockq.kernel_tag() == "blockq8-amx"
            with blockq.vnni(True) as both:  # short passes on VNNI: a tag (cost curve) of its own
                assert blockq.kernel_tag() == ("blockq8-vnni3-amx6-24" if both else "blockq8-amx")
    else:
        assert tag.startswith("blockq14") and tag.endswith("-vnni4")
    with blockq.avx_kernels():
        assert not blockq.records_active() and not blockq.kernel_tag().endswith(("-amx", "-vnni4"))
    assert blockq.records_active() and blockq.kernel_tag() == tag


def test_the_records_can_be_switched_off_by_environment() -> None:
    code = (
        "from agent_mtp.engine.fast import blockq; import torch; "
        "w = torch.zeros(16, 32); w[:, 0] = 0.9375; b = blockq.block_weights(w); "
        "print(blockq.records_active(), b is not None and b.tiles is None)"
    )
    env = {**os.environ, blockq.AMX_ENV: "0", blockq.VNNI_ENV: "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]


@pytest.fixture(scope="module", params=[("plain-llama", False), ("plain-llama", True), ("llama", True)], ids=str)
def engine(request: pytest.FixtureRequest) -> MTPEngine:
    family, adapter = request.param
    return _engine(family, adapter=adapter)


def test_fast_model_builds_tiles_for_every_block_weight(engine: MTPEngine) -> None:
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    linears = fast._linears()
    assert all(linear.blocks is not None and linear.blocks.tiles is not None for linear in linears)


def test_tile_passes_match_the_avx_kernels_and_hf(engine: MTPEngine) -> None:
    """Whole passes (fused layers, masks, the adapter's delta, rollbacks) on tiles against the AVX kernels."""
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    ids = _random_ids(20, seed=3)
    on_tiles, on_avx = fast.new_cache(), fast.new_cache()
    mask = engine.mask_token_id

    def both(tokens: list[int], keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = fast.forward(tokens, on_tiles, keep)
        with blockq.avx_kernels():
            b = fast.forward(tokens, on_avx, keep)
        return a, b

    torch.testing.assert_close(*both(ids, 3), atol=1e-4, rtol=1e-4)
    for step, tokens in enumerate([[5], [7, mask], [9, 3, 8], [mask, 4, mask, 6], [1, 2, 3, 4, 5, mask, mask]]):
        torch.testing.assert_close(*both(tokens, len(tokens)), atol=1e-4, rtol=1e-4)
        if step % 2:
            on_tiles.truncate(on_tiles.length - 1)
            on_avx.truncate(on_avx.length - 1)
    hf = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(fast.forward(ids, fast.new_cache(), 1)[0], hf, atol=1e-4, rtol=1e-4)


def test_batched_tile_passes_give_each_sequence_its_single_bits(
    monkeypatch: pytest.MonkeyPatch, engine: MTPEngine
) -> None:
    """Every pass on tiles (a small model's crossover pinned past the batch): each sequence gets the bits it gets
    alone, one-token or drafted, beside others (no linear layer, attention or output-head row, the float32 mask-token
    row included, depends on the rows beside it)."""
    monkeypatch.setenv(blockq.ROWS_ENV, "64")
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    passes = [[[5], [6], [7]], [[5], [7, engine.mask_token_id], [9, 3, 8, 2, 6, 1]]]
    for tokens, a, b in batched_against_single(fast, passes):
        assert torch.equal(a, b), tokens


@pytest.mark.parametrize("mode", ["ntp", "verified"])
def test_greedy_on_tiles_equals_hf(engine: MTPEngine, mode: str) -> None:
    assert_greedy_equals_hf(engine, mode)


def test_bench_curves_time_the_tiles_beside_the_avx_kernels(engine: MTPEngine) -> None:
    from agent_mtp.bench.curves import measure_curves
    from agent_mtp.bench.hf import FAST_AVX512, kernels_for

    report = measure_curves(engine, context=16, rounds=1)
    assert {
        "hf",
        "fast",
        "fast-fp32",
        "fast-draft-masks",
        "fast-avx512",
        "fast-int16",
        "fast-int16-draft-masks",
    } <= set(report.ms)
    with kernels_for(FAST_AVX512):
        assert not blockq.records_active()
    assert blockq.records_active()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_amx_and_vnni_give_the_same_bits(kind: str, path: str) -> None:
    """The two record paths sum the same exact integers and scale them with the same code, draft-only rows too."""
    if path != "amx" or "vnni" not in _paths():
        pytest.skip("needs a CPU with both AMX-INT8 and AVX-512 VNNI")
    _, blocks = _blocks(kind, 72, 160)
    x = torch.randn(11, 160)
    on_tiles = blocks(x)
    with blockq.amx(False), blockq.vnni(True):
        assert blockq.vnni_active()
        assert torch.equal(blocks(x), on_tiles)
    coarse_on_tiles = blocks(x, coarse=[1, 4, 9, 11])
    with blockq.amx(False), blockq.vnni(True):
        assert torch.equal(blocks(x, coarse=[1, 4, 9, 11]), coarse_on_tiles)
    # a batch's worth: 9 exact rows (two exact chunks) and 31 draft-only rows in runs between them (the tiles take
    # these in chunks of up to 16, apart from the exact rows), products and products added into a residual
    x = torch.randn(40, 160, generator=torch.Generator().manual_seed(6))
    runs = [1, 4, 5, 21, 22, 25, 30, 37, 38, 40]
    residual = torch.randn(40, 72)
    on_tiles, added_on_tiles = blocks(x, coarse=runs), residual.clone()
    if kind == "q4_1":
        blocks.add_into(added_on_tiles, x, coarse=runs)
    with blockq.amx(False), blockq.vnni(True):
        assert torch.equal(blocks(x, coarse=runs), on_tiles)
        if kind == "q4_1":
            blocks.add_into(residual, x, coarse=runs)
            assert torch.equal(residual, added_on_tiles)


def _coarse_bound(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """Error of a product whose input is on the 8-bit grid per block of 32 (a unit is the block's largest |x| / 127;
    rounding stays within half of one), plus float32 rounding."""
    rows, k = x.shape
    unit = x.reshape(rows, k // 32, 32).abs().amax(-1).double() / 127 * 0.51  # [rows, blocks]
    blocks = weight.double().reshape(weight.shape[0], k // 32, 32)
    # what the grid's error multiplies: d * q (Q4_1's minimum term takes the exact input sum)
    magnitude = blocks - blocks.amin(-1, keepdim=True) if kind == "q4_1" else blocks.abs()
    return torch.einsum("rb,obi->ro", unit, magnitude) + _error_bound(x, weight)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_coarse_rows_take_the_8_bit_grid_and_leave_every_other_row_alone(kind: str) -> None:
    """Draft-only rows (verified's masks) on the 8-bit grid: one integer product per weight, within a grid unit of
    the exact product, and no other row's bits change; a coarse row's numbers do not depend on the pass either."""
    weight, blocks = _blocks(kind, 72, 160)
    x = torch.randn(11, 160, generator=torch.Generator().manual_seed(5))
    x[9, :32] = 0.0  # a zero block
    runs = [2, 5, 7, 10]  # rows 2-4 and 7-9
    coarse_rows = [2, 3, 4, 7, 8, 9]
    exact, coarse = blocks(x), blocks(x, coarse=runs)
    fine_rows = [r for r in range(11) if r not in coarse_rows]
    assert torch.equal(coarse[fine_rows], exact[fine_rows])
    truth = x.double() @ weight.double().T
    error = (coarse[coarse_rows].double() - truth[coarse_rows]).abs()
    assert (error <= _coarse_bound(x[coarse_rows], weight, kind)).all()
    assert (error > _error_bound(x[coarse_rows], weight)).any()  # not the exact grid
    for r in coarse_rows:
        assert torch.equal(blocks(x[r : r + 1], coarse=[0, 1])[0], coarse[r]), r
    residual = torch.randn(11, 72)
    if kind == "q4_1":
        expected = residual + coarse
        blocks.add_into(residual, x, coarse=runs)
        torch.testing.assert_close(residual, expected, atol=1e-5, rtol=1e-6)
    with pytest.raises(RuntimeError, match="outside"):
        blocks(x, coarse=[3, 12])


def test_draft_only_masks_change_only_the_mask_rows_of_a_pass(
    monkeypatch: pytest.MonkeyPatch, engine: MTPEngine
) -> None:
    """A whole pass with draft-only masks (fused layers, the adapter's delta, the head): the real rows' logits and
    every cached key and value of a real row are the exact pass's bits; the mask rows' logits stay close. Beside a
    sequence whose masks are exact, each gets what it gets alone."""
    monkeypatch.setenv(blockq.ROWS_ENV, "64")  # every pass on the records (a small model's crossover is low)
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    mask = engine.mask_token_id
    ids = _random_ids(20, seed=4)
    exact_cache, coarse_cache = fast.new_cache(), fast.new_cache()
    fast.forward(ids, exact_cache, 1)
    fast.forward(ids, coarse_cache, 1)
    tokens = [5, 9, mask, mask, mask]
    exact = fast.forward(tokens, exact_cache, 5)
    coarse = fast.forward(tokens, coarse_cache, 5, coarse_masks=True)
    assert torch.equal(coarse[:2], exact[:2])
    assert not torch.equal(coarse[2:], exact[2:])
    scale = exact[2:].abs().amax(-1, keepdim=True)
    assert ((coarse[2:] - exact[2:]).abs() <= 0.15 * scale).all()  # random weights: errors grow by layer
    real = len(ids) + 2
    for a, b in zip(exact_cache.layers, coarse_cache.layers, strict=True):
        assert torch.equal(a[:, :, :real], b[:, :, :real])
    exact_cache.truncate(real)
    coarse_cache.truncate(real)
    assert torch.equal(fast.forward([7], coarse_cache, 1), fast.forward([7], exact_cache, 1))
    from agent_mtp.engine.fast import BatchItem

    alone = [fast.new_cache() for _ in range(2)]
    beside = [fast.new_cache() for _ in range(2)]
    for cache in alone + beside:
        fast.forward(ids, cache, 1)
    passes = [([3, mask, mask], True), ([8, 2, mask], False)]
    singles = [fast.forward(t, c, len(t), coarse_masks=flag) for (t, flag), c in zip(passes, alone, strict=True)]
    batch = fast.forward_batch([BatchItem(t, c, len(t), flag) for (t, flag), c in zip(passes, beside, strict=True)])
    for single, batched in zip(singles, batch, strict=True):
        assert torch.equal(single, batched)


def test_verified_masks_are_draft_only_on_fast_runners_unless_exact_is_asked(
    monkeypatch: pytest.MonkeyPatch, engine: MTPEngine
) -> None:
    """The decode loop marks a fast runner's masks draft-only for ``verified`` (never for ConfAdapt, which commits
    mask tokens), unless the engine computes them exactly; greedy verified output is the same either way."""
    from agent_mtp.engine import DecodeConfig
    from agent_mtp.engine.engine import DRAFT_MASKS_ENV
    from agent_mtp.errors import ConfigError

    exact = engine.with_runtime("fast", draft_masks="exact")
    assert engine.draft_masks == "int8" and exact.draft_masks == "exact" and exact is not engine
    assert exact._cost_curve_path() != engine._cost_curve_path()
    prompt = "The quick brown fox"
    outputs = []
    for on, mode, expected in ((engine, "verified", True), (engine, "confadapt", False), (exact, "verified", False)):
        runner = on.new_runner()
        result = on.generate(prompt, DecodeConfig(mode=mode, max_new_tokens=12, k_max=4), runner=runner)
        assert runner.coarse_masks is expected, (on.draft_masks, mode)
        if mode == "verified":
            outputs.append(result.token_ids)
    assert outputs[0] == outputs[1]
    monkeypatch.setenv(DRAFT_MASKS_ENV, "exact")
    assert MTPEngine(engine.loaded, runtime="hf").draft_masks == "exact"
    monkeypatch.setenv(DRAFT_MASKS_ENV, "fp8")
    with pytest.raises(ConfigError, match=r"'fp8'.*int8"):
        MTPEngine(engine.loaded, runtime="hf")


@contextlib.contextmanager
def _amx_and_vnni(path: str) -> Iterator[None]:
    """Both record paths on (the ``path`` fixture turns VNNI off on the AMX path), or skip."""
    if path != "amx" or "vnni" not in _paths():
        pytest.skip("needs a CPU with both AMX-INT8 and AVX-512 VNNI")
    with blockq.vnni(True):
        yield


def test_short_passes_take_vnni_and_long_ones_the_tiles(path: str) -> None:
    """Where the CPU has both record paths, a pass goes to the tiles from the exact rows set, a drafted pass (one
    exact row, then draft-only rows) from the drafted rows set, and mixed passes by their weight in between."""
    with _amx_and_vnni(path), blockq.tiles_from(blockq.TileRows(6, 24)):
        assert blockq.tile_rows() == blockq.TileRows(6, 24)
        assert [blockq.records_path(n) for n in (1, 5, 6, 40)] == ["vnni", "vnni", "amx", "amx"]
        assert [blockq.records_path(n, n - 1) for n in (2, 23, 24, 40)] == ["vnni", "vnni", "amx", "amx"]
        assert blockq.records_path(8, 4) == "vnni"  # 4 exact rows and 4 draft-only (each 5/23 of a row): 4.9 rows
        assert blockq.records_path(7, 1) == "amx" and blockq.records_path(6, 1) == "vnni"
        with blockq.vnni(False):
            assert blockq.records_path(1) == "amx"  # without VNNI the tiles serve every pass
        with blockq.amx(False):
            assert blockq.records_path(40) == "vnni"
        with blockq.avx_kernels():
            assert blockq.records_path(40) == "avx"
    with _amx_and_vnni(path):
        _every_or_none()


def _every_or_none() -> None:
    for rows, expected in (
        (blockq.TILES_EVERY_PASS, "amx"),
        (blockq.TileRows(1, 1), "amx"),
        (blockq.TILES_NEVER, "vnni"),
    ):
        with blockq.tiles_from(rows):
            assert blockq.records_path(1) == expected and blockq.records_path(64, 63) == expected


def test_passes_split_between_tiles_and_vnni_keep_the_tiles_bits(
    monkeypatch: pytest.MonkeyPatch, path: str, engine: MTPEngine
) -> None:
    """Whole passes (one sequence and batches; exact and draft-only masks) split between the two paths by size
    give every row the bits the tiles give it: the choice is speed only."""
    from agent_mtp.engine.fast import BatchItem

    monkeypatch.setenv(blockq.ROWS_ENV, "64")  # every pass on the records (a small model's crossover is low)
    fast = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    mask = engine.mask_token_id
    ids = _random_ids(12, seed=5)
    passes = [([5], False), ([7, mask, mask], True), ([9, 3, mask, mask, mask, mask], True), ([4, 8, 2, 6], False)]

    def run(rows: blockq.TileRows) -> list[torch.Tensor]:
        with blockq.tiles_from(rows):
            out: list[torch.Tensor] = []
            for tokens, coarse in passes:
                cache = fast.new_cache()
                fast.forward(ids, cache, 1)
                out.append(fast.forward(tokens, cache, len(tokens), coarse_masks=coarse))
            caches = [fast.new_cache() for _ in passes]
            for cache in caches:
                fast.forward(ids, cache, 1)
            items = [BatchItem(t, c, len(t), flag) for (t, flag), c in zip(passes, caches, strict=True)]
            return out + fast.forward_batch(items)

    with _amx_and_vnni(path):
        split = run(blockq.TileRows(3, 5))
        every, never = run(blockq.TILES_EVERY_PASS), run(blockq.TILES_NEVER)
    for a, b, c in zip(every, split, never, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize(
    ("exact_from", "drafted_from", "expected"),
    [
        (6, 24, blockq.TileRows(6, 24)),
        (1, 4, blockq.TILES_EVERY_PASS),
        (8, 99, blockq.TileRows(8, 64)),
        (99, 99, blockq.TileRows(64, 64)),
    ],
)
def test_tile_rows_measurement_finds_where_the_tiles_win(
    monkeypatch: pytest.MonkeyPatch, path: str, exact_from: int, drafted_from: int, expected: blockq.TileRows
) -> None:
    """The smallest candidate from which the tiles win (exact passes, then drafted ones); twice the largest
    candidate where they never do; the tiles for every pass where they win from one row."""
    import time

    from agent_mtp.engine.fast import weights

    linears = [weights.PackedLinear(q4_1(torch.randn(64, 128)), prepack=False) for _ in range(2)]
    for linear in linears:
        product = linear.blocks_product

        def slowed(x: torch.Tensor, norm: Any = None, coarse: Any = (), product: Any = product) -> torch.Tensor:
            rows, drafted = x.shape[0], bool(coarse)
            tiles_faster = rows >= (drafted_from if drafted else exact_from)
            on_tiles = blockq.records_path(rows, rows - 1 if drafted else 0) == "amx"
            if on_tiles != tiles_faster:
                time.sleep(0.005)
            return product(x, norm, coarse)

        monkeypatch.setattr(linear, "blocks_product", slowed)
    with _amx_and_vnni(path):
        assert weights.measure_tile_rows(linears, rounds=2) == expected


def test_tile_rows_are_settled_once_per_process_unless_pinned(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    from agent_mtp.errors import ConfigError

    calls: list[int] = []

    def measure() -> blockq.TileRows:
        calls.append(1)
        return blockq.TileRows(5, 17)

    monkeypatch.delenv(blockq.AMX_ROWS_ENV, raising=False)
    monkeypatch.setattr(blockq, "_tiles_settled", [])
    monkeypatch.setattr(blockq, "_tile_rows_chosen", [blockq.TILES_EVERY_PASS])
    try:
        with _amx_and_vnni(path):
            with blockq.tiles_from(blockq.TILES_NEVER):  # settled inside a block (a bench's sibling runtime)
                assert blockq.settle_tile_rows(measure) == blockq.TileRows(5, 17)
                assert blockq.tile_rows() == blockq.TILES_NEVER and blockq.records_path(40) == "vnni"
            assert blockq.tile_rows() == blockq.TileRows(5, 17) and blockq.records_path(5) == "amx"  # serves after
            assert blockq.settle_tile_rows(measure) == blockq.TileRows(5, 17) and calls == [1]  # measured once
            monkeypatch.setattr(blockq, "_tiles_settled", [])
            monkeypatch.setenv(blockq.AMX_ROWS_ENV, "8,20")
            assert blockq.pinned_tile_rows() == blockq.TileRows(8, 20)
            assert blockq.settle_tile_rows(measure) == blockq.TileRows(5, 17) and calls == [1]  # pinned: no measuring
    finally:
        monkeypatch.undo()
        blockq._apply_tile_rows()  # the process's own choice back in the kernels
    for raw, expected in (("8", blockq.TileRows(8, 8)), (" 0 ", blockq.TileRows(0, 0)), ("", None)):
        monkeypatch.setenv(blockq.AMX_ROWS_ENV, raw)
        assert blockq.pinned_tile_rows() == expected
    monkeypatch.setenv(blockq.AMX_ROWS_ENV, "1,40")
    assert blockq.pinned_tile_rows() == blockq.TILES_EVERY_PASS
    for bad in ("eight", "8,", "1,2,3", "-4", "8,4"):
        monkeypatch.setenv(blockq.AMX_ROWS_ENV, bad)
        with pytest.raises(ConfigError, match=blockq.AMX_ROWS_ENV):
            blockq.pinned_tile_rows()


def test_pinned_tile_rows_serve_from_the_start() -> None:
    """``AGENT_MTP_AMX_ROWS`` sets the split when the kernels load (a process that never measures keeps it)."""
    code = (
        "from agent_mtp.engine.fast import blockq; "
        "print(blockq.tile_rows(), blockq.records_path(3), blockq.records_path(4))"
    )
    env = {**os.environ, blockq.AMX_ROWS_ENV: "4,10"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = "4 exact / 10 drafted rows vnni amx" if "vnni" in _paths() and "amx" in _paths() else None
    if expected is None:
        pytest.skip("needs a CPU with both AMX-INT8 and AVX-512 VNNI")
    assert done.stdout.strip() == expected


def test_the_tile_split_costs_least_over_every_size_so_one_noisy_sample_does_not_move_it() -> None:
    from agent_mtp.engine.fast.weights import _best_split

    sizes = (1, 2, 3, 4, 6, 8, 12, 16)
    vnni = [7.5, 8.0, 9.2, 10.1, 13.7, 17.1, 24.0, 31.0]
    tiles = [10.5, 7.9, 12.1, 12.8, 13.6, 14.5, 19.0, 23.0]  # a noisy win at 2 rows, a near-tie at 6
    assert _best_split(sizes, tiles, vnni) in (6, 8)
    tiles[4] = 14.5  # the near-tie lost: still one split, not the noisy 2
    assert _best_split(sizes, tiles, vnni) == 8
    assert _best_split(sizes, [t + 100 for t in tiles], vnni) == 32  # VNNI everywhere: past the largest size
    assert _best_split(sizes, [1.0] * len(sizes), vnni) == 1  # the tiles everywhere


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_record_products_do_not_depend_on_how_the_threads_split_the_tasks(kind: str) -> None:
    _, blocks = _blocks(kind, 520, 256)
    for rows in (1, 5, 12):
        x = torch.randn(rows, 256)
        same_bits_however_the_threads_split(lambda x=x: blocks(x))
        same_bits_however_the_threads_split(lambda x=x, half=rows // 2: blocks(x, coarse=[0, half]))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_short_last_chunk_on_vnni_keeps_the_tiles_bits(kind: str, path: str) -> None:
    """Where both record paths are on, an exact tile pass's last partial chunk may run on VNNI beside the tiles' full
    chunks (a 9th row no longer costs a whole tile chunk): every row keeps the bits the tiles give it, products and
    products added into a residual, with draft-only rows among the exact ones, at every tail length."""
    with _amx_and_vnni(path):
        _, blocks = _blocks(kind, 72, 160)
        x = torch.randn(27, 160, generator=torch.Generator().manual_seed(8))
        residual = torch.randn(27, 72)
        for rows in (8, 9, 10, 12, 16, 17, 18, 25, 27):
            # from 13 rows a draft-only row; where splitting it off does not save a chunk (18, 25, 27 rows) it stays
            # among the exact ones, in the tail
            runs = [rows - 1, rows] if rows > 12 else []
            results = []
            for tail in (0, 1, 2, 8):
                with blockq.vnni_tail(tail):
                    added = residual[:rows].clone()
                    if kind == "q4_1":
                        blocks.add_into(added, x[:rows], coarse=runs)
                    results.append((blocks(x[:rows], coarse=runs), added))
            for product, added in results[1:]:
                assert torch.equal(product, results[0][0]), (rows, kind)
                assert torch.equal(added, results[0][1]), (rows, kind)
    from agent_mtp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"0 .* to 8 rows"), blockq.vnni_tail(9):
        pass
