"""Multi-step agent transcripts with and without the prefix cache, side by side in one process.

An agent re-sends its whole conversation at every step: system prompt with the tool schemas, earlier turns, tool
results. Each transcript here is played step by step: the model answers (constrained like ``AgentMTPChat`` when
tools are offered), its answer and the next tool result or user turn are appended, and the next step starts. Every
step runs twice, once reading and keeping the engine's prefix cache and once bypassing it, in alternating order;
the outputs must be equal (the cache is exact), so both arms walk the same conversation.

    transcripts = load_transcripts("agent")
    report = run_transcripts(engine, transcripts, DecodeConfig(mode="verified", k_max=4))
    report.summary()          # TTFT and latency ratios (cache / no cache) for step 1 and for steps 2+
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from agent_mtp.bench.suites import BenchPrompt, prompt_grammar
from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.errors import ConfigError


@dataclass(frozen=True)
class Transcript:
    """One agent conversation: the opening messages, the tools, and what comes back after each model turn."""

    id: str
    messages: tuple[dict[str, str], ...]
    turns: tuple[dict[str, str], ...]
    """Appended after the model's answer at step i (a tool result or the user's next message)."""
    tools: tuple[Mapping[str, Any], ...] = ()
    max_new_tokens: int = 48


def load_transcripts(name_or_path: str = "agent") -> list[Transcript]:
    """A shipped transcript file (``agent``) or a ``.jsonl`` path: one transcript per line with ``id``,
    ``messages``, ``turns`` and optionally ``tools`` and ``max_new_tokens``."""
    path = Path(name_or_path)
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise ConfigError(f"Transcript file {name_or_path!r} does not exist; pass an existing .jsonl file.")
        text, source = path.read_text(encoding="utf-8"), str(path)
    else:
        resource = resources.files("agent_mtp.bench").joinpath("transcripts").joinpath(f"{name_or_path}.jsonl")
        if not resource.is_file():
            raise ConfigError(f"Unknown transcript set {name_or_path!r}; use 'agent' or a .jsonl path.")
        text, source = resource.read_text(encoding="utf-8"), f"{name_or_path}.jsonl"
    return [_transcript(line, f"{source}:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def _transcript(line: str, where: str) -> Transcript:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg}); one transcript object per line.") from e
    if not isinstance(item, dict) or not isinstance(item.get("id"), str):
        raise ConfigError(f"{where}: a transcript needs 'id' (string), 'messages' and 'turns'.")
    for key in ("messages", "turns"):
        value = item.get(key)
        if not isinstance(value, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value):
            raise ConfigError(f"{where}: '{key}' must be a list of {{'role': ..., 'content': ...}} messages.")
    return Transcript(
        id=item["id"],
        messages=tuple(item["messages"]),
        turns=tuple(item["turns"]),
        tools=tuple(item.get("tools", ())),
        max_new_tokens=int(item.get("max_new_tokens", 48)),
    )


@dataclass
class StepRow:
    """One step of one transcript, with and without the prefix cache."""

    transcript: str
    step: int
    """1-based: step 1 reads a conversation the cache has not seen (except a shared system prompt)."""
    prompt_tokens: int
    cached_prompt_tokens: int
    new_tokens: int
    ttft_cached_s: float
    ttft_plain_s: float
    wall_cached_s: float
    wall_plain_s: float
    equal: bool
    """The two outputs are the same token ids (they must be)."""


@dataclass
class TranscriptReport:
    rows: list[StepRow]
    settings: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per group ("step 1", "steps 2+"): pooled TTFT and latency ratios (cache / no cache) and reuse."""
        groups = {"step 1": [r for r in self.rows if r.step == 1], "steps 2+": [r for r in self.rows if r.step > 1]}
        return {name: _group_summary(rows) for name, rows in groups.items() if rows}

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "summary": self.summary(), "rows": [asdict(r) for r in self.rows]}


def _group_summary(rows: Sequence[StepRow]) -> dict[str, float]:
    return {
        "steps": len(rows),
        "prompt_tokens": statistics.mean(r.prompt_tokens for r in rows),
        "cached_share": sum(r.cached_prompt_tokens for r in rows) / sum(r.prompt_tokens for r in rows),
        "ttft_cached_ms": 1000 * statistics.median(r.ttft_cached_s for r in rows),
        "ttft_plain_ms": 1000 * statistics.median(r.ttft_plain_s for r in rows),
        "ttft_ratio": sum(r.ttft_cached_s for r in rows) / sum(r.ttft_plain_s for r in rows),
        "latency_ratio": sum(r.wall_cached_s for r in rows) / sum(r.wall_plain_s for r in rows),
        "equal": float(all(r.equal for r in rows)),
    }


def run_transcripts(
    engine: MTPEngine,
    transcripts: Sequence[Transcript],
    config: DecodeConfig,
    *,
    on_step: Callable[[StepRow], None] | None = None,
) -> TranscriptReport:
    """Play every transcript step by step, each step with and without the prefix cache (see the module doc)."""
    engine.prefix_cache.clear()
    rows: list[StepRow] = []
    for t in transcripts:
        messages = [dict(m) for m in t.messages]
        for step in range(1, len(t.turns) + 2):
            row, text = _one_step(engine, t, messages, step, config)
            rows.append(row)
            if on_step is not None:
                on_step(row)
            messages.append({"role": "assistant", "content": text})
            if step <= len(t.turns):
                messages.append(dict(t.turns[step - 1]))
    settings = {
        "model": engine.model_id,
        "runtime": engine.runtime,
        "mode": config.mode,
        "k_max": config.k_max,
        "transcripts": len(transcripts),
        "prefix_cache_mb": engine.prefix_cache.budget_bytes / 2**20,
    }
    return TranscriptReport(rows, settings)


def _one_step(
    engine: MTPEngine, t: Transcript, messages: list[dict[str, str]], step: int, config: DecodeConfig
) -> tuple[StepRow, str]:
    prompt = BenchPrompt(
        id=f"{t.id}-{step}",
        suite="transcript",
        messages=tuple(messages),
        max_new_tokens=t.max_new_tokens,
        tools=t.tools,
        tool_choice="auto" if t.tools else None,
    )
    ids = engine.encode_prompt(prompt.prompt_messages())
    compiled = prompt_grammar(engine, prompt)
    cfg = config.replace(max_new_tokens=t.max_new_tokens)
    results: dict[bool, tuple[Any, float]] = {}
    for use_cache in (True, False) if step % 2 else (False, True):  # alternate which arm runs first
        constraint = compiled.constraint() if compiled is not None else None
        start = time.perf_counter()
        result = engine.generate(ids, cfg.replace(prefix_cache=use_cache), constraint=constraint)
        results[use_cache] = (result, time.perf_counter() - start)
    (cached, wall_cached), (plain, wall_plain) = results[True], results[False]
    row = StepRow(
        transcript=t.id,
        step=step,
        prompt_tokens=len(ids),
        cached_prompt_tokens=cached.stats.cached_prompt_tokens,
        new_tokens=len(cached.token_ids),
        ttft_cached_s=cached.stats.ttft_s,
        ttft_plain_s=plain.stats.ttft_s,
        wall_cached_s=wall_cached,
        wall_plain_s=wall_plain,
        equal=cached.token_ids == plain.token_ids,
    )
    return row, cached.text
