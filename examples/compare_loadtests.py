"""Plot `agent-mtp loadtest` runs side by side: aggregate tokens/s and P95 latency by concurrent clients.

    python examples/compare_loadtests.py "1 replica x 2 threads=runs/lt-1x2" "2 replicas x 1 thread=runs/lt-2x1" \
        --out docs/img/ray-replicas.png

Each argument is LABEL=DIRECTORY (a loadtest output directory with loadtest.json); prints a Markdown table too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load_cells(directory: Path) -> list[dict[str, Any]]:
    """The cells of one run, sorted by clients."""
    report = json.loads((directory / "loadtest.json").read_text())
    return sorted(report["cells"], key=lambda cell: (cell["policy"], cell["clients"]))


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: one row per clients level, tokens/s and P95 of each run, and the last run over the first."""
    labels = list(runs)
    lines = ["| clients | " + " | ".join(f"{label} tok/s (P95 s)" for label in labels) + " | ratio |"]
    lines.append("|---:|" + "---:|" * (len(labels) + 1))
    first, last = runs[labels[0]], runs[labels[-1]]
    for base, top in zip(first, last, strict=True):
        cells = [next(c for c in runs[label] if c["clients"] == base["clients"]) for label in labels]
        values = " | ".join(f"{c['tokens_per_s']:.1f} ({c['p95_latency_s']:.2f})" for c in cells)
        lines.append(f"| {base['clients']} | {values} | {top['tokens_per_s'] / base['tokens_per_s']:.2f}x |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, latency) = plt.subplots(1, 2, figsize=(9, 3.6))
    for label, cells in runs.items():
        clients = [c["clients"] for c in cells]
        speed.plot(clients, [c["tokens_per_s"] for c in cells], marker="o", label=label)
        latency.plot(clients, [c["p95_latency_s"] for c in cells], marker="o", label=label)
    speed.set(xlabel="concurrent clients", ylabel="aggregate tokens/s", title="throughput")
    latency.set(xlabel="concurrent clients", ylabel="P95 latency (s)", title="latency")
    speed.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL=DIRECTORY of a loadtest run")
    parser.add_argument("--out", type=Path, default=Path("runs/compare-loadtests.png"))
    args = parser.parse_args()
    runs = {}
    for item in args.runs:
        label, _, directory = item.partition("=")
        runs[label] = load_cells(Path(directory))
    print(table(runs))
    plot(runs, args.out)
    print(f"plot written to {args.out}")


if __name__ == "__main__":
    main()
