"""The latency histogram: bucket geometry, exact merging across writers, percentile error bound."""

from __future__ import annotations

import math
import random

import pytest

from agent_mtp.telemetry import histogram


def _histogram(latencies: list[float]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for latency in latencies:
        index = histogram.bucket_index(latency)
        counts[index] = counts.get(index, 0) + 1
    return counts


def _nearest_rank(latencies: list[float], q: float) -> float:
    ordered = sorted(latencies)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def test_every_latency_falls_inside_its_bucket() -> None:
    rng = random.Random(0)
    samples = [10 ** rng.uniform(-5, 5.5) for _ in range(5000)] + [0.0, 0.001, 0.0099, 0.01, 1.0, 99.99]
    for latency in samples:
        low, high = histogram.bucket_bounds(histogram.bucket_index(latency))
        assert low <= latency * (1 + 1e-9) and latency < high * (1 + 1e-9), (latency, low, high)


def test_buckets_are_ordered_and_contiguous() -> None:
    previous_high = 0.0
    for index in range(histogram.OVERFLOW + 1):
        low, high = histogram.bucket_bounds(index)
        assert low == pytest.approx(previous_high)
        assert high > low
        previous_high = high
    assert math.isinf(previous_high)


def test_relative_width_is_at_most_ten_percent_above_one_ms() -> None:
    for index in range(1, histogram.OVERFLOW):
        low, high = histogram.bucket_bounds(index)
        assert (high - low) / low <= 0.1 + 1e-12


def test_merged_histograms_give_exactly_the_percentiles_of_all_samples() -> None:
    rng = random.Random(1)
    latencies = [rng.lognormvariate(-1.0, 1.2) for _ in range(3000)]
    writers: list[list[float]] = [[], [], [], []]
    for latency in latencies:
        rng.choice(writers).append(latency)
    merged = histogram.merge(_histogram(part) for part in writers)
    assert merged == _histogram(latencies)
    for q in (0.5, 0.9, 0.95, 0.99, 1.0):
        assert histogram.percentile(merged, q) == histogram.percentile(_histogram(latencies), q)


@pytest.mark.parametrize("q", [0.01, 0.5, 0.95, 0.99, 1.0])
def test_percentile_is_never_below_the_true_value_and_at_most_ten_percent_above(q: float) -> None:
    rng = random.Random(2)
    latencies = [rng.uniform(0.002, 30.0) for _ in range(999)]
    estimate = histogram.percentile(_histogram(latencies), q)
    true = _nearest_rank(latencies, q)
    assert estimate is not None
    assert true <= estimate <= true * 1.1 + 1e-12


def test_percentile_of_empty_histogram_is_none_and_bad_quantile_raises() -> None:
    assert histogram.percentile({}, 0.5) is None
    with pytest.raises(ValueError, match="quantile"):
        histogram.percentile({1: 1}, 0.0)


def test_huge_latency_goes_to_overflow() -> None:
    assert histogram.bucket_index(1e9) == histogram.OVERFLOW
    assert histogram.percentile({histogram.OVERFLOW: 3}, 0.5) == histogram.MAX_LATENCY_S
