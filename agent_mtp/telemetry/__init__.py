"""Fleet telemetry: a non-blocking recorder, an idempotent Redis flusher, windowed queries and a dashboard.

    from agent_mtp.telemetry import Telemetry
    telemetry = Telemetry()                       # AGENT_MTP_REDIS_URL, else in memory (logged once)
    process_telemetry()                           # the shared one front ends use when given no recorder
    telemetry.record(step_event)                  # O(1), no I/O, never raises
    report = telemetry.query("5m")                # merged across every writer of the namespace
    report.select(step_type="tool_call").p95_s

See docs/telemetry.md for the operator guide and the Redis key schema.
"""

from __future__ import annotations

from agent_mtp.redis_url import redact_url
from agent_mtp.telemetry.config import (
    BUCKET_S,
    ENV_NAMESPACE,
    ENV_REDIS_URL,
    WINDOWS,
    TelemetryConfig,
    parse_window,
    validate_key_part,
)
from agent_mtp.telemetry.queries import MetricsRow, StatsReport, query_stats, redis_store, timeline
from agent_mtp.telemetry.recorder import Telemetry, TelemetryStats, process_telemetry
from agent_mtp.telemetry.store import MemoryStore, RedisStore, Store

__all__ = [
    "BUCKET_S",
    "ENV_NAMESPACE",
    "ENV_REDIS_URL",
    "WINDOWS",
    "MemoryStore",
    "MetricsRow",
    "RedisStore",
    "StatsReport",
    "Store",
    "Telemetry",
    "TelemetryConfig",
    "TelemetryStats",
    "parse_window",
    "process_telemetry",
    "query_stats",
    "redact_url",
    "redis_store",
    "timeline",
    "validate_key_part",
]
