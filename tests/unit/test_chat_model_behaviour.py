"""AgentMTPChat on a tiny random model: invoke/stream/async, metadata, tools, structured output, policy, errors."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
from langchain_core.exceptions import ContextOverflowError, ModelInvalidRequestError, ModelTimeoutError
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field, ValidationError
from typing_extensions import TypedDict

from agent_mtp import AgentMTPChat
from agent_mtp.errors import ConfigError, DeadlineExceededError, PolicyError, PromptTooLongError
from agent_mtp.events import MemoryRecorder, StepEvent
from agent_mtp.langchain import MTPContextOverflowError, MTPInvalidRequestError, MTPTimeoutError
from tests.unit.test_chat_model_helpers import shared_tiny_engine


class BookingArgs(BaseModel):
    city: Literal["Paris", "Oslo", "Zürich"]
    people: int = Field(ge=1, le=9)


@tool(args_schema=BookingArgs)
def book_table(city: str, people: int) -> str:
    """Book a table in a city for some people (bounded arguments keep a random model's calls short)."""
    return f"booked {people} in {city}"


class Verdict(BaseModel):
    """A short verdict."""

    label: str = Field(max_length=8)
    score: int = Field(ge=0, le=9)


class VerdictDict(TypedDict):
    """A short verdict."""

    label: Literal["good", "bad"]
    score: Literal[0, 1, 2]


VERDICT_SCHEMA = {
    "title": "Verdict",
    "description": "A short verdict.",
    "type": "object",
    "properties": {"label": {"type": "string", "maxLength": 8}, "score": {"type": "integer", "maximum": 9}},
    "required": ["label", "score"],
}


@pytest.fixture(scope="module")
def engine():
    return shared_tiny_engine()


def chat(engine, **kwargs: Any) -> AgentMTPChat:
    settings: dict[str, Any] = {"model": engine, "max_tokens": 48}
    if "policy" not in kwargs:
        settings.update(mode="confadapt", threshold=0.0, k_max=4)
    settings.update(kwargs)
    return AgentMTPChat(**settings)


def aggregate(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    return full


# -- plain generation ----------------------------------------------------------------------------------------------
def test_invoke_returns_usage_and_mtp_metadata(engine):
    msg = chat(engine).invoke("Hello")
    assert isinstance(msg, AIMessage) and isinstance(msg.content, str)
    usage = msg.usage_metadata
    assert usage is not None and usage["output_tokens"] == 48 and usage["input_tokens"] > 5
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    meta = msg.response_metadata
    assert meta["model_name"] == "tiny-smollm2-vocab"
    assert meta["finish_reason"] == "length"
    mtp = meta["mtp"]
    assert mtp["mode"] == "confadapt" and mtp["forward_passes"] >= 1
    assert mtp["tokens_per_forward"] > 1  # threshold 0 accepts whole blocks
    assert sum(int(k) * v for k, v in mtp["accept_histogram"].items()) == mtp["new_tokens"]
    assert {"wall_s", "jump_forward_tokens", "ttft_s"} <= set(mtp)


def test_stream_yields_one_chunk_per_forward_pass(engine):
    llm = chat(engine)
    chunks = list(llm.stream("Hello"))
    full = aggregate(chunks)
    invoked = llm.invoke("Hello")
    assert full.content == invoked.content
    assert len(chunks) == full.response_metadata["mtp"]["forward_passes"]
    assert chunks[-1].chunk_position == "last"
    assert all(c.chunk_position is None for c in chunks[:-1])
    assert [bool(c.usage_metadata and c.usage_metadata["input_tokens"]) for c in chunks].count(True) == 1
    assert full.usage_metadata == invoked.usage_metadata
    assert full.response_metadata["model_name"] == "tiny-smollm2-vocab"  # set on one chunk only


def test_stop_strings_from_init_and_call_are_both_applied(engine):
    text = chat(engine, max_tokens=40).invoke("Hello").content
    assert len(text) > 4
    cut = text[2:4]
    stopped = chat(engine, max_tokens=40, stop=["\u2603"]).invoke("Hello", stop=[cut])
    assert stopped.content == text[: text.find(cut)]
    assert stopped.response_metadata["finish_reason"] == "stop"


def test_streaming_flag_makes_invoke_stream(engine):
    tokens: list[str] = []

    from langchain_core.callbacks import BaseCallbackHandler

    class Collect(BaseCallbackHandler):
        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            tokens.append(token)

    msg = chat(engine, streaming=True).invoke("Hello", config={"callbacks": [Collect()]})
    assert "".join(tokens) == msg.content
    assert len(tokens) == msg.response_metadata["mtp"]["forward_passes"]


# -- tools ---------------------------------------------------------------------------------------------------------
def test_bind_tools_stores_openai_tools_under_the_tools_kwarg(engine):
    bound = chat(engine).bind_tools([book_table], tool_choice="required", parallel_tool_calls=True)
    assert bound.kwargs["tools"][0]["type"] == "function"  # type: ignore[attr-defined]
    assert bound.kwargs["tools"][0]["function"]["name"] == "book_table"  # type: ignore[attr-defined]
    assert bound.kwargs["tool_choice"] == "any"  # type: ignore[attr-defined]
    assert bound.kwargs["parallel_tool_calls"] is True  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="book_table"):
        chat(engine).bind_tools([book_table], tool_choice="nope")


@pytest.mark.parametrize("choice", ["any", "book_table"])
def test_forced_tool_call_is_valid_on_a_random_model(engine, choice):
    llm = chat(engine, max_tokens=200).bind_tools([book_table], tool_choice=choice)
    msg = llm.invoke("Book a table in Paris for 2.")
    assert msg.invalid_tool_calls == []
    (call,) = msg.tool_calls
    assert call["name"] == "book_table" and set(call["args"]) == {"city", "people"}
    assert isinstance(call["args"]["people"], int)
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    assert msg.response_metadata["mtp"]["jump_forward_tokens"] > 0


def test_streamed_tool_calls_aggregate_to_the_invoked_ones(engine):
    llm = chat(engine, max_tokens=200).bind_tools([book_table], tool_choice="any")
    invoked = llm.invoke("Book a table.")
    full = aggregate(list(llm.stream("Book a table.")))
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in invoked.tool_calls]
    assert full.tool_calls[0]["id"]
    assert full.response_metadata["finish_reason"] == "tool_calls"


def test_tool_choice_none_keeps_the_prompt_but_never_calls(engine):
    """The tools stay in the prompt whatever the step's tool_choice (so each agent step's prompt extends the last
    one, for the prefix cache); the grammar keeps "none" from calling."""
    llm = chat(engine).bind_tools([book_table], tool_choice="none")
    msg = llm.invoke("Book a table.")
    assert msg.tool_calls == [] and msg.invalid_tool_calls == [] and "<tool_call>" not in msg.content
    forced = chat(engine).bind_tools([book_table], tool_choice="any").invoke("Book a table.")
    assert msg.usage_metadata["input_tokens"] == forced.usage_metadata["input_tokens"]


def test_a_cut_off_call_is_reported_as_invalid(engine):
    msg = chat(engine, max_tokens=8).bind_tools([book_table], tool_choice="any").invoke("Book.")
    assert msg.tool_calls == []
    assert len(msg.invalid_tool_calls) == 1 and "max_tokens" in msg.invalid_tool_calls[0]["error"]
    assert msg.response_metadata["finish_reason"] == "length"


def test_a_tool_message_last_continues_the_conversation(engine):
    history = [
        HumanMessage("Book a table in Oslo for 3."),
        AIMessage("", tool_calls=[{"name": "book_table", "args": {"city": "Oslo", "people": 3}, "id": "c1"}]),
        ToolMessage("booked", tool_call_id="c1"),
    ]
    msg = chat(engine).bind_tools([book_table]).invoke(history)
    assert isinstance(msg, AIMessage)


# -- structured output ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
@pytest.mark.parametrize("schema", [Verdict, VerdictDict, VERDICT_SCHEMA], ids=["pydantic", "typeddict", "json"])
def test_structured_output_always_parses(engine, method, schema):
    llm = chat(engine, max_tokens=120).with_structured_output(schema, method=method)
    result = llm.invoke("Judge this.")
    if schema is Verdict:
        assert isinstance(result, Verdict)
    else:
        assert isinstance(result, dict) and set(result) == {"label", "score"}
        assert isinstance(result["score"], int)


def test_structured_output_include_raw(engine):
    llm = chat(engine, max_tokens=120).with_structured_output(Verdict, include_raw=True)
    out = llm.invoke("Judge this.")
    assert isinstance(out["raw"], AIMessage) and isinstance(out["parsed"], Verdict) and out["parsing_error"] is None
    cut_off = chat(engine, max_tokens=4).with_structured_output(Verdict, method="json_schema", include_raw=True)
    broken = cut_off.invoke("Judge.")
    assert broken["raw"].response_metadata["finish_reason"] == "length"
    assert broken["parsed"] is None and broken["parsing_error"] is not None


# -- policy and telemetry ------------------------------------------------------------------------------------------
def test_policy_decides_and_reports_in_metadata(engine):
    recorder = MemoryRecorder()
    llm = AgentMTPChat(model=engine, max_tokens=200, recorder=recorder)  # the shipped default policy
    msg = llm.bind_tools([book_table], tool_choice="any").invoke("Book a table.")
    policy = msg.response_metadata["policy"]
    assert policy["step_type"] == "tool_call" and policy["mode"] == "verified"
    assert policy["decisions"][0].startswith("step type tool_call")
    assert msg.tool_calls
    (event,) = [e for e in recorder.events if isinstance(e, StepEvent)]
    assert event.step_type == "tool_call" and event.outcome == "ok"


def test_policy_streaming_path_observes_the_step(engine):
    recorder = MemoryRecorder()
    llm = AgentMTPChat(model=engine, max_tokens=20, recorder=recorder)
    full = aggregate(list(llm.stream("Hello")))
    assert full.response_metadata["policy"]["step_type"] == "final_answer"
    assert len(recorder.events) == 1


def test_explicit_step_type_per_call(engine):
    llm = AgentMTPChat(model=engine, max_tokens=10)
    assert llm.invoke("Hello", step_type="reasoning").response_metadata["policy"]["step_type"] == "reasoning"
    tagged = llm.invoke("Hello", config={"metadata": {"step_type": "formatting"}})
    assert tagged.response_metadata["policy"]["step_type"] == "formatting"


def test_fixed_settings_record_an_event_too(engine):
    recorder = MemoryRecorder()
    chat(engine, recorder=recorder).invoke("Hello")
    (event,) = recorder.events
    assert isinstance(event, StepEvent) and event.mode == "confadapt" and event.new_tokens == 48


# -- async ---------------------------------------------------------------------------------------------------------
async def test_ainvoke_does_not_block_the_running_loop(engine):
    llm = chat(engine, max_tokens=48, mode="ntp", threshold=None, k_max=None)
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    msg = await llm.ainvoke("Hello")
    done = True
    await task
    assert isinstance(msg, AIMessage) and msg.usage_metadata["output_tokens"] == 48
    assert ticks > 1  # the loop kept running while the engine worked in a thread


async def test_astream_matches_stream_and_does_not_block(engine):
    llm = chat(engine)
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    chunks = [c async for c in llm.astream("Hello")]
    done = True
    await task
    assert aggregate(chunks).content == aggregate(list(llm.stream("Hello"))).content
    assert chunks[-1].chunk_position == "last"
    assert ticks > 1


async def test_breaking_out_of_astream_releases_the_engine(engine):
    llm = chat(engine, max_tokens=40, k_max=1)
    async for _chunk in llm.astream("Hello"):
        break
    msg = await asyncio.wait_for(llm.ainvoke("Hello"), timeout=120)
    assert isinstance(msg, AIMessage)


async def test_async_tool_calls_and_concurrent_calls(engine):
    llm = chat(engine, max_tokens=200).bind_tools([book_table], tool_choice="any")
    results = await asyncio.gather(llm.ainvoke("Book a table."), llm.ainvoke("Book another table."))
    assert all(r.tool_calls and not r.invalid_tool_calls for r in results)
    full = None
    async for chunk in llm.astream("Book a table."):
        full = chunk if full is None else full + chunk
    assert full is not None and full.tool_calls


# -- errors --------------------------------------------------------------------------------------------------------
def test_prompt_too_long_is_a_context_overflow(engine):
    with pytest.raises(ContextOverflowError) as info:
        chat(engine).invoke("word " * 3000)
    assert isinstance(info.value, MTPContextOverflowError) and isinstance(info.value, PromptTooLongError)
    assert info.value.context_window == 2048
    with pytest.raises(ContextOverflowError):
        list(chat(engine).stream("word " * 3000))


def test_deadline_raises_a_retryable_timeout_before_the_first_chunk(engine):
    llm = chat(engine, timeout=1e-9)
    with pytest.raises(ModelTimeoutError) as info:
        llm.invoke("Hello")
    assert info.value.is_retryable and isinstance(info.value, DeadlineExceededError)
    assert isinstance(info.value, MTPTimeoutError)
    chunks: list[AIMessageChunk] = []
    with pytest.raises(ModelTimeoutError):
        for chunk in llm.stream("Hello"):
            chunks.append(chunk)
    assert chunks == []
    partial = chat(engine, timeout=1e-9, on_timeout="return").invoke("Hello")
    assert partial.response_metadata["finish_reason"] == "timeout"


async def test_async_errors_keep_their_types(engine):
    with pytest.raises(ModelTimeoutError):
        await chat(engine, timeout=1e-9).ainvoke("Hello")
    with pytest.raises(ModelTimeoutError):
        async for _chunk in chat(engine, timeout=1e-9).astream("Hello"):
            pass


def test_bad_requests_are_invalid_request_errors(engine):
    llm = chat(engine)
    with pytest.raises(ModelInvalidRequestError, match="text-only"):
        llm.invoke([HumanMessage([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])])
    with pytest.raises(ModelInvalidRequestError, match="response_format"):
        llm.invoke("Hello", response_format={"type": "xml"})
    with pytest.raises(MTPInvalidRequestError, match="policy=None"):
        AgentMTPChat(model=engine).invoke("Hello", mode="ntp")
    with pytest.raises(ModelInvalidRequestError, match="function name"):
        llm.bind(tools=[{"type": "function", "function": {}}]).invoke("Hello")
    with pytest.raises(ModelInvalidRequestError, match="not a bound tool"):
        llm.bind(tools=[convert_to_openai_tool(book_table)]).invoke("Hello", tool_choice="nope")


def test_bad_settings_fail_at_construction(engine):
    """Agent-mtp errors of LangChain's class (never pydantic's ValidationError) that name the value."""
    with pytest.raises(MTPInvalidRequestError, match=r"threshold=-1\.0"):
        AgentMTPChat(model=engine, threshold=-1.0)
    with pytest.raises(MTPInvalidRequestError, match="policy=None"):
        AgentMTPChat(model=engine, mode="ntp", policy="default")
    with pytest.raises(PolicyError, match="does not exist") as info:
        AgentMTPChat(model=engine, policy="no/such/policy.yaml")
    assert isinstance(info.value, ModelInvalidRequestError) and not isinstance(info.value, ValidationError)
    assert AgentMTPChat(model=engine, mode="ntp").policy is None


def test_identifying_and_tracing_params(engine):
    llm = chat(engine, max_tokens=7, stop=["x"])
    assert llm._identifying_params["model"] == "tiny-smollm2-vocab"
    params = llm._get_ls_params(stop=["y"])
    assert params["ls_provider"] == "agent_mtp" and params["ls_max_tokens"] == 7 and params["ls_stop"] == ["y"]
    assert llm._get_ls_params(model="other")["ls_model_name"] == "other"
    assert AgentMTPChat().model_name == "SmolLM2-135M-Instruct"  # named without loading anything


# -- an agent loop -------------------------------------------------------------------------------------------------
def test_create_agent_loop_runs_on_a_random_model(engine):
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call

    @wrap_model_call
    def call_once_then_answer(request, handler):  # type: ignore[no-untyped-def]
        answered = any(isinstance(m, ToolMessage) for m in request.messages)
        return handler(request.override(tool_choice="none" if answered else "any"))

    agent = create_agent(chat(engine, max_tokens=120), tools=[book_table], middleware=[call_once_then_answer])
    state = agent.invoke({"messages": [HumanMessage("Book a table in Paris for 2.")]})
    kinds = [type(m).__name__ for m in state["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert state["messages"][1].tool_calls[0]["name"] == "book_table"
    assert state["messages"][2].content.startswith("booked")
