"""Real rows on a 16-bit grid (``row_grid="int16"``, ``grid_bits=16``): on the record paths (AMX, VNNI) an exact row's
inputs per block of 32 at 2^-15 of the block's largest |x| instead of 2^-23, so VNNI makes 16 integer products a block
instead of 24. Within that grid's error bound, every other row (draft-only rows) untouched, a row's numbers
independent of the pass, both record paths the same bits, and the engine setting validated like the KV cache's.
Skipped where the CPU (or the OS) gives neither AMX-INT8 nor AVX-512 VNNI."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.engine import ROW_GRID_ENV, row_grid_setting
from agent_mtp.engine.fast import BatchItem, FastModel, FastRunner, blockq
from agent_mtp.errors import ConfigError
from tests.unit.test_fast_blockq import _engine, batched_against_single, q4_1, q8_0
from tests.unit.test_fast_runtime import _loaded, _random_ids
from tests.unit.test_fast_tiles import _error_bound, _paths

pytestmark = pytest.mark.skipif(
    not (blockq.kernels_available() and blockq.tiles_wanted()),
    reason="neither AMX-INT8 tiles nor AVX-512 VNNI on this CPU / OS",
)


@pytest.fixture(autouse=True, params=_paths() or ["none"])
def path(request: pytest.FixtureRequest) -> Any:
    """Every test on each record path the CPU has: AMX tiles, or VNNI with the tiles off."""
    with blockq.amx(request.param == "amx"), blockq.vnni(request.param == "vnni"):
        assert blockq.records_active()
        yield request.param


def _blocks(kind: str, out: int = 72, k: int = 160) -> tuple[torch.Tensor, blockq.BlockWeights]:
    weight = {"q4_1": q4_1, "q8_0": q8_0}[kind](torch.randn(out, k, generator=torch.Generator().manual_seed(3)))
    blocks = blockq.block_weights(weight)
    assert blocks is not None and blocks.tiles is not None
    return weight, blocks


def _grid16_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Error of a product whose inputs are on the 16-bit grid per block of 32 (a unit is 2^-15 of the power of two
    above the block's largest |x|; rounding stays within half of one), plus float32 rounding."""
    rows, k = x.shape
    peak = x.reshape(rows, k // 32, 32).abs().amax(-1).double()
    unit = torch.exp2(torch.floor(torch.log2(peak)) + 1 - 15) * 0.5  # [rows, blocks]
    blocks = weight.double().reshape(weight.shape[0], k // 32, 32).abs()
    return torch.einsum("rb,obi->ro", unit, blocks) + _error_bound(x, weight)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_16_bit_rows_stay_within_their_grid_and_leave_draft_rows_alone(kind: str) -> None:
    weight, blocks = _blocks(kind)
    x = torch.randn(11, 160, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 3, 11)[:, None]
    x[4, :32] = 0.0  # a zero block
    exact, fine = blocks(x), blocks(x, grid_bits=16)
    truth = x.double() @ weight.double().T
    error = (fine.double() - truth).abs()
    assert (error <= _grid16_bound(x, weight)).all()
    assert (error > _error_bound(x, weight)).any()  # not the 24-bit grid
    assert ((exact.double() - truth).abs() <= _error_bound(x, weight)).all()  # which is float32-accurate
    runs = [2, 5, 7, 10]  # draft-only rows 2-4 and 7-9 take the 8-bit grid whatever the real rows' grid
    coarse_rows = [2, 3, 4, 7, 8, 9]
    mixed, mixed24 = blocks(x, coarse=runs, grid_bits=16), blocks(x, coarse=runs)
    assert torch.equal(mixed[coarse_rows], mixed24[coarse_rows])
    real = [r for r in range(11) if r not in coarse_rows]
    assert torch.equal(mixed[real], fine[real])
    for r in range(11):  # a row's numbers do not depend on the pass (chunks of 8, a 9th alone)
        assert torch.equal(blocks(x[r : r + 1], grid_bits=16)[0], fine[r]), r
    if kind == "q4_1":
        residual = torch.randn(11, 72)
        expected = residual + fine
        blocks.add_into(residual, x, grid_bits=16)
        torch.testing.assert_close(residual, expected, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_amx_and_vnni_give_the_same_16_bit_bits(kind: str, path: str) -> None:
    """The tiles multiply the grid's zero low byte (the same sums); VNNI leaves its products out."""
    if path != "amx" or "vnni" not in _paths():
        pytest.skip("needs a CPU with both AMX-INT8 and AVX-512 VNNI")
    _, blocks = _blocks(kind)
    x = torch.randn(19, 160, generator=torch.Generator().manual_seed(8))
    on_tiles = blocks(x, coarse=[3, 9], grid_bits=16)
    with blockq.amx(False), blockq.vnni(True):
        assert torch.equal(blocks(x, coarse=[3, 9], grid_bits=16), on_tiles)


def test_the_kernels_refuse_other_grids() -> None:
    _, blocks = _blocks("q4_1")
    with pytest.raises(RuntimeError, match="grid_bits must be 24 or 16, got 8"):
        blocks(torch.randn(2, 160), grid_bits=8)


@pytest.fixture(scope="module")
def engine() -> MTPEngine:
    return _engine("plain-llama", adapter=True)  # plain Q4_1 layers: the fused layer pass serves it


@pytest.fixture
def on_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(blockq.ROWS_ENV, "64")  # every pass on the records (a small model's crossover is low)


def test_a_16_bit_fast_model_stays_close_and_batches_give_single_bits(engine: MTPEngine, on_records: None) -> None:
    """The fused layer pass on 16-bit rows: logits close to the 24-bit model's, a batched pass giving each sequence
    its single pass's bits, the Python layer loop the fused pass's bits."""
    exact = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id)
    fine = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id, grid_bits=16)
    assert fine.grid_bits == 16 and fine._fused is not None
    mask = engine.mask_token_id
    ids = _random_ids(30, seed=2)
    a, b = exact.new_cache(), fine.new_cache()
    for tokens in (ids, [5, 6, mask]):  # on the records (a prefill too, below the pinned crossover)
        la, lb = exact.forward(tokens, a, len(tokens)), fine.forward(tokens, b, len(tokens))
        assert not torch.equal(la, lb)
        torch.testing.assert_close(lb, la, atol=1e-3 * float(la.abs().max()), rtol=0)
    for tokens, together, alone in batched_against_single(fine, [[[4], [5, 6], [7, mask]], [[8, 9], [2], [3]]]):
        assert torch.equal(together, alone), tokens
    fused, looped = fine.new_cache(), fine.new_cache()
    fine.forward(ids, fused, 1)
    fine.forward(ids, looped, 1)
    want = fine.forward([5, 6, mask, mask], fused, 4, coarse_masks=True)
    stack, fine._fused = fine._fused, None  # the Python layer loop
    try:
        assert torch.equal(fine.forward([5, 6, mask, mask], looped, 4, coarse_masks=True), want)
    finally:
        fine._fused = stack


def test_verified_equals_ntp_on_16_bit_rows(engine: MTPEngine, on_records: None) -> None:
    """Exactness against the engine's own NTP holds: a real row's numbers do not depend on the rows beside it."""
    fine = engine.with_runtime("fast", row_grid="int16")
    runner = fine.new_runner()
    assert isinstance(runner, FastRunner) and runner.model.grid_bits == 16
    for seed in range(3):
        prompt = _random_ids(6 + 9 * seed, seed)
        ntp = fine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=24)).token_ids
        assert fine.generate(prompt, DecodeConfig(mode="verified", k_max=4, max_new_tokens=24)).token_ids == ntp


def test_the_row_grid_setting_is_validated(engine: MTPEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    fine = engine.with_runtime("fast", row_grid="int16")
    assert (engine.row_grid, fine.row_grid) == ("int24", "int16")
    assert fine.with_runtime("fast") is fine and engine.with_runtime("fast", row_grid="int24") is engine
    assert fine.with_runtime("hf").row_grid == "int24"  # the HF runtime computes rows in float32
    assert "-grid16" in fine._cost_curve_path().name and "-grid16" not in engine._cost_curve_path().name
    from agent_mtp.bench.hf import FAST_INT16, BaselineModels

    assert BaselineModels(engine).engine(FAST_INT16).row_grid == "int16"  # the bench's ntp@fast-int16 and others
    with pytest.raises(ConfigError, match=r"row_grid='int8'.*'int16'"):
        row_grid_setting("int8", "fast")
    with pytest.raises(ConfigError, match="needs the fast runtime"):
        MTPEngine(_loaded(engine), runtime="hf", row_grid="int16")
    with pytest.raises(ValueError, match="grid_bits=12"):
        FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id, grid_bits=12)
    monkeypatch.setenv(ROW_GRID_ENV, "int16")
    assert row_grid_setting(None, "fast") == "int16"
    assert row_grid_setting(None, "hf") == "int24"
    monkeypatch.setenv(ROW_GRID_ENV, "fp8")
    with pytest.raises(ConfigError, match=f"{ROW_GRID_ENV}='fp8'"):
        row_grid_setting(None, "fast")


def test_a_server_setting_picks_the_row_grid(engine: MTPEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``agent-mtp serve --row-grid int16`` (``ServerSettings.row_grid``) serves a sibling of the shared engine."""
    from agent_mtp import service
    from agent_mtp.server import app
    from agent_mtp.server.settings import ServerSettings

    monkeypatch.setattr(service, "shared_engine", lambda *args, **kwargs: engine)
    served = app.build_service(ServerSettings(row_grid="int16"))
    assert served.engine.row_grid == "int16" and served.engine.loaded is engine.loaded
    assert app.build_service(ServerSettings()).engine is engine
    with pytest.raises(ValueError, match="row_grid"):
        ServerSettings(row_grid="int8")  # type: ignore[arg-type]


def test_batch_items_of_a_16_bit_model_keep_their_caches(engine: MTPEngine, on_records: None) -> None:
    """A batched pass on 16-bit rows appends to every sequence's cache as a single pass does."""
    fine = FastModel.from_hf(engine.model, mask_token_id=engine.mask_token_id, grid_bits=16)
    caches = [fine.new_cache() for _ in range(3)]
    for i, cache in enumerate(caches):
        fine.forward(_random_ids(5 + i, seed=i), cache, 1)
    fine.forward_batch([BatchItem([3, 4], cache, 2) for cache in caches])
    assert [c.length for c in caches] == [7, 8, 9]
