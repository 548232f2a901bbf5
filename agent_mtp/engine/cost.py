"""The cost curve: how expensive a forward of n tokens is on this machine, relative to one token.

On a CPU a 16-token forward costs ~2x a 1-token forward (fp32), on a GPU ~1x, so the best number of masks differs;
the planner (:mod:`agent_mtp.engine.planner`) reads this curve.
"""

from __future__ import annotations

import bisect
import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

CURVE_POINTS = (1, 2, 4, 8, 16, 32)
MEMO_FIRST = 64
"""Cost ranges starting at up to this many rows are kept per curve (decode passes; prefills are not)."""


@dataclass(frozen=True)
class CostCurve:
    """Relative cost of a forward pass by number of tokens fed (cost(1) == 1)."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points or self.points[0][0] != 1:
            raise ValueError("A cost curve needs a point at n=1.")

    @functools.cached_property
    def _xs(self) -> list[int]:
        return [p[0] for p in self.points]

    @functools.cached_property
    def _ys(self) -> list[float]:
        return [p[1] for p in self.points]

    def cost(self, n: int) -> float:
        xs, ys = self._xs, self._ys  # read once per curve: the planner asks for tens of sizes per pass
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:  # extrapolate linearly from the last segment
            if len(xs) == 1:
                return ys[0] * n
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (n - xs[-1])
        i = bisect.bisect_left(xs, n)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    @functools.cached_property
    def _memo(self) -> dict[tuple[int, int], tuple[float, ...]]:
        return {}

    def costs(self, first: int, count: int) -> Sequence[float]:
        """``[cost(first), ..., cost(first + count - 1)]``: what a planner reads once per pass (a curve whose
        costs depend on the moment, as a shared pass's do, reads that moment once). A curve is a value, so the
        ranges of decode passes (a few pending tokens) are kept."""
        if first > MEMO_FIRST:
            return [self.cost(n) for n in range(first, first + count)]
        key = (first, count)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = tuple(self.cost(n) for n in range(first, first + count))
        return found

    def to_json(self) -> str:
        return json.dumps({"points": [list(p) for p in self.points]})

    @classmethod
    def from_json(cls, text: str) -> CostCurve:
        data = json.loads(text)
        return cls(tuple((int(n), float(c)) for n, c in data["points"]))

    @classmethod
    def flat(cls) -> CostCurve:
        """A GPU-like curve: extra tokens are free."""
        return cls(((1, 1.0), (64, 1.0)))


def measure_cost_curve(
    forward_n: Callable[[int], None], *, points: tuple[int, ...] = CURVE_POINTS, repeats: int = 5
) -> CostCurve:
    """Time ``forward_n(n)`` (one forward of n tokens on a cached prefix) and normalise by n=1.

    Robust to a busy machine: the sizes are timed in interleaved rounds and the fastest sample of each is kept
    (contention only ever adds time), and a pass of n tokens is never taken to cost more than n single passes.
    """
    samples: dict[int, list[float]] = {n: [] for n in points}
    for _ in range(2):
        forward_n(1)  # warm-up
    for _ in range(repeats):
        for n in points:
            start = time.perf_counter()
            forward_n(n)
            samples[n].append(time.perf_counter() - start)
    base = min(samples[1])
    monotone, best = [], 1.0
    for n in points:
        cost = min(max(min(samples[n]) / base, 1.0), float(n))
        best = max(best, cost)  # cost can only grow with n
        monotone.append((n, best))
    return CostCurve(tuple(monotone))


def load_or_measure(path: Path, measure: Callable[[], CostCurve]) -> CostCurve:
    if path.is_file():
        try:
            return CostCurve.from_json(path.read_text())
        except (ValueError, KeyError, json.JSONDecodeError):
            pass
    curve = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(curve.to_json())
    except OSError:
        pass
    return curve
