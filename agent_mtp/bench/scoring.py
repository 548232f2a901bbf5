"""Quality scoring of bench outputs: pure functions, no model (the NLL comes from ``engine.score``).

Per output, against the item's own reference (``BenchPrompt.score`` / ``expected``):
  * ``tool_call``       a complete, schema-valid call (``valid``); name and arguments equal the expected call
                        (``success``); task output = the parsed calls.
  * ``json``            parses as a JSON object (``valid``); has the expected keys / value (``success``).
  * ``markdown_list``   at least ``min_items`` bullet or numbered lines.
  * ``markdown_table``  a header, a separator row and at least ``min_rows`` body rows.
  * ``react``           a ``Thought:`` / ``Action:`` / ``Action Input:`` step (``valid``) with the expected action.
  * ``answer``          the last number in the output equals the expected answer.
  * ``keywords``        at least half of the expected keywords appear (case-insensitive).
  * ``free``            no reference: only the metrics below.

Against plain NTP decoding of the same prompt (the lossless reference): token agreement (share of the NTP tokens
reproduced before the first divergence), task agreement (same task output: same call, same JSON value, same list,
same final answer, same normalised text), exact match. Reference-free: base-model NLL per token and the repetition
rate (share of repeated 4-grams).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent_mtp.bench.suites import BenchPrompt

REPETITION_N = 4
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+(.+?)\s*$")
_SEPARATOR_ROW = re.compile(r"^\s*\|?\s*:?-{2,}:?\s*(?:\|\s*:?-{2,}:?\s*)*\|?\s*$")
_REACT_FIELD = re.compile(r"^\s*(Thought|Action Input|Action)\s*:\s*(.*)$", re.IGNORECASE)


@dataclass(frozen=True)
class ItemScore:
    """The item-level verdict on one output."""

    valid: bool | None
    """Well-formed for its kind (tool call, JSON, ReAct step); None where the kind has no syntax to check."""
    success: bool | None
    """Matches the item's reference; None without a reference (``free``)."""
    task_output: str
    """Canonical form of what the output *does* (compared with NTP's for task-level agreement)."""


# -- agreement with NTP and reference-free metrics ----------------------------------------------------------------
def token_agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Share of ``reference`` tokens reproduced before the first divergence (1.0 when both are empty)."""
    if not reference:
        return 1.0 if not tokens else 0.0
    same = 0
    for a, b in zip(tokens, reference, strict=False):
        if a != b:
            break
        same += 1
    return same / len(reference)


def repetition_rate(tokens: Sequence[int], n: int = REPETITION_N) -> float:
    """Share of repeated n-grams, ``1 - unique / total`` (0.0 when the output has fewer than n tokens)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def mean_nll(logprobs: Sequence[float]) -> float:
    """Mean negative log-likelihood per token (nan for an empty output)."""
    return -sum(logprobs) / len(logprobs) if logprobs else math.nan


def normalise_text(text: str) -> str:
    return " ".join(text.split()).lower()


# -- parsing helpers ------------------------------------------------------------------------------------------------
def extract_json(text: str) -> tuple[bool, Any]:
    """(found, value) of the first JSON object or array in ``text`` (code fences and prose around it allowed)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"[{\[]", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        return True, value
    return False, None


def parse_calls(text: str, tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]] | None:
    """The tool calls in ``text`` as (name, arguments), or None when there is none or one is broken.

    Accepts the project's ``<tool_call>`` blocks and, as a fallback, a bare ``{"name": ..., "arguments": ...}``
    object (what an unconstrained model often writes)."""
    from agent_mtp.tools import parse_tool_calls, tool_specs

    specs = tool_specs(tools)
    parsed = parse_tool_calls(text, specs)
    if parsed.invalid_tool_calls:
        return None
    if parsed.tool_calls:
        return [(c["name"], dict(c["args"])) for c in parsed.tool_calls]
    found, value = extract_json(text)
    names = {s.name for s in specs}
    if found and isinstance(value, dict) and value.get("name") in names and isinstance(value.get("arguments"), dict):
        return [(str(value["name"]), dict(value["arguments"]))]
    return None


def tool_call_valid(text: str, tools: Sequence[Mapping[str, Any]]) -> bool:
    """At least one call, every call complete and valid against its tool's parameter schema."""
    from agent_mtp.tools import render_tool_call, tool_specs, validation_errors

    calls = parse_calls(text, tools)
    if not calls:
        return False
    rendered = "\n".join(render_tool_call(name, args) for name, args in calls)
    return not validation_errors(rendered, tool_specs(tools), require_call=True)


def markdown_list_items(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := _BULLET.match(line))]


def markdown_table_rows(text: str) -> list[list[str]] | None:
    """Body rows of the first markdown table (header and separator row required), else None."""
    lines = [line.strip() for line in text.splitlines()]
    for i in range(1, len(lines)):
        if _SEPARATOR_ROW.match(lines[i]) and "|" in lines[i - 1]:
            rows = []
            for line in lines[i + 1 :]:
                if "|" not in line:
                    break
                rows.append([cell.strip() for cell in line.strip("|").split("|")])
            return rows
    return None


def react_step(text: str) -> dict[str, str] | None:
    """The first ``Thought`` / ``Action`` / ``Action Input`` of a ReAct step (lower-case keys), None without an
    Action."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        m = _REACT_FIELD.match(line)
        if m:
            fields.setdefault(m.group(1).lower(), m.group(2).strip())
    return fields if "action" in fields and "thought" in fields else None


def final_number(text: str) -> str | None:
    """The answer's number, normalised ("1,500.0" -> "1500"): the first number after the last ``Answer`` marker, or
    the last number of the text when there is no marker followed by a number."""
    marker = text.lower().rfind("answer")
    after = _NUMBER.findall(text[marker:]) if marker >= 0 else []
    numbers = after[:1] or _NUMBER.findall(text)[-1:]
    if not numbers:
        return None
    value = float(numbers[0].replace(",", ""))
    return str(int(value)) if value.is_integer() else repr(value)


# -- item scoring ---------------------------------------------------------------------------------------------------
def score_item(prompt: BenchPrompt, text: str, tokens: Sequence[int]) -> ItemScore:
    """Validity, success against the reference, and the canonical task output of one output."""
    kind = prompt.score
    expected = dict(prompt.expected or {})
    fallback = "text:" + normalise_text(text)
    if kind == "tool_call":
        calls = parse_calls(text, prompt.tools)
        valid = tool_call_valid(text, prompt.tools)
        want = [(expected["name"], dict(expected.get("arguments", {})))] if "name" in expected else None
        success = None if want is None else (valid and calls == want)
        return ItemScore(valid, success, _canonical("calls", calls) if calls else fallback)
    if kind == "json":
        found, value = extract_json(text)
        valid = found and isinstance(value, dict)
        success = valid and _json_matches(value, expected) if expected else None
        return ItemScore(valid, success, _canonical("json", value) if found else fallback)
    if kind == "markdown_list":
        items = markdown_list_items(text)
        success = len(items) >= int(expected.get("min_items", 1))
        return ItemScore(None, success, _canonical("list", [normalise_text(i) for i in items]) if items else fallback)
    if kind == "markdown_table":
        rows = markdown_table_rows(text)
        success = rows is not None and len(rows) >= int(expected.get("min_rows", 1))
        return ItemScore(None, success, _canonical("table", rows) if rows is not None else fallback)
    if kind == "react":
        step = react_step(text)
        action = (step or {}).get("action", "").strip().lower()
        success = step is not None and ("action" not in expected or action == str(expected["action"]).lower())
        decision = [action, normalise_text((step or {}).get("action input", ""))]
        return ItemScore(step is not None, success, _canonical("react", decision) if step else fallback)
    if kind == "answer":
        number = final_number(text)
        want = expected.get("answer")
        success = None if want is None else number is not None and number == final_number(str(want))
        return ItemScore(None, success, f"answer:{number}" if number is not None else fallback)
    if kind == "keywords":
        words = [str(w).lower() for w in expected.get("keywords", [])]
        hits = sum(w in text.lower() for w in words)
        success = hits * 2 >= len(words) if words else None
        return ItemScore(None, success, fallback)
    return ItemScore(None, None, fallback)


def _json_matches(value: dict[str, Any], expected: Mapping[str, Any]) -> bool:
    keys = expected.get("keys", [])
    if any(k not in value for k in keys):
        return False
    return "value" not in expected or value == expected["value"]


def _canonical(kind: str, value: Any) -> str:
    return f"{kind}:" + json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
