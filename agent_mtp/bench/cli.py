"""`agent-mtp bench`: variants side by side, table + JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from agent_mtp.cli_common import (
    AdapterOpt,
    DtypeOpt,
    ModelOpt,
    ThreadsOpt,
    console,
    load_engine,
    out,
    set_threads,
    threads_in_use,
)


def register(app: typer.Typer) -> None:
    app.command()(bench)


def bench(
    suite: Annotated[str, typer.Option(help="Shipped suite name or a .jsonl path.")] = "quick",
    thresholds: Annotated[str, typer.Option(help="Comma-separated ConfAdapt thresholds.")] = "0.9",
    k_max: Annotated[int, typer.Option("--k-max")] = 8,
    repeats: int = 1,
    json_out: Annotated[Path | None, typer.Option("--json-out", help="Write the full report as JSON.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON instead of a table.")] = False,
    model: ModelOpt = "default",
    adapter: AdapterOpt = None,
    dtype: DtypeOpt = "float32",
    threads: ThreadsOpt = None,
) -> None:
    """HF generate, engine ntp, confadapt and verified side by side: tokens/s, tokens/forward, ratios to HF."""
    from rich.progress import Progress

    from agent_mtp.bench.core import default_variants, load_suite, run_bench

    set_threads(threads)
    engine = load_engine(model, adapter, dtype)
    prompts = load_suite(suite)
    taus = [float(t) for t in thresholds.split(",") if t.strip()]
    variants = default_variants(thresholds=taus, k_max=k_max)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(prompts) * len(variants) * repeats)
        report = run_bench(engine, prompts, variants, repeats=repeats, on_run=lambda _: progress.advance(task))
    if json_out:
        json_out.write_text(json.dumps(report.to_dict(), indent=2))
    if as_json:
        out.print_json(json.dumps({"machine": report.machine, "summaries": report.to_dict()["summaries"]}))
        return
    table = Table(
        title=f"agent-mtp bench: suite={suite}, {len(prompts)} prompts x {repeats}, {threads_in_use()} threads"
    )
    for col in (
        "variant",
        "tokens",
        "tokens/s",
        "tokens/forward",
        "x HF generate",
        "TTFT s",
        "P50 s",
        "P95 s",
        "= NTP",
    ):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for s in report.summaries:
        table.add_row(
            s.variant,
            str(s.tokens),
            f"{s.tokens_per_s:.1f}",
            f"{s.tokens_per_forward:.2f}",
            f"{s.speedup_vs_hf:.2f}",
            f"{s.ttft_s:.3f}",
            f"{s.p50_latency_s:.2f}",
            f"{s.p95_latency_s:.2f}",
            f"{s.ntp_match:.0%}",
        )
    out.print(table)
