"""Dashboard settings: which Redis, which fleets (namespaces) under which labels, and who may look.

DashboardSettings(redis_url="redis://user:pw@host:6379/0")                      # one fleet, namespace agent_mtp
DashboardSettings(redis_url=url, sources=[DashboardSource(label="fast", namespace="ab-fast"),
                                          DashboardSource(label="safe", namespace="ab-safe")])   # an A/B view
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from agent_mtp.errors import ConfigError, TelemetryError
from agent_mtp.redis_url import validate_redis_url
from agent_mtp.telemetry.config import validate_namespace

_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


class DashboardSource(BaseModel):
    """One fleet shown on the page: a telemetry namespace under a label (the ``policy`` label in /metrics)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str
    """Shown in legends and tables, and the ``policy`` label of every Prometheus sample of this fleet."""
    namespace: str = "agent_mtp"
    """The workers' ``AGENT_MTP_TELEMETRY_NAMESPACE``."""

    @field_validator("label")
    @classmethod
    def _label(cls, value: str) -> str:
        if _LABEL.fullmatch(value) is None:
            msg = (
                f"dashboard label {value!r}: use 1-64 characters from A-Z a-z 0-9 _ . - starting with a letter or digit"
            )
            raise ValueError(msg)
        return value

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        try:
            return validate_namespace(value)
        except TelemetryError as e:
            raise ValueError(str(e)) from None


class DashboardSettings(BaseModel):
    """What one dashboard process reads and how it guards the page. Read-only: nothing is written to Redis."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: SecretStr
    """The fleet's Redis (never shown: the page and every error name it as ``redis://user:***@host:port/db``)."""
    sources: tuple[DashboardSource, ...] = (DashboardSource(label="agent_mtp"),)
    """One fleet, or two (or more) side by side on the same charts for an A/B view."""
    token: SecretStr | None = None
    """When set, every route needs ``Authorization: Bearer <token>`` (or the cookie the page sets after being
    opened once with ``?token=<token>``)."""
    refresh_s: float = Field(default=5.0, ge=1.0, le=3600.0)
    """How often the page reloads its data."""
    points: int = Field(default=60, ge=2, le=720)
    """Time-series points per chart across the window (one per 10 s bucket at most)."""
    socket_timeout_s: float = Field(default=2.0, gt=0, le=60)
    """Bounds each Redis read; a slow or dead Redis shows as an error on the page, not a hung request."""

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: SecretStr) -> SecretStr:
        validate_redis_url(value.get_secret_value(), setting="dashboard --redis")
        return value

    @field_validator("sources")
    @classmethod
    def _sources(cls, value: tuple[DashboardSource, ...]) -> tuple[DashboardSource, ...]:
        if not value:
            raise ValueError("give at least one source (a namespace to show)")
        labels = [source.label for source in value]
        if len(set(labels)) != len(labels):
            msg = f"dashboard labels must differ, got {labels}: name each fleet, e.g. fast=ns-a safe=ns-b"
            raise ValueError(msg)
        return value


def parse_source(text: str) -> DashboardSource:
    """``LABEL=NAMESPACE`` or ``NAMESPACE`` (labelled by itself), as given to ``agent-mtp dashboard``."""
    label, sep, namespace = text.partition("=")
    if not sep:
        label = namespace = text
    try:
        return DashboardSource(label=label.strip(), namespace=namespace.strip())
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"bad --namespace {text!r}: {_first_error(e)}; use LABEL=NAMESPACE or NAMESPACE") from None


def _first_error(error: ValueError) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):
        items = errors()
        if items:
            return str(items[0].get("msg", error))
    return str(error)
