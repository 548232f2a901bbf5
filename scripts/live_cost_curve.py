"""``verified`` planning on the live cost curve against the stored one, beside ``ntp``, in one process.

    .venv/bin/python scripts/live_cost_curve.py                                  # the machine's stored curve
    .venv/bin/python scripts/live_cost_curve.py --curve old.json --rounds 3      # a curve stored some other time

Runs every prompt of ``--suites`` (those without tools) as ``ntp``, ``verified`` on the stored curve and ``verified``
on the live curve (the stored one corrected by this process's own pass times, `engine/cost.py` ``PassTimes``), the
three in random order prompt by prompt, ``--rounds`` times; prints each arm's decode seconds (prefill left out: it is
the same pass for all three) and its ratio to ``ntp``, overall and per suite, checks that every arm gave ``ntp``'s
tokens, and prints the stored and the live curve at the end. ``--curve``: a cost-curve JSON file (as
``agent-mtp measure-machine`` stores them) to use as the stored curve, e.g. one measured in another state of the
machine.
"""

from __future__ import annotations

import argparse
import collections
import random
from dataclasses import replace
from pathlib import Path

import torch

from agent_mtp.bench.core import load_suite
from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.cost import CostCurve

ARMS = ("ntp", "verified stored", "verified live")


def _curve_text(curve: CostCurve) -> str:
    def points(name: str, pts: tuple[tuple[int, float], ...] | None) -> str:
        return f"{name} " + ", ".join(f"{n}: {c:.2f}" for n, c in pts or ()) if pts else f"{name} -"

    return "; ".join((points("real", curve.real), points("draft masks", curve.draft)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", default="quick,chat,reasoning,formatting,summary")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--curve", type=Path, help="a stored cost curve (JSON) to plan on instead of this machine's")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = MTPEngine.from_pretrained("default", cost_curve_source="live")
    engine.prepare_runtime()
    if args.curve is not None:
        engine.set_cost_curve(CostCurve.from_json(args.curve.read_text()))
    stored = engine.cost_curve
    prompts = [p for name in args.suites.split(",") for p in load_suite(name) if not p.tools]
    spent: dict[tuple[str, str], float] = collections.defaultdict(float)
    for _ in range(args.rounds):
        for prompt in random.sample(prompts, len(prompts)):
            outputs = {}
            for arm in random.sample(ARMS, len(ARMS)):
                engine.cost_curve_source = "stored" if arm == "verified stored" else "live"
                mode = "ntp" if arm == "ntp" else "verified"
                cfg = DecodeConfig(mode=mode, max_new_tokens=prompt.max_new_tokens, prefix_cache=False)
                result = engine.generate(prompt.messages, replace(cfg, k_max=8) if mode == "verified" else cfg)
                decode_s = result.stats.wall_s - result.stats.prefill_s
                spent[(arm, prompt.suite)] += decode_s
                spent[(arm, "all")] += decode_s
                outputs[arm] = result.token_ids
            if len(set(map(tuple, outputs.values()))) != 1:
                raise SystemExit(f"{prompt.id}: the arms gave different tokens")
    suites = [*sorted({suite for _, suite in spent if suite != "all"}), "all"]
    print(f"{len(prompts)} prompts x {args.rounds} rounds, {args.threads} threads; decode seconds and x ntp")
    for suite in suites:
        base = spent[("ntp", suite)]
        cells = "  ".join(f"{arm} {spent[(arm, suite)]:6.2f} s ({base / spent[(arm, suite)]:.3f}x)" for arm in ARMS)
        print(f"  {suite:11} {cells}")
    print("stored curve:", _curve_text(stored))
    print("live curve:  ", _curve_text(engine.pass_times.calibrated(stored)))


if __name__ == "__main__":
    main()
