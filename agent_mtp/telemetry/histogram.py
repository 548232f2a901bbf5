"""Log-linear latency histogram whose buckets are the same in every process, so counts merge exactly.

A latency is cut to two significant digits on a 0.1 ms grid: 1.0-1.1 ms, 1.1-1.2 ms, ... 9.9-10 ms,
10-11 ms, ... 99-100 ms, 100-110 ms, ... (90 linear buckets per decade, 1 ms to 10^5 s) plus one bucket
below 1 ms and one overflow bucket. Merging = adding counts per bucket index, so the percentile of merged
histograms is exactly the percentile of one histogram fed every sample. A reported percentile is the upper
edge of the bucket that holds the nearest-rank sample: never below the true value and at most 10% above it
(at most 1 ms above it below 1 ms).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

_UNITS_PER_S = 10_000
"""Grid step: 0.1 ms."""
_PER_DECADE = 90
_MAX_DECADES = 8
UNDERFLOW = 0
OVERFLOW = 1 + _PER_DECADE * _MAX_DECADES
MAX_LATENCY_S = 10**_MAX_DECADES * 10 / _UNITS_PER_S
"""Latencies at or above this (10^5 s) land in the overflow bucket."""


def bucket_index(latency_s: float) -> int:
    """Histogram bucket of one latency in seconds (non-negative and finite; the caller checks)."""
    units = math.floor(latency_s * _UNITS_PER_S + 1e-9)
    if units < 10:
        return UNDERFLOW
    exponent = len(str(units)) - 2
    if exponent >= _MAX_DECADES:
        return OVERFLOW
    lead = units // 10**exponent  # two significant digits, 10..99
    return 1 + _PER_DECADE * exponent + (lead - 10)


def bucket_bounds(index: int) -> tuple[float, float]:
    """``[low, high)`` of a bucket in seconds."""
    if index == UNDERFLOW:
        return 0.0, 10 / _UNITS_PER_S
    if index >= OVERFLOW:
        return MAX_LATENCY_S, math.inf
    exponent, offset = divmod(index - 1, _PER_DECADE)
    lead = offset + 10
    return lead * 10**exponent / _UNITS_PER_S, (lead + 1) * 10**exponent / _UNITS_PER_S


def merge(histograms: Iterable[Mapping[int, int]]) -> dict[int, int]:
    """Sum of bucket counts; the order of the inputs does not matter."""
    total: dict[int, int] = {}
    for histogram in histograms:
        for index, count in histogram.items():
            total[index] = total.get(index, 0) + count
    return total


def percentile(histogram: Mapping[int, int], q: float) -> float | None:
    """Nearest-rank ``q``-quantile (0 < q <= 1) as the upper edge of its bucket; ``None`` when empty."""
    if not 0.0 < q <= 1.0:
        msg = f"quantile {q!r} must be in (0, 1]"
        raise ValueError(msg)
    total = sum(count for count in histogram.values() if count > 0)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total - 1e-9))
    seen = 0
    for index in sorted(histogram):
        seen += max(histogram[index], 0)
        if seen >= rank:
            low, high = bucket_bounds(index)
            return low if math.isinf(high) else high
    raise AssertionError("unreachable: rank <= total")
