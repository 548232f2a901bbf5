"""``agent-mtp stats``: the fleet dashboard in a terminal (``register(app)`` adds it to the main CLI)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.live import Live

from agent_mtp.errors import TelemetryError
from agent_mtp.redis_url import scrub, url_secrets
from agent_mtp.telemetry.config import ENV_REDIS_URL, WINDOWS, load_env, parse_window, replica_namespace
from agent_mtp.telemetry.dashboard import plot_report, render
from agent_mtp.telemetry.queries import StatsReport, query_stats, redis_store, window_buckets
from agent_mtp.telemetry.store import STORE_ERRORS, RedisStore


def register(app: typer.Typer) -> None:
    """Add the ``stats`` command to ``app``."""
    app.command("stats")(stats)


def stats(
    window: Annotated[str, typer.Option("--window", "-w", help=f"Window: {', '.join(WINDOWS)} (or <n>s/m/h).")] = "5m",
    watch: Annotated[bool, typer.Option("--watch", help="Refresh live until Ctrl-C.")] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print JSON (one line per refresh with --watch).")
    ] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Also draw the window to this PNG file.")] = None,
    redis_url: Annotated[
        str | None,
        typer.Option("--redis-url", help=f"Redis to read (default: ${ENV_REDIS_URL}).", show_default=False),
    ] = None,
    namespace: Annotated[
        str | None, typer.Option("--namespace", help="Key namespace of the fleet (default: agent_mtp).")
    ] = None,
    by_model: Annotated[bool, typer.Option("--by-model", help="One row per model as well.")] = False,
    by_replica: Annotated[
        bool, typer.Option("--by-replica", help="The fleet, then each replica (Ray Serve replicas) on its own.")
    ] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes with --watch.")] = 2.0,
    refreshes: Annotated[int, typer.Option("--refreshes", hidden=True, help="Stop --watch after N refreshes.")] = 0,
) -> None:
    """Timeout ratio, retry/fallback/error/monitor-failure rates, tokens per forward, speedup and latency
    percentiles per step type and mode, merged over every worker writing to the same Redis namespace."""
    env = load_env()
    url = redis_url or env.get("redis_url")
    secrets = url_secrets(url)
    if not url:
        _fail(f"no Redis to read from: pass --redis-url or set {ENV_REDIS_URL}", code=2)
    try:
        window_s = parse_window(window)
        store = redis_store(url, namespace=namespace or env.get("namespace", "agent_mtp"))
    except TelemetryError as e:
        _fail(str(e), code=2)
    group_by = ("model", "step_type", "mode") if by_model else ("step_type", "mode")

    def read() -> StatsReport:
        try:
            return query_stats(store, window=window_s, namespace=store.config.namespace, group_by=group_by)
        except TelemetryError as e:  # Redis down or refused the credentials (the message is already redacted)
            _fail(scrub(str(e), secrets), code=1)

    if watch:
        _watch(read, json_output=json_output, plot=plot, interval=interval, refreshes=refreshes)
        return
    report = read()
    if by_replica:
        _emit_replicas(report, store, window_s=window_s, group_by=group_by, json_output=json_output, secrets=secrets)
        return
    _emit(report, json_output=json_output, plot=plot)


def fleet_replicas(store: RedisStore, window_s: int) -> list[str]:
    """Replica ids that wrote to the fleet's namespace in the window (writer ids ``replica@host:pid``)."""
    writers = store.read(window_buckets(window_s, time.time())).writers
    return sorted({name.split("@", 1)[0] for name in writers if "@" in name})


def _emit_replicas(
    fleet: StatsReport,
    store: RedisStore,
    *,
    window_s: int,
    group_by: tuple[str, ...],
    json_output: bool,
    secrets: tuple[str, ...],
) -> None:
    namespace = store.config.namespace
    try:
        names = fleet_replicas(store, window_s)
        reports = {
            name: query_stats(
                RedisStore(
                    store.client, config=store.config.with_overrides(namespace=replica_namespace(namespace, name))
                ),
                window=window_s,
                namespace=replica_namespace(namespace, name),
                group_by=group_by,
            )
            for name in names
        }
    except (TelemetryError, *STORE_ERRORS) as e:
        _fail(scrub(f"cannot read the replicas: {e}", secrets), code=1)
    if json_output:
        body = {"fleet": fleet.to_dict(), "replicas": {name: r.to_dict() for name, r in reports.items()}}
        typer.echo(json.dumps(body, indent=2))
        return
    console = Console()
    console.print(render(fleet))
    for name, report in reports.items():
        console.print(f"[bold]replica {name}[/bold]")
        console.print(render(report))


def _emit(report: StatsReport, *, json_output: bool, plot: Path | None) -> None:
    if plot is not None:
        plot_report(report, plot)
    if json_output:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        Console().print(render(report))
        if plot is not None:
            typer.echo(f"plot written to {plot}")


def _watch(
    read: Callable[[], StatsReport], *, json_output: bool, plot: Path | None, interval: float, refreshes: int
) -> None:
    count = 0
    try:
        if json_output:
            while refreshes <= 0 or count < refreshes:
                report = read()
                if plot is not None:
                    plot_report(report, plot)
                typer.echo(json.dumps(report.to_dict(), separators=(",", ":")))
                count += 1
                if refreshes <= 0 or count < refreshes:
                    time.sleep(interval)
            return
        report = read()
        with Live(render(report), auto_refresh=False) as live:
            while True:
                if plot is not None:
                    plot_report(report, plot)
                count += 1
                if 0 < refreshes <= count:
                    return
                time.sleep(interval)
                report = read()
                live.update(render(report), refresh=True)
    except KeyboardInterrupt:
        return


def _fail(message: str, *, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
