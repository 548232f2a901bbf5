"""Calibration prompt suites: short agent-like prompts labelled with the step type they exercise.

A suite is a built-in name (``agent``, ``smoke``) or a ``.json`` / ``.jsonl`` file whose records look like
``{"step_type": "tool_call", "prompt": "..." | [{"role": ..., "content": ...}], "max_new_tokens": 64}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_mtp.errors import ConfigError

_WEATHER_TOOL = (
    "You can call this tool: get_weather(city: string, unit: 'celsius' | 'fahrenheit'). "
    'Answer only with a JSON object {"name": "get_weather", "arguments": {...}}.'
)
_SEARCH_TOOL = (
    "You can call this tool: search(query: string, max_results: integer). "
    'Answer only with a JSON object {"name": "search", "arguments": {...}}.'
)


@dataclass(frozen=True)
class CalibrationPrompt:
    step_type: str
    prompt: str | list[dict[str, str]]
    max_new_tokens: int = 64


def _chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


_AGENT: list[CalibrationPrompt] = [
    CalibrationPrompt("tool_call", _chat(_WEATHER_TOOL, "What's the weather in Paris in celsius?")),
    CalibrationPrompt("tool_call", _chat(_WEATHER_TOOL, "Is it hot in Phoenix today? Use fahrenheit.")),
    CalibrationPrompt("tool_call", _chat(_SEARCH_TOOL, "Find 3 recent articles about solar batteries.")),
    CalibrationPrompt("tool_call", _chat(_SEARCH_TOOL, "Look up the population of Lagos, one result is enough.")),
    CalibrationPrompt(
        "reasoning",
        _chat(
            "Think step by step.",
            "A shop sells pens at 3 dollars each. How much do 7 pens cost with a 2 dollar discount?",
        ),
    ),
    CalibrationPrompt(
        "reasoning",
        _chat(
            "Think step by step.",
            "The tool returned: temperature 31 C, humidity 80%. Should I bring an umbrella?",
        ),
    ),
    CalibrationPrompt(
        "reasoning",
        _chat(
            "Think step by step.",
            "If a train leaves at 9:40 and the trip takes 85 minutes, when does it arrive?",
        ),
    ),
    CalibrationPrompt(
        "formatting",
        _chat("Reply with JSON only.", 'Turn this into JSON with keys name and age: "Alice is 31 years old".'),
    ),
    CalibrationPrompt(
        "formatting",
        _chat("Reply with a markdown table only.", "List three fruits and their colours."),
    ),
    CalibrationPrompt("formatting", _chat("Reply with JSON only.", "Give a JSON list of the first five even numbers.")),
    CalibrationPrompt(
        "final_answer",
        _chat("You are a helpful assistant.", "Summarise what a vector database is in two sentences."),
    ),
    CalibrationPrompt(
        "final_answer",
        _chat("You are a helpful assistant.", "The weather tool said 18 C and sunny in Paris. Tell the user."),
    ),
    CalibrationPrompt(
        "final_answer", _chat("You are a helpful assistant.", "Explain what an API key is to a beginner.")
    ),
]

SUITES: dict[str, list[CalibrationPrompt]] = {
    "agent": _AGENT,
    "smoke": [CalibrationPrompt(p.step_type, p.prompt, 24) for p in (_AGENT[0], _AGENT[4], _AGENT[7], _AGENT[10])],
}


def load_suite(name_or_path: str) -> list[CalibrationPrompt]:
    """A built-in suite by name, or a JSON / JSONL file of records (see the module docstring)."""
    if name_or_path in SUITES:
        return list(SUITES[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        builtins = ", ".join(SUITES)
        msg = f"calibration suite {name_or_path!r} is neither a built-in ({builtins}) nor an existing file"
        raise ConfigError(msg)
    text = path.read_text(encoding="utf-8")
    try:
        records = (
            [json.loads(line) for line in text.splitlines() if line.strip()]
            if path.suffix == ".jsonl"
            else json.loads(text)
        )
    except json.JSONDecodeError as exc:
        raise ConfigError(f"calibration suite {path}: line {exc.lineno}: not valid JSON ({exc.msg})") from exc
    return [_record(r, path, i) for i, r in enumerate(records)]


def _record(record: Any, path: Path, index: int) -> CalibrationPrompt:
    if not isinstance(record, dict) or "step_type" not in record or "prompt" not in record:
        msg = f"calibration suite {path}: record {index} needs keys step_type and prompt (got {record!r:.80})"
        raise ConfigError(msg)
    max_new = record.get("max_new_tokens", 64)
    if not isinstance(max_new, int) or max_new < 1:
        raise ConfigError(f"calibration suite {path}: record {index}: max_new_tokens={max_new!r}; use an int >= 1")
    return CalibrationPrompt(str(record["step_type"]), record["prompt"], max_new)
