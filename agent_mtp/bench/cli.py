"""`agent-mtp bench` (variants side by side: speed, quality, JSON, plots) and `agent-mtp ab` (two policies)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from agent_mtp.cli_common import (
    AdapterOpt,
    DtypeOpt,
    ModelOpt,
    RuntimeOpt,
    ThreadsOpt,
    console,
    load_engine,
    out,
    set_threads,
    threads_in_use,
)
from agent_mtp.engine.threads import compute
from agent_mtp.plotting import plotting_available

if TYPE_CHECKING:
    from agent_mtp.bench.ab import ABReport
    from agent_mtp.bench.core import BenchReport, VariantSummary


FALLBACK_K_MAX = 8
"""k_max of the engine variants when the model has no adapter (and --k-max is not given)."""
DEFAULT_LIMIT = 4
"""Prompts per suite of the default run (6 suites x 4 = 24 prompts, 13 variants: under 20 minutes on 2 cores)."""


def register(app: typer.Typer) -> None:
    app.command()(bench)
    app.command()(ab)
    app.command("bench-prefix")(bench_prefix)
    app.command("bench-curves")(bench_curves)


def bench(
    quick: Annotated[
        bool, typer.Option("--quick", help="The quick suite and seven variants, peers included (< 5 minutes).")
    ] = False,
    suite: Annotated[
        str | None,
        typer.Option(help="Suite, group (agent, full) or .jsonl path; comma-separate several. Default: full."),
    ] = None,
    variants: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated variants: hf-generate-fp32, hf-generate-bf16, hf-prompt-lookup, llama-cpp, ntp, "
            "static-<k>, confadapt-<tau>[-auto], verified[-mtp|-ngram][-auto]; an engine variant ending in @hf or "
            "@fast runs on that runtime (@fast-fp32: the fast runtime without block weights; @fast-avx2: its "
            "kernels in their AVX2 forms on an AVX-512 CPU; @fast-avx512: its AVX kernels instead of AMX tiles on "
            "an AMX CPU; @fast-amx: AMX tiles for every pass where short ones otherwise take VNNI; "
            "@fast-exact-masks: verified's mask rows computed exactly; @fast-int16: real rows on the 16-bit "
            "grid). Default: all of "
            "them with the threshold sweep (llama-cpp when installed)."
        ),
    ] = None,
    thresholds: Annotated[
        str, typer.Option(help="ConfAdapt threshold sweep of the default variants.")
    ] = "0.6,0.8,0.9,0.95",
    k_max: Annotated[
        int | None,
        typer.Option("--k-max", help="k_max of the engine variants (not -auto); default: the adapter's trained k."),
    ] = None,
    repeats: Annotated[int, typer.Option(help="Runs per prompt and variant.")] = 1,
    limit: Annotated[
        int | None,
        typer.Option(help=f"Prompts per suite, at most; 0 = all (default: {DEFAULT_LIMIT} for the full suite)."),
    ] = None,
    grammar: Annotated[bool, typer.Option(help="Constrain tool-call / schema prompts like AgentMTPChat does.")] = True,
    fresh_cost_curve: Annotated[
        bool,
        typer.Option(help="Measure the forward cost curve at the start (else: the one cached on disk)."),
    ] = True,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Folder for bench.json, frontier.png and suites.png.")
    ] = Path("runs/bench"),
    json_out: Annotated[Path | None, typer.Option("--json-out", help="Also write the full report here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summaries as JSON instead of tables.")] = False,
    model: ModelOpt = "default",
    adapter: AdapterOpt = None,
    dtype: DtypeOpt = "float32",
    runtime: RuntimeOpt = "auto",
    gguf: Annotated[
        Path | None, typer.Option(help="GGUF file of the model for the llama-cpp variant (default model: found).")
    ] = None,
    threads: ThreadsOpt = None,
) -> None:
    """HF generate (fp32, bf16, prompt lookup) and engine modes side by side on agent prompt suites.

    Speed (tokens/s, tokens/forward, TTFT, P50/P95, ratios to HF generate) and quality (tool-call validity and
    exact match, agreement with NTP, base-model NLL, repetition) are reported separately.
    """
    from rich.progress import Progress

    from agent_mtp.bench.core import DEFAULT_VARIANTS, QUICK_VARIANTS, run_bench, variants_from_names
    from agent_mtp.bench.llamacpp import unavailable_reason
    from agent_mtp.bench.suites import describe, load_suite

    set_threads(threads)
    names = _variant_names(variants, quick=quick, thresholds=thresholds, defaults=(QUICK_VARIANTS, DEFAULT_VARIANTS))
    peer_missing = unavailable_reason(model, gguf)
    if variants is None and peer_missing is not None:
        names = [n for n in names if n != "llama-cpp"]
        console.print(f"[dim]llama-cpp peer skipped: {peer_missing}[/dim]")
    variants_from_names(names)  # fail on a bad name before loading the model
    if limit is None and suite is None and not quick:
        limit = DEFAULT_LIMIT
    prompts = _limit(load_suite(suite or ("quick" if quick else "full")), limit)
    engine = load_engine(model, adapter, dtype, runtime)
    k = k_max or (engine.adapter.config.k_max_trained if engine.adapter is not None else FALLBACK_K_MAX)
    chosen = variants_from_names(names, k_max=k)
    console.print(
        f"[bold]{engine.model_id}[/bold] ({dtype}, {'MTP adapter' if engine.adapter else 'no adapter'}, "
        f"{engine.runtime} runtime), "
        f"{threads_in_use()} threads; prompts {describe(prompts)}; {len(chosen)} variants x {repeats}, k_max {k}"
    )
    with Progress(console=console, transient=True) as progress:
        timed = progress.add_task("generating", total=len(prompts) * len(chosen) * repeats)
        scored = progress.add_task("scoring", total=len(prompts) * len(chosen) * repeats)
        report = run_bench(
            engine,
            prompts,
            chosen,
            repeats=repeats,
            grammar=grammar,
            fresh_cost_curve=fresh_cost_curve,
            gguf=gguf,
            on_run=lambda _: progress.advance(timed),
            on_score=lambda done, _total: progress.update(scored, completed=done),
        )
    report.settings["k_max"] = k
    written = _write_outputs(report, out_dir, json_out)
    if as_json:
        data = report.to_dict()
        out.print_json(json.dumps({k: data[k] for k in ("machine", "settings", "summaries", "suite_summaries")}))
    else:
        title = f"{len(prompts)} prompts x {repeats}, {threads_in_use()} threads"
        out.print(speed_table(report.summaries, f"speed ({title})"))
        out.print(quality_table(report.summaries, "quality (vs NTP = the base model's own greedy output)"))
        out.print(suite_table(report))
    for path in written:
        console.print(f"wrote {path}")


def _variant_names(
    variants: str | None, *, quick: bool, thresholds: str, defaults: tuple[Sequence[str], Sequence[str]]
) -> list[str]:
    if variants:
        return [v.strip() for v in variants.split(",") if v.strip()]
    if quick:
        return list(defaults[0])
    taus = [float(t) for t in thresholds.split(",") if t.strip()]
    base = [v for v in defaults[1] if not v.startswith("confadapt-")]
    at = base.index("verified") if "verified" in base else len(base)
    return [*base[:at], *(f"confadapt-{t:g}" for t in taus), *base[at:]]


def _limit(prompts: list[Any], limit: int | None) -> list[Any]:
    if not limit:
        return prompts
    seen: dict[str, int] = {}
    kept = []
    for p in prompts:
        seen[p.suite] = seen.get(p.suite, 0) + 1
        if seen[p.suite] <= limit:
            kept.append(p)
    return kept


def _write_outputs(report: BenchReport, out_dir: Path | None, json_out: Path | None) -> list[Path]:
    from agent_mtp.bench.markdown import report_markdown
    from agent_mtp.bench.plots import write_plots

    written: list[Path] = []
    text = json.dumps(report.to_dict(), indent=1)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench.json").write_text(text)
        (out_dir / "bench.md").write_text(report_markdown(report))
        written += [out_dir / "bench.json", out_dir / "bench.md", *write_plots(report, out_dir)]
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text)
        written.append(json_out)
    return written


def bench_prefix(
    transcripts: Annotated[str, typer.Option(help="Transcript set ('agent') or a .jsonl path.")] = "agent",
    mode: Annotated[str, typer.Option(help="Decode mode of every step.")] = "verified",
    k_max: Annotated[int, typer.Option("--k-max")] = 4,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Folder for prefix.json and prefix.md.")] = Path(
        "runs/bench-prefix"
    ),
    model: ModelOpt = "default",
    adapter: AdapterOpt = None,
    dtype: DtypeOpt = "float32",
    runtime: RuntimeOpt = "auto",
    threads: ThreadsOpt = None,
) -> None:
    """Multi-step agent transcripts (tool results fed back) with and without the prefix cache, side by side: TTFT
    and latency per step, and whether the outputs are equal."""
    from agent_mtp.bench.transcript import load_transcripts, run_transcripts
    from agent_mtp.engine import DecodeConfig

    set_threads(threads)
    chosen = load_transcripts(transcripts)
    config = DecodeConfig(mode=mode, k_max=k_max)  # type: ignore[arg-type]
    engine = load_engine(model, adapter, dtype, runtime)
    console.print(
        f"[bold]{engine.model_id}[/bold] ({engine.runtime} runtime), {threads_in_use()} threads; "
        f"{len(chosen)} transcripts, {sum(len(t.turns) + 1 for t in chosen)} steps, mode {mode}"
    )
    _ = engine.cost_curve  # measured (or loaded) before timing
    with console.status("Warming up ..."):
        engine.generate("Warm up.", DecodeConfig(mode=mode, k_max=k_max, max_new_tokens=8))  # type: ignore[arg-type]
    table = _table("steps: with / without the prefix cache", ["transcript", "step", "prompt", "cached",
                   "TTFT ms", "TTFT ms (no cache)", "latency s", "latency s (no cache)", "same output"])  # fmt: skip
    report = run_transcripts(engine, chosen, config, on_step=lambda r: table.add_row(*_step_cells(r)))
    out.print(table)
    summary = _table("summary (ratios: with cache / without)", ["steps", "n", "prompt tokens", "cached share",
                     "TTFT ms", "TTFT ms (no cache)", "TTFT ratio", "latency ratio", "all equal"])  # fmt: skip
    for name, group in report.summary().items():
        summary.add_row(name, *_summary_cells(group))
    out.print(summary)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "prefix.json").write_text(json.dumps(report.to_dict(), indent=1))
        console.print(f"wrote {out_dir / 'prefix.json'}")


def bench_curves(
    context: Annotated[int, typer.Option(help="Tokens already in the cache before each timed pass.")] = 300,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds; the fastest sample of each size is kept.")] = 5,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Folder for curves.json and curves.png.")] = Path(
        "runs/bench-curves"
    ),
    model: ModelOpt = "default",
    adapter: AdapterOpt = None,
    gguf: Annotated[Path | None, typer.Option(help="GGUF for the llama.cpp curve (default model: found).")] = None,
    threads: ThreadsOpt = None,
) -> None:
    """Cost of a forward pass of 1-16 tokens on the HF forward, the fast runtime and llama.cpp, side by side."""
    from agent_mtp.bench.curves import measure_curves, plot_curves
    from agent_mtp.bench.llamacpp import LlamaCppPeer, gguf_for, unavailable_reason

    set_threads(threads)
    engine = load_engine(model, adapter, "float32")
    missing = unavailable_reason(model, gguf)
    peer = compute().run(LlamaCppPeer, gguf_for(model, gguf)) if missing is None else None
    if missing is not None:
        console.print(f"[dim]llama.cpp curve skipped: {missing}[/dim]")
    with console.status("Timing passes ..."):
        report = compute().run(
            measure_curves, engine, context=context, rounds=rounds, llama_cpp=peer
        )  # one OpenMP pool
    table = _table(f"ms per pass ({context}-token context, {report.threads} threads; x = relative to 1 token)",
                   ["runtime", *(f"{n} tok" for n in sorted(next(iter(report.ms.values()))))])  # fmt: skip
    for name, curve in report.ms.items():
        rel = report.relative(name)
        table.add_row(name, *(f"{curve[n]:.1f} ({rel[n]:.2f}x)" for n in sorted(curve)))
    out.print(table)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "curves.json").write_text(json.dumps(report.to_dict(), indent=1))
        written = [out_dir / "curves.json"]
        if plotting_available():
            written.append(plot_curves(report, out_dir / "curves.png"))
        console.print("wrote " + ", ".join(str(p) for p in written))


def _step_cells(r: Any) -> list[str]:
    return [r.transcript, str(r.step), str(r.prompt_tokens), str(r.cached_prompt_tokens),
            f"{1000 * r.ttft_cached_s:.0f}", f"{1000 * r.ttft_plain_s:.0f}", f"{r.wall_cached_s:.2f}",
            f"{r.wall_plain_s:.2f}", "yes" if r.equal else "NO"]  # fmt: skip


def _summary_cells(s: dict[str, float]) -> list[str]:
    return [str(int(s["steps"])), f"{s['prompt_tokens']:.0f}", _pct(s["cached_share"]), f"{s['ttft_cached_ms']:.0f}",
            f"{s['ttft_plain_ms']:.0f}", f"{s['ttft_ratio']:.2f}", f"{s['latency_ratio']:.2f}",
            "yes" if s["equal"] == 1.0 else "NO"]  # fmt: skip


# -- tables ------------------------------------------------------------------------------------------------------
def _f(value: float, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{fmt}}{suffix}"


def _pct(value: float) -> str:
    return _f(value * 100 if value == value else value, ".0f", "%")


def _table(title: str, columns: Sequence[str]) -> Table:
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    return table


def speed_table(summaries: Sequence[VariantSummary], title: str) -> Table:
    table = _table(
        title,
        ("variant", "tokens", "tokens/s", "x HF", "decode tok/s", "x HF", "tokens/fwd", "TTFT ms", "x HF", "P50 s",
         "x HF", "P95 s", "x HF"),
    )  # fmt: skip
    for s in summaries:
        table.add_row(
            s.variant,
            str(s.tokens),
            _f(s.tokens_per_s, ".1f"),
            _f(s.speedup_vs_hf),
            _f(s.decode_tokens_per_s, ".1f"),
            _f(s.decode_speedup_vs_hf),
            _f(s.tokens_per_forward),
            _f(s.ttft_s * 1000, ".0f"),
            _f(s.ttft_vs_hf),
            _f(s.p50_latency_s),
            _f(s.p50_vs_hf),
            _f(s.p95_latency_s),
            _f(s.p95_vs_hf),
        )
    return table


def quality_table(summaries: Sequence[VariantSummary], title: str) -> Table:
    table = _table(
        title,
        (
            "variant",
            "= NTP",
            "token agree",
            "task agree",
            "tool valid",
            "tool = NTP",
            "tool = ref",
            "valid",
            "task ok",
            "NLL",
            "rep-4",
        ),
    )
    for s in summaries:
        table.add_row(
            s.variant,
            _pct(s.ntp_match),
            _pct(s.token_agreement),
            _pct(s.task_agreement),
            _pct(s.tool_call_valid),
            _pct(s.tool_call_exact_vs_ntp),
            _pct(s.tool_call_exact_vs_ref),
            _pct(s.valid_rate),
            _pct(s.success_rate),
            _f(s.nll),
            _pct(s.repetition),
        )
    return table


def suite_table(report: BenchReport) -> Table:
    suites = list(report.suite_summaries)
    table = _table("per suite: tokens/forward | speedup vs HF generate | task agreement", ("variant", *suites))
    for s in report.summaries:
        cells = []
        for suite in suites:
            row = report.summary(s.variant, suite)
            cells.append(
                "-"
                if row is None
                else f"{_f(row.tokens_per_forward)} | {_f(row.speedup_vs_hf)}x | {_pct(row.task_agreement)}"
            )
        table.add_row(s.variant, *cells)
    return table


# -- A/B ----------------------------------------------------------------------------------------------------------
def ab(
    a: Annotated[str, typer.Option("--a", help="Policy A: a YAML path or a shipped name.")] = "policies/exact.yaml",
    b: Annotated[str, typer.Option("--b", help="Policy B: a YAML path or a shipped name.")] = "policies/default.yaml",
    suite: Annotated[str, typer.Option(help="Suite, group (agent, full) or .jsonl path.")] = "agent",
    limit: Annotated[int | None, typer.Option(help="At most this many prompts per suite.")] = None,
    grammar: Annotated[bool, typer.Option(help="Constrain tool-call / schema prompts like AgentMTPChat.")] = True,
    redis_url: Annotated[
        str | None, typer.Option("--redis-url", help="Write the runs here (default: AGENT_MTP_REDIS_URL, if set).")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json-out", help="Write the full A/B report here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the sides as JSON instead of tables.")] = False,
    model: ModelOpt = "default",
    adapter: AdapterOpt = None,
    dtype: DtypeOpt = "float32",
    threads: ThreadsOpt = None,
) -> None:
    """The same prompts under two policies: quality, speed and the user-facing metrics (P95, timeout ratio, retry
    rate), side by side; the runs go to Redis when telemetry is configured, so the dashboard shows them."""
    from rich.progress import Progress

    from agent_mtp.bench.ab import run_ab
    from agent_mtp.bench.suites import load_suite
    from agent_mtp.telemetry import Telemetry

    set_threads(threads)
    prompts = _limit(load_suite(suite), limit)
    engine = load_engine(model, adapter, dtype)
    telemetry = Telemetry(redis_url) if redis_url else Telemetry()
    with Progress(console=console, transient=True) as progress:
        steps = progress.add_task("A/B steps", total=2 * len(prompts))
        scored = progress.add_task("scoring", total=2 * len(prompts))
        report = run_ab(
            engine,
            prompts,
            a,
            b,
            recorder=telemetry,
            grammar=grammar,
            on_step=lambda _: progress.advance(steps),
            on_score=lambda done, _total: progress.update(scored, completed=done),
        )
    flushed = telemetry.close(timeout_s=10.0)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report.to_dict(), indent=1))
    if as_json:
        out.print_json(json.dumps({k: v for k, v in report.to_dict().items() if k != "steps"}))
    else:
        out.print(ab_table(report))
    stats = telemetry.stats()
    if stats.backend == "redis":
        state = "flushed" if flushed else f"NOT fully flushed ({stats.last_error})"
        console.print(f"telemetry: {stats.recorded_events} step events {state} to {stats.target}; `agent-mtp stats`")
    else:
        console.print("telemetry: in memory only (set AGENT_MTP_REDIS_URL or --redis-url to see the runs in Redis)")
    if json_out is not None:
        console.print(f"wrote {json_out}")


def ab_table(report: ABReport) -> Table:
    a, b = report.sides["a"], report.sides["b"]
    table = _table(
        f"A/B on {report.settings['prompts']} prompts",
        ("", "metric", f"A: {a.policy}", f"B: {b.policy}", "B / A"),
    )
    rows: list[tuple[str, str, float, float, str]] = [
        ("quality", "task agreement with NTP", a.summary.task_agreement, b.summary.task_agreement, "pct"),
        ("quality", "token agreement with NTP", a.summary.token_agreement, b.summary.token_agreement, "pct"),
        ("quality", "output = NTP", a.summary.ntp_match, b.summary.ntp_match, "pct"),
        ("quality", "tool calls valid", a.summary.tool_call_valid, b.summary.tool_call_valid, "pct"),
        ("quality", "task ok (vs reference)", a.summary.success_rate, b.summary.success_rate, "pct"),
        ("quality", "base-model NLL / token", a.summary.nll, b.summary.nll, "num"),
        ("quality", "repetition (rep-4)", a.summary.repetition, b.summary.repetition, "pct"),
        ("speed", "tokens/s", a.summary.tokens_per_s, b.summary.tokens_per_s, "num"),
        ("speed", "decode tokens/s", a.summary.decode_tokens_per_s, b.summary.decode_tokens_per_s, "num"),
        ("speed", "tokens/forward", a.summary.tokens_per_forward, b.summary.tokens_per_forward, "num"),
        ("speed", "TTFT median s", a.summary.ttft_s, b.summary.ttft_s, "sec"),
        ("user-facing", "P50 latency s", a.summary.p50_latency_s, b.summary.p50_latency_s, "sec"),
        ("user-facing", "P95 latency s", a.summary.p95_latency_s, b.summary.p95_latency_s, "sec"),
        ("user-facing", "timeout ratio", a.timeout_ratio, b.timeout_ratio, "pct"),
        ("user-facing", "retry rate", a.retry_rate, b.retry_rate, "pct"),
        ("user-facing", "fallback rate", a.fallback_rate, b.fallback_rate, "pct"),
        ("user-facing", "error rate", a.error_rate, b.error_rate, "pct"),
        ("user-facing", "monitor failure rate", a.monitor_failure_rate, b.monitor_failure_rate, "pct"),
    ]
    section = ""
    for group, name, va, vb, kind in rows:
        if group != section:
            if section:
                table.add_section()
            section = group
            label = group
        else:
            label = ""
        fmt = _pct if kind == "pct" else (lambda v: _f(v, ".3f")) if kind == "sec" else _f
        ratio = vb / va if va and not math.isnan(va) and not math.isnan(vb) else math.nan
        table.add_row(label, name, fmt(va), fmt(vb), _f(ratio))
    table.add_section()
    table.add_row("policy", "modes used", _modes(a.modes), _modes(b.modes), "")
    return table


def _modes(modes: dict[str, int]) -> str:
    return ", ".join(f"{m} {n}" for m, n in sorted(modes.items()))
