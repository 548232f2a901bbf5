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
import threading
import time
from dataclasses import dataclass

import torch

import agent_mtp.engine.decode as decode
from agent_mtp.bench.suites import load_suite
from agent_mtp.server.loadtest import request_body
from agent_mtp.server.protocol import ChatCompletionRequest
from agent_mtp.server.serving import ChatServing
from agent_mtp.server.settings import ServerSettings
from agent_mtp.service import Service, shared_engine


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
    torch.set_num_threads(args.threads)
    settings = ServerSettings(policy="none")
    service = Service(shared_engine(settings.model), concurrency="batched")
    serving = ChatServing(service, settings)
    prompts = load_suite("agent")

    def send(index: int, variant: str) -> int:
        body = ChatCompletionRequest.model_validate(request_body(prompts[index % len(prompts)], variant, None))
        tokens = 0
        for delta in service.stream(serving.to_service_request(body, timeout=settings.request_timeout_s)):
            tokens += delta.usage.output_tokens
        return tokens

    def drain(arm: Arm) -> float:
        decode.GREEDY_RUN = arm.greedy_run
        work: queue.Queue[int] = queue.Queue()
        for i in range(len(prompts) * args.repeat):
            work.put(i)
        counts = [0] * args.clients

        def client(c: int) -> None:
            while True:
                try:
                    i = work.get_nowait()
                except queue.Empty:
                    return
                counts[c] += send(i, arm.variant)

        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) / (time.perf_counter() - start)

    for variant in dict.fromkeys(arm.variant for arm in arms):  # warm-up: every prompt once, one at a time
        for i in range(len(prompts)):
            send(i, variant)
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
    service.close()


if __name__ == "__main__":
    main()
