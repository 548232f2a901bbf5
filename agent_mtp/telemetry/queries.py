"""Metrics over sliding windows, merged across every writer of a namespace.

A window of W seconds is the last W / 10 buckets, the current (still filling) one included, so it covers
between W - 10 and W seconds of data. Counters add up exactly across processes; latency percentiles come
from the merged log-linear histogram (see :mod:`agent_mtp.telemetry.histogram`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from agent_mtp.errors import TelemetryError
from agent_mtp.redis_url import scrub
from agent_mtp.telemetry import aggregate as f
from agent_mtp.telemetry import histogram
from agent_mtp.telemetry.aggregate import SeriesKey, bucket_start
from agent_mtp.telemetry.config import BUCKET_S, TelemetryConfig, parse_window
from agent_mtp.telemetry.store import STORE_ERRORS, RedisStore, Store

ALL = "*"
GROUP_FIELDS = ("model", "step_type", "mode")


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


@dataclass(frozen=True)
class MetricsRow:
    """Merged counters of the series of one group (``*`` marks a part that was merged over)."""

    model: str
    step_type: str
    mode: str
    fields: Mapping[str, float] = field(repr=False)
    latency_histogram: Mapping[int, int] = field(repr=False)

    def count(self, name: str) -> int:
        return round(self.fields.get(name, 0))

    # Counts ----------------------------------------------------------------------------------------------
    @property
    def requests(self) -> int:
        """Agent steps (chat-model calls) that finished in the window."""
        return self.count(f.REQUESTS)

    @property
    def monitor_failures(self) -> dict[str, int]:
        """Steps in which each quality monitor failed (on any attempt), by monitor name."""
        prefix = f.MONITOR_PREFIX
        return {name[len(prefix) :]: self.count(name) for name in sorted(self.fields) if name.startswith(prefix)}

    # Ratios over requests -----------------------------------------------------------------------------------
    @property
    def timeout_ratio(self) -> float | None:
        """Share of steps that hit their deadline (partial output or raised)."""
        return _ratio(self.count(f.TIMEOUTS), self.requests)

    @property
    def retry_rate(self) -> float | None:
        """Share of steps that needed at least one retry."""
        return _ratio(self.count(f.RETRIED), self.requests)

    @property
    def retries_per_step(self) -> float | None:
        return _ratio(self.count(f.RETRIES), self.requests)

    @property
    def fallback_rate(self) -> float | None:
        """Share of steps whose output came from a safer mode than the policy's first choice."""
        return _ratio(self.count(f.FALLBACKS), self.requests)

    @property
    def error_rate(self) -> float | None:
        return _ratio(self.count(f.ERRORS), self.requests)

    @property
    def monitor_failure_rate(self) -> float | None:
        """Share of steps in which any quality monitor failed on any attempt."""
        return _ratio(self.count(f.MONITOR_FAILED_STEPS), self.requests)

    @property
    def monitor_failure_rates(self) -> dict[str, float | None]:
        return {name: _ratio(count, self.requests) for name, count in self.monitor_failures.items()}

    @property
    def breaker_open_rate(self) -> float | None:
        return _ratio(self.count(f.BREAKER_OPEN), self.requests)

    # Speed -------------------------------------------------------------------------------------------------
    @property
    def tokens_per_forward(self) -> float | None:
        """New tokens per model forward pass ("Eff. k"; 1.0 for plain decoding)."""
        return _ratio(self.count(f.NEW_TOKENS), self.count(f.FORWARD_PASSES))

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of prompt tokens read from the engine's prefix cache instead of prefilled (agents re-send the
        conversation every step: the cache reads it once)."""
        return _ratio(self.count(f.CACHED_PROMPT_TOKENS), self.count(f.PROMPT_TOKENS))

    @property
    def speedup_vs_ntp(self) -> float | None:
        """Estimated plain-NTP time / actual time, over the steps whose NTP-equivalent time is known."""
        return _ratio(self.fields.get(f.NTP_EQUIVALENT_S, 0.0), self.fields.get(f.NTP_KNOWN_LATENCY_S, 0.0))

    @property
    def mean_latency_s(self) -> float | None:
        return _ratio(self.fields.get(f.LATENCY_S, 0.0), sum(self.latency_histogram.values()))

    @property
    def mean_ttft_s(self) -> float | None:
        return _ratio(self.fields.get(f.TTFT_S, 0.0), self.count(f.TTFT_COUNT))

    def latency_percentile(self, q: float) -> float | None:
        return histogram.percentile(self.latency_histogram, q)

    @property
    def p50_s(self) -> float | None:
        return self.latency_percentile(0.50)

    @property
    def p95_s(self) -> float | None:
        return self.latency_percentile(0.95)

    @property
    def p99_s(self) -> float | None:
        return self.latency_percentile(0.99)

    def to_dict(self) -> dict[str, Any]:
        counts = {
            name: self.count(name)
            for name in (
                f.REQUESTS,
                f.OK,
                f.TIMEOUTS,
                f.ERRORS,
                f.MONITOR_FAILED,
                f.MONITOR_FAILED_STEPS,
                f.RETRIES,
                f.RETRIED,
                f.FALLBACKS,
                f.BREAKER_OPEN,
                f.NEW_TOKENS,
                f.FORWARD_PASSES,
                f.PROMPT_TOKENS,
                f.CACHED_PROMPT_TOKENS,
                f.MANUAL_INTERVENTIONS,
                f.USER_VISIBLE_FAILURES,
            )
        }
        return {
            "model": self.model,
            "step_type": self.step_type,
            "mode": self.mode,
            **counts,
            "monitor_failures": self.monitor_failures,
            "timeout_ratio": self.timeout_ratio,
            "retry_rate": self.retry_rate,
            "retries_per_step": self.retries_per_step,
            "fallback_rate": self.fallback_rate,
            "error_rate": self.error_rate,
            "monitor_failure_rate": self.monitor_failure_rate,
            "monitor_failure_rates": self.monitor_failure_rates,
            "breaker_open_rate": self.breaker_open_rate,
            "tokens_per_forward": self.tokens_per_forward,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "speedup_vs_ntp": self.speedup_vs_ntp,
            "latency_s": {
                "p50": self.p50_s,
                "p95": self.p95_s,
                "p99": self.p99_s,
                "mean": self.mean_latency_s,
            },
            "mean_ttft_s": self.mean_ttft_s,
        }


def merge_rows(
    series: Iterable[tuple[SeriesKey, Mapping[str, float]]], *, model: str, step_type: str, mode: str
) -> MetricsRow:
    """One row from raw series hashes: counters and histogram buckets are summed."""
    fields: dict[str, float] = {}
    hist: dict[int, int] = {}
    for _, values in series:
        for name, value in values.items():
            if name.startswith(f.HIST_PREFIX):
                index = int(name[len(f.HIST_PREFIX) :])
                hist[index] = hist.get(index, 0) + round(value)
            else:
                fields[name] = fields.get(name, 0) + value
    return MetricsRow(model, step_type, mode, fields, hist)


def group_rows(
    series: Sequence[tuple[SeriesKey, Mapping[str, float]]], group_by: Sequence[str] = ("step_type", "mode")
) -> list[MetricsRow]:
    """Rows per distinct value of the ``group_by`` parts (others merged as ``*``), sorted by name."""
    unknown = [name for name in group_by if name not in GROUP_FIELDS]
    if unknown:
        msg = f"cannot group by {unknown}: use a subset of {GROUP_FIELDS}"
        raise ValueError(msg)
    groups: dict[tuple[str, str, str], list[tuple[SeriesKey, Mapping[str, float]]]] = {}
    for key, values in series:
        label = tuple(getattr(key, name) if name in group_by else ALL for name in GROUP_FIELDS)
        groups.setdefault(label, []).append((key, values))  # type: ignore[arg-type]
    return [
        merge_rows(items, model=label[0], step_type=label[1], mode=label[2]) for label, items in sorted(groups.items())
    ]


@dataclass(frozen=True)
class StatsReport:
    """What ``agent-mtp stats`` shows: per-group rows, the total, health counters and recent interventions."""

    namespace: str
    window_s: int
    start: int
    """First bucket start (epoch seconds)."""
    end: int
    """End of the last bucket (epoch seconds)."""
    writers: int
    """Distinct processes (host:pid) that flushed in the window."""
    rows: list[MetricsRow]
    total: MetricsRow
    health: dict[str, int]
    recent_interventions: list[dict[str, Any]]
    series: Sequence[tuple[SeriesKey, Mapping[str, float]]] = field(repr=False, default_factory=list)

    def select(self, *, model: str | None = None, step_type: str | None = None, mode: str | None = None) -> MetricsRow:
        """Merge of the series matching the given parts (``None`` = any)."""
        chosen = [
            (key, values)
            for key, values in self.series
            if (model is None or key.model == model)
            and (step_type is None or key.step_type == step_type)
            and (mode is None or key.mode == mode)
        ]
        return merge_rows(chosen, model=model or ALL, step_type=step_type or ALL, mode=mode or ALL)

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "window_s": self.window_s,
            "bucket_s": BUCKET_S,
            "start": self.start,
            "end": self.end,
            "writers": self.writers,
            "rows": [row.to_dict() for row in self.rows],
            "total": self.total.to_dict(),
            "health": self.health,
            "recent_interventions": self.recent_interventions,
        }


def window_buckets(window_s: int, now: float) -> list[int]:
    """Bucket starts of the window ending now, oldest first."""
    last = bucket_start(now)
    count = max(1, window_s // BUCKET_S)
    return [last - BUCKET_S * i for i in range(count - 1, -1, -1)]


def query_stats(
    store: Store,
    *,
    window: str | int = "5m",
    namespace: str = "agent_mtp",
    now: float | None = None,
    group_by: Sequence[str] = ("step_type", "mode"),
) -> StatsReport:
    """Read the window from ``store`` and summarise it. A store that cannot be read (Redis down, wrong password)
    raises :class:`~agent_mtp.errors.TelemetryError` naming the redacted URL."""
    window_s = parse_window(window)
    now = time.time() if now is None else now
    buckets = window_buckets(window_s, now)
    try:
        data = store.read(buckets)
    except STORE_ERRORS as e:
        detail = scrub(f"{type(e).__name__}: {e}", getattr(store, "secrets", ()))
        hint = "check the user and password" if isinstance(e, redis.AuthenticationError) else "is Redis running?"
        raise TelemetryError(f"cannot read telemetry from {store.target}: {detail}; {hint}") from None
    health: dict[str, int] = {}
    for values in data.per_bucket_health.values():
        for name, value in values.items():
            health[name] = health.get(name, 0) + value
    notes = [n for n in data.notes if isinstance(n.get("timestamp"), (int, float)) and n["timestamp"] >= buckets[0]]
    return StatsReport(
        namespace=namespace,
        window_s=window_s,
        start=buckets[0],
        end=buckets[-1] + BUCKET_S,
        writers=len(data.writers),
        rows=group_rows(data.series, group_by),
        total=merge_rows(data.series, model=ALL, step_type=ALL, mode=ALL),
        health=dict(sorted(health.items())),
        recent_interventions=notes,
        series=data.series,
    )


def timeline(report: StatsReport, *, points: int = 60) -> list[tuple[int, MetricsRow]]:
    """The report's total over consecutive slices of the window (for plots), oldest first."""
    step = max(BUCKET_S, (report.window_s // points) // BUCKET_S * BUCKET_S)
    slices: dict[int, list[tuple[SeriesKey, Mapping[str, float]]]] = {
        start: [] for start in range(report.start, report.end, step)
    }
    for key, values in report.series:
        slot = report.start + (key.bucket - report.start) // step * step
        slices.setdefault(slot, []).append((key, values))
    return [(start, merge_rows(items, model=ALL, step_type=ALL, mode=ALL)) for start, items in sorted(slices.items())]


def redis_store(
    target: str | redis.Redis, *, namespace: str = "agent_mtp", socket_timeout_s: float = 2.0
) -> RedisStore:
    """A read-side store for a Redis URL or client (what ``agent-mtp stats`` uses)."""
    config = TelemetryConfig(namespace=namespace, socket_timeout_s=socket_timeout_s)
    if isinstance(target, redis.Redis):
        return RedisStore(target, config=config)
    return RedisStore.from_url(target, config=config.with_overrides(redis_url=target))
