"""A bench report as Markdown tables (``bench.md`` beside ``bench.json``; docs/benchmarks.md is built from it)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from agent_mtp.bench.core import BenchReport, VariantSummary


def _num(value: float, fmt: str = ".2f") -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, fmt)


def _pct(value: float) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{100 * value:.0f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["--:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def speed_markdown(summaries: Sequence[VariantSummary]) -> str:
    header = ("variant", "tokens", "tokens/s", "speedup vs HF", "decode tokens/s", "decode vs HF", "tokens/forward",
              "TTFT ms", "TTFT vs HF", "P50 s", "P50 vs HF", "P95 s", "P95 vs HF")  # fmt: skip
    rows = [
        (
            f"`{s.variant}`",
            str(s.tokens),
            _num(s.tokens_per_s, ".1f"),
            _num(s.speedup_vs_hf),
            _num(s.decode_tokens_per_s, ".1f"),
            _num(s.decode_speedup_vs_hf),
            _num(s.tokens_per_forward),
            _num(s.ttft_s * 1000, ".0f"),
            _num(s.ttft_vs_hf),
            _num(s.p50_latency_s),
            _num(s.p50_vs_hf),
            _num(s.p95_latency_s),
            _num(s.p95_vs_hf),
        )
        for s in summaries
    ]
    return _table(header, rows)


def quality_markdown(summaries: Sequence[VariantSummary]) -> str:
    header = ("variant", "= NTP", "token agreement", "task agreement", "tool calls valid", "tool call = NTP",
              "tool call = reference", "well-formed", "task ok", "NLL/token", "rep-4")  # fmt: skip
    rows = [
        (
            f"`{s.variant}`",
            _pct(s.ntp_match),
            _pct(s.token_agreement),
            _pct(s.task_agreement),
            _pct(s.tool_call_valid),
            _pct(s.tool_call_exact_vs_ntp),
            _pct(s.tool_call_exact_vs_ref),
            _pct(s.valid_rate),
            _pct(s.success_rate),
            _num(s.nll, ".3f"),
            _pct(s.repetition),
        )
        for s in summaries
    ]
    return _table(header, rows)


def _per_suite(report: BenchReport, cell: Callable[[str, str | None], str]) -> str:
    """A table of ``cell(variant, suite)`` for every variant and suite, and the variant over all suites (None)."""
    suites = list(report.suite_summaries)
    rows = [
        (f"`{s.variant}`", *(cell(s.variant, suite) for suite in suites), cell(s.variant, None))
        for s in report.summaries
    ]
    return _table(("variant", *suites, "all"), rows)


def suite_markdown(report: BenchReport, field: str, fmt: Callable[[float], str]) -> str:
    def cell(variant: str, suite: str | None) -> str:
        row = report.summary(variant, suite)
        return "-" if row is None else fmt(getattr(row, field))

    return _per_suite(report, cell)


def suite_ratio_markdown(report: BenchReport, field: str, baseline: str = "ntp") -> str | None:
    """Each variant's ``field`` per suite over the ``baseline`` variant's (the engine's own NTP: what the MTP modes
    gain, per kind of step); None when the report has no such variant."""
    if report.summary(baseline) is None:
        return None

    def ratio(variant: str, suite: str | None) -> str:
        row, base = report.summary(variant, suite), report.summary(baseline, suite)
        if row is None or base is None or not getattr(base, field):
            return "-"
        return _num(getattr(row, field) / getattr(base, field))

    return _per_suite(report, ratio)


def _curves(settings: dict[str, Any]) -> str:
    curves = settings.get("cost_curves")
    if curves is None:  # reports written before runtimes existed
        return _curve(settings.get("cost_curve"))
    return "; ".join(f"{runtime}: {_curve(points)}" for runtime, points in sorted(curves.items())) or "-"


def _curve(points: list[list[float]] | None) -> str:
    return "-" if not points else ", ".join(f"{int(n)}: {c:.2f}" for n, c in points)


def _optional(title: str, table: str | None) -> list[str]:
    return [] if table is None else [title, "", table, ""]


def report_markdown(report: BenchReport) -> str:
    st, m = report.settings, report.machine
    adapter = st.get("adapter")
    adapter_text = (
        "none (untrained mask token)"
        if not adapter
        else f"gated LoRA rank {adapter.get('rank')}, trained for k <= {adapter.get('k_max_trained')}"
    )
    parts = [
        "## Settings",
        "",
        f"- model: {st.get('model')} ({st.get('dtype')}), MTP adapter: {adapter_text}; k_max of the engine variants "
        f"{st.get('k_max', '-')}",
        f"- prompts: {st.get('prompts')} x {st.get('repeats')} repeat(s); grammar for tool calls / schemas: "
        f"{'on' if st.get('grammar') else 'off'}",
        f"- machine: {m.get('cpu')}, {m.get('cpu_count')} cores, torch threads {m.get('torch_threads')}, "
        f"load average {_num(m.get('load_avg_1m') or math.nan)} at the start, "
        f"{_num(m.get('load_avg_1m_end') or math.nan)} at the end; torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}",
        f"- runtime of the engine variants without @: {st.get('runtime', 'hf')}; forward cost curves the planner used "
        f"(tokens fed: cost relative to 1 token): {_curves(st)}",
        "",
        "## Speed",
        "",
        speed_markdown(report.summaries),
        "",
        "## Quality",
        "",
        quality_markdown(report.summaries),
        "",
        "## Per suite: tokens per forward pass",
        "",
        suite_markdown(report, "tokens_per_forward", _num),
        "",
        "## Per suite: speedup vs HF generate (tokens/s)",
        "",
        suite_markdown(report, "speedup_vs_hf", _num),
        "",
        "## Per suite: decode speedup vs HF generate (tokens/s after the first token)",
        "",
        suite_markdown(report, "decode_speedup_vs_hf", _num),
        "",
        *_optional(
            "## Per suite: tokens/s over the engine's NTP (the prompt's prefill included)",
            suite_ratio_markdown(report, "tokens_per_s"),
        ),
        *_optional(
            "## Per suite: decode tokens/s over the engine's NTP (after the first token)",
            suite_ratio_markdown(report, "decode_tokens_per_s"),
        ),
        "## Per suite: share of the time before the first token (the prompt's prefill; no decoding speedup "
        "touches it: a free decode loop would run at most 1 / share times as fast)",
        "",
        suite_markdown(report, "prefill_share", _pct),
        "",
        "## Per suite: task-level agreement with NTP",
        "",
        suite_markdown(report, "task_agreement", _pct),
        "",
    ]
    return "\n".join(parts)
