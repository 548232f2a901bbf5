"""The cost curve: how expensive a forward of n tokens is on this machine, relative to one token.

On a CPU a 16-token forward costs ~2x a 1-token forward (fp32), on a GPU ~1x, so the best number of masks differs;
the planner (:mod:`agent_mtp.engine.planner`) reads this curve.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent_mtp.engine.files import exclusive, write_atomically

CURVE_POINTS = (1, 2, 3, 4, 8, 16, 32)
MEMO_FIRST = 64
"""Cost ranges starting at up to this many rows are kept per curve (decode passes; prefills are not)."""


@dataclass(frozen=True)
class CostCurve:
    """Relative cost of a forward pass by number of tokens fed (cost(1) == 1)."""

    points: tuple[tuple[int, float], ...]
    """Passes of one real token and ``n - 1`` masks computed exactly (what static and ConfAdapt feed)."""
    mask_share: float = 1.0
    """What a draft-only mask row (``verified``: computed on an 8-bit input grid where the fast runtime's record
    paths serve the pass) adds to a pass, as a share of what an exact row adds; 1.0 where masks cost as much."""
    real: tuple[tuple[int, float], ...] | None = None
    """Passes of ``n`` real tokens, no masks (a verified pass's pending tokens and draft); None: as ``points``."""
    draft: tuple[tuple[int, float], ...] | None = None
    """Passes of one real token and ``n - 1`` draft-only masks (``verified``'s); None: ``points`` scaled by
    ``mask_share``. Measured apart because the first mask turns the adapter on in every layer: on a 2-core Zen 5
    one draft mask added 0.30 of a one-token pass, a second real token 0.06-0.10 (``points`` at 2 said 0.19-0.25
    for a draft token and two thirds of that for a mask: the planner bought masks that did not pay and left drafts
    that would have)."""

    def __post_init__(self) -> None:
        for name, points in (("points", self.points), ("real", self.real), ("draft", self.draft)):
            if points is not None and (not points or points[0][0] != 1):
                raise ValueError(f"A cost curve needs a point at n=1 ({name}).")
        if not 0.0 < self.mask_share <= 1.0:
            raise ValueError(f"mask_share={self.mask_share} must be in (0, 1].")

    @functools.cached_property
    def _xs(self) -> list[int]:
        return [p[0] for p in self.points]

    @functools.cached_property
    def _ys(self) -> list[float]:
        return [p[1] for p in self.points]

    def cost(self, n: int) -> float:
        return _interpolate(self._xs, self._ys, n)  # read once per curve: the planner asks for tens of sizes a pass

    @property
    def prices_masks_apart(self) -> bool:
        """Whether draft-only masks have a curve of their own (:attr:`draft`): the planner then prices a verified
        pass's draft tokens on :attr:`real` and its masks on :attr:`draft`; else every row alike on
        :attr:`points`, a mask at :attr:`mask_share` of a row."""
        return self.draft is not None

    def real_costs(self, first: int, count: int) -> Sequence[float]:
        """``costs`` of passes of ``first .. first + count - 1`` real tokens and no masks."""
        if self.real is None:
            return self.costs(first, count)
        key = (-first, count)  # negative: apart from :meth:`costs`' ranges in the memo
        found = self._memo.get(key) if first <= MEMO_FIRST else None
        if found is None:
            xs, ys = [p[0] for p in self.real], [p[1] for p in self.real]
            found = tuple(_interpolate(xs, ys, n) for n in range(first, first + count))
            if first <= MEMO_FIRST:
                self._memo[key] = found
        return found

    def mask_costs(self, count: int) -> Sequence[float]:
        """``[0, ...]``: what ``0 .. count - 1`` draft-only masks add to a one-token pass (relative to it)."""
        key = (0, -count)
        found = self._memo.get(key)
        if found is None:
            if self.draft is None:
                found = tuple(self.mask_share * (self.cost(1 + m) - 1.0) for m in range(count))
            else:
                xs, ys = [p[0] for p in self.draft], [p[1] for p in self.draft]
                found = tuple(max(_interpolate(xs, ys, 1 + m) - ys[0], 0.0) for m in range(count))
            self._memo[key] = found
        return found

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
        data: dict[str, object] = {"points": [list(p) for p in self.points], "mask_share": self.mask_share}
        for name, points in (("real", self.real), ("draft", self.draft)):
            if points is not None:
                data[name] = [list(p) for p in points]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> CostCurve:
        data = json.loads(text)

        def read(points: list[list[float]] | None) -> tuple[tuple[int, float], ...] | None:
            return None if points is None else tuple((int(n), float(c)) for n, c in points)

        points = read(data["points"])
        assert points is not None
        return cls(points, float(data.get("mask_share", 1.0)), read(data.get("real")), read(data.get("draft")))

    @classmethod
    def flat(cls) -> CostCurve:
        """A GPU-like curve: extra tokens are free."""
        return cls(((1, 1.0), (64, 1.0)))


def _interpolate(xs: Sequence[int], ys: Sequence[float], n: int) -> float:
    """The curve (xs, ys) at ``n``: linear between points, its first value below them, its last segment beyond."""
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


MASK_SHARE_POINTS = (4, 8, 16)
"""Pass sizes whose extra rows' cost gives :attr:`CostCurve.mask_share` (2-token passes differ by less than the
noise)."""
MIN_MASK_SHARE = 0.2


def measure_cost_curve(
    forward_n: Callable[[int], None],
    *,
    points: tuple[int, ...] = CURVE_POINTS,
    repeats: int = 5,
    draft_masks_n: Callable[[int], None] | None = None,
    real_n: Callable[[int], None] | None = None,
) -> CostCurve:
    """Time ``forward_n(n)`` (one forward of n tokens on a cached prefix: one real token, then masks) and
    normalise by n=1; with ``draft_masks_n`` (the same passes, their masks draft-only), also time it, keep it as
    :attr:`CostCurve.draft` and set :attr:`CostCurve.mask_share` from the extra rows' cost at
    :data:`MASK_SHARE_POINTS`; with ``real_n`` (n real tokens), keep it as :attr:`CostCurve.real`.

    Robust to a busy machine: the sizes are timed in interleaved rounds and the fastest sample of each is kept
    (contention only ever adds time), and a pass of n tokens is never taken to cost more than n single passes.
    """
    runs = {"exact": forward_n}
    if draft_masks_n is not None:
        runs["draft"] = draft_masks_n
    if real_n is not None:
        runs["real"] = real_n
    samples: dict[str, dict[int, list[float]]] = {name: {n: [] for n in points} for name in runs}
    for run in runs.values():
        for _ in range(2):
            run(1)  # warm-up
    for _ in range(repeats):
        for n in points:
            for name, run in runs.items():
                start = time.perf_counter()
                run(n)
                samples[name][n].append(time.perf_counter() - start)
    exact = samples["exact"]
    base = min(min(run[1]) for run in samples.values())  # every run's one-token pass is the same pass
    share = 1.0
    if "draft" in samples:
        sizes = [n for n in MASK_SHARE_POINTS if n in points]
        added = sum(min(exact[n]) - base for n in sizes)
        draft = samples["draft"]
        if sizes and added > 0:
            share = sum(min(draft[n]) - base for n in sizes) / added
        share = min(max(share, MIN_MASK_SHARE), 1.0)
    return CostCurve(
        _relative(exact, points, base),
        share,
        _relative(samples["real"], points, base) if "real" in samples else None,
        _relative(samples["draft"], points, base) if "draft" in samples else None,
    )


def _relative(samples: dict[int, list[float]], points: Sequence[int], base: float) -> tuple[tuple[int, float], ...]:
    """The fastest sample of each size over ``base`` (one token's), never below 1 or above n, never falling."""
    return _monotone([(n, min(samples[n]) / base) for n in points])


def _monotone(costs: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """``costs`` (by tokens fed, ascending) each within [1, n] (1 at n = 1) and never below a smaller pass's: a pass
    costs at least one token's, at most n single passes, and can only cost more with more tokens."""
    monotone, best = [], 1.0
    for n, cost in costs:
        best = max(best, 1.0 if n <= 1 else min(max(cost, 1.0), float(n)))
        monotone.append((n, best))
    return tuple(monotone)


def load_or_measure(path: Path, measure: Callable[[], CostCurve]) -> CostCurve:
    """The curve stored at ``path``, else ``measure()``'s, stored there (an unwritable cache is skipped); one
    process measures at a time (:func:`exclusive`): one that waited reads what the other stored."""
    with exclusive(path):
        if path.is_file():
            try:
                return CostCurve.from_json(path.read_text())
            except (ValueError, KeyError, json.JSONDecodeError):
                pass
        curve = measure()
        with contextlib.suppress(OSError):
            store_curve(path, curve)
        return curve


def store_curve(path: Path, curve: CostCurve) -> None:
    """Write ``curve`` to ``path`` (atomically); OSError if the folder cannot be written."""
    write_atomically(path, curve.to_json())


LIVE_WINDOW = 64
"""Pass times kept per kind of pass (the most recent) by :class:`PassTimes`."""
LIVE_MIN_PASSES = 12
"""Passes of a kind (and of one-token passes) before their median ratio stands in for the stored curve's point."""
LIVE_MAX_TOKENS = 8
"""Largest pass (real tokens, or one real token and masks) whose time is kept: decode passes, not prefills."""


class PassTimes:
    """This process's own times of one sequence's decode passes, by kind, to correct the stored cost curve with.

    Why: the curve is measured once per machine and kept on disk (:func:`load_or_measure`), but what a pass of n
    tokens costs against one moves with the machine's state: on a 2-core Zen 4 VM the stored curve said a 2-token pass
    cost 1.07x a one-token pass and 1 real token + 2 draft masks 1.27x, while the same engine's passes in decoding took
    1.19x and 1.44x minutes later; the planner bought masks that did not pay and ``verified`` ran 0.96x ``ntp``
    (with the curve measured again, 1.08x). The decode loop records how long each of its passes took
    (:meth:`record`: the runner's forward, or a greedy run's time per step), and every new generation plans on
    :meth:`calibrated`: the stored curve with each point where this process has enough passes of that kind replaced
    by the median time of those passes over the median one-token pass.

    Kinds: ``(real, 0, False)`` a pass of ``real`` real tokens (pending and draft tokens, :attr:`CostCurve.real`);
    ``(1, masks, True)`` one real token and ``masks`` draft-only masks (``verified``'s, :attr:`CostCurve.draft`);
    ``(1, masks, False)`` one real token and exact masks (static and ConfAdapt, :attr:`CostCurve.points`). A curve
    without a draft-mask curve (no record paths: the planner prices every row alike on ``points``) has every kind's
    cost at n tokens fed in its ``points`` (their mean). Passes that mix draft tokens and masks, or are larger than
    :data:`LIVE_MAX_TOKENS`, are not kept. Thread-safe."""

    def __init__(self, *, window: int = LIVE_WINDOW, min_passes: int = LIVE_MIN_PASSES) -> None:
        if window < 1 or not 1 <= min_passes <= window:
            raise ValueError(f"window={window}, min_passes={min_passes}: use 1 <= min_passes <= window.")
        self.window = window
        self.min_passes = min_passes
        self._times: dict[tuple[int, int, bool], deque[float]] = {}
        self._lock = threading.Lock()
        self._recorded = 0
        self._cache: tuple[CostCurve, int, CostCurve] | None = None  # (prior, recorded, calibrated)

    def record(self, real: int, masks: int, seconds: float, *, draft_masks: bool = False) -> None:
        """One pass of ``real`` real tokens and ``masks`` masks (draft-only where ``draft_masks``) took
        ``seconds``. Kinds that no curve point describes are ignored."""
        if seconds <= 0.0 or real < 1 or masks < 0 or (masks and real != 1) or real + masks > LIVE_MAX_TOKENS:
            return
        key = (real, masks, draft_masks and masks > 0)
        with self._lock:
            times = self._times.get(key)
            if times is None:
                times = self._times[key] = deque(maxlen=self.window)
            times.append(seconds)
            self._recorded += 1

    def medians(self) -> dict[tuple[int, int, bool], float]:
        """The median time of each kind with at least ``min_passes`` passes kept."""
        with self._lock:
            kept = {key: list(times) for key, times in self._times.items() if len(times) >= self.min_passes}
        return {key: statistics.median(times) for key, times in kept.items()}

    def calibrated(self, prior: CostCurve) -> CostCurve:
        """``prior`` with every point that this process has measured replaced by what its own passes took (see the
        class docstring); ``prior`` itself until enough one-token passes are kept. Built again only after new
        passes were recorded."""
        with self._lock:
            cache, recorded = self._cache, self._recorded
        if cache is not None and cache[0] is prior and cache[1] == recorded:
            return cache[2]
        medians = self.medians()
        base = medians.get((1, 0, False))
        curve = prior
        if base is not None:
            measured = {key: value / base for key, value in medians.items() if key != (1, 0, False)}
            real = {r: c for (r, m, _), c in measured.items() if m == 0}
            exact_masks = {1 + m: c for (_, m, d), c in measured.items() if m and not d}
            draft_masks = {1 + m: c for (_, m, d), c in measured.items() if m and d}
            if prior.draft is None:  # every row priced alike on ``points`` (no record paths): every kind measures it
                alike: dict[int, list[float]] = {}
                for (r, m, _), c in measured.items():
                    alike.setdefault(r + m, []).append(c)
                exact_masks = {n: statistics.fmean(costs) for n, costs in alike.items()}
            curve = CostCurve(
                _replaced(prior.points, exact_masks),
                prior.mask_share,
                _replaced(prior.real, real) if prior.real is not None else None,
                _replaced(prior.draft, draft_masks) if prior.draft is not None else None,
            )
        with self._lock:
            self._cache = (prior, recorded, curve)
        return curve


def _replaced(points: tuple[tuple[int, float], ...], measured: dict[int, float]) -> tuple[tuple[int, float], ...]:
    """``points`` with the ``measured`` costs (by tokens fed) in place of theirs or added; a stored point past a
    measured one scaled as that one was (what the stored curve says a pass adds beyond it, in the measured pass's
    proportion); then :func:`_monotone`, as a measured curve."""
    if not measured:
        return points
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    merged = dict(points)
    merged.update(measured)
    costs, scale = [], 1.0
    for n in sorted(merged):
        if n in measured:
            scale = measured[n] / max(_interpolate(xs, ys, n), 1e-9)
        costs.append((n, measured[n] if n in measured else merged[n] * scale))
    return _monotone(costs)
