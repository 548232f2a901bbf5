"""The live cost curve: the stored curve corrected by the process's own decode passes (engine/cost.py PassTimes)."""

from __future__ import annotations

import pytest

from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.batching import BatchedEngine
from agent_mtp.engine.cost import CostCurve, PassTimes
from agent_mtp.engine.engine import COST_CURVE_ENV, cost_curve_source_setting
from agent_mtp.errors import ConfigError
from tests.tiny import tiny_engine

PROMPT = "The quick brown fox"
STORED = CostCurve(
    ((1, 1.0), (2, 1.2), (4, 1.6), (8, 2.4)),
    0.5,
    real=((1, 1.0), (2, 1.1), (3, 1.2), (4, 1.3), (8, 2.0)),
    draft=((1, 1.0), (2, 1.15), (3, 1.25), (4, 1.35), (8, 1.9)),
)
CHEAP_ROWS = CostCurve(  # masks and drafts nearly free: a verified planner buys them
    ((1, 1.0), (2, 1.02), (4, 1.05), (8, 1.1), (16, 1.6)),
    real=((1, 1.0), (2, 1.02), (4, 1.05), (8, 1.1), (16, 1.6)),
    draft=((1, 1.0), (2, 1.02), (4, 1.05), (8, 1.1), (16, 1.6)),
)


def _fill(times: PassTimes, real: int, masks: int, seconds: float, n: int, *, draft_masks: bool = False) -> None:
    for _ in range(n):
        times.record(real, masks, seconds, draft_masks=draft_masks)


def _close(got: tuple[tuple[int, float], ...] | None, want: tuple[tuple[int, float], ...]) -> None:
    assert got is not None and [n for n, _ in got] == [n for n, _ in want]
    assert [c for _, c in got] == pytest.approx([c for _, c in want])


def test_measured_points_replace_the_stored_ones() -> None:
    times = PassTimes(min_passes=3)
    one = 1 / 64  # seconds whose ratios are exact in binary
    _fill(times, 1, 0, one, 3)
    _fill(times, 2, 0, 1.5 * one, 3)  # a draft token: 1.5x, where the stored curve says 1.1x
    _fill(times, 1, 2, 2 * one, 3, draft_masks=True)  # two draft masks: 2.0x, stored 1.25x
    _fill(times, 1, 1, 1.25 * one, 3)  # one exact mask (static / ConfAdapt): 1.25x, stored 1.2x
    curve = times.calibrated(STORED)
    # stored points past a measured one scaled as it was (1.5 / 1.1 for the real tokens), within [1, n]
    _close(curve.real, ((1, 1.0), (2, 1.5), (3, 1.2 * 1.5 / 1.1), (4, 1.3 * 1.5 / 1.1), (8, 2.0 * 1.5 / 1.1)))
    _close(curve.draft, ((1, 1.0), (2, 1.15), (3, 2.0), (4, 1.35 * 2.0 / 1.25), (8, 1.9 * 2.0 / 1.25)))
    _close(curve.points, ((1, 1.0), (2, 1.25), (4, 1.6 * 1.25 / 1.2), (8, 2.4 * 1.25 / 1.2)))
    assert curve.mask_share == STORED.mask_share
    assert times.calibrated(STORED) is curve  # nothing new recorded: the same curve object (its memo kept)
    times.record(1, 0, 0.010)
    assert times.calibrated(STORED) is not curve


def test_rows_priced_alike_take_every_kind_on_the_one_curve() -> None:
    """Without a draft-mask curve (AVX2: no record paths) the planner prices every row on ``points``: real-token
    passes and verified's masks correct it there (at a size both measured, their mean)."""
    alike = CostCurve(((1, 1.0), (2, 1.2), (4, 1.6), (8, 2.4)), 0.9)
    times = PassTimes(min_passes=1)
    one = 1 / 64
    times.record(1, 0, one)
    times.record(2, 0, 1.5 * one)
    times.record(1, 1, 1.75 * one, draft_masks=True)  # n = 2 as well: the mean of 1.5 and 1.75
    times.record(1, 3, 2.5 * one, draft_masks=True)
    curve = times.calibrated(alike)
    assert curve.real is None and curve.draft is None and curve.mask_share == 0.9
    _close(curve.points, ((1, 1.0), (2, 1.625), (4, 2.5), (8, 2.4 * 2.5 / 1.6)))


def test_the_stored_curve_stands_until_enough_one_token_passes() -> None:
    times = PassTimes(min_passes=4)
    _fill(times, 2, 0, 2 / 64, 10)
    _fill(times, 1, 0, 1 / 64, 3)
    assert times.calibrated(STORED) is STORED
    times.record(1, 0, 1 / 64)
    assert times.calibrated(STORED).real[1] == (2, 2.0)


def test_a_kind_with_few_passes_keeps_its_stored_point() -> None:
    times = PassTimes(min_passes=4)
    _fill(times, 1, 0, 0.010, 4)
    _fill(times, 3, 0, 0.030, 3)
    assert times.calibrated(STORED).real == STORED.real


def test_medians_of_the_latest_window() -> None:
    """One slow pass (a preemption, a collection) does not move a point; the window follows the machine."""
    times = PassTimes(window=8, min_passes=4)
    _fill(times, 1, 0, 0.010, 7)
    times.record(1, 0, 0.500)
    assert times.medians()[(1, 0, False)] == pytest.approx(0.010)
    _fill(times, 1, 0, 0.020, 8)  # the machine slowed: the old passes leave the window
    assert times.medians()[(1, 0, False)] == pytest.approx(0.020)


def test_costs_stay_within_one_and_n() -> None:
    times = PassTimes(min_passes=1)
    times.record(1, 0, 1 / 64)
    times.record(2, 0, 1 / 128)  # faster than one token (noise): costs at least 1
    times.record(3, 0, 10 / 64)  # ten times: at most 3 (and 4 and 8, scaled as 3 was, at most 4 and 8)
    assert times.calibrated(STORED).real == ((1, 1.0), (2, 1.0), (3, 3.0), (4, 4.0), (8, 8.0))


def test_a_measured_pass_never_makes_a_larger_one_cheaper() -> None:
    """A stored point past a measured one, scaled down with it, stays at least the measured cost."""
    times = PassTimes(min_passes=1)
    times.record(1, 0, 1 / 64)
    times.record(4, 0, 2.6 / 64)  # 2.6x where the stored curve says 1.3x: 8 tokens scaled to 4.0x
    times.record(3, 0, 1 / 64)  # but 3 tokens no dearer than one: 4 tokens keep 2.6x
    _close(times.calibrated(STORED).real, ((1, 1.0), (2, 1.1), (3, 1.1), (4, 2.6), (8, 4.0)))


@pytest.mark.parametrize(
    ("real", "masks", "seconds", "draft_masks"),
    [
        (2, 1, 0.01, True),  # a draft token and a mask: no curve point describes it
        (1, 8, 0.01, True),  # past LIVE_MAX_TOKENS: a prefill-like pass
        (9, 0, 0.01, False),
        (1, 0, 0.0, False),  # no time
        (0, 0, 0.01, False),
        (1, -1, 0.01, False),
    ],
)
def test_passes_no_point_describes_are_not_kept(real: int, masks: int, seconds: float, draft_masks: bool) -> None:
    times = PassTimes(min_passes=1)
    times.record(real, masks, seconds, draft_masks=draft_masks)
    assert times.medians() == {}


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="min_passes"):
        PassTimes(window=4, min_passes=5)


def test_the_setting_names_its_source_and_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COST_CURVE_ENV, raising=False)
    assert cost_curve_source_setting(None) == "live"
    monkeypatch.setenv(COST_CURVE_ENV, "stored")
    assert cost_curve_source_setting(None) == "stored"
    assert cost_curve_source_setting("live") == "live"
    monkeypatch.setenv(COST_CURVE_ENV, "measured")
    with pytest.raises(ConfigError, match=r"AGENT_MTP_COST_CURVE='measured' is not a cost curve source.*'stored'"):
        cost_curve_source_setting(None)
    with pytest.raises(ConfigError, match=r"cost_curve_source='x'"):
        cost_curve_source_setting("x")


@pytest.fixture
def live_engine() -> MTPEngine:
    engine = tiny_engine(adapter=True)
    engine.cost_curve_source = "live"
    engine.pass_times = PassTimes(min_passes=1)
    return engine


def test_the_decode_loop_records_its_passes(live_engine: MTPEngine) -> None:
    """ntp's greedy runs give one-token passes, verified's drafted passes their kinds (its masks draft-only); the
    prefill is not a decode pass."""
    live_engine.set_cost_curve(CHEAP_ROWS)
    live_engine.generate(PROMPT, DecodeConfig(mode="ntp", max_new_tokens=12, prefix_cache=False))
    kinds = set(live_engine.pass_times.medians())
    assert kinds == {(1, 0, False)}
    r = live_engine.generate(PROMPT, DecodeConfig(mode="verified", max_new_tokens=24, prefix_cache=False))
    assert max(r.stats.k_used) > 1
    kinds = set(live_engine.pass_times.medians())
    assert any(masks and draft for _, masks, draft in kinds)
    assert all(real + masks <= 8 for real, masks, _ in kinds)


def test_live_costs_steer_the_planner_and_keep_the_output(live_engine: MTPEngine) -> None:
    """The stored curve says masks and drafts are nearly free, this process's passes say they cost 10x a one-token
    pass: a live planner buys none (every pass plain, the output ntp's); a stored one still buys them."""
    live_engine.set_cost_curve(CHEAP_ROWS)
    cfg = DecodeConfig(mode="verified", max_new_tokens=24, prefix_cache=False)
    ntp = live_engine.generate(PROMPT, DecodeConfig(mode="ntp", max_new_tokens=24, prefix_cache=False))
    times = live_engine.pass_times = PassTimes(min_passes=8)
    _fill(times, 1, 0, 0.001, times.window)
    for n in range(2, 9):
        _fill(times, n, 0, 0.010, times.window)
        _fill(times, 1, n - 1, 0.010, times.window, draft_masks=True)
    live = live_engine.generate(PROMPT, cfg)
    assert set(live.stats.k_used) == {1} and live.stats.draft_stats == {}
    assert live.token_ids == ntp.token_ids
    live_engine.cost_curve_source = "stored"
    stored = live_engine.generate(PROMPT, cfg)
    assert max(stored.stats.k_used) > 1
    assert stored.token_ids == ntp.token_ids


def test_batched_sequences_record_nothing(live_engine: MTPEngine) -> None:
    """Beside other sequences a pass's time is the batch's: the batch prices it (its fitted pass times)."""
    live_engine.set_cost_curve(CHEAP_ROWS)
    batched = BatchedEngine(live_engine)
    try:
        batched.generate(PROMPT, DecodeConfig(mode="verified", max_new_tokens=16, prefix_cache=False))
    finally:
        batched.close()
    assert live_engine.pass_times.medians() == {}


def test_the_bench_reports_the_live_curve_its_planner_used(live_engine: MTPEngine) -> None:
    from agent_mtp.bench.hf import BaselineModels

    live_engine.set_cost_curve(STORED)
    models = BaselineModels(live_engine)
    assert set(models.cost_curves()) == {"fast"}  # nothing timed yet: the stored curve
    _fill(live_engine.pass_times, 1, 0, 1 / 64, 1)
    _fill(live_engine.pass_times, 2, 0, 2 / 64, 1)
    curves = models.cost_curves()
    assert curves["fast"] == [list(p) for p in STORED.points]
    assert curves["fast live, real tokens"][:2] == [[1, 1.0], [2, 2.0]]
    assert "fast live, draft masks" in curves
    live_engine.cost_curve_source = "stored"
    assert set(models.cost_curves()) == {"fast"}
    live_engine.cost_curve_source = "live"
    live_engine.set_cost_curve(CostCurve(STORED.points))  # no draft-mask curve: every row priced alike
    assert models.cost_curves()["fast live, rows"][:2] == [[1, 1.0], [2, 2.0]]


def test_a_reference_run_records_nothing(live_engine: MTPEngine) -> None:
    """The engine's reference runs (the HF forward behind a fast engine, for equivalence tests) time another
    runtime's passes: they stay out of this runtime's curve."""
    live_engine.generate(PROMPT, DecodeConfig(mode="ntp", max_new_tokens=12, prefix_cache=False), _reference=True)
    assert live_engine.pass_times.medians() == {}
    live_engine.generate(PROMPT, DecodeConfig(mode="ntp", max_new_tokens=12, prefix_cache=False))
    assert live_engine.pass_times.medians() != {}
