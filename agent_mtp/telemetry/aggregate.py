"""In-memory aggregation of events into (time bucket, model, step type, mode) series, and the flush batch.

Everything here is pure Python and O(1) per event; the recorder calls it under its lock.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from agent_mtp.events import InterventionEvent, StepEvent
from agent_mtp.telemetry import histogram
from agent_mtp.telemetry.config import BUCKET_S, INVALID_PART, NO_MODE, OVERFLOW_PART, is_valid_key_part

# Integer counters of a series hash (HINCRBY).
REQUESTS = "requests"
OK = "ok"
TIMEOUTS = "timeouts"
ERRORS = "errors"
MONITOR_FAILED = "monitor_failed"
"""Steps returned with outcome ``monitor_failed`` (a monitor still failed on the returned output)."""
MONITOR_FAILED_STEPS = "monitor_failed_steps"
"""Steps in which any monitor failed on any attempt."""
RETRIES = "retries"
RETRIED = "retried"
FALLBACKS = "fallbacks"
BREAKER_OPEN = "breaker_open"
NEW_TOKENS = "new_tokens"
FORWARD_PASSES = "forward_passes"
PROMPT_TOKENS = "prompt_tokens"
CACHED_PROMPT_TOKENS = "cached_prompt_tokens"
"""Prompt tokens read from the engine's prefix cache instead of prefilled."""
NTP_KNOWN = "ntp_known"
TTFT_COUNT = "ttft_count"
MANUAL_INTERVENTIONS = "manual_interventions"
USER_VISIBLE_FAILURES = "user_visible_failures"
MONITOR_PREFIX = "mon:"
HIST_PREFIX = "h:"
# Float sums of a series hash (HINCRBYFLOAT).
LATENCY_S = "latency_s"
NTP_EQUIVALENT_S = "ntp_equivalent_s"
NTP_KNOWN_LATENCY_S = "ntp_known_latency_s"
TTFT_S = "ttft_s"

# Health counters (one hash per time bucket, written with the batch that reports them).
DROPPED_BUCKETS = "dropped_buckets"
DROPPED_REQUESTS = "dropped_requests"
DROPPED_INTERVENTIONS = "dropped_interventions"
INVALID_KEY_PARTS = "invalid_key_parts"
INVALID_VALUES = "invalid_values"
INVALID_EVENTS = "invalid_events"
OVERFLOW_SERIES = "overflow_series"
SCRIPT_ERRORS = "script_errors"
UNVERIFIED_BATCHES = "unverified_batches"
RECORD_ERRORS = "record_errors"
LOST_REQUESTS = "lost_requests"
"""Steps Redis acknowledged and then no longer had (restart without persistence, FLUSHALL): see lua.py."""
LOST_DATA_EVENTS = "lost_data_events"
"""Times a writer found Redis holding less than it had acknowledged."""

_INTERVENTION_FIELDS = {
    "manual_intervention": MANUAL_INTERVENTIONS,
    "user_visible_failure": USER_VISIBLE_FAILURES,
}
_FUTURE_SLACK_S = 60.0
_NOTE_CHARS = 500


class SeriesKey(NamedTuple):
    bucket: int
    """Start of the time bucket, in whole seconds since the epoch (a multiple of BUCKET_S)."""
    model: str
    step_type: str
    mode: str

    @property
    def member(self) -> str:
        """Name of the series inside its bucket's index set (parts are validated, so ':' is unambiguous)."""
        return f"{self.model}:{self.step_type}:{self.mode}"


def bucket_start(timestamp: float) -> int:
    return int(timestamp // BUCKET_S) * BUCKET_S


@dataclass
class Aggregate:
    """Counters, float sums and latency histogram of one series over one flush interval."""

    counts: dict[str, int] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + value

    def add_float(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value


def _count(value: object) -> int | None:
    """A non-negative int, or None for anything else (bools count as invalid too)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _seconds(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


@dataclass(frozen=True)
class Ledger:
    """What a writer tells Redis with a batch so that Redis can notice lost data (see :mod:`.lua`)."""

    epoch: str
    """Random id of the writing process (host:pid can repeat: a restarted container is pid 1 again)."""
    acknowledged: int
    """Steps this writer's earlier batches carried that Redis acknowledged."""
    floor: int
    """Of those, the steps acknowledged longer ago than the retention: gone anyway, never counted as lost."""


@dataclass
class Batch:
    """What one flush sends: series aggregates, health counters and intervention notes, under one flush id.

    A batch keeps its flush id until Redis acknowledges it, so a retry after an ambiguous failure is
    recognised as a duplicate. When the backlog is over its bound the batch is "husked": its series are
    removed and counted as dropped in its own health counters, and the husk is still sent under the same id
    (so the drop is counted if and only if the original was never applied).
    """

    series: dict[SeriesKey, Aggregate]
    health: dict[str, int]
    notes: list[str]
    health_bucket: int
    flush_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    attempted: bool = False
    """True once the batch was sent at least once without an acknowledgement (it may have been applied)."""
    script_failures: int = 0
    ledger: Ledger | None = None
    """Set by the flusher before every send."""

    @property
    def requests(self) -> int:
        """Steps counted in this batch."""
        return sum(agg.counts.get(REQUESTS, 0) for agg in self.series.values())

    @property
    def size(self) -> int:
        return len(self.series)

    def husk(self) -> int:
        """Drop the series (counting them as dropped); return how many series were dropped."""
        dropped = len(self.series)
        requests = self.requests
        interventions = sum(
            agg.counts.get(MANUAL_INTERVENTIONS, 0) + agg.counts.get(USER_VISIBLE_FAILURES, 0)
            for agg in self.series.values()
        )
        for name, value in (
            (DROPPED_BUCKETS, dropped),
            (DROPPED_REQUESTS, requests),
            (DROPPED_INTERVENTIONS, interventions),
        ):
            if value:
                self.health[name] = self.health.get(name, 0) + value
        self.series = {}
        self.notes = []
        return dropped

    def absorb_health(self, other: Batch) -> None:
        """Add the health counters of a never-sent husk to this one (used to keep husks few)."""
        for name, value in other.health.items():
            self.health[name] = self.health.get(name, 0) + value


class Pending:
    """Aggregates of the current flush interval. Not thread-safe: the recorder holds its lock around calls."""

    def __init__(self, *, max_series: int, retention_s: int, note_limit: int) -> None:
        self.max_series = max_series
        self.retention_s = retention_s
        self.note_limit = note_limit
        self.series: dict[SeriesKey, Aggregate] = {}
        self.health: dict[str, int] = {}
        self.notes: list[str] = []
        self.events = 0

    def count_health(self, name: str, value: int = 1) -> None:
        self.health[name] = self.health.get(name, 0) + value

    def add(self, event: object, now: float) -> None:
        if isinstance(event, StepEvent):
            self._add_step(event, now)
        elif isinstance(event, InterventionEvent):
            self._add_intervention(event, now)
        else:
            self.count_health(INVALID_EVENTS)
            return
        self.events += 1

    def _part(self, value: object) -> str:
        if is_valid_key_part(value):
            assert isinstance(value, str)
            return value
        self.count_health(INVALID_KEY_PARTS)
        return INVALID_PART

    def _bucket(self, timestamp: object, now: float) -> int:
        ts = _seconds(timestamp)
        if ts is None or ts < now - self.retention_s or ts > now + _FUTURE_SLACK_S:
            self.count_health(INVALID_VALUES)
            return bucket_start(now)
        return bucket_start(ts)

    def _series(self, bucket: int, model: object, step_type: object, mode: str, now: float) -> Aggregate:
        key = SeriesKey(bucket, self._part(model), self._part(step_type), mode)
        agg = self.series.get(key)
        if agg is not None:
            return agg
        if len(self.series) >= self.max_series:
            self.count_health(OVERFLOW_SERIES)
            key = SeriesKey(bucket_start(now), OVERFLOW_PART, OVERFLOW_PART, OVERFLOW_PART)
            agg = self.series.get(key)
            if agg is not None:
                return agg
        agg = self.series[key] = Aggregate()
        return agg

    def _add_step(self, event: StepEvent, now: float) -> None:
        mode = self._part(event.mode)
        agg = self._series(self._bucket(event.timestamp, now), event.model, event.step_type, mode, now)
        agg.add(REQUESTS)
        outcome = event.outcome
        if outcome == "ok":
            agg.add(OK)
        elif outcome == "error":
            agg.add(ERRORS)
        elif outcome == "monitor_failed":
            agg.add(MONITOR_FAILED)
        elif outcome != "timeout":
            self.count_health(INVALID_VALUES)
        if outcome == "timeout" or event.timeout is True:
            agg.add(TIMEOUTS)
        attempts = _count(event.attempts)
        if attempts is None or attempts < 1:
            self.count_health(INVALID_VALUES)
        elif attempts > 1:
            agg.add(RETRIES, attempts - 1)
            agg.add(RETRIED)
        if event.fallback is True:
            agg.add(FALLBACKS)
        if event.breaker_open is True:
            agg.add(BREAKER_OPEN)
        self._add_monitors(agg, event.monitor_failures)
        self._add_work(agg, event)

    def _add_monitors(self, agg: Aggregate, names: object) -> None:
        if not isinstance(names, (tuple, list, frozenset, set)) or not names:
            return
        agg.add(MONITOR_FAILED_STEPS)
        for name in dict.fromkeys(names):
            agg.add(MONITOR_PREFIX + self._part(name))

    def _add_work(self, agg: Aggregate, event: StepEvent) -> None:
        work = (
            (NEW_TOKENS, event.new_tokens),
            (FORWARD_PASSES, event.forward_passes),
            (PROMPT_TOKENS, event.prompt_tokens),
            (CACHED_PROMPT_TOKENS, event.cached_prompt_tokens),
        )
        for name, value in work:
            amount = _count(value)
            if amount is None:
                self.count_health(INVALID_VALUES)
            elif amount:
                agg.add(name, amount)
        latency = _seconds(event.latency_s)
        if latency is None:
            self.count_health(INVALID_VALUES)
            return
        agg.add_float(LATENCY_S, latency)
        agg.add(HIST_PREFIX + str(histogram.bucket_index(latency)))
        ntp = _seconds(event.ntp_equivalent_s) if event.ntp_equivalent_s is not None else None
        if ntp is not None:
            agg.add(NTP_KNOWN)
            agg.add_float(NTP_EQUIVALENT_S, ntp)
            agg.add_float(NTP_KNOWN_LATENCY_S, latency)
        ttft = _seconds(event.ttft_s) if event.ttft_s is not None else None
        if ttft is not None:
            agg.add(TTFT_COUNT)
            agg.add_float(TTFT_S, ttft)

    def _add_intervention(self, event: InterventionEvent, now: float) -> None:
        name = _INTERVENTION_FIELDS.get(event.kind) if isinstance(event.kind, str) else None
        if name is None:
            self.count_health(INVALID_VALUES)
            name = USER_VISIBLE_FAILURES
        agg = self._series(self._bucket(event.timestamp, now), event.model, event.step_type, NO_MODE, now)
        agg.add(name)
        if len(self.notes) < self.note_limit:
            self.notes.append(intervention_note(event))

    @property
    def empty(self) -> bool:
        return not self.series and not self.health and not self.notes

    def take(self) -> Batch | None:
        """Move everything aggregated so far into a new batch (None when there is nothing to send)."""
        if self.empty:
            return None
        batch = Batch(self.series, self.health, self.notes, bucket_start(time.time()))
        self.series, self.health, self.notes = {}, {}, []
        return batch

    def clear(self) -> None:
        self.series, self.health, self.notes = {}, {}, []


def intervention_note(event: InterventionEvent) -> str:
    """The JSON line kept in the recent-interventions list (free text is truncated, never part of a key)."""
    return json.dumps(
        {
            "timestamp": event.timestamp if _seconds(event.timestamp) is not None else time.time(),
            "kind": str(event.kind)[:40],
            "step_type": str(event.step_type)[:128],
            "model": str(event.model)[:128],
            "run_id": None if event.run_id is None else str(event.run_id)[:200],
            "note": str(event.note)[:_NOTE_CHARS],
        },
        ensure_ascii=True,
    )
