"""Tool schemas, tool_choice, tool-call parsing (valid, partial, malformed, unicode), coercion, streaming."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessageChunk
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from agent_mtp.errors import ConfigError
from agent_mtp.langchain.tools import as_openai_tool
from agent_mtp.tools import (
    ToolCallStream,
    ToolSpec,
    call_schema,
    coerce_arguments,
    normalize_tool_choice,
    parse_tool_calls,
    render_tool_call,
    tool_call_grammar,
    tool_specs,
    tools_system_block,
    validation_errors,
)


@tool
def get_weather(city: str, days: int = 1) -> str:
    """Weather forecast for a city."""
    return "sunny"


class Address(BaseModel):
    street: str
    number: int


class Customer(BaseModel):
    """Create a customer."""

    name: str = Field(description="The customer's name")
    vip: bool = False
    address: Address | None = None
    tags: list[str] = Field(default_factory=list)


SPECS = tool_specs([as_openai_tool(get_weather), as_openai_tool(Customer)])


def block(payload: object) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"<tool_call>\n{text}\n</tool_call>"


# -- schemas and choices -------------------------------------------------------------------------------------------
def test_specs_from_langchain_tools_and_pydantic():
    assert [s.name for s in SPECS] == ["get_weather", "Customer"]
    assert SPECS[0].parameters["properties"]["days"]["type"] == "integer"
    assert "Create a customer" in SPECS[1].description


def test_duplicate_tool_names_are_rejected():
    with pytest.raises(ConfigError, match="unique"):
        tool_specs([as_openai_tool(get_weather), as_openai_tool(get_weather)])


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, None),
        ("auto", "auto"),
        ("any", "any"),
        ("required", "any"),
        (True, "any"),
        ("none", "none"),
        ("get_weather", "get_weather"),
        ({"type": "function", "function": {"name": "Customer"}}, "Customer"),
        ({"type": "tool", "name": "Customer"}, "Customer"),
    ],
)
def test_tool_choice_spellings(choice, expected):
    assert normalize_tool_choice(choice, ["get_weather", "Customer"]) == expected


def test_unknown_tool_choice_names_the_tools():
    with pytest.raises(ConfigError, match="get_weather"):
        normalize_tool_choice("get_time", ["get_weather"])


def test_call_schema_hoists_defs_of_each_tool():
    def with_defs(name: str) -> dict:
        params = {
            "type": "object",
            "properties": {"address": {"$ref": "#/$defs/Address"}},
            "$defs": {"Address": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Address"}}}},
        }
        return {"type": "function", "function": {"name": name, "parameters": params}}

    schema = call_schema(tool_specs([with_defs("a"), with_defs("b")]))
    assert set(schema["$defs"]) == {"a__Address", "b__Address"}
    arguments = schema["anyOf"][1]["properties"]["arguments"]
    assert arguments["properties"]["address"]["$ref"] == "#/$defs/b__Address"
    assert schema["$defs"]["b__Address"]["properties"]["next"]["$ref"] == "#/$defs/b__Address"


def test_grammar_per_tool_choice():
    assert json.loads(tool_call_grammar(SPECS, "none").source)["format"] == {
        "type": "any_text",
        "excludes": ["<tool_call>"],
    }
    auto = json.loads(tool_call_grammar(SPECS, "auto").source)
    assert auto["format"]["type"] == "triggered_tags"
    forced = json.loads(tool_call_grammar(SPECS, "any").source)
    assert forced["format"]["type"] == "tags_with_separator" and forced["format"]["at_least_one"]
    named = tool_call_grammar(SPECS, "get_weather").source
    assert "get_weather" in named and "Customer" not in named
    with_answer = json.loads(tool_call_grammar(SPECS, "auto", answer_schema={"type": "object"}).source)
    assert with_answer["format"]["type"] == "or"


def test_system_block_documents_the_syntax():
    text = tools_system_block(SPECS, "Customer", parallel=True)
    assert '"name": "get_weather"' in text
    assert "<tool_call>" in text and "</tool_call>" in text
    assert "must call the tool Customer" in text
    assert "several tools" in text


# -- parsing -------------------------------------------------------------------------------------------------------
def test_valid_call_is_parsed_with_unique_string_ids():
    text = block({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}})
    parsed = parse_tool_calls(text + "\n" + text, SPECS)
    assert parsed.content == ""
    assert [c["args"] for c in parsed.tool_calls] == [{"city": "Paris", "days": 2}] * 2
    ids = [c["id"] for c in parsed.tool_calls]
    assert all(isinstance(i, str) and i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert parsed.invalid_tool_calls == []


def test_text_around_calls_is_content():
    text = "Let me check.\n" + block({"name": "get_weather", "arguments": {"city": "Oslo"}}) + "\n"
    parsed = parse_tool_calls(text, SPECS)
    assert parsed.content == "Let me check."
    assert parsed.tool_calls[0]["name"] == "get_weather"


def test_partial_call_becomes_invalid():
    parsed = parse_tool_calls('Sure <tool_call>\n{"name":"get_weather","arguments":{"ci', SPECS)
    assert parsed.content == "Sure"
    assert parsed.tool_calls == []
    (bad,) = parsed.invalid_tool_calls
    assert bad["name"] == "get_weather" and "cut off" in bad["error"]
    assert bad["args"].startswith('{"name"')


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "get_weather", "arguments": {"city": }', "not valid JSON"),
        ('["get_weather"]', "JSON object"),
        ('{"name": "get_time", "arguments": {}}', "Unknown tool"),
        ('{"name": "get_weather", "arguments": "city=Paris"}', "not JSON"),
        ('{"name": "get_weather", "arguments": [1]}', "must be a JSON object"),
    ],
)
def test_malformed_calls_become_invalid(body, error):
    parsed = parse_tool_calls(block(body), SPECS)
    assert parsed.tool_calls == []
    (bad,) = parsed.invalid_tool_calls
    assert error in bad["error"]
    assert isinstance(bad["id"], str)


def test_unicode_arguments_survive_parsing_and_rendering():
    text = render_tool_call("Customer", {"name": "你好啊集团", "tags": ["こんにちは"]})
    assert "你好啊集团" in text  # not escaped in the history either
    parsed = parse_tool_calls(text, SPECS)
    assert parsed.tool_calls[0]["args"] == {"name": "你好啊集团", "tags": ["こんにちは"]}
    escaped = parse_tool_calls(block('{"name":"Customer","arguments":{"name":"\\u4f60\\u597d"}}'), SPECS)
    assert escaped.tool_calls[0]["args"]["name"] == "你好"


def test_arguments_given_as_a_json_string_are_accepted():
    parsed = parse_tool_calls(block({"name": "get_weather", "arguments": '{"city": "Rome"}'}), SPECS)
    assert parsed.tool_calls[0]["args"] == {"city": "Rome"}


# -- coercion ------------------------------------------------------------------------------------------------------
def test_arguments_are_coerced_to_schema_types():
    schema = dict(SPECS[1].parameters)
    schema["$defs"] = schema.get("$defs", {})
    args = {"name": 42, "vip": "true", "address": '{"street": "Main", "number": "7"}', "tags": '["a"]'}
    assert coerce_arguments(args, schema) == {
        "name": "42",
        "vip": True,
        "address": {"street": "Main", "number": 7},
        "tags": ["a"],
    }
    weather = coerce_arguments({"city": "Paris", "days": "3"}, SPECS[0].parameters)
    assert weather == {"city": "Paris", "days": 3}


def test_coercion_leaves_lossy_values_alone():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}}
    assert coerce_arguments({"n": "3.5", "x": "abc"}, schema) == {"n": "3.5", "x": "abc"}
    assert coerce_arguments({"n": 4.0, "x": "2.5"}, schema) == {"n": 4, "x": 2.5}


def test_validation_errors_report_schema_problems():
    ok = block({"name": "get_weather", "arguments": {"city": "Paris"}})
    assert validation_errors(ok, SPECS, require_call=True) == []
    missing = block({"name": "get_weather", "arguments": {"days": 2}})
    assert "city" in validation_errors(missing, SPECS, require_call=True)[0]
    assert validation_errors("no call", SPECS, require_call=True) == [
        "a tool call was required but the output has none"
    ]
    assert validation_errors("no call", SPECS, require_call=False) == []


# -- streaming -----------------------------------------------------------------------------------------------------
def _stream(text: str, step: int) -> tuple[str, AIMessageChunk]:
    parser = ToolCallStream(SPECS)
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    content = ""
    full: AIMessageChunk | None = None
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece)
        if i == len(pieces) - 1:
            tail = parser.finish()
            delta.content += tail.content
            delta.tool_call_chunks += tail.tool_call_chunks
        content += delta.content
        chunk = AIMessageChunk(
            content=delta.content,
            tool_call_chunks=delta.tool_call_chunks,
            chunk_position="last" if i == len(pieces) - 1 else None,
        )
        full = chunk if full is None else full + chunk
    assert full is not None
    return content, full


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_calls_aggregate_like_invoke(step):
    text = (
        "  Checking both.\n"
        + block({"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}})
        + "\n"
        + block({"name": "Customer", "arguments": {"name": "你好"}})
        + "\n"
    )
    content, full = _stream(text, step)
    parsed = parse_tool_calls(text, SPECS)
    assert content == parsed.content == "Checking both."
    assert full.content == parsed.content
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in parsed.tool_calls]
    assert all(c["id"] for c in full.tool_calls)
    assert len({c["id"] for c in full.tool_calls}) == 2
    assert full.invalid_tool_calls == []


@pytest.mark.parametrize("step", [1, 5])
def test_a_cut_off_streamed_call_aggregates_to_an_invalid_call(step):
    content, full = _stream('ok <tool_call>\n{"name":"get_weather","arguments":{"city":"Pa', step)
    assert content == "ok"
    assert full.tool_calls == []
    (bad,) = full.invalid_tool_calls
    assert bad["name"] == "get_weather"


def test_text_that_only_looks_like_a_call_opening_is_released():
    content, full = _stream("a <tool b <tool_cal", 2)
    assert content == "a <tool b <tool_cal"
    assert full.tool_calls == [] and full.invalid_tool_calls == []


def test_spec_defaults():
    spec = ToolSpec.from_openai({"type": "function", "function": {"name": "noop"}})
    assert spec.parameters == {"type": "object", "properties": {}}
    with pytest.raises(ConfigError):
        ToolSpec.from_openai({"type": "function", "function": {}})
