"""PNG plots of a bench report (matplotlib, Agg backend): the speed-quality frontier and per-suite bars."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent_mtp.bench.core import BenchReport, VariantSummary
from agent_mtp.plotting import pyplot

_CONFADAPT = re.compile(r"^confadapt-(\d+(?:\.\d+)?)$")


def _pyplot() -> Any:
    return pyplot()


def write_plots(report: BenchReport, out_dir: str | Path) -> list[Path]:
    """frontier.png and suites.png in ``out_dir``; returns the paths written."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return [frontier_plot(report, folder / "frontier.png"), suite_plot(report, folder / "suites.png")]


def frontier_plot(report: BenchReport, path: str | Path) -> Path:
    """Speed (x) against quality (y) for every variant; the ConfAdapt threshold sweep is joined by a line."""
    plt = _pyplot()
    panels = [
        ("tokens_per_forward", "tokens per forward pass", "token_agreement", "token agreement with NTP"),
        ("speedup_vs_hf", "speedup vs HF generate (tokens/s)", "task_agreement", "task-level agreement with NTP"),
        ("speedup_vs_hf", "speedup vs HF generate (tokens/s)", "nll", "base-model NLL per token (lower = better)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5))
    for ax, (xf, xlabel, yf, ylabel) in zip(axes, panels, strict=True):
        _frontier_panel(ax, report.summaries, xf, yf)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(_title(report, "speed-quality frontier"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _frontier_panel(ax: Any, summaries: Sequence[VariantSummary], xf: str, yf: str) -> None:
    sweep = sorted(
        ((float(m.group(1)), s) for s in summaries if (m := _CONFADAPT.match(s.variant))), key=lambda t: t[0]
    )
    points = [(t, getattr(s, xf), getattr(s, yf)) for t, s in sweep]
    points = [(t, x, y) for t, x, y in points if _finite(x, y)]
    if points:
        ax.plot([x for _, x, _ in points], [y for _, _, y in points], "o-", color="tab:blue", label="confadapt sweep")
        for tau, x, y in points:
            ax.annotate(f"τ={tau:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    swept = {s.variant for _, s in sweep}
    markers = iter("s^vD<>pP*hX")
    for s in summaries:
        x, y = getattr(s, xf), getattr(s, yf)
        if s.variant in swept or not _finite(x, y):
            continue
        ax.plot([x], [y], next(markers, "o"), label=s.variant, markersize=7, alpha=0.85)


def suite_plot(report: BenchReport, path: str | Path) -> Path:
    """Per-suite grouped bars of speedup vs HF generate and tokens per forward pass."""
    plt = _pyplot()
    suites = list(report.suite_summaries)
    variants = [s.variant for s in report.summaries]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(suites) + 4), 8), sharex=True)
    width = 0.8 / max(len(variants), 1)
    cmap = plt.get_cmap("tab20")
    for ax, field, label in (
        (axes[0], "speedup_vs_hf", "speedup vs HF generate"),
        (axes[1], "tokens_per_forward", "tokens per forward pass"),
    ):
        for j, variant in enumerate(variants):
            values = [getattr(report.summary(variant, suite), field, math.nan) for suite in suites]
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(suites))]
            ax.bar(xs, [v if math.isfinite(v) else 0.0 for v in values], width, label=variant, color=cmap(j % 20))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(suites)))
    axes[1].set_xticklabels(suites)
    axes[0].legend(fontsize=7, ncol=4, loc="upper left")
    fig.suptitle(_title(report, "per suite"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _title(report: BenchReport, what: str) -> str:
    st, m = report.settings, report.machine
    adapter = "MTP adapter" if st.get("adapter") else "no adapter"
    return (
        f"agent-mtp bench, {what}: {st.get('model', '?')} ({st.get('dtype', '?')}, {adapter}), "
        f"{st.get('prompts', '?')} prompts x {st.get('repeats', 1)}, {m.get('torch_threads')} threads, {m.get('cpu')}"
    )
