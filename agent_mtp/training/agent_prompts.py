"""Project-made agent prompts: the step types agents produce (tool calls as JSON, ReAct steps, formatting, summaries).

Deterministic for a seed, so the held-out split and the cached teacher responses stay valid across runs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

KINDS = ("tool_call", "react", "list", "table", "json_object", "summary", "arithmetic")

_CITIES = ["Paris", "Berlin", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Toronto", "Madrid", "Sydney", "Delhi", "Rome"]
_PEOPLE = ["Alice", "Bob", "Carol", "Dan", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
_TOPICS = [
    "fruits",
    "programming languages",
    "planets",
    "European capitals",
    "musical instruments",
    "sports",
    "kitchen tools",
    "mammals",
    "colours",
    "board games",
    "rivers",
    "vegetables",
    "car brands",
    "metals",
]
_ITEMS = ["laptop", "phone", "book", "chair", "lamp", "backpack", "camera", "guitar", "bicycle", "watch"]

_TOOLS: list[dict[str, Any]] = [
    {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"city": "string", "unit": "celsius|fahrenheit"},
    },
    {
        "name": "search_web",
        "description": "Search the web",
        "parameters": {"query": "string", "max_results": "integer"},
    },
    {
        "name": "send_email",
        "description": "Send an email",
        "parameters": {"to": "string", "subject": "string", "body": "string"},
    },
    {
        "name": "create_event",
        "description": "Add a calendar event",
        "parameters": {"title": "string", "date": "YYYY-MM-DD", "time": "HH:MM"},
    },
    {
        "name": "convert_currency",
        "description": "Convert money",
        "parameters": {"amount": "number", "from": "string", "to": "string"},
    },
    {"name": "lookup_order", "description": "Look up an order by id", "parameters": {"order_id": "string"}},
    {"name": "calculator", "description": "Evaluate an arithmetic expression", "parameters": {"expression": "string"}},
]


@dataclass(frozen=True)
class AgentPrompt:
    id: str
    kind: str
    messages: list[dict[str, str]]


def agent_prompts(n: int, *, seed: int = 0) -> Iterator[AgentPrompt]:
    """``n`` prompts cycling through :data:`KINDS` (so any prefix covers every kind)."""
    rng = random.Random(seed)
    makers = {
        "tool_call": _tool_call,
        "react": _react,
        "list": _list,
        "table": _table,
        "json_object": _json_object,
        "summary": _summary,
        "arithmetic": _arithmetic,
    }
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        yield AgentPrompt(f"agent-{seed}-{i}", kind, makers[kind](rng))


def _tool_system(rng: random.Random) -> tuple[str, list[dict[str, Any]]]:
    tools = rng.sample(_TOOLS, k=rng.randint(2, 4))
    spec = json.dumps(tools, separators=(",", ":"))
    system = (
        "You are an assistant that calls tools. Available tools: " + spec + "\n"
        'To call a tool, reply with only a JSON object: {"name": <tool name>, "arguments": {...}}.'
    )
    return system, tools


def _request_for(tool: dict[str, Any], rng: random.Random) -> str:
    name = tool["name"]
    if name == "get_weather":
        return f"What's the weather in {rng.choice(_CITIES)} in {rng.choice(['celsius', 'fahrenheit'])}?"
    if name == "search_web":
        return f"Find {rng.randint(2, 5)} articles about {rng.choice(_TOPICS)}."
    if name == "send_email":
        return f"Email {rng.choice(_PEOPLE).lower()}@example.com that the meeting moved to {rng.randint(1, 5)} pm."
    if name == "create_event":
        title = rng.choice(["Team sync", "Dentist", "Lunch with " + rng.choice(_PEOPLE)])
        date = f"2025-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}"
        return f"Schedule '{title}' on {date} at {rng.randint(8, 17)}:00."
    if name == "convert_currency":
        return (
            f"Convert {rng.randint(5, 900)} {rng.choice(['USD', 'EUR', 'JPY'])} to {rng.choice(['GBP', 'CHF', 'INR'])}."
        )
    if name == "lookup_order":
        return f"Where is my order {rng.choice('ABCXYZ')}{rng.randint(10000, 99999)}?"
    return f"What is {rng.randint(10, 999)} * {rng.randint(2, 99)} + {rng.randint(1, 500)}?"


def _tool_call(rng: random.Random) -> list[dict[str, str]]:
    system, tools = _tool_system(rng)
    return [{"role": "system", "content": system}, {"role": "user", "content": _request_for(rng.choice(tools), rng)}]


def _react(rng: random.Random) -> list[dict[str, str]]:
    system, tools = _tool_system(rng)
    system += "\nThink step by step. Use the format:\nThought: ...\nAction: <tool name>\nAction Input: <JSON>"
    return [{"role": "system", "content": system}, {"role": "user", "content": _request_for(rng.choice(tools), rng)}]


def _list(rng: random.Random) -> list[dict[str, str]]:
    n = rng.randint(3, 7)
    style = rng.choice(["a numbered list", "a bulleted list", "a markdown list"])
    return [{"role": "user", "content": f"Give me {n} {rng.choice(_TOPICS)} as {style}."}]


def _table(rng: random.Random) -> list[dict[str, str]]:
    topic = rng.choice(_TOPICS)
    cols = rng.choice(["name and description", "name, category and one fact", "name and colour"])
    return [{"role": "user", "content": f"Make a markdown table of {rng.randint(3, 5)} {topic} with columns {cols}."}]


def _json_object(rng: random.Random) -> list[dict[str, str]]:
    person = rng.choice(_PEOPLE)
    fields = rng.sample(["name", "age", "city", "email", "hobbies", "job", "skills"], k=rng.randint(3, 5))
    item = rng.choice(_ITEMS)
    if rng.random() < 0.5:
        text = f"Return a JSON object describing a person named {person} with the fields {', '.join(fields)}."
    else:
        text = f"Return a JSON object for a product '{item}' with fields name, price, in_stock and tags."
    return [{"role": "user", "content": text}]


def _summary(rng: random.Random) -> list[dict[str, str]]:
    a, b = rng.sample(_PEOPLE, 2)
    city = rng.choice(_CITIES)
    item = rng.choice(_ITEMS)
    text = (
        f"{a} met {b} in {city} to discuss the launch of a new {item}. They agreed the price should stay under "
        f"{rng.randint(50, 900)} dollars, that the first batch of {rng.randint(100, 5000)} units ships in "
        f"{rng.choice(['March', 'June', 'October'])}, and that {b} will write the announcement."
    )
    ask = rng.choice(["in one sentence", "in two sentences", "as three bullet points"])
    return [{"role": "user", "content": f"Summarize the following text {ask}:\n\n{text}"}]


def _arithmetic(rng: random.Random) -> list[dict[str, str]]:
    a, b, c = rng.randint(2, 60), rng.randint(2, 60), rng.randint(2, 30)
    item = rng.choice(_ITEMS)
    text = (
        f"{rng.choice(_PEOPLE)} buys {a} {item}s at {b} dollars each and gets a discount of {c} dollars. "
        "How much does she pay? Show the steps."
    )
    return [{"role": "user", "content": text}]
