"""The operator's web dashboard and Prometheus ``/metrics`` over the fleet's Redis aggregates (``[dashboard]`` extra).

    from agent_mtp.telemetry.web import DashboardSettings, create_dashboard_app
    app = create_dashboard_app(DashboardSettings(redis_url="redis://user:pw@host:6379/0"))
    server_app.mount("/dashboard", app)          # or run it alone: agent-mtp dashboard --redis URL

Importing this package is cheap; FastAPI and prometheus-client load with ``create_dashboard_app``.
See docs/telemetry.md ("The web dashboard").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_mtp.telemetry.web.settings import DashboardSettings, DashboardSource, parse_source

if TYPE_CHECKING:
    from agent_mtp.telemetry.web.app import create_dashboard_app

__all__ = ["DashboardSettings", "DashboardSource", "create_dashboard_app", "parse_source"]


def __getattr__(name: str) -> Any:
    if name == "create_dashboard_app":
        from agent_mtp.telemetry.web.app import create_dashboard_app

        return create_dashboard_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
