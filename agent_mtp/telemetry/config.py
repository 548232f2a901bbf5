"""Telemetry settings, the one place that reads the environment, and key-part validation (Redis URLs are parsed,
checked and redacted by :mod:`agent_mtp.redis_url`, shared with the breaker).

Environment (read only by :func:`load_env`):

    AGENT_MTP_REDIS_URL              redis://[user:password@]host:port/db, rediss://... (TLS) or unix:///path
    AGENT_MTP_TELEMETRY_NAMESPACE    key namespace shared by every worker of one fleet (default ``agent_mtp``)
    AGENT_MTP_TELEMETRY_REPLICA      this worker's replica id (a Ray Serve replica): its steps are also kept apart
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent_mtp.errors import TelemetryError
from agent_mtp.redis_url import redact_url, validate_redis_url

ENV_REDIS_URL = "AGENT_MTP_REDIS_URL"
ENV_NAMESPACE = "AGENT_MTP_TELEMETRY_NAMESPACE"
ENV_REPLICA = "AGENT_MTP_TELEMETRY_REPLICA"

BUCKET_S = 10
"""Width of one time bucket in seconds; fixed so that every writer and reader of a namespace agree on keys."""

WINDOWS: dict[str, int] = {"1m": 60, "5m": 300, "1h": 3600}
"""The named windows of the dashboard; :func:`parse_window` also accepts other ``<n>s|m|h`` values."""

_KEY_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}")
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
_WINDOW = re.compile(r"([1-9][0-9]*)([smh])")

INVALID_PART = "_invalid_"
"""Stands in for a key part from an event that failed validation (the event is still counted)."""
OVERFLOW_PART = "_overflow_"
"""Stands in for series beyond ``max_series_per_flush`` (the event is still counted)."""
NO_MODE = "-"
"""Mode part of the series that hold interventions (they belong to a run, not to a decode mode)."""


@dataclass(frozen=True)
class TelemetryConfig:
    """How a :class:`~agent_mtp.telemetry.Telemetry` recorder buffers, flushes and names its data."""

    redis_url: str | None = field(default=None, repr=False)
    """Redis to write to; ``None`` keeps telemetry in memory. Shown in reprs and logs without its password."""
    namespace: str = "agent_mtp"
    """Prefix shared by all workers of one fleet; readers must use the same one."""
    flush_interval_s: float = 2.0
    """Seconds between two background flushes."""
    retention_s: int = 7200
    """TTL of every bucket key in Redis (and how long the in-memory store keeps buckets)."""
    max_backlog_buckets: int = 5000
    """Most (time bucket x series) aggregates kept while Redis is down; older ones are dropped and counted."""
    max_series_per_flush: int = 512
    """Most distinct (bucket, model, step type, mode) series a flush; more go to ``_overflow_``."""
    socket_timeout_s: float = 1.0
    """Connect and read timeout of the Redis client built from ``redis_url`` (bounds one flush attempt)."""
    dedupe_ttl_s: int = 86400
    """How long Redis remembers a flush id: a retried batch is recognised as a duplicate within this time."""
    intervention_log_size: int = 1000
    """Most recent interventions kept in the Redis list shown by the dashboard."""
    replica: str | None = None
    """This worker's replica id: its events also go to the namespace :func:`replica_namespace` (the fleet's
    aggregates are unchanged; ``agent-mtp stats --by-replica`` reads both)."""

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        if self.replica is not None and _NAMESPACE.fullmatch(replica_namespace(self.namespace, self.replica)) is None:
            msg = (
                f"invalid telemetry replica id {self.replica!r} (${ENV_REPLICA}): use characters from "
                f"A-Z a-z 0-9 _ . - so that {replica_namespace(self.namespace, '<id>')!r} stays within 64"
            )
            raise TelemetryError(msg)
        if self.redis_url is not None:
            validate_redis_url(self.redis_url, setting="telemetry redis_url")
        _require_positive("flush_interval_s", self.flush_interval_s)
        _require_positive("socket_timeout_s", self.socket_timeout_s)
        if self.retention_s < max(WINDOWS.values()) + BUCKET_S:
            msg = f"retention_s={self.retention_s} is shorter than the 1h window; use at least 3610"
            raise TelemetryError(msg)
        for name in ("max_backlog_buckets", "max_series_per_flush", "dedupe_ttl_s", "intervention_log_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                msg = f"{name}={value!r} must be a positive integer"
                raise TelemetryError(msg)
        if self.dedupe_ttl_s < self.retention_s:
            msg = (
                f"dedupe_ttl_s={self.dedupe_ttl_s} must be >= retention_s={self.retention_s} "
                "so that retries stay idempotent"
            )
            raise TelemetryError(msg)

    def __repr__(self) -> str:
        url = redact_url(self.redis_url) if self.redis_url else None
        return (
            f"TelemetryConfig(redis_url={url!r}, namespace={self.namespace!r}, "
            f"flush_interval_s={self.flush_interval_s}, retention_s={self.retention_s}, "
            f"max_backlog_buckets={self.max_backlog_buckets})"
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> TelemetryConfig:
        """Settings from ``AGENT_MTP_REDIS_URL`` / ``AGENT_MTP_TELEMETRY_NAMESPACE``; keywords override."""
        values: dict[str, Any] = dict(load_env(environ))
        values.update(overrides)
        return cls(**values)

    def with_overrides(self, **overrides: Any) -> TelemetryConfig:
        return replace(self, **overrides)


def load_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The only function in agent_mtp.telemetry that reads the environment."""
    env = os.environ if environ is None else environ
    values: dict[str, str] = {}
    url = env.get(ENV_REDIS_URL, "").strip()
    if url:
        values["redis_url"] = url
    namespace = env.get(ENV_NAMESPACE, "").strip()
    if namespace:
        values["namespace"] = namespace
    replica = env.get(ENV_REPLICA, "").strip()
    if replica:
        values["replica"] = replica
    return values


def replica_namespace(namespace: str, replica: str) -> str:
    """Where one replica's own copy of its events lives: ``<namespace>.r.<replica>``."""
    return f"{namespace}.r.{replica}"


def _require_positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        msg = f"{name}={value!r} must be a positive number of seconds"
        raise TelemetryError(msg)


def is_valid_key_part(value: object) -> bool:
    return isinstance(value, str) and _KEY_PART.fullmatch(value) is not None


def validate_key_part(kind: str, value: object) -> str:
    """Return ``value`` if it may appear in a Redis key, else raise :class:`TelemetryError` naming it."""
    if not is_valid_key_part(value):
        msg = (
            f"invalid telemetry {kind} {value!r}: use 1-128 characters from A-Z a-z 0-9 _ . - / "
            "starting with a letter or digit"
        )
        raise TelemetryError(msg)
    assert isinstance(value, str)
    return value


def validate_namespace(value: object) -> str:
    if not isinstance(value, str) or _NAMESPACE.fullmatch(value) is None:
        msg = (
            f"invalid telemetry namespace {value!r}: use 1-64 characters from A-Z a-z 0-9 _ . - "
            "starting with a letter or digit"
        )
        raise TelemetryError(msg)
    return value


def parse_window(window: str | int) -> int:
    """Window length in seconds from ``"1m"``, ``"5m"``, ``"1h"``, ``"<n>s|m|h"`` or an int of seconds."""
    if isinstance(window, int) and not isinstance(window, bool):
        seconds = window
    else:
        match = _WINDOW.fullmatch(str(window).strip())
        if match is None:
            msg = f"invalid window {window!r}: use one of {', '.join(WINDOWS)} (or <n>s, <n>m, <n>h)"
            raise TelemetryError(msg)
        seconds = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]
    if seconds < BUCKET_S or seconds > 24 * 3600:
        msg = f"window of {seconds} s is out of range: use between {BUCKET_S} s and 24h"
        raise TelemetryError(msg)
    return seconds
