"""`agent-mtp loadtest`: concurrent agent clients against the OpenAI-compatible server.

For each concurrency level (1, 4, 8, 16 clients) and each decoding variant (NTP, verified, ConfAdapt; or shipped
policies), the clients send the agent suites' prompts (tool calls, reasoning, formatting, summaries, chat; their
tools, tool choice and answer schemas) as streaming chat completions, each client one request after the other.
Variants are interleaved per level, so machine drift hits them alike. Reported per cell: aggregate tokens/s (every
completion token of the cell / the cell's wall time), per-request P50/P95 latency, P50 TTFT, error and timeout
ratios, the share of tool-call prompts whose call parsed, and the ratios the issue's targets name. With ``rounds``
above one the whole sweep runs that many times, the figures are pooled over the rounds and each ratio to NTP also
comes as its spread over the rounds (one round's two cells ran minutes apart at most): on a 2-core machine the same
code's ratio swung 0.89-1.10x between 30 s cells, so one pair of cells cannot show a change of a few percent.

Without ``--base-url`` a server is started here in a subprocess (``agent-mtp serve --policy none``) and stopped at
the end; the variants are per-request ``agent_mtp`` options.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent_mtp.bench.suites import BenchPrompt, load_suite
from agent_mtp.cli_common import console, out
from agent_mtp.errors import ConfigError
from agent_mtp.server.ports import free_port

VARIANTS: dict[str, dict[str, Any]] = {
    "ntp": {"mode": "ntp"},
    "verified": {"mode": "verified"},
    "confadapt": {"mode": "confadapt", "threshold": 0.9, "k_max": "auto"},
}
"""Fixed decoding variants (per-request ``agent_mtp`` options); any other name is sent as a shipped policy."""


@dataclass(frozen=True)
class LoadtestConfig:
    clients: tuple[int, ...] = (1, 4, 8, 16)
    policies: tuple[str, ...] = ("ntp", "verified", "confadapt")
    suite: str = "agent"
    requests_per_client: int = 3
    """Requests each client sends per cell (at least; a cell has at least ``min_requests``)."""
    min_requests: int = 8
    max_tokens: int | None = None
    """Cap on each prompt's own token budget (None: the suite's budgets, so tool calls are never cut off)."""
    timeout_s: float = 300.0
    duration_s: float | None = None
    """Steady state: every client sends requests back to back for this long, and tokens/s counts the tokens
    streamed inside the window (a request still running at its end finishes, its later tokens are not counted).
    None: each client sends ``requests_per_client`` requests and the cell lasts until the last one ends (the
    tail then runs with fewer clients than the cell's level)."""
    rounds: int = 1
    """How many times the whole sweep (every level, every variant) runs; the report pools them."""

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ConfigError(f"rounds={self.rounds!r} is invalid; use a whole number of sweeps >= 1.")


@dataclass
class RequestRecord:
    prompt_id: str
    latency_s: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0
    error: str | None = None
    timeout: bool = False
    finish_reason: str | None = None
    tool_call_ok: bool | None = None
    """For prompts that must call a tool and finished within their token budget: did the streamed call parse
    (name known, JSON-object arguments). A call cut off by max_tokens is counted in ``tool_calls_cut_off``."""
    tool_call_cut_off: bool = False
    chunk_times: list[float] = field(default_factory=list)
    """``time.perf_counter()`` of every streamed chunk that carried content or a tool call (one per pass)."""

    def tokens_before(self, deadline: float) -> float:
        """This request's tokens streamed before ``deadline`` (its total spread evenly over its chunks)."""
        if not self.chunk_times:
            return float(self.tokens)
        inside = sum(1 for t in self.chunk_times if t <= deadline)
        return self.tokens * inside / len(self.chunk_times)


@dataclass
class Cell:
    policy: str
    clients: int
    wall_s: float
    records: list[RequestRecord] = field(default_factory=list)
    window_end: float | None = None
    """Steady-state cells: the ``perf_counter`` at which the window closed (tokens after it are not counted)."""
    round_index: int = 0
    """Which sweep of the run the cell belongs to, from 0 (``LoadtestConfig.rounds``)."""

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.records if r.error is None]
        latencies = sorted(r.latency_s for r in ok)
        ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        tools = [r.tool_call_ok for r in self.records if r.tool_call_ok is not None]
        if self.window_end is None:
            tokens = sum(r.tokens for r in ok)
        else:
            tokens = round(sum(r.tokens_before(self.window_end) for r in ok))
        return {
            "policy": self.policy,
            "clients": self.clients,
            "requests": len(self.records),
            "tokens": tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(tokens / self.wall_s, 3) if self.wall_s else 0.0,
            "p50_latency_s": round(_percentile(latencies, 50), 3),
            "p95_latency_s": round(_percentile(latencies, 95), 3),
            "p50_ttft_s": round(_percentile(ttfts, 50), 3),
            "p95_ttft_s": round(_percentile(ttfts, 95), 3),
            "error_ratio": round(1 - len(ok) / len(self.records), 4) if self.records else 0.0,
            "timeout_ratio": round(sum(r.timeout for r in self.records) / len(self.records), 4) if self.records else 0,
            "tool_calls_parsed": round(sum(tools) / len(tools), 4) if tools else None,
            "tool_calls_cut_off": sum(r.tool_call_cut_off for r in self.records),
        }


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return float(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1])


# ------------------------------------------------------------------------------------------------ one request
def request_body(prompt: BenchPrompt, variant: str, max_tokens: int | None) -> dict[str, Any]:
    """The chat-completion body of a suite prompt under a variant."""
    body: dict[str, Any] = {
        "model": "default",
        "messages": [dict(m) for m in prompt.messages],
        "max_tokens": min(prompt.max_new_tokens, max_tokens or prompt.max_new_tokens),
        "stream": True,
        "stream_options": {"include_usage": True},
        "agent_mtp": dict(VARIANTS.get(variant, {"policy": variant})),
    }
    if prompt.step_type:
        body["agent_mtp"]["step_type"] = prompt.step_type
    if prompt.tools:
        body["tools"] = [dict(t) for t in prompt.tools]
        choice = prompt.tool_choice
        if choice == "any":
            body["tool_choice"] = "required"
        elif choice in ("auto", "none", None):
            body["tool_choice"] = choice or "auto"
        else:
            body["tool_choice"] = {"type": "function", "function": {"name": choice}}
    if prompt.response_schema is not None:
        schema = dict(prompt.response_schema)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    return body


async def one_request(
    http: httpx.AsyncClient, url: str, prompt: BenchPrompt, variant: str, max_tokens: int | None
) -> RequestRecord:
    record = RequestRecord(prompt.id)
    body = request_body(prompt, variant, max_tokens)
    names = {t["function"]["name"] for t in prompt.tools}
    calls: dict[int, dict[str, str]] = {}
    started = time.perf_counter()
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    record.error = str(chunk["error"].get("message"))[:200]
                    break
                _read_chunk(chunk, record, calls, started)
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"[:200]
    record.latency_s = time.perf_counter() - started
    if prompt.tools and prompt.tool_choice not in (None, "auto", "none") and record.error is None:
        if record.finish_reason == "length":
            record.tool_call_cut_off = True
        else:
            record.tool_call_ok = bool(calls) and all(_call_parses(c, names) for c in calls.values())
    return record


def _read_chunk(chunk: dict[str, Any], record: RequestRecord, calls: dict[int, dict[str, str]], started: float) -> None:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
        if delta.get("content") or delta.get("tool_calls"):
            now = time.perf_counter()
            record.chunk_times.append(now)
            if record.ttft_s is None:
                record.ttft_s = now - started
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(int(call["index"]), {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name") or ""
            entry["arguments"] += call.get("function", {}).get("arguments") or ""
    extension = chunk.get("agent_mtp")
    if extension is not None:
        record.timeout = extension.get("finish_reason") == "timeout"
    if chunk.get("usage"):
        record.tokens = int(chunk["usage"]["completion_tokens"])


def _call_parses(call: dict[str, str], names: set[str]) -> bool:
    try:
        args = json.loads(call["arguments"])
    except json.JSONDecodeError:
        return False
    return call["name"] in names and isinstance(args, dict)


# ------------------------------------------------------------------------------------------------ cells
async def run_cell(
    base_url: str, prompts: Sequence[BenchPrompt], variant: str, clients: int, config: LoadtestConfig
) -> Cell:
    per_client = max(config.requests_per_client, math.ceil(config.min_requests / clients))
    url = f"{base_url}/chat/completions"
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as http:
        started = time.perf_counter()
        window_end = started + config.duration_s if config.duration_s else None

        async def client(index: int) -> list[RequestRecord]:
            records = []
            j = 0
            while (j < per_client) if window_end is None else (time.perf_counter() < window_end):
                prompt = prompts[(index * per_client + j) % len(prompts)]
                records.append(await one_request(http, url, prompt, variant, config.max_tokens))
                j += 1
            return records

        results = await asyncio.gather(*(client(i) for i in range(clients)))
        wall = time.perf_counter() - started if window_end is None else config.duration_s
    return Cell(variant, clients, float(wall or 0.0), [r for rs in results for r in rs], window_end)


def run_cells(base_url: str, config: LoadtestConfig) -> list[Cell]:
    prompts = load_suite(config.suite)
    cells: list[Cell] = []
    with console.status("Warming up every variant and the prefix cache ..."):
        for variant in config.policies:
            asyncio.run(run_cell(base_url, prompts[:2], variant, 1, LoadtestConfig(min_requests=2, max_tokens=16)))
        # every prompt once, so no cell pays cold prefills another cell does not (the first variant of a level
        # would otherwise prefill the prompts new to that level for the others)
        warm = LoadtestConfig(requests_per_client=1, min_requests=len(prompts), max_tokens=1)
        asyncio.run(run_cell(base_url, prompts, "ntp", len(prompts), warm))
    for sweep in range(config.rounds):
        label = f"round {sweep + 1}/{config.rounds}, " if config.rounds > 1 else ""
        for clients in config.clients:
            for variant in config.policies:  # interleaved: drift hits every variant alike
                with console.status(f"{label}{clients} clients, {variant} ..."):
                    cell = asyncio.run(run_cell(base_url, prompts, variant, clients, config))
                cell.round_index = sweep
                s = cell.summary()
                console.print(
                    f"{label}{clients:>3} clients {variant:>10}: {s['tokens_per_s']:7.1f} tokens/s, "
                    f"P50 {s['p50_latency_s']:.2f} s, P95 {s['p95_latency_s']:.2f} s, "
                    f"TTFT {s['p50_ttft_s']:.2f} s, errors {s['error_ratio']:.0%}"
                )
                cells.append(cell)
    return cells


def pooled_summaries(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """One summary per (variant, level) over every round: tokens counted as each cell counts them (inside its
    window) over the cells' summed time, latencies over all their requests; ``round_tokens_per_s`` lists each
    round's own figure, in round order."""
    groups: dict[tuple[str, int], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.policy, cell.clients), []).append(cell)
    pooled = []
    for group in groups.values():
        ordered = sorted(group, key=lambda c: c.round_index)
        per_round = [c.summary() for c in ordered]
        wall = sum(c.wall_s for c in ordered)
        merged = Cell(ordered[0].policy, ordered[0].clients, wall, [r for c in ordered for r in c.records]).summary()
        tokens = sum(s["tokens"] for s in per_round)
        merged.update(
            tokens=tokens,
            wall_s=round(wall, 3),
            tokens_per_s=round(tokens / wall, 3) if wall else 0.0,
            rounds=len(group),
            round_tokens_per_s=[s["tokens_per_s"] for s in per_round],
        )
        pooled.append(merged)
    return pooled


# ------------------------------------------------------------------------------------------------ reports
def ratios(summaries: Sequence[dict[str, Any]], baseline: str = "ntp") -> dict[str, Any]:
    """Aggregate tokens/s of each variant over the baseline's at the same concurrency, and the baseline's scaling."""
    rate = {(s["policy"], s["clients"]): s["tokens_per_s"] for s in summaries}
    by_round = {(s["policy"], s["clients"]): s.get("round_tokens_per_s", []) for s in summaries}
    levels = sorted({s["clients"] for s in summaries})
    out: dict[str, Any] = {"vs_" + baseline: {}, baseline + "_scaling": {}, "vs_" + baseline + "_rounds": {}}
    for c in levels:
        base = rate.get((baseline, c))
        if base:
            out["vs_" + baseline][c] = {p: round(r / base, 3) for (p, cc), r in rate.items() if cc == c}
            single = rate.get((baseline, 1))
            if single:
                out[baseline + "_scaling"][c] = round(base / single, 3)
        bases = by_round.get((baseline, c), [])
        if len(bases) > 1:  # each round's variant over the same round's baseline
            out["vs_" + baseline + "_rounds"][c] = {
                p: [round(r / b, 3) if b else 0.0 for r, b in zip(rs, bases, strict=False)]
                for (p, cc), rs in by_round.items()
                if cc == c
            }
    return out


def markdown(summaries: Sequence[dict[str, Any]], extra: dict[str, Any]) -> str:
    head = (
        "| clients | variant | tokens/s | vs ntp | P50 latency s | P95 latency s | P50 TTFT s | errors | timeouts "
        "| tool calls parsed (cut off) |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    vs = extra["ratios"].get("vs_ntp", {})
    spread = extra["ratios"].get("vs_ntp_rounds", {})
    rows = []
    for s in summaries:
        ratio = vs.get(s["clients"], {}).get(s["policy"])
        shown = "-" if ratio is None else f"{ratio:.2f}x"
        per_round = spread.get(s["clients"], {}).get(s["policy"], [])
        if ratio is not None and len(per_round) > 1 and s["policy"] != "ntp":
            shown += f" ({min(per_round):.2f}-{max(per_round):.2f})"
        parsed = "-" if s["tool_calls_parsed"] is None else f"{s['tool_calls_parsed']:.0%} ({s['tool_calls_cut_off']})"
        rows.append(
            f"| {s['clients']} | {s['policy']} | {s['tokens_per_s']:.1f} | {shown} "
            f"| {s['p50_latency_s']:.2f} | {s['p95_latency_s']:.2f} | {s['p50_ttft_s']:.2f} | {s['error_ratio']:.0%} "
            f"| {s['timeout_ratio']:.0%} | {parsed} |"
        )
    scaling = extra["ratios"].get("ntp_scaling", {})
    rounds = max((s.get("rounds", 1) for s in summaries), default=1)
    if rounds > 1:
        head = f"Pooled over {rounds} rounds; vs ntp: pooled ratio (lowest-highest of the rounds).\n\n" + head
    tail = "\nNTP aggregate tokens/s over one client's: " + ", ".join(
        f"{c} clients {r:.2f}x" for c, r in scaling.items()
    )
    server = extra.get("server_at_end") or {}
    if server.get("runtime"):
        tail += f"\nServer runtime: {server['runtime']}, KV cache {server.get('kv_cache', 'fp32')}"
        tail += f", real rows on the {server.get('row_grid', 'int24')} grid."
    batching = server.get("batching")
    if batching:
        passes, mean = batching["passes"], batching["mean_batch"]
        tail += f"\nServer: {passes} batched passes, {mean:.2f} sequences per pass on average."
    if extra.get("load_average"):
        tail += f"\nLoad average at the end: {', '.join(f'{x:.1f}' for x in extra['load_average'])}."
    return head + "\n".join(rows) + "\n" + tail + "\n"


def plot(summaries: Sequence[dict[str, Any]], path: Path) -> None:
    from agent_mtp.plotting import plotting_available, pyplot

    if not plotting_available():
        return
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for variant in dict.fromkeys(s["policy"] for s in summaries):
        rows = [s for s in summaries if s["policy"] == variant]
        xs = [s["clients"] for s in rows]
        left.plot(xs, [s["tokens_per_s"] for s in rows], marker="o", label=variant)
        right.plot(xs, [s["p95_latency_s"] for s in rows], marker="o", label=variant)
    left.set(xlabel="concurrent clients", ylabel="aggregate tokens/s", title="Throughput")
    right.set(xlabel="concurrent clients", ylabel="P95 latency (s)", title="Per-request P95 latency")
    for ax in (left, right):
        ax.set_xticks(sorted({s["clients"] for s in summaries}))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ the command
@contextmanager
def local_server(*, threads: int | None, max_active: int) -> Iterator[str]:
    """``agent-mtp serve`` in a subprocess on a free port (fixed decoding; variants per request)."""
    port = free_port()
    command = [sys.executable, "-m", "agent_mtp.cli", "serve", "--port", str(port), "--policy", "none"]
    command += ["--max-active", str(max_active), "--max-queue", str(4 * max_active), "--log-level", "warning"]
    if threads:
        command += ["--threads", str(threads)]
    process = subprocess.Popen(command, env={**os.environ, "AGENT_MTP_LOG_LEVEL": "WARNING"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        with console.status("Starting the server (loading the model) ..."):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"agent-mtp serve exited with {process.returncode}")
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("agent-mtp serve did not become healthy in 10 minutes")
                time.sleep(0.5)
        yield f"{base}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def _cell_key(cell: Cell, rounds: int) -> str:
    return f"{cell.policy}@{cell.clients}" + (f"#{cell.round_index + 1}" if rounds > 1 else "")


def check_base_url(base_url: str) -> str:
    """``base_url`` without a trailing slash, once ``GET {base_url}/models`` answers as an OpenAI-compatible API does;
    else a ConfigError naming what answered. Without the check a wrong URL (the server's root instead of its ``/v1``)
    sent every client into a loop of instant 404s: the cells ran their full duration at 100% errors."""
    url = base_url.rstrip("/")
    try:
        response = httpx.get(f"{url}/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise ConfigError(
            f"--base-url {base_url!r}: no server answered ({type(e).__name__}: {e}); start one with "
            "`agent-mtp serve`, or leave --base-url out to have the load test start one."
        ) from e
    if response.status_code == 401:
        raise ConfigError(
            f"--base-url {base_url!r} asks for an API key (HTTP 401) and the load test sends none: run it against "
            "a server started without one ($AGENT_MTP_SERVE_API_KEY unset), or leave --base-url out."
        )
    listed = False
    if response.status_code == 200:
        try:
            listed = isinstance(response.json().get("data"), list)
        except (ValueError, AttributeError):
            listed = False
    if not listed:
        hint = f" (did you mean {url}/v1?)" if not url.endswith("/v1") else ""
        raise ConfigError(
            f"--base-url {base_url!r} is not the root of an OpenAI-compatible API: GET {url}/models "
            f"answered HTTP {response.status_code}{hint}; pass e.g. http://127.0.0.1:8000/v1."
        )
    return url


def run_loadtest(config: LoadtestConfig, *, base_url: str | None, threads: int | None, out_dir: Path) -> dict[str, Any]:
    """Run every cell, print the table, write JSON, Markdown and PNG under ``out_dir``; return the report."""
    started = time.time()
    if base_url is None:
        with local_server(threads=threads, max_active=max(config.clients)) as url:
            cells = run_cells(url, config)
            health = httpx.get(url.replace("/v1", "/health")).json()
    else:
        url = check_base_url(base_url)
        cells = run_cells(url, config)
        health = httpx.get(url.removesuffix("/v1") + "/health").json()
    summaries = pooled_summaries(cells)
    report: dict[str, Any] = {
        "config": asdict(config),
        "server_at_end": health,
        "load_average": os.getloadavg(),
        "server_threads": threads,
        "cpus": os.cpu_count(),
        "started": started,
        "cells": summaries,
        "requests": {_cell_key(c, config.rounds): [asdict(r) for r in c.records] for c in cells},
    }
    if config.rounds > 1:
        report["round_cells"] = [{**c.summary(), "round": c.round_index + 1} for c in cells]
    report["ratios"] = ratios(summaries)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "loadtest.json").write_text(json.dumps(report, indent=2))
    table = markdown(summaries, report)
    (out_dir / "loadtest.md").write_text(table)
    plot(summaries, out_dir / "loadtest.png")
    out.print(table)
    out.print(f"[dim]Written to {out_dir}/loadtest.json, .md, .png[/dim]")
    return report
