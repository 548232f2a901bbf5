"""End to end: AgentMTPChat with the default policy drives a few agent steps on the real default model, its
controller records them into Redis through Telemetry, and ``agent-mtp stats --json`` reports them."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import typer
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from typer.testing import CliRunner

from agent_mtp.engine import MTPEngine
from agent_mtp.events import InterventionEvent, MemoryRecorder, StepEvent
from agent_mtp.langchain import AgentMTPChat
from agent_mtp.telemetry import Telemetry, TelemetryConfig
from agent_mtp.telemetry.cli import register
from tests.fixtures.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.redis]

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class Tee:
    """Sends every event to telemetry (under test) and to a MemoryRecorder (what the chat model emitted)."""

    def __init__(self, *recorders: Any) -> None:
        self.recorders = recorders

    def record(self, event: StepEvent | InterventionEvent) -> None:
        for recorder in self.recorders:
            recorder.record(event)


def _cli() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """agent-mtp (test app)."""

    register(app)
    return app


def _agent_steps(llm: AgentMTPChat) -> None:
    """One small agent run: a tool call, the answer after the tool result, a formatting step, a chat turn."""
    with_tools = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    question = [SystemMessage("You are a weather assistant."), HumanMessage("What is the weather in Paris?")]
    call = with_tools.invoke(question)
    assert isinstance(call, AIMessage) and call.tool_calls and call.tool_calls[0]["name"] == "get_weather"
    answered = [*question, call, ToolMessage("18 C, sunny", tool_call_id=call.tool_calls[0]["id"])]
    llm.invoke(answered)
    llm.invoke([HumanMessage("List two colours, one per line.")], step_type="formatting")
    llm.invoke([HumanMessage("Say hello.")])
    with_tools.invoke([HumanMessage("Weather in Rome?")])


def test_agent_steps_are_reported_by_stats_json(redis_server: RedisServer, default_engine: MTPEngine) -> None:
    telemetry = Telemetry(redis_server.url, config=TelemetryConfig(namespace="e2e"), start=False)
    emitted = MemoryRecorder()
    llm = AgentMTPChat(model=default_engine, policy="default", recorder=Tee(telemetry, emitted), max_tokens=64)
    _agent_steps(llm)
    telemetry.report_intervention("manual_intervention", step_type="tool_call", run_id="run-1", note="checked")
    assert telemetry.flush()

    result = CliRunner().invoke(
        _cli(), ["stats", "--json", "--redis-url", redis_server.url, "--namespace", "e2e", "--window", "5m"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)

    steps = [e for e in emitted.events if isinstance(e, StepEvent)]
    assert len(steps) == 5  # one event per chat-model call
    assert Counter(e.step_type for e in steps) == {
        "tool_call": 2,
        "reasoning": 1,
        "formatting": 1,
        "final_answer": 1,
    }
    rows = {(row["step_type"], row["mode"]): row for row in report["rows"] if row["requests"]}
    expected = Counter((e.step_type, e.mode) for e in steps)
    assert {key: row["requests"] for key, row in rows.items()} == dict(expected)
    assert rows["tool_call", "verified"]["requests"] == 2  # the default policy decodes tool calls losslessly
    total = report["total"]
    assert total["requests"] == 5
    assert total["new_tokens"] == sum(e.new_tokens for e in steps) > 0
    assert total["forward_passes"] == sum(e.forward_passes for e in steps) > 0
    assert total["timeouts"] == sum(e.outcome == "timeout" or e.timeout for e in steps)
    assert total["retried"] == sum(e.attempts > 1 for e in steps)
    assert total["fallbacks"] == sum(e.fallback for e in steps)
    assert total["manual_interventions"] == 1
    assert total["latency_s"]["p99"] >= max(e.latency_s for e in steps)
    assert report["writers"] == 1 and report["health"] == {}
    assert report["recent_interventions"][0]["run_id"] == "run-1"
