"""AgentMTPChat on the real default model: an agent loop, constrained exactness, jump-forward, the examples."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from agent_mtp import AgentMTPChat
from agent_mtp.engine import DecodeConfig
from agent_mtp.engine.grammar import compile_for_engine
from agent_mtp.langchain.messages import render_prompt
from agent_mtp.service import shared_engine
from agent_mtp.tools import parse_tool_calls, tool_call_grammar, tool_specs, tools_system_block

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return "It's sunny."


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_agent_loop_with_a_forced_first_call():
    llm = AgentMTPChat(max_tokens=64)
    question = HumanMessage("What is the weather in San Francisco, CA?")
    call = llm.bind_tools([get_weather], tool_choice="any").invoke([question])
    assert isinstance(call, AIMessage) and len(call.tool_calls) == 1 and not call.invalid_tool_calls
    assert call.tool_calls[0]["name"] == "get_weather"
    assert "San Francisco" in call.tool_calls[0]["args"]["location"]
    assert any(block["type"] == "tool_call" for block in call.content_blocks)
    result = get_weather.invoke(call.tool_calls[0])
    assert isinstance(result, ToolMessage)
    answer = llm.bind_tools([get_weather]).invoke([question, call, result])  # auto after the tool result
    assert isinstance(answer, AIMessage) and not answer.invalid_tool_calls
    assert answer.response_metadata["policy"]["step_type"] == "reasoning"


@pytest.mark.parametrize("jump_forward", [True, False])
def test_constrained_verified_equals_ntp_on_the_default_model(jump_forward):
    engine = shared_engine("default")
    specs = tool_specs([AgentMTPChat().bind_tools([get_weather]).kwargs["tools"][0]])  # type: ignore[attr-defined]
    grammar = compile_for_engine(engine, tool_call_grammar(specs, "any"), jump_forward=jump_forward)
    block = tools_system_block(specs, "any")
    prompt = render_prompt(engine.tokenizer, [HumanMessage("What is the weather in Paris?")], system_block=block)
    ntp = engine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=64), constraint=grammar.constraint())
    verified = engine.generate(
        prompt, DecodeConfig(mode="verified", max_new_tokens=64), constraint=grammar.constraint()
    )
    assert verified.token_ids == ntp.token_ids
    assert parse_tool_calls(ntp.text, specs).tool_calls[0]["args"] == {"location": "Paris"}


def test_jump_forward_appends_forced_tokens_without_forward_passes():
    question = "What is the weather in Paris?"
    runs = {}
    for jump_forward in (True, False):
        llm = AgentMTPChat(mode="ntp", max_tokens=48, jump_forward=jump_forward)
        runs[jump_forward] = llm.bind_tools([get_weather], tool_choice="any").invoke(question)
    with_jf, without = runs[True].response_metadata["mtp"], runs[False].response_metadata["mtp"]
    assert runs[True].tool_calls and runs[False].tool_calls
    assert without["jump_forward_tokens"] == 0 and with_jf["jump_forward_tokens"] > 10
    assert with_jf["forward_passes"] == with_jf["new_tokens"] - with_jf["jump_forward_tokens"]
    assert with_jf["forward_passes"] < without["forward_passes"]


def test_langgraph_agent_example_runs(capsys):
    example = load_example("langgraph_agent")
    state = example.run("What is the weather in Paris, in Fahrenheit?", max_tokens=96)
    tools_called = [m.name for m in state["messages"] if isinstance(m, ToolMessage)]
    assert tools_called == ["get_weather", "convert_temperature"]
    assert isinstance(state["structured_response"], example.WeatherAnswer)
    out = capsys.readouterr().out
    assert "model -> get_weather(" in out and "tokens/forward" in out and "answer:" in out


def test_quickstart_example_runs(capsys):
    load_example("quickstart").main()
    out = capsys.readouterr().out
    for label in ("invoke:", "stream:", "tool call: get_weather", "structured: City(", "async:"):
        assert label in out
