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

import torch

from agent_mtp.bench.suites import load_suite
from agent_mtp.server.loadtest import request_body
from agent_mtp.server.protocol import ChatCompletionRequest
from agent_mtp.server.serving import ChatServing
from agent_mtp.server.settings import ServerSettings
from agent_mtp.service import Service, shared_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", help="ntp, verified or confadapt (the load test's variants)")
    parser.add_argument("clients", type=int)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--no-tools", action="store_true", help="leave out prompts with tools or a response schema")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = ServerSettings(policy="none")
    service = Service(shared_engine(settings.model), concurrency="batched")
    serving = ChatServing(service, settings)
    prompts = [p for p in load_suite("agent") if not (args.no_tools and (p.tools or p.response_schema is not None))]

    def run(index: int) -> int:
        body = ChatCompletionRequest.model_validate(request_body(prompts[index % len(prompts)], args.variant, None))
        tokens = 0  # as the load test counts them: the usage's output tokens
        for delta in service.stream(serving.to_service_request(body, timeout=settings.request_timeout_s)):
            tokens += delta.usage.output_tokens
        return tokens

    for i in range(len(prompts)):  # warm-up: every prompt once (as the load test does), then measure
        run(i)
    counts = [0] * args.clients
    stop = time.time() + args.seconds

    def client(c: int) -> None:
        j = c
        while time.time() < stop:
            counts[c] += run(j)
            j += args.clients

    scheduler = service.decoder.scheduler
    before = scheduler.stats() if scheduler is not None else None
    start = time.time()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - start
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
