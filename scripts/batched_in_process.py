"""Aggregate tokens/s of the batched engine in one process (no HTTP server, no load generator on the same cores).

    .venv/bin/python scripts/batched_in_process.py ntp 8 25      # mode, concurrent generations, seconds

``clients`` threads generate the agent suite's prompts that need no tool or schema (22, at most 96 new tokens each)
through one :class:`agent_mtp.engine.batching.BatchedEngine` for ``seconds``; prints tokens/s and the scheduler's pass
statistics. Set beside `agent-mtp loadtest` (the same engine behind the OpenAI-compatible server, driven over HTTP from
the same machine) it separates what batching gives from what the serving path costs.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from agent_mtp.bench.suites import BenchPrompt, load_suite
from agent_mtp.cli_common import load_engine
from agent_mtp.engine.batching import BatchedEngine
from agent_mtp.engine.config import DecodeConfig


def _config(mode: str, prompt: BenchPrompt) -> DecodeConfig:
    return DecodeConfig(mode=mode, max_new_tokens=min(prompt.max_new_tokens, 96), k_max=8 if mode == "ntp" else "auto")  # type: ignore[arg-type]


def main(mode: str, clients: int, seconds: float) -> None:
    torch.set_num_threads(2)
    batched = BatchedEngine(load_engine("default", None, "float32", "fast"))
    prompts = [p for p in load_suite("agent") if not p.tools and p.response_schema is None]
    batched.generate(list(prompts[0].messages), _config(mode, prompts[0]))  # warm-up
    tokens = [0] * clients
    stop = time.time() + seconds

    def worker(i: int) -> None:
        j = i
        while time.time() < stop:
            prompt = prompts[j % len(prompts)]
            j += clients
            tokens[i] += len(batched.generate(list(prompt.messages), _config(mode, prompt)).token_ids)

    start = time.time()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - start
    stats = batched.scheduler.stats() if batched.scheduler is not None else None
    print(f"{mode}, {clients} concurrent: {sum(tokens) / elapsed:.1f} tokens/s; {stats}")
    batched.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
