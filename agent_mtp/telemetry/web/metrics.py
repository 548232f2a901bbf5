"""``/metrics``: the fleet's Redis aggregates in the Prometheus text format (prometheus-client), for Grafana.

Every sample carries ``policy`` (the fleet's label), ``replica`` (``all``: the aggregates are merged across
workers; ``agent_mtp_replica_last_seen_timestamp_seconds`` lists the workers), ``step_type`` and ``mode``:

* counters (``agent_mtp_steps_total``, ``..._timeouts_total``, ...) and the histogram
  ``agent_mtp_step_latency_seconds``: the sums of the 10-second buckets this process has read. Each scrape re-reads
  the last hour (late flushes land in buckets already seen); buckets older than that are kept folded in memory, so
  the counters never go down while the process runs (a restart is a counter reset to Prometheus) and, over any
  hour this process watched, equal the Redis aggregates of that hour.
* gauges ``agent_mtp_window_*{window="1m"|"5m"|"1h"}``: the windowed figures of ``agent-mtp stats`` (ratios,
  percentiles, tokens per forward, speedup), from the same query functions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from agent_mtp.errors import TelemetryError
from agent_mtp.telemetry import aggregate as f
from agent_mtp.telemetry import histogram
from agent_mtp.telemetry.aggregate import SeriesKey
from agent_mtp.telemetry.config import BUCKET_S, WINDOWS
from agent_mtp.telemetry.queries import MetricsRow, StatsReport, merge_rows, query_stats
from agent_mtp.telemetry.store import STORE_ERRORS
from agent_mtp.telemetry.web.data import Fleet, breaker_states, replicas

REPLICA_ALL = "all"
LABELS = ("policy", "replica", "step_type", "mode")
LATENCY_EDGES_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
"""``le`` edges of the latency histogram: each is an edge of the telemetry's log-linear buckets, so the cumulative
counts are exact."""

COUNTERS: dict[str, tuple[str, str]] = {
    f.REQUESTS: ("agent_mtp_steps", "Agent steps (chat-model calls) that finished."),
    f.OK: ("agent_mtp_steps_ok", "Steps that returned normally."),
    f.TIMEOUTS: ("agent_mtp_step_timeouts", "Steps that hit their deadline."),
    f.ERRORS: ("agent_mtp_step_errors", "Steps that raised."),
    f.RETRIED: ("agent_mtp_steps_retried", "Steps that needed at least one retry."),
    f.RETRIES: ("agent_mtp_step_retries", "Retries (attempts beyond the first)."),
    f.FALLBACKS: ("agent_mtp_step_fallbacks", "Steps whose output came from a safer mode than the policy's first."),
    f.BREAKER_OPEN: ("agent_mtp_steps_breaker_open", "Steps decoded with NTP because the breaker was open."),
    f.MONITOR_FAILED_STEPS: ("agent_mtp_steps_monitor_failed", "Steps in which a quality monitor failed."),
    f.MONITOR_FAILED: ("agent_mtp_steps_returned_monitor_failed", "Steps returned while a monitor still failed."),
    f.NEW_TOKENS: ("agent_mtp_new_tokens", "Tokens generated."),
    f.TTFT_COUNT: ("agent_mtp_steps_with_ttft", "Steps whose time to the first token is known."),
    f.PROMPT_TOKENS: ("agent_mtp_prompt_tokens", "Prompt tokens of the steps."),
    f.CACHED_PROMPT_TOKENS: ("agent_mtp_cached_prompt_tokens", "Prompt tokens read from the prefix cache."),
    f.FORWARD_PASSES: ("agent_mtp_forward_passes", "Model forward passes."),
    f.MANUAL_INTERVENTIONS: ("agent_mtp_manual_interventions", "Manual interventions reported."),
    f.USER_VISIBLE_FAILURES: ("agent_mtp_user_visible_failures", "User-visible failures reported."),
}
FLOAT_COUNTERS: dict[str, tuple[str, str]] = {
    f.NTP_EQUIVALENT_S: ("agent_mtp_ntp_equivalent_seconds", "Estimated plain-NTP time of the steps where known."),
    f.NTP_KNOWN_LATENCY_S: ("agent_mtp_ntp_known_latency_seconds", "Actual time of those steps (speedup = ratio)."),
    f.TTFT_S: ("agent_mtp_ttft_seconds", "Sum of times to the first token, where known."),
}
GAUGES: dict[str, tuple[str, Callable[[MetricsRow], float | None]]] = {
    "agent_mtp_window_steps": ("Steps in the window.", lambda r: float(r.requests)),
    "agent_mtp_window_timeout_ratio": ("Share of steps that hit their deadline.", lambda r: r.timeout_ratio),
    "agent_mtp_window_retry_rate": ("Share of steps that retried.", lambda r: r.retry_rate),
    "agent_mtp_window_fallback_rate": ("Share of steps that fell back to a safer mode.", lambda r: r.fallback_rate),
    "agent_mtp_window_breaker_open_rate": ("Share of steps under an open breaker.", lambda r: r.breaker_open_rate),
    "agent_mtp_window_error_rate": ("Share of steps that raised.", lambda r: r.error_rate),
    "agent_mtp_window_monitor_failure_rate": (
        "Share of steps with a monitor failure.",
        lambda r: r.monitor_failure_rate,
    ),
    "agent_mtp_window_tokens_per_forward": ("New tokens per forward pass.", lambda r: r.tokens_per_forward),
    "agent_mtp_window_speedup_vs_ntp": ("Estimated plain-NTP time / actual time.", lambda r: r.speedup_vs_ntp),
    "agent_mtp_window_prefix_cache_hit_rate": (
        "Prompt tokens from the prefix cache.",
        lambda r: r.prefix_cache_hit_rate,
    ),
    "agent_mtp_window_mean_ttft_seconds": ("Mean time to the first token.", lambda r: r.mean_ttft_s),
}
_LEDGER_WINDOW = "1h"


class _Ledger:
    """Counter totals of one fleet that only grow: buckets of the last hour are re-read (and replaced) on every
    scrape; a bucket that left the hour is folded into per-(step type, mode) totals and never read again."""

    def __init__(self) -> None:
        self.live: dict[SeriesKey, dict[str, float]] = {}
        self.folded: dict[tuple[str, str], dict[str, float]] = {}

    def update(self, series: Sequence[tuple[SeriesKey, Mapping[str, float]]], oldest_bucket: int) -> None:
        for key, values in series:
            old = self.live.get(key, {})
            # Redis only adds to a bucket: keep the larger value of each field (a key that expired reads as absent)
            self.live[key] = {name: max(values.get(name, 0.0), old.get(name, 0.0)) for name in {*old, *values}}
        for key in [key for key in self.live if key.bucket < oldest_bucket]:
            total = self.folded.setdefault((key.step_type, key.mode), {})
            for name, value in self.live.pop(key).items():
                total[name] = total.get(name, 0.0) + value

    def rows(self) -> list[MetricsRow]:
        groups: dict[tuple[str, str], list[tuple[SeriesKey, Mapping[str, float]]]] = {}
        for key, values in self.live.items():
            groups.setdefault((key.step_type, key.mode), []).append((key, values))
        for (step_type, mode), values in self.folded.items():
            groups.setdefault((step_type, mode), []).append((SeriesKey(0, "*", step_type, mode), values))
        return [
            merge_rows(items, model="*", step_type=step_type, mode=mode)
            for (step_type, mode), items in sorted(groups.items())
        ]


class FleetCollector:
    """A prometheus-client collector that reads the fleets' aggregates from Redis at every scrape (read-only)."""

    def __init__(self, fleets: Sequence[Fleet], *, clock: Callable[[], float] = time.time) -> None:
        self.fleets = list(fleets)
        self.clock = clock
        self._ledgers = {fleet.label: _Ledger() for fleet in self.fleets}
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = self.clock()
            up = GaugeMetricFamily(
                "agent_mtp_dashboard_redis_up", "1 when the fleet's Redis could be read.", labels=["policy"]
            )
            reports: dict[str, dict[str, StatsReport]] = {}
            for fleet in self.fleets:
                try:
                    reports[fleet.label] = {
                        name: query_stats(fleet.store, window=seconds, namespace=fleet.namespace, now=now)
                        for name, seconds in WINDOWS.items()
                    }
                except TelemetryError:
                    up.add_metric([fleet.label], 0.0)
                    continue
                up.add_metric([fleet.label], 1.0)
                hour = reports[fleet.label][_LEDGER_WINDOW]
                self._ledgers[fleet.label].update(hour.series, hour.start)
            yield up
            yield from self._counters(reports)
            yield from self._gauges(reports)
            yield from self._replicas(reports, now)

    def _counters(self, reports: Mapping[str, Mapping[str, StatsReport]]) -> Iterator[Metric]:
        families = {
            field: CounterMetricFamily(name, doc, labels=LABELS)
            for field, (name, doc) in {**COUNTERS, **FLOAT_COUNTERS}.items()
        }
        monitors = CounterMetricFamily(
            "agent_mtp_monitor_failures",
            "Steps a quality monitor failed, by monitor.",
            labels=[*LABELS, "monitor"],
        )
        latency = HistogramMetricFamily("agent_mtp_step_latency_seconds", "Wall time of a whole step.", labels=LABELS)
        for label in reports:
            for row in self._ledgers[label].rows():
                labels = [label, REPLICA_ALL, row.step_type, row.mode]
                for field, family in families.items():
                    value = row.count(field) if field in COUNTERS else row.fields.get(field, 0.0)
                    family.add_metric(labels, value)
                for monitor, count in row.monitor_failures.items():
                    monitors.add_metric([*labels, monitor], count)
                if row.latency_histogram:
                    latency.add_metric(labels, _cumulative(row.latency_histogram), row.fields.get(f.LATENCY_S, 0.0))
        yield from families.values()
        yield monitors
        yield latency

    def _gauges(self, reports: Mapping[str, Mapping[str, StatsReport]]) -> Iterator[Metric]:
        labels = [*LABELS, "window"]
        families = {name: GaugeMetricFamily(name, doc, labels=labels) for name, (doc, _) in GAUGES.items()}
        quantiles = GaugeMetricFamily(
            "agent_mtp_window_latency_seconds", "Latency percentile of the window.", labels=[*labels, "quantile"]
        )
        writers = GaugeMetricFamily(
            "agent_mtp_window_writers", "Processes that flushed in the window.", labels=["policy", "window"]
        )
        breaker = GaugeMetricFamily(
            "agent_mtp_breaker_open", "1 when the step type's newest steps ran under an open breaker.",
            labels=["policy", "replica", "step_type"],
        )  # fmt: skip
        for label, by_window in reports.items():
            for window, report in by_window.items():
                writers.add_metric([label, window], float(report.writers))
                for row in [*report.rows, report.total]:
                    if not row.requests:
                        continue
                    step_type, mode = ("all", "all") if row is report.total else (row.step_type, row.mode)
                    row_labels = [label, REPLICA_ALL, step_type, mode, window]
                    for name, (_, getter) in GAUGES.items():
                        value = getter(row)
                        if value is not None:
                            families[name].add_metric(row_labels, value)
                    for q, value in (("0.5", row.p50_s), ("0.95", row.p95_s), ("0.99", row.p99_s)):
                        if value is not None:
                            quantiles.add_metric([*row_labels, q], value)
            for step_type, state in breaker_states(by_window[_LEDGER_WINDOW]).items():
                breaker.add_metric([label, REPLICA_ALL, step_type], 1.0 if state["state"] == "open" else 0.0)
        yield from families.values()
        yield quantiles
        yield writers
        yield breaker

    def _replicas(self, reports: Mapping[str, Mapping[str, StatsReport]], now: float) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "agent_mtp_replica_last_seen_timestamp_seconds",
            "End of the newest 10-s bucket in which a worker (host:pid) flushed, over the last hour.",
            labels=["policy", "replica"],
        )
        for fleet in self.fleets:
            report = reports.get(fleet.label, {}).get(_LEDGER_WINDOW)
            if report is None:
                continue
            try:
                rows = replicas(fleet.store, list(range(report.start, report.end, BUCKET_S)))
            except STORE_ERRORS:
                continue
            for row in rows:
                family.add_metric([fleet.label, row["replica"]], float(row["last_seen"]))
        yield family


def _cumulative(hist: Mapping[int, int]) -> list[tuple[str, float]]:
    """Prometheus buckets (``le``, cumulative count) from the log-linear histogram."""
    uppers = [(histogram.bucket_bounds(index)[1], count) for index, count in hist.items()]
    buckets = [(repr(edge), float(sum(c for upper, c in uppers if upper <= edge + 1e-12))) for edge in LATENCY_EDGES_S]
    buckets.append(("+Inf", float(sum(hist.values()))))
    return buckets


def metrics_registry(fleets: Sequence[Fleet], *, clock: Callable[[], float] = time.time) -> CollectorRegistry:
    """A private registry holding one :class:`FleetCollector` (not the process-global default registry)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(fleets, clock=clock))
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
