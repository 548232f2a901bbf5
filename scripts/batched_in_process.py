"""The load test's requests through the same request path in one process: no HTTP server, no SSE, no load generator.

    .venv/bin/python scripts/batched_in_process.py ntp 8 25         # variant, concurrent clients, seconds
    .venv/bin/python scripts/batched_in_process.py verified 8 25 --no-tools

Each client thread sends the agent suite's prompts as `agent-mtp loadtest` builds them (the same chat-completion
bodies: tools, tool choice, response formats, the variant's ``agent_mtp`` options), maps them to service requests
with the server's own `ChatServing.to_service_request` and streams them through one batched `Service`, as the server
does for a streamed request. ``--no-tools`` leaves out the prompts with tools or a response schema. Prints aggregate
tokens/s and the batch scheduler's pass statistics; set beside `agent-mtp loadtest` (the same engine and service
behind uvicorn, driven over HTTP from this machine) it separates what batching gives from what serving costs.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import torch

from agent_mtp.bench.suites import load_suite
from agent_mtp.server.loadtest import request_body
from agent_mtp.server.protocol import ChatCompletionRequest
from agent_mtp.server.serving import ChatServing
from agent_mtp.server.settings import ServerSettings
from agent_mtp.service import Service, shared_engine


class InProcess:
    """One batched `Service` behind the server's own request mapping, sent the agent suite's prompts as the load test
    builds them (also used by scripts/fixed_workload.py)."""

    def __init__(self, *, threads: int, no_tools: bool = False) -> None:
        torch.set_num_threads(threads)
        self.settings = ServerSettings(policy="none")
        self.service = Service(shared_engine(self.settings.model), concurrency="batched")
        self.serving = ChatServing(self.service, self.settings)
        suite = load_suite("agent")
        self.prompts = [p for p in suite if not (no_tools and (p.tools or p.response_schema is not None))]

    def send(self, index: int, variant: str) -> int:
        """Stream prompt ``index`` (modulo the suite) as ``variant``; its output tokens, as the load test counts them
        (the usage's)."""
        prompt = self.prompts[index % len(self.prompts)]
        body = ChatCompletionRequest.model_validate(request_body(prompt, variant, None))
        request = self.serving.to_service_request(body, timeout=self.settings.request_timeout_s)
        return sum(delta.usage.output_tokens for delta in self.service.stream(request))


def run_clients(clients: int, client: Callable[[int], None]) -> float:
    """``client(c)`` for c in 0..clients-1, each on a thread of its own; the seconds until the last returns."""
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", help="ntp, verified or confadapt (the load test's variants)")
    parser.add_argument("clients", type=int)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--no-tools", action="store_true", help="leave out prompts with tools or a response schema")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args()
    app = InProcess(threads=args.threads, no_tools=args.no_tools)
    service, prompts = app.service, app.prompts
    for i in range(len(prompts)):  # warm-up: every prompt once (as the load test does), then measure
        app.send(i, args.variant)
    counts = [0] * args.clients
    stop = time.time() + args.seconds

    def client(c: int) -> None:
        j = c
        while time.time() < stop:
            counts[c] += app.send(j, args.variant)
            j += args.clients

    scheduler = service.decoder.scheduler
    before = scheduler.stats() if scheduler is not None else None
    elapsed = run_clients(args.clients, client)
    rate = sum(counts) / elapsed
    print(f"{args.variant}, {args.clients} clients, {len(prompts)} prompts: {rate:.1f} tokens/s")
    if scheduler is not None and before is not None:  # the measured phase only (the warm-up ran one at a time)
        after = scheduler.stats()
        passes, sequences = after.passes - before.passes, after.sequences - before.sequences
        rows = after.rows - before.rows
        print(
            f"{passes} passes ({passes / elapsed:.0f}/s, {elapsed * 1e3 / max(passes, 1):.2f} ms each): "
            f"{sequences / max(passes, 1):.2f} sequences and {rows / max(passes, 1):.2f} rows a pass"
        )
    service.close()


if __name__ == "__main__":
    main()
