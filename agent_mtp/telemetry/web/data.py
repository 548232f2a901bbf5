"""What the web page shows, computed with the telemetry query functions: one ``query_stats`` read per fleet and
window (so the page's numbers are ``agent-mtp stats --json``'s numbers), plus what the terminal view has no room
for: time series per step type, the breaker state per step type and the replicas (writers) seen.

Read-only: every Redis command here is a read (SMEMBERS, HGETALL, LRANGE).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent_mtp.errors import TelemetryError
from agent_mtp.redis_url import scrub
from agent_mtp.telemetry import aggregate as f
from agent_mtp.telemetry.aggregate import SeriesKey
from agent_mtp.telemetry.config import BUCKET_S, NO_MODE
from agent_mtp.telemetry.queries import ALL, MetricsRow, StatsReport, merge_rows, query_stats, window_buckets
from agent_mtp.telemetry.store import STORE_ERRORS, RedisStore, Store

Series = Sequence[tuple[SeriesKey, Mapping[str, float]]]

TIMELINE_METRICS: dict[str, Callable[[MetricsRow], float | None]] = {
    "requests": lambda r: float(r.requests),
    "timeout_ratio": lambda r: r.timeout_ratio,
    "retry_rate": lambda r: r.retry_rate,
    "fallback_rate": lambda r: r.fallback_rate,
    "breaker_open_rate": lambda r: r.breaker_open_rate,
    "error_rate": lambda r: r.error_rate,
    "monitor_failure_rate": lambda r: r.monitor_failure_rate,
    "p50_s": lambda r: r.p50_s,
    "p95_s": lambda r: r.p95_s,
    "p99_s": lambda r: r.p99_s,
    "mean_ttft_s": lambda r: r.mean_ttft_s,
    "tokens_per_forward": lambda r: r.tokens_per_forward,
    "speedup_vs_ntp": lambda r: r.speedup_vs_ntp,
    "prefix_cache_hit_rate": lambda r: r.prefix_cache_hit_rate,
}
"""Quantities drawn over time (one value per slice of the window; ``None`` where a slice has no steps)."""


@dataclass(frozen=True)
class Fleet:
    """One fleet on the page: its label (``policy`` in /metrics), namespace and read-side store."""

    label: str
    namespace: str
    store: Store


def slice_seconds(window_s: int, points: int) -> int:
    """Width of one time-series point: a whole number of buckets, about ``window_s / points``."""
    return max(BUCKET_S, (window_s // points) // BUCKET_S * BUCKET_S)


def timelines(report: StatsReport, *, points: int) -> dict[str, Any]:
    """``{"t": [slice starts], "slice_s": s, "series": {step type or "all": {metric: [values]}}}``."""
    step = slice_seconds(report.window_s, points)
    starts = list(range(report.start, report.end, step))
    groups: dict[str, dict[int, list[tuple[SeriesKey, Mapping[str, float]]]]] = {ALL: {}}
    for key, values in report.series:
        if key.mode == NO_MODE:  # interventions only: no steps to draw
            continue
        slot = report.start + (key.bucket - report.start) // step * step
        groups[ALL].setdefault(slot, []).append((key, values))
        groups.setdefault(key.step_type, {}).setdefault(slot, []).append((key, values))
    series: dict[str, dict[str, list[float | None]]] = {}
    for name, slots in sorted(groups.items()):
        rows = [merge_rows(slots.get(start, []), model=ALL, step_type=name, mode=ALL) for start in starts]
        series["all" if name == ALL else name] = {
            metric: [_finite(getter(row)) for row in rows] for metric, getter in TIMELINE_METRICS.items()
        }
    return {"t": starts, "slice_s": step, "series": series}


def breaker_states(report: StatsReport) -> dict[str, dict[str, Any]]:
    """Per step type: ``open`` when its newest bucket with steps had steps forced to NTP by an open breaker, else
    ``closed``; with the steps and share of the window that ran under an open breaker."""
    newest: dict[str, int] = {}
    for key, values in report.series:
        if values.get(f.REQUESTS, 0) > 0 and key.bucket > newest.get(key.step_type, -1):
            newest[key.step_type] = key.bucket
    states: dict[str, dict[str, Any]] = {}
    for step_type, bucket in sorted(newest.items()):
        latest = merge_rows(
            [(k, v) for k, v in report.series if k.step_type == step_type and k.bucket == bucket],
            model=ALL,
            step_type=step_type,
            mode=ALL,
        )
        window = report.select(step_type=step_type)
        states[step_type] = {
            "state": "open" if latest.count(f.BREAKER_OPEN) else "closed",
            "as_of": bucket,
            "breaker_open_steps": window.count(f.BREAKER_OPEN),
            "breaker_open_rate": window.breaker_open_rate,
        }
    return states


def replicas(store: Store, buckets: Sequence[int]) -> list[dict[str, Any]]:
    """The processes (``host:pid``) that flushed in the window: buckets they flushed in and when they were last
    seen, newest first. Only a Redis store keeps writers per bucket; other stores give an empty list."""
    if not isinstance(store, RedisStore) or not buckets:
        return []
    pipe = store.client.pipeline(transaction=False)
    for bucket in buckets:
        pipe.smembers(store.writers_key(bucket))
    seen: dict[str, list[int]] = {}
    for bucket, members in zip(buckets, pipe.execute(), strict=True):
        for member in members:
            name = member.decode() if isinstance(member, bytes) else str(member)
            seen.setdefault(name, []).append(bucket)
    rows = [
        {"replica": name, "buckets": len(found), "first_seen": min(found), "last_seen": max(found) + BUCKET_S}
        for name, found in seen.items()
    ]
    return sorted(rows, key=lambda row: (-row["last_seen"], row["replica"]))


def fleet_view(fleet: Fleet, *, window_s: int, now: float, points: int) -> dict[str, Any]:
    """Everything the page shows for one fleet and window, or ``{"error": ...}`` (redacted) when Redis fails."""
    try:
        report = query_stats(fleet.store, window=window_s, namespace=fleet.namespace, now=now)
        writers = replicas(fleet.store, window_buckets(window_s, now))
    except TelemetryError as e:
        return {"label": fleet.label, "namespace": fleet.namespace, "error": str(e)}
    except STORE_ERRORS as e:
        secrets = getattr(fleet.store, "secrets", ())
        detail = scrub(f"{type(e).__name__}: {e}", secrets)
        return {
            "label": fleet.label,
            "namespace": fleet.namespace,
            "error": f"cannot read {fleet.store.target}: {detail}",
        }
    return {
        "label": fleet.label,
        "namespace": fleet.namespace,
        "target": fleet.store.target,
        "report": report.to_dict(),
        "breakers": breaker_states(report),
        "replicas": writers,
        "timeline": timelines(report, points=points),
    }


def dashboard_view(fleets: Sequence[Fleet], *, window_s: int, points: int, now: float | None = None) -> dict[str, Any]:
    """The JSON of ``/api/stats``: one entry per fleet, in the order given (the A/B order of the legends)."""
    now = time.time() if now is None else now
    return {
        "window_s": window_s,
        "generated_at": now,
        "fleets": [fleet_view(fleet, window_s=window_s, now=now, points=points) for fleet in fleets],
    }


def _finite(value: float | None) -> float | None:
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return None
    return value
