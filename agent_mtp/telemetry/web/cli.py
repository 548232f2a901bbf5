"""``agent-mtp dashboard``: the web dashboard and ``/metrics`` in this process (``register(app)`` adds it)."""

from __future__ import annotations

import ipaddress
from typing import Annotated, NoReturn

import typer
from pydantic import SecretStr

from agent_mtp.errors import ConfigError
from agent_mtp.redis_url import redact_url
from agent_mtp.telemetry.config import ENV_REDIS_URL, load_env

ENV_TOKEN = "AGENT_MTP_DASHBOARD_TOKEN"
INSTALL_HINT = "the dashboard needs its extra: pip install 'agent-mtp[dashboard]'"


def register(app: typer.Typer) -> None:
    """Add the ``dashboard`` command to ``app``."""
    app.command("dashboard")(dashboard)


def dashboard(
    redis_url: Annotated[
        str | None,
        typer.Option("--redis", "--redis-url", help=f"Redis to read (default: ${ENV_REDIS_URL}).", show_default=False),
    ] = None,
    namespaces: Annotated[
        list[str] | None,
        typer.Option(
            "--namespace",
            help="Fleet to show as NAMESPACE or LABEL=NAMESPACE; repeat for an A/B view (default: the workers' "
            "AGENT_MTP_TELEMETRY_NAMESPACE, else agent_mtp).",
            show_default=False,
        ),
    ] = None,
    host: Annotated[str, typer.Option("--host", help="Interface to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8050,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar=ENV_TOKEN,
            help="Require this bearer token (better: set the variable).",
            show_default=False,
        ),
    ] = None,
    refresh: Annotated[float, typer.Option("--refresh", help="Seconds between page refreshes.")] = 5.0,
) -> None:
    """A web page over the fleet's Redis aggregates (rates, latency, speed, breakers, replicas, interventions,
    A/B charts) and Prometheus /metrics. Read-only; binds 127.0.0.1 unless told otherwise."""
    env = load_env()
    url = redis_url or env.get("redis_url")
    if not url:
        _fail(f"no Redis to read from: pass --redis URL or set {ENV_REDIS_URL}")
    try:
        from agent_mtp.telemetry.web.settings import DashboardSettings, parse_source

        sources = tuple(parse_source(text) for text in (namespaces or [env.get("namespace", "agent_mtp")]))
        settings = DashboardSettings(
            redis_url=SecretStr(url),
            sources=sources,
            token=None if token is None else SecretStr(token),
            refresh_s=refresh,
        )
    except (ConfigError, ValueError) as e:
        _fail(_scrubbed(e, url))
    if not _is_loopback(host) and settings.token is None:
        typer.echo(f"warning: serving on {host} without a token; set {ENV_TOKEN} to require one", err=True)
    try:
        import uvicorn

        from agent_mtp.telemetry.web.app import create_dashboard_app
    except ModuleNotFoundError as e:
        _fail(f"{INSTALL_HINT} ({e.name} is missing)")
    app = create_dashboard_app(settings)
    shown = "localhost" if host in ("127.0.0.1", "::1") else host
    typer.echo(f"dashboard of {redact_url(url)} on http://{shown}:{port}/ (metrics at /metrics); Ctrl-C to stop")
    uvicorn.run(app, host=host, port=port, log_level="warning")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _scrubbed(error: Exception, url: str) -> str:
    from agent_mtp.redis_url import scrub, url_secrets

    return scrub(str(error), url_secrets(url))


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
