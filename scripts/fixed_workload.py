"""A fixed workload per arm, arms alternated in one process: the steadier way to compare batched variants.

    .venv/bin/python scripts/fixed_workload.py --clients 8 --rounds 6 --arms ntp,verified
    .venv/bin/python scripts/fixed_workload.py --clients 8 --rounds 6 --arms ntp:1,ntp:4,ntp:8   # greedy-run lengths

Each arm is ``variant[:greedy run]`` (the load test's variants; the run length sets `decode.GREEDY_RUN` for that
arm). A round drains every prompt of the agent suite ``--repeat`` times with ``--clients`` threads through one
batched `Service`, as `scripts/batched_in_process.py` does, once per arm, in alternating order from round to round;
it prints each round's aggregate tokens/s and, per arm, the mean and the median of its per-round ratios over the
first arm. Phases of a fixed length instead (the load test's cells) swing by +-15% with the prompt mix they happen
to hold on a 2-core VM; a fixed workload paired round by round does not.
"""

from __future__ import annotations

import argparse
import queue
import statistics
from dataclasses import dataclass

from batched_in_process import InProcess, run_clients  # this folder (run as a script)

import agent_mtp.engine.decode as decode


@dataclass(frozen=True)
class Arm:
    variant: str
    greedy_run: int

    @classmethod
    def parse(cls, text: str) -> Arm:
        variant, _, run = text.partition(":")
        if variant not in {"ntp", "verified", "confadapt"}:
            raise SystemExit(f"arm {text!r}: the variant must be ntp, verified or confadapt")
        if run and (not run.isdigit() or int(run) < 1):
            raise SystemExit(f"arm {text!r}: the greedy run length must be a whole number >= 1, e.g. ntp:4")
        return cls(variant, int(run) if run else decode.GREEDY_RUN)

    def __str__(self) -> str:
        return f"{self.variant}:{self.greedy_run}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=1, help="times each prompt is sent in a round")
    parser.add_argument("--arms", default="ntp,verified", help="comma-separated variant[:greedy run]")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args()
    arms = [Arm.parse(a) for a in args.arms.split(",")]
    app = InProcess(threads=args.threads)

    def drain(arm: Arm) -> float:
        decode.GREEDY_RUN = arm.greedy_run
        work: queue.Queue[int] = queue.Queue()
        for i in range(len(app.prompts) * args.repeat):
            work.put(i)
        counts = [0] * args.clients

        def client(c: int) -> None:
            while True:
                try:
                    i = work.get_nowait()
                except queue.Empty:
                    return
                counts[c] += app.send(i, arm.variant)

        elapsed = run_clients(args.clients, client)  # before the sum: the clients fill the counts
        return sum(counts) / elapsed

    for variant in dict.fromkeys(arm.variant for arm in arms):  # warm-up: every prompt once, one at a time
        for i in range(len(app.prompts)):
            app.send(i, variant)
    rates: dict[Arm, list[float]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            rates[arm].append(drain(arm))
        print(f"round {r}: " + ", ".join(f"{arm} {rates[arm][-1]:.1f}" for arm in arms), flush=True)
    first = rates[arms[0]]
    for arm in arms:
        ratios = [a / b for a, b in zip(rates[arm], first, strict=True)]
        print(
            f"{arm}: mean {statistics.fmean(rates[arm]):.1f} tokens/s; over {arms[0]}: median "
            f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})"
        )
    app.service.close()


if __name__ == "__main__":
    main()
