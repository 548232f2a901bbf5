"""Rendering a :class:`StatsReport`: a rich table for terminals and a matplotlib PNG of the recent window."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from agent_mtp.telemetry.queries import MetricsRow, StatsReport, group_rows, timeline

_HEALTH_WARNINGS = (
    "dropped_buckets",
    "dropped_requests",
    "lost_requests",
    "unverified_batches",
    "script_errors",
    "overflow_series",
)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    return f"{value:.2f}s" if value < 10 else f"{value:.1f}s"


def _reliability_cells(row: MetricsRow) -> list[str]:
    return [
        str(row.requests),
        _pct(row.timeout_ratio),
        _pct(row.retry_rate),
        _pct(row.fallback_rate),
        _pct(row.error_rate),
        _pct(row.monitor_failure_rate),
    ]


def _speed_cells(row: MetricsRow) -> list[str]:
    return [
        str(row.requests),
        _num(row.tokens_per_forward),
        _pct(row.prefix_cache_hit_rate),
        "-" if row.speedup_vs_ntp is None else f"{row.speedup_vs_ntp:.2f}x",
        _ms(row.p50_s),
        _ms(row.p95_s),
        _ms(row.p99_s),
    ]


def _table(report: StatsReport, title: str, headers: list[str], cells: Callable[[MetricsRow], list[str]]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("step type", no_wrap=True)
    table.add_column("mode", no_wrap=True)
    for header in headers:
        table.add_column(header, justify="right", min_width=len(header))
    for row in report.rows:
        if row.requests:  # rows of interventions only are shown in their own table
            table.add_row(row.step_type, row.mode, *cells(row))
    table.add_section()
    table.add_row("all", "all", *cells(report.total), style="bold")
    return table


def stats_tables(report: StatsReport) -> list[Table]:
    """Reliability and speed, one row per (step type, mode) and the total."""
    reliability = _table(
        report,
        "reliability",
        ["steps", "timeout", "retry", "fallback", "error", "monitor fail"],
        _reliability_cells,
    )
    headers = ["steps", "tok/fwd", "cache hit", "speedup", "P50", "P95", "P99"]
    speed = _table(report, "speed", headers, _speed_cells)
    return [reliability, speed]


def heading(report: StatsReport) -> Text:
    start = dt.datetime.fromtimestamp(report.start).strftime("%H:%M:%S")
    end = dt.datetime.fromtimestamp(report.end).strftime("%H:%M:%S")
    return Text(
        f"agent-mtp · {report.namespace} · last {report.window_s} s ({start}-{end}) · {report.writers} writer(s)",
        style="bold",
    )


def health_text(report: StatsReport) -> Text:
    problems = {name: report.health.get(name, 0) for name in _HEALTH_WARNINGS if report.health.get(name, 0)}
    if not problems:
        return Text(
            "health: nothing dropped, lost or rejected (latency percentiles: bucket upper edges, <= 10% high)",
            style="green",
        )
    details = ", ".join(f"{name}={value}" for name, value in problems.items())
    return Text(f"health: {details}", style="bold red")


def interventions_table(report: StatsReport, limit: int = 5) -> Table | None:
    """Counts per step type, then the most recent reports with their notes."""
    counts = [
        (row.step_type, row.count("manual_interventions"), row.count("user_visible_failures"))
        for row in group_rows(report.series, ("step_type",))
    ]
    counts = [item for item in counts if item[1] or item[2]]
    if not counts:
        return None
    table = Table(title="interventions", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("step type", "manual", "user-visible failures", "latest (time, run, note)"):
        table.add_column(header, justify="right" if header in ("manual", "user-visible failures") else "left")
    for step_type, manual, failures in counts:
        table.add_row(step_type, str(manual), str(failures), "")
    for note in report.recent_interventions[:limit]:
        when = note.get("timestamp")
        clock = dt.datetime.fromtimestamp(when).strftime("%H:%M:%S") if isinstance(when, (int, float)) else "?"
        latest = f"{clock} {note.get('run_id') or '-'}: {str(note.get('note', ''))[:60]}"
        table.add_row(str(note.get("step_type", "")), "", "", f"{note.get('kind', '')} {latest}")
    return table


def render(report: StatsReport) -> RenderableType:
    """Everything ``agent-mtp stats`` prints (and ``--watch`` refreshes)."""
    parts: list[RenderableType] = [heading(report), *stats_tables(report), health_text(report)]
    interventions = interventions_table(report)
    if interventions is not None:
        parts.append(interventions)
    return Group(*parts)


def plot_report(report: StatsReport, path: Path | str, *, points: int = 60) -> Path:
    """PNG with speed (tokens/forward, speedup), failure ratios and latency percentiles over the window."""
    from agent_mtp.plotting import pyplot

    plt = pyplot()
    import matplotlib.dates as mdates

    series = timeline(report, points=points)
    times = [dt.datetime.fromtimestamp(start) for start, _ in series]
    rows = [row for _, row in series]

    fig, (speed, failures, latency) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    speed.plot(times, _nan([r.tokens_per_forward for r in rows]), marker=".", label="tokens / forward")
    speed.plot(times, _nan([r.speedup_vs_ntp for r in rows]), marker=".", label="speedup vs NTP")
    speed.set_ylabel("speed")
    speed.legend(loc="upper left")
    for label, getter in (
        ("timeout ratio", lambda r: r.timeout_ratio),
        ("retry rate", lambda r: r.retry_rate),
        ("fallback rate", lambda r: r.fallback_rate),
        ("error rate", lambda r: r.error_rate),
        ("monitor failure rate", lambda r: r.monitor_failure_rate),
    ):
        failures.plot(times, _nan([_as_pct(getter(r)) for r in rows]), marker=".", label=label)
    failures.set_ylabel("% of steps")
    failures.legend(loc="upper left")
    for q in (0.50, 0.95, 0.99):
        latency.plot(times, _nan([r.latency_percentile(q) for r in rows]), marker=".", label=f"P{int(q * 100)}")
    latency.set_ylabel("latency (s)")
    latency.legend(loc="upper left")
    latency.set_xlabel("time (bucket start)")
    latency.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    fig.suptitle(f"agent-mtp telemetry · {report.namespace} · last {report.window_s} s · {report.writers} writer(s)")
    fig.autofmt_xdate()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _as_pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _nan(values: list[float | None]) -> list[float]:
    return [float("nan") if value is None else value for value in values]
