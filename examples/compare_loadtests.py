"""Plot `agent-mtp loadtest` runs side by side: aggregate tokens/s and P95 latency by concurrent clients.

    python examples/compare_loadtests.py "1 replica x 2 threads=runs/lt-1x2" "2 replicas x 1 thread=runs/lt-2x1" \
        --out docs/img/ray-replicas.png

Each argument is LABEL=DIRECTORY (a loadtest output directory with loadtest.json); prints a Markdown table too (one
row per policy and clients level; runs with several policies get one line per policy in the plot).
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
    """Markdown: one row per policy and clients level, tokens/s and P95 of each run, and the last run over the
    first (runs are matched by policy and clients; a level missing from a run shows as a dash)."""
    labels = list(runs)
    lines = ["| policy | clients | " + " | ".join(f"{label} tok/s (P95 s)" for label in labels) + " | ratio |"]
    lines.append("|---|---:|" + "---:|" * (len(labels) + 1))
    by_key = {label: {(c["policy"], c["clients"]): c for c in cells} for label, cells in runs.items()}
    for policy, clients in sorted({key for cells in by_key.values() for key in cells}):
        cells = [by_key[label].get((policy, clients)) for label in labels]
        values = " | ".join("-" if c is None else f"{c['tokens_per_s']:.1f} ({c['p95_latency_s']:.2f})" for c in cells)
        first, last = cells[0], cells[-1]
        ratio = "-" if first is None or last is None else f"{last['tokens_per_s'] / first['tokens_per_s']:.2f}x"
        lines.append(f"| {policy} | {clients} | {values} | {ratio} |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict[str, Any]]], out: Path) -> None:
    """Throughput and P95 latency by clients: one line per run and policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, latency) = plt.subplots(1, 2, figsize=(9, 3.6))
    policies = sorted({c["policy"] for cells in runs.values() for c in cells})
    for label, cells in runs.items():
        for policy in policies:
            mine = [c for c in cells if c["policy"] == policy]
            if not mine:
                continue
            name = label if len(policies) == 1 else f"{label}, {policy}"
            style = "-" if policy == policies[0] else "--"
            clients = [c["clients"] for c in mine]
            speed.plot(clients, [c["tokens_per_s"] for c in mine], style, marker="o", label=name)
            latency.plot(clients, [c["p95_latency_s"] for c in mine], style, marker="o", label=name)
    speed.set(xlabel="concurrent clients", ylabel="aggregate tokens/s", title="throughput")
    latency.set(xlabel="concurrent clients", ylabel="P95 latency (s)", title="latency")
    speed.legend(fontsize=7)
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
