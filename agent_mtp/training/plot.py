"""The training curves as one PNG: loss and per-slot agreement (train), tokens/forward and NTP agreement (held-out)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``log.jsonl`` (none when the run logged nothing yet)."""
    rows: list[dict[str, Any]] = []
    if not Path(path).is_file():
        return rows
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_log(log_path: str | Path, png_path: str | Path) -> Path | None:
    """Write the curves of ``log.jsonl`` to ``png_path`` (None when the log has nothing to plot)."""
    from agent_mtp.plotting import plotting_available, pyplot

    if not plotting_available():
        return None  # training never fails for want of a plot
    plt = pyplot()
    rows = read_log(log_path)
    train = [r for r in rows if r.get("event") == "train"]
    evals = [r for r in rows if r.get("event") == "eval"]
    if not train and not evals:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    if train:
        steps = [r["step"] for r in train]
        axes[0].plot(steps, [r["loss"] for r in train])
        axes[0].set_title("distillation loss (train)")
        n = len(train[-1]["agree_per_slot"])
        for j in range(min(n, 7)):
            axes[1].plot(
                steps,
                [r["agree_per_slot"][j] if j < len(r["agree_per_slot"]) else None for r in train],
                label=f"mask {j + 1}",
            )
        axes[1].set_title("student argmax == teacher (train)")
        axes[1].legend(fontsize=7)
    if evals:
        steps = [r["step"] for r in evals]
        for key in ("tpf_verified", "tpf_confadapt_0.8", "tpf_confadapt_0.9"):
            axes[2].plot(steps, [r.get(key) for r in evals], marker="o", label=key.removeprefix("tpf_"))
        axes[2].set_title("tokens / forward (held-out)")
        axes[2].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(png_path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
