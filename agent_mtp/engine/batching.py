"""Continuous batching: concurrent generations share forward passes on one :class:`FastModel`.

Each generation keeps the whole decode loop (planner, drafts, grammar, stop strings, prefix cache) and decodes in
its own thread on a :class:`BatchingRunner`; the runner's ``forward`` hands its rows to the scheduler thread and
waits. The scheduler collects rows until every active sequence has submitted (or ``window_s`` has passed since the
first one arrived), runs one :meth:`FastModel.forward_batch` over all of them (every GEMM once, attention per
sequence against its own KV cache) and wakes the callers. Sequences join and leave between passes::

    batched = BatchedEngine(engine)                  # an engine whose generations share passes
    batched.generate(prompt, config)                 # from many threads at once; equals engine.generate (greedy)
    batched.close()

Under batching a sequence's extra rows (drafts, masks) lengthen a pass every active sequence waits for, so each
runner gives its planner a :class:`SharedPassCurve`: the marginal cost of its rows in a pass that already carries
the others' rows, weighted by how many sequences wait for it. Drafts and masks shrink as concurrency grows and
come back when the machine is idle; output stays what the mode gives alone.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.constraints import TokenConstraint
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.engine import MTPEngine, Prompt
from agent_mtp.engine.fast import BatchItem, FastModel, FastRunner
from agent_mtp.engine.results import GenerationResult, StreamChunk
from agent_mtp.engine.threads import compute

log = logging.getLogger("agent_mtp.engine.batching")

DEFAULT_WINDOW_S = 0.002
"""Shortest wait of a pass for sequences that have not submitted yet (they are between passes: sampling, grammar)."""


STRAGGLER_SHARE = 0.5
"""A pass waits for missing sequences up to this share of the last pass's time (at least ``window_s``). Between two
passes every active sequence runs its decode step in Python, one at a time under the GIL, while the server streams
the last tokens: with 8 clients on 2 cores the last of them submits several ms after the first. At 0.15 of a pass
(~4 ms) only 51% of the passes with 8 active sequences carried all 8, the stragglers ran in small passes of their
own, and 8-client NTP made 255-267 tokens/s; at 0.5, 98% and 278-282 (`agent-mtp loadtest`, 2 runs each,
alternated). A sequence that misses a pass waits a whole pass; waiting for it costs the others a fraction of one."""
REFIT_EVERY = 16
"""The pass-time curve is refitted to the measured table at most once per this many passes (one fit serves every
sequence; fitting holds the GIL that the sequences between passes need)."""
MEASURED_ROWS = 256
"""Pass times are measured by total rows up to this many (every decode pass; longer ones are prefills). A pass the
planner chose must be measurable, or a fit that underrates rows could never learn better."""


@dataclass(frozen=True)
class PassTime:
    seconds: float
    """EWMA of the wall time of a pass with this many rows."""
    count: int


@dataclass
class _Job:
    runner: BatchingRunner
    item: BatchItem
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    greedy: list[int] | None = None
    error: BaseException | None = None
    prefill: bool = False
    """The sequence's first pass (its prompt, or what the prefix cache did not hold)."""
    steps: int = 0
    """A greedy run (:meth:`BatchingRunner.greedy_steps`): up to this many one-token passes, each fed the last
    one's greedy token by the scheduler itself; 0: one pass, its caller woken after it."""
    stop_ids: frozenset[int] = frozenset()
    """A greedy run ends after a token in these (EOS, the request's stop tokens)."""
    until: Callable[[int], bool] | None = None
    """A greedy run also ends after a token for which this returns True (called on the scheduler thread)."""
    run: list[int] = field(default_factory=list)
    """A greedy run's tokens so far, one a pass."""
    stamps: list[float] = field(default_factory=list)
    """When each of a greedy run's passes ended (``time.perf_counter()``)."""

    def goes_on(self) -> bool:
        """After a pass: whether this greedy run takes the next pass too (fed its last token)."""
        if not self.steps or self.runner.closed or len(self.run) >= self.steps or self.run[-1] in self.stop_ids:
            return False
        if self.until is not None and self.until(self.run[-1]):
            return False
        self.item = BatchItem([self.run[-1]], self.item.cache, 1, argmax_only=True)  # read only for its argmax
        self.prefill = False
        return True


@dataclass(frozen=True)
class PassStats:
    """What the scheduler has run so far."""

    passes: int
    sequences: int
    """Sequence-passes (the sum over passes of the sequences in each)."""
    rows: int
    active: int

    @property
    def mean_batch(self) -> float:
        return self.sequences / self.passes if self.passes else 0.0


class BatchScheduler:
    """Owns a :class:`FastModel`; runs one batched forward per pass over every active sequence's rows."""

    def __init__(self, model: FastModel, *, window_s: float = DEFAULT_WINDOW_S) -> None:
        if not 0 <= window_s < 1:
            raise ValueError(f"window_s={window_s!r} is invalid; use seconds in [0, 1), e.g. 0.002.")
        self.model = model
        self.window_s = window_s
        self._cond = threading.Condition()
        self._active: set[BatchingRunner] = set()
        self._jobs: list[_Job] = []
        self._last_rows: dict[BatchingRunner, int] = {}
        self._closed = False
        self._passes = self._sequences = self._rows = 0
        self._last_pass_s = 0.0
        self.pass_times: tuple[PassTime | None, ...] = (None,) * (MEASURED_ROWS + 1)
        """Measured wall time of a pass by its total rows (EWMA; replaced, never mutated: read without a lock)."""
        self._fitted: tuple[CostCurve, int, list[float]] | None = None
        self._thread = threading.Thread(target=self._loop, name="agent-mtp-batch", daemon=True)
        self._thread.start()

    # -- runners ------------------------------------------------------------------------------------------------
    def runner(self) -> BatchingRunner:
        """A new empty sequence. It joins the batch with its first pass and takes part in every pass until
        :meth:`BatchingRunner.close`: passes do not wait for a generation that is still preparing its prompt
        (chat template, tokenizer, prefix cache), which holds the GIL and the compute thread for milliseconds."""
        with self._cond:
            if self._closed:
                raise RuntimeError("The batch scheduler is closed.")
        runner = BatchingRunner(self)
        runner.shared_load = self.load(runner)
        return runner

    def load(self, runner: BatchingRunner) -> tuple[int, int]:
        """(other active sequences, rows they will feed next) as ``runner`` sees the machine now: the rows of
        each one's last pass, one for a sequence whose last pass was its prefill (counting a 400-token prefill of
        a neighbour as next pass's load made rows look nearly free: 4-token drafts and 4 masks, measured)."""
        with self._cond:
            others = [r for r in self._active if r is not runner]
            return len(others), sum(max(self._last_rows.get(r, 1), 1) for r in others)

    def pass_time_curve(self, base: CostCurve) -> Sequence[float]:
        """:func:`pass_time_curve` of the measured passes, refitted every :data:`REFIT_EVERY` passes (lock-free: a
        stale fit for a pass or two is harmless)."""
        fitted = self._fitted
        if fitted is None or fitted[0] is not base or self._passes - fitted[1] >= REFIT_EVERY:
            fitted = (base, self._passes, pass_time_curve(base, self.pass_times))
            self._fitted = fitted
        return fitted[2]

    def stats(self) -> PassStats:
        with self._cond:
            return PassStats(self._passes, self._sequences, self._rows, len(self._active))

    def close(self) -> None:
        """Stop the scheduler thread; waiting callers get an error."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _leave(self, runner: BatchingRunner) -> None:
        with self._cond:
            self._active.discard(runner)
            self._last_rows.pop(runner, None)
            self._cond.notify_all()  # a pass may be waiting for this sequence

    def _submit(self, job: _Job) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("The batch scheduler is closed.")
            self._active.add(job.runner)  # a sequence joins with its first pass
            self._jobs.append(job)
            self._cond.notify_all()

    # -- the pass loop ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            self._run(batch)

    def _collect(self) -> list[_Job] | None:
        with self._cond:
            while not self._jobs and not self._closed:
                self._cond.wait()
            if self._closed:
                for job in self._jobs:
                    job.error = RuntimeError("The batch scheduler closed before this pass ran.")
                    job.done.set()
                return None
            # a sequence still between passes (sampling, grammar, a busy core) joins if it comes within the
            # window: its row costs a pass a few percent, leaving it out costs it a whole pass
            deadline = time.perf_counter() + max(self.window_s, STRAGGLER_SHARE * self._last_pass_s)
            while len(self._jobs) < len(self._active) and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, self._jobs = self._jobs, []
            for job in batch:  # what each will feed next: a prefill is followed by a decode pass of a row or a few
                self._last_rows[job.runner] = 1 if job.prefill else len(job.item.tokens)
            return batch

    def _run(self, batch: list[_Job]) -> None:
        started = time.perf_counter()
        try:
            with torch.no_grad():  # on the process's compute thread (engine/threads.py)
                outputs = compute().run(self._forward, [job.item for job in batch])
        except BaseException as e:  # every caller gets the error; the scheduler keeps running
            for job in batch:
                job.error = e
                job.done.set()
            return
        rows = sum(len(job.item.tokens) for job in batch)
        ended = time.perf_counter()
        self._last_pass_s = ended - started
        self._measure(rows, self._last_pass_s)
        going_on: list[_Job] = []
        for job, (logits, greedy) in zip(batch, outputs, strict=True):
            job.logits, job.greedy = logits, greedy
            if job.steps:
                job.run.append(greedy[-1])
                job.stamps.append(ended)
                try:
                    if job.goes_on():  # its next pass is already known: no wake-up, no step in Python between
                        going_on.append(job)
                        continue
                except Exception as e:  # its ``until`` failed: the error is its caller's, the passes go on
                    job.error = e
            job.done.set()
        with self._cond:
            self._passes += 1
            self._sequences += len(batch)
            self._rows += rows
            if going_on:
                self._jobs.extend(going_on)
                self._cond.notify_all()

    def _forward(self, items: list[BatchItem]) -> list[tuple[torch.Tensor, list[int]]]:
        """The pass, and each sequence's greedy tokens while its logits are in this core's cache (see
        :meth:`FastModel.greedy_tokens`)."""
        return [(logits, self.model.greedy_tokens(logits)) for logits in self.model.forward_batch(items)]

    def _measure(self, rows: int, seconds: float) -> None:
        if rows > MEASURED_ROWS:
            return
        table = list(self.pass_times)
        old = table[rows]
        table[rows] = (
            PassTime(seconds, 1) if old is None else PassTime(0.8 * old.seconds + 0.2 * seconds, old.count + 1)
        )
        self.pass_times = tuple(table)


class BatchingRunner(FastRunner):
    """A :class:`FastRunner` whose forward passes run inside the scheduler's batched passes."""

    def __init__(self, scheduler: BatchScheduler) -> None:
        super().__init__(scheduler.model)
        self.scheduler = scheduler
        self._closed = False
        self._fed = False
        self.shared_load: tuple[int, int] = (0, 0)
        """(other sequences, their rows) after this sequence's last pass: what its planner budgets against."""

    @property
    def closed(self) -> bool:
        return self._closed

    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        item = BatchItem(tokens, self.cache, keep, self.coarse_masks, self.argmax_only)
        job = self._wait(_Job(self, item, prefill=not self._fed))
        assert job.logits is not None
        self.tokens += tokens
        return job.logits

    def _greedy_run(
        self, first: int, steps: int, stop_ids: frozenset[int], until: Callable[[int], bool] | None
    ) -> tuple[list[int], list[float]]:
        """A greedy run (:meth:`greedy_steps`) in the scheduler's batches, each pass fed the last one's greedy token
        by the scheduler: the caller wakes once for them all, so a plain greedy sequence holds no Python step, and
        keeps no pass waiting for one, between its passes."""
        item = BatchItem([first], self.cache, 1, self.coarse_masks, argmax_only=True)  # a run reads only argmaxes
        job = self._wait(_Job(self, item, prefill=not self._fed, steps=steps, stop_ids=stop_ids, until=until))
        self.tokens += [first, *job.run[:-1]]  # the last token is the caller's to feed
        return list(job.run), list(job.stamps)

    def _wait(self, job: _Job) -> _Job:
        if self._closed:
            raise RuntimeError("This runner left the batch; start a new one.")
        self._fed = True
        self.scheduler._submit(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        self.greedy = job.greedy
        self.shared_load = self.scheduler.load(self)
        return job

    def share_curve(self, base: CostCurve) -> CostCurve:
        """The planner's curve for this sequence's passes (read by the decode loop)."""
        return SharedPassCurve(base, self)

    def close(self) -> None:
        """Leave the batch (the scheduler stops waiting for this sequence at once)."""
        if not self._closed:
            self._closed = True
            self.scheduler._leave(self)


class SharedPassCurve(CostCurve):
    """Cost of feeding n rows in a pass shared with other sequences, relative to feeding one.

    With ``B`` sequences in the pass (this one included) whose others feed ``R`` rows, ``X = R - (B - 1)`` of them
    beyond one each, this sequence's ``n - 1`` rows beyond its first share with those ``X`` what all the extra rows
    add to the pass of one row each, in proportion to their number, for all ``B`` sequences:
    ``1 + B * (n - 1) / (X + n - 1) * (T(R + n) - T(B)) / T(R + 1)``. On a line ``T`` that is the marginal cost
    ``B * (T(R + n) - T(R + 1)) / T(R + 1)``, and maximising tokens per unit of it maximises the aggregate tokens
    per second; where ``T`` steps (AMX tiles multiply rows in chunks of 8), the marginal cost of a row inside a
    chunk another sequence opened is small while the step is large, so each sequence, priced at the margin, added
    a draft row because others had, and together they paid the step for a few rows (8 clients: ``verified`` 0.94x
    NTP priced at the margin). Priced at the average, a few drafts pay the step and many share it. ``T`` is fitted
    to the pass times the scheduler measures by total rows (:func:`pass_time_curve`). Alone (B = 1) it is the base
    curve.
    """

    _base: CostCurve
    _runner: BatchingRunner
    _fit: Sequence[float] | None
    _ranges: dict[tuple[int, int, int, int], list[float]]
    """Cost ranges by (first, count, other sequences, their rows) under the fit ``_fit``."""

    def __init__(self, base: CostCurve, runner: BatchingRunner) -> None:
        object.__setattr__(self, "points", base.points)
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_fit", None)
        object.__setattr__(self, "_ranges", {})

    @property  # type: ignore[override]
    def mask_share(self) -> float:
        """The base curve's share alone; beside other sequences 1.0: the pass times the fit reads were measured
        with their draft-only masks in them, so the fitted rows' cost already holds the masks' discount."""
        return self._base.mask_share if self._runner.shared_load[0] == 0 else 1.0

    def cost(self, n: int) -> float:
        return self.costs(n, 1)[0]

    @property
    def prices_masks_apart(self) -> bool:
        """Alone, as the base curve; beside others every row alike (the fitted pass times count rows)."""
        return self._base.prices_masks_apart and self._runner.shared_load[0] == 0

    def real_costs(self, first: int, count: int) -> Sequence[float]:
        """The base curve's (read only where :attr:`prices_masks_apart`: alone)."""
        return self._base.real_costs(first, count)

    def mask_costs(self, count: int) -> Sequence[float]:
        """The base curve's (read only where :attr:`prices_masks_apart`: alone)."""
        return self._base.mask_costs(count)

    def costs(self, first: int, count: int) -> Sequence[float]:
        others, rows = self._runner.shared_load  # the load and the fitted pass times, read once for every size
        if others == 0:
            return self._base.costs(first, count)
        times = self._runner.scheduler.pass_time_curve(self._base)
        if self._fit is not times:  # the ranges below hold while the fit does (refitted every REFIT_EVERY passes)
            self._ranges.clear()
            object.__setattr__(self, "_fit", times)
        key = (first, count, others, rows)
        found = self._ranges.get(key)
        if found is None:
            found = [shared_pass_cost(times, n, others=others, other_rows=rows) for n in range(first, first + count)]
            self._ranges[key] = found
        return found


def pass_time_curve(base: CostCurve, table: Sequence[PassTime | None], *, min_count: int = 2) -> list[float]:
    """Relative pass time by total rows 0..len(table)-1 (index 0 unused): through the measured passes where they
    were measured (made non-decreasing, linear between them), elsewhere a fit to them: a continuous two-segment line
    (weighted least squares over the knee) when the table shows where passes turn from reading weights to computing,
    else a straight line; every slope at least the base curve's, so noise never makes extra rows look free. The base
    curve until two row counts have been measured ``min_count`` times.

    One straight line through all row counts underrates what a row costs past the knee (measured on 2 cores: passes
    of 1-8 rows cost about the same, each row beyond adds ~2.5 ms; a line through 1-24 rows said ~1.8 ms), and a
    planner that underrates rows feeds drafts that cost the batch more than they give. Neither line sees steps: on
    AMX tiles rows are multiplied in chunks of 8 whose cost counts blocks, not rows, so 8 sequences' one-row passes
    took 14.8 ms and a 9th row 21.4 ms, while 9 to 12 rows cost about the same (2-core Sapphire-Rapids-class VM,
    8 clients in one process). Priced by the fitted line (~1.6 ms a row), ``verified`` beside 7 others added a draft
    row or two to most passes, paid the whole step for them and made 0.89x NTP's tokens/s."""
    points = [
        (r, t.seconds, min(t.count, 20)) for r, t in enumerate(table) if r and t is not None and t.count >= min_count
    ]
    fit = _hinge(points) or _as_hinge(_line(points))
    if fit is None:
        return [0.0, *(base.cost(r) for r in range(1, len(table)))]
    a, b, c, knee = fit
    # a row in a batch costs at least what it costs one sequence alone (the base curve's slope): noisy timings
    # on a starved CPU must never make rows look nearly free
    floor = a * (base.cost(16) - base.cost(1)) / 15
    steep = max(b + c, floor)
    b = max(b, floor)
    c = steep - b
    line = [0.0, *(a + b * r + c * max(r - knee, 0) for r in range(1, len(table)))]
    return _through_measured(line, _isotonic(points), floor)


def _isotonic(points: Sequence[tuple[int, float, int]]) -> list[tuple[int, float]]:
    """(rows, time) of the weighted least-squares non-decreasing fit to ``points`` (pool adjacent violators): a pass
    never costs less with more rows, so a dip is noise (or passes of fewer sequences) and is pooled with its
    neighbours."""
    blocks: list[list[float]] = []  # [time, weight, first index, last index]
    ordered = sorted(points)
    for i, (_, t, w) in enumerate(ordered):
        blocks.append([t, float(w), i, i])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            t2, w2, _, last = blocks.pop()
            t1, w1, first, _ = blocks.pop()
            blocks.append([(t1 * w1 + t2 * w2) / (w1 + w2), w1 + w2, first, last])
    return [(ordered[i][0], t) for t, _, first, last in blocks for i in range(int(first), int(last) + 1)]


def _through_measured(line: list[float], measured: Sequence[tuple[int, float]], floor: float) -> list[float]:
    """``line`` (index = rows) replaced by ``measured`` (sorted (rows, time), non-decreasing) where it was measured:
    linear between measured row counts, the line's shape below the first (scaled to meet it) and its slope past the
    last; every row then adds at least ``floor``."""
    if not measured:
        return line
    out = list(line)
    (first, t_first), (last, t_last) = measured[0], measured[-1]
    for r in range(1, min(first, len(out))):
        out[r] = line[r] * t_first / line[first]
    for (r0, t0), (r1, t1) in itertools.pairwise(measured):
        for r in range(r0, min(r1, len(out))):
            out[r] = t0 + (t1 - t0) * (r - r0) / (r1 - r0)
    for r in range(last, len(out)):
        out[r] = t_last + line[r] - line[last]
    for r in range(2, len(out)):
        out[r] = max(out[r], out[r - 1] + floor)
    return out


Fit = tuple[float, float, float, int]
"""(a, b, c, knee): t = a + b r + c max(r - knee, 0)."""


def _as_hinge(line: tuple[float, float] | None) -> Fit | None:
    return None if line is None else (line[0], line[1], 0.0, 0)


def _line(points: Sequence[tuple[int, float, int]]) -> tuple[float, float] | None:
    """(a, b) of the weighted least-squares line t = a + b r, with b > 0 and a > 0; None when underdetermined."""
    if len({r for r, _, _ in points}) < 2:
        return None
    total = sum(w for _, _, w in points)
    mean_r = sum(w * r for r, _, w in points) / total
    mean_t = sum(w * t for _, t, w in points) / total
    var = sum(w * (r - mean_r) ** 2 for r, _, w in points)
    b = sum(w * (r - mean_r) * (t - mean_t) for r, t, w in points) / var
    floor = 0.01 * mean_t  # every row costs something
    b = max(b, floor)
    a = max(mean_t - b * mean_r, floor)
    return a, b


def _hinge(points: Sequence[tuple[int, float, int]]) -> Fit | None:
    """The best-fitting (weighted squared error) continuous two-segment line over every knee that leaves two
    measured row counts on each side (the knee counted on its left), keeping only fits whose second slope is the
    steeper (a convex curve: rows never get cheaper past the knee); None when no knee qualifies.

    Each knee's normal equations and squared error are assembled from sums over the points right of it, kept as
    running sums from the right, so the search is linear in the points: a server's table holds ~100 measured row
    counts (prefills of up to 256 rows beside decode rows), where solving each knee over every point took ~40 ms of
    Python holding the GIL every REFIT_EVERY passes, and the batch waited for the sequence making it."""
    rows = sorted({r for r, _, _ in points})
    if len(rows) < 4:
        return None
    ordered = sorted(points)
    total = _moments(ordered)
    right = _moments(())  # the moments of the points right of the knee
    best: tuple[float, Fit] | None = None
    at = len(ordered)
    for knee in reversed(rows[1:-2]):
        while at > 0 and ordered[at - 1][0] > knee:
            at -= 1
            _add_moments(right, *ordered[at])
        fit = _hinge_at(knee, total, right)
        if fit is not None and (best is None or fit[0] <= best[0]):  # ties: the lowest knee, as ascending
            best = fit
    return best[1] if best is not None else None


def _moments(points: Sequence[tuple[int, float, int]]) -> list[float]:
    """[sum w, sum w r, sum w r^2, sum w t, sum w r t, sum w t^2] over ``points`` (rows, time, weight)."""
    sums = [0.0] * 6
    for point in points:
        _add_moments(sums, *point)
    return sums


def _add_moments(sums: list[float], r: int, t: float, w: int) -> None:
    """Add one point's terms to :func:`_moments`' sums."""
    for i, v in enumerate((w, w * r, w * r * r, w * t, w * r * t, w * t * t)):
        sums[i] += v


def _hinge_at(knee: int, total: Sequence[float], right: Sequence[float]) -> tuple[float, Fit] | None:
    """(weighted squared error, fit) of t = a + b r + c max(r - knee, 0) from the points' moments (``total``) and
    those of the points right of the knee (``right``); None where the system is singular or the fit is not one with
    a > 0, b >= 0 and c > 0 (convex, as :func:`_hinge` keeps)."""
    s0, s1, s2, t0, t1, tt = total
    h0, h1, h2, u0, u1 = right[:5]
    k = float(knee)
    wh = h1 - k * h0  # sum w h, h = max(r - knee, 0)
    wrh = h2 - k * h1  # sum w r h
    whh = h2 - 2 * k * h1 + k * k * h0  # sum w h^2
    wht = u1 - k * u0  # sum w h t
    matrix = ((s0, s1, wh), (s1, s2, wrh), (wh, wrh, whh))
    solved = _solve3(matrix, (t0, t1, wht))
    if solved is None:
        return None
    a, b, c = solved
    if a <= 0 or b < 0 or c <= 0:
        return None
    beta = (a, b, c)
    rhs = (t0, t1, wht)
    quadratic = sum(beta[i] * matrix[i][j] * beta[j] for i in range(3) for j in range(3))
    sse = tt - 2 * sum(x * y for x, y in zip(beta, rhs, strict=True)) + quadratic
    return sse, (a, b, c, knee)


def _solve3(matrix: Sequence[Sequence[float]], rhs: Sequence[float]) -> tuple[float, float, float] | None:
    """Solve a 3 x 3 linear system (Gaussian elimination with partial pivoting); None when singular."""
    m = [[*row, v] for row, v in zip(matrix, rhs, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda i: abs(m[i][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for i in range(3):
            if i != col:
                f = m[i][col] / m[col][col]
                m[i] = [v - f * u for v, u in zip(m[i], m[col], strict=True)]
    return m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]


def shared_pass_cost(times: Sequence[float], n: int, *, others: int, other_rows: int) -> float:
    """See :class:`SharedPassCurve`; ``times[r]`` is the (relative) time of an r-row pass."""
    if others == 0:
        return times[min(n, len(times) - 1)] / times[1]
    last = len(times) - 1

    def at(r: int) -> float:  # beyond the table: extend its last slope
        return times[r] if r <= last else times[last] + (times[last] - times[last - 1]) * (r - last)

    if n <= 1:
        return 1.0
    extra = max(other_rows - others, 0)  # the others' rows beyond one each
    share = (n - 1) / (extra + n - 1)
    return 1.0 + (others + 1) * share * (at(other_rows + n) - at(others + 1)) / at(other_rows + 1)


class BatchedEngine:
    """An :class:`MTPEngine` whose concurrent generations share forward passes (one :class:`BatchScheduler`).

    ``generate`` / ``stream`` take the engine's arguments and may be called from many threads at once; greedy
    output equals the engine's own. Everything else (tokenizer, ``encode_prompt``, ``score``, ``model_id``, the
    prefix cache) is the wrapped engine's. An engine on the Hugging Face runtime cannot batch: its generations are
    serialised by its lock as before.
    """

    def __init__(self, engine: MTPEngine, *, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.engine = engine
        self.scheduler: BatchScheduler | None = None
        if engine.runtime == "fast":
            fast = engine.new_runner()
            assert isinstance(fast, FastRunner)
            self.scheduler = BatchScheduler(fast.model, window_s=window_s)
        else:
            log.info("The %s runtime cannot batch; generations are serialised", engine.runtime)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def stream(
        self, prompt: Prompt, config: DecodeConfig | None = None, *, constraint: TokenConstraint | None = None
    ) -> Generator[StreamChunk, None, None]:
        if self.scheduler is None:
            yield from self.engine.stream(prompt, config, constraint=constraint)
            return
        runner = self.scheduler.runner()
        try:
            for chunk in self.engine.stream(prompt, config, constraint=constraint, runner=runner):
                if chunk.finish_reason is not None:
                    runner.close()  # no pass follows the last chunk: the next pass must not wait for this one
                yield chunk
        finally:
            runner.close()

    def generate(
        self, prompt: Prompt, config: DecodeConfig | None = None, *, constraint: TokenConstraint | None = None
    ) -> GenerationResult:
        text: list[str] = []
        ids: list[int] = []
        last: StreamChunk | None = None
        for chunk in self.stream(prompt, config, constraint=constraint):
            text.append(chunk.text)
            ids += chunk.token_ids
            last = chunk
        assert last is not None and last.stats is not None and last.finish_reason is not None
        return GenerationResult("".join(text), ids, last.finish_reason, last.stats)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()


__all__ = [
    "BatchScheduler",
    "BatchedEngine",
    "BatchingRunner",
    "PassStats",
    "PassTime",
    "SharedPassCurve",
    "pass_time_curve",
    "shared_pass_cost",
]
