"""Issue 19, items 3 and 4 (service, LangChain and telemetry side): prompt tokens read from the engine's prefix
cache are reported (usage ``input_token_details.cache_read``, StepEvents, ``agent-mtp stats``), and an agent's
prompt at step n is a token prefix of its prompt at step n+1, so the cache can serve it."""

from __future__ import annotations

import itertools
from typing import Any, Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from agent_mtp import AgentMTPChat
from agent_mtp.events import MemoryRecorder, StepEvent
from agent_mtp.service import Service
from agent_mtp.telemetry import MemoryStore, Telemetry, TelemetryConfig
from agent_mtp.telemetry.dashboard import render
from tests.unit.test_chat_model_helpers import shared_tiny_engine


@pytest.fixture(scope="module")
def engine():
    return shared_tiny_engine()


def chat(engine: Any, **kwargs: Any) -> AgentMTPChat:
    settings: dict[str, Any] = {"model": engine, "max_tokens": 6, "mode": "ntp", "recorder": MemoryRecorder()}
    settings.update(kwargs)
    return AgentMTPChat(**settings)


# -- usage metadata ---------------------------------------------------------------------------------------------------
def test_a_repeated_request_reports_its_cached_prompt_tokens(engine):
    llm = chat(engine)
    question = "Please list three colours that a rainbow has, in order."
    llm.invoke(question)
    again = llm.invoke(question)
    usage = again.usage_metadata
    assert usage is not None
    cached = usage["input_token_details"]["cache_read"]
    assert 0 < cached < usage["input_tokens"]  # every prompt token but the last came from the cache
    assert cached == again.response_metadata["mtp"]["cached_prompt_tokens"]


def test_streaming_reports_input_and_cached_tokens_on_one_chunk(engine):
    llm = chat(engine)
    question = "Stream the names of two planets."
    llm.invoke(question)
    chunks = list(llm.stream(question))
    with_input = [c for c in chunks if c.usage_metadata and c.usage_metadata["input_tokens"]]
    assert len(with_input) == 1 and with_input[0] is chunks[-1]
    details = with_input[0].usage_metadata["input_token_details"]  # type: ignore[index]
    assert details["cache_read"] > 0
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    assert total.usage_metadata is not None
    assert total.usage_metadata["input_token_details"]["cache_read"] == details["cache_read"]


# -- events and telemetry ---------------------------------------------------------------------------------------------
def test_step_events_carry_prompt_and_cached_tokens_and_stats_show_the_hit_rate(engine):
    recorder = MemoryRecorder()
    llm = chat(engine, recorder=recorder)
    llm.invoke("Count from one to three.")
    llm.invoke("Count from one to three.")
    events = [e for e in recorder.events if isinstance(e, StepEvent)]
    assert len(events) == 2 and events[0].prompt_tokens == events[1].prompt_tokens
    assert events[0].cached_prompt_tokens < events[1].cached_prompt_tokens == events[1].prompt_tokens - 1

    config = TelemetryConfig()
    telemetry = Telemetry(MemoryStore(config=config), config=config, start=False)
    for event in events:
        telemetry.record(event)
    report = telemetry.query("1m")
    row = report.select(step_type=events[0].step_type)
    cached, prompt = (sum(e.cached_prompt_tokens for e in events), sum(e.prompt_tokens for e in events))
    assert row.prefix_cache_hit_rate == pytest.approx(cached / prompt)
    assert report.to_dict()["total"]["prefix_cache_hit_rate"] == row.prefix_cache_hit_rate
    assert report.to_dict()["total"]["cached_prompt_tokens"] == cached
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(render(report))
    assert "cache hit" in console.export_text()


# -- a LangGraph agent's prompts extend each other --------------------------------------------------------------------
class Booking(BaseModel):
    city: Literal["Paris", "Oslo"]
    people: int = Field(ge=1, le=9)


@tool(args_schema=Booking)
def check_table(city: str, people: int) -> str:
    """Check whether a table is free."""
    return f"free for {people} in {city}"


@tool(args_schema=Booking)
def book_table(city: str, people: int) -> str:
    """Book a table."""
    return f"booked {people} in {city} (ref 1234)"


def test_each_agent_step_prompt_extends_the_previous_one(engine, monkeypatch):
    """create_agent (LangGraph) with two tools and a plan that changes tool_choice at every step (each tool by
    name, then "none"): the token ids of step n's prompt are a prefix of step n+1's, and steps 2+ read that
    prefix from the cache."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call

    prompts: list[list[int]] = []
    generate = Service.generate

    def recording(self: Service, request: Any) -> Any:
        prompts.append(self.prompt_ids(request))
        return generate(self, request)

    monkeypatch.setattr(Service, "generate", recording)

    @wrap_model_call
    def plan(request, handler):  # type: ignore[no-untyped-def]
        used = {m.name for m in request.messages if isinstance(m, ToolMessage)}
        unused = [t.name for t in request.tools if t.name not in used]
        return handler(request.override(tool_choice=unused[0] if unused else "none"))

    llm = chat(engine, max_tokens=40, mode="verified")
    agent = create_agent(llm, tools=[check_table, book_table], middleware=[plan], system_prompt="Book tables.")
    state = agent.invoke({"messages": [HumanMessage("A table in Oslo for 2, please.")]})
    kinds = [type(m).__name__ for m in state["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert len(prompts) == 3
    for step, (before, after) in enumerate(itertools.pairwise(prompts), start=1):
        assert after[: len(before)] == before, f"step {step}'s prompt is not a prefix of step {step + 1}'s"
    replies = [m for m in state["messages"] if isinstance(m, AIMessage)]
    for reply, prompt in zip(replies[1:], prompts[:-1], strict=True):
        assert reply.usage_metadata is not None
        assert reply.usage_metadata["input_token_details"]["cache_read"] >= len(prompt) - 1
