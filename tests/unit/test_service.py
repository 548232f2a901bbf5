"""The service is the one request path: AgentMTPChat with a policy, without one, and the service called directly
give the same text and tool calls, and every step records exactly one StepEvent."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from agent_mtp import AgentMTPChat
from agent_mtp.events import MemoryRecorder, StepEvent
from agent_mtp.langchain.tools import as_openai_tool
from agent_mtp.service import FIXED_POLICY, Limits, Request, Service
from tests.unit.test_chat_model_helpers import shared_tiny_engine

# One step type whose settings equal the fixed ones below; verified is lossless, so even a retry in NTP would
# produce the same text.
SAME_POLICY: dict[str, Any] = {
    "name": "same-as-fixed",
    "defaults": {"mode": "verified", "threshold": 0.9, "k_max": 4, "max_new_tokens": 96},
}


class BookingArgs(BaseModel):
    city: Literal["Paris", "Oslo"]
    people: int = Field(ge=1, le=9)


@tool(args_schema=BookingArgs)
def book_table(city: str, people: int) -> str:
    """Book a table in a city for some people."""
    return f"booked {people} in {city}"


@pytest.fixture(scope="module")
def engine():
    return shared_tiny_engine()


def _events(recorder: MemoryRecorder) -> list[StepEvent]:
    return [e for e in recorder.events if isinstance(e, StepEvent)]


@pytest.mark.parametrize("tool_choice", [None, "book_table"])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_model_with_and_without_policy_and_the_service_agree(engine, tool_choice, stream) -> None:
    message = [HumanMessage("Book a table for two in Paris.")]
    outputs = []
    recorders = []
    for policy in (SAME_POLICY, None):
        recorder = MemoryRecorder()
        settings: dict[str, Any] = {"policy": policy, "recorder": recorder, "max_tokens": 96}
        if policy is None:
            settings.update(mode="verified", k_max=4)
        llm = AgentMTPChat(model=engine, **settings).bind_tools([book_table], tool_choice=tool_choice)
        if stream:
            chunks = list(llm.stream(message))
            full = chunks[0]
            for c in chunks[1:]:
                full += c
            outputs.append((full.content, [(c["name"], c["args"]) for c in full.tool_calls]))
        else:
            msg = llm.invoke(message)
            outputs.append((msg.content, [(c["name"], c["args"]) for c in msg.tool_calls]))
        recorders.append(recorder)

    recorder = MemoryRecorder()
    service = Service(engine, recorder=recorder)
    request = Request(
        messages=({"role": "user", "content": "Book a table for two in Paris."},),
        tools=(as_openai_tool(book_table),),
        tool_choice=tool_choice,
        limits=Limits(max_tokens=96),
        policy=None,
        decode=AgentMTPChat(model=engine, mode="verified", k_max=4, max_tokens=96)._fixed_config(),
    )
    if stream:
        deltas = list(service.stream(request))
        result = deltas[-1].result
        assert result is not None and "".join(d.content for d in deltas) == result.content
    else:
        result = service.generate(request)
    outputs.append((result.content, [(c["name"], c["args"]) for c in result.tool_calls]))
    recorders.append(recorder)

    assert outputs[0] == outputs[1] == outputs[2]
    if tool_choice is not None:
        assert outputs[0][1] and outputs[0][1][0][0] == "book_table"  # a forced call parsed into tool_calls
    for r in recorders:
        events = _events(r)
        assert len(events) == 1  # one step, one event, from the controller
        assert events[0].outcome == "ok" and events[0].mode == "verified"
    assert _events(recorders[1])[0].step_type == "unclassified"  # the trivial policy's one step type


def test_no_policy_is_the_trivial_policy(engine) -> None:
    assert FIXED_POLICY.defaults.retries.attempts == 1
    assert not FIXED_POLICY.defaults.fallback.enabled
    monitors = FIXED_POLICY.defaults.monitors
    assert not any(
        m.enabled for m in (monitors.validity, monitors.repetition, monitors.ntp_agreement, monitors.likelihood)
    )
    result = Service(engine).generate(
        Request(messages=({"role": "user", "content": "hi"},), policy=None, limits=Limits(max_tokens=5))
    )
    assert result.policy is None and result.usage.output_tokens == len(result.generation.token_ids) <= 5


async def test_async_forms_match_the_sync_ones(engine) -> None:
    service = Service(engine)
    request = Request(messages=({"role": "user", "content": "hi"},), policy=None, limits=Limits(max_tokens=8))
    sync = service.generate(request)
    assert (await service.agenerate(request)).text == sync.text
    deltas = [d async for d in service.astream(request)]
    assert "".join(d.content for d in deltas) == sync.text and deltas[-1].result is not None


async def test_worker_threads_reach_the_loop_in_order_with_one_wake_up_per_burst() -> None:
    """Items posted from many threads arrive on each queue in the order each thread posted them; while a wake-up is
    pending, further posts ride on it instead of scheduling their own."""
    import asyncio
    import threading

    from agent_mtp.service import _mailbox

    loop = asyncio.get_running_loop()
    box = _mailbox(loop)
    assert _mailbox(loop) is box  # one per loop
    wake_ups = 0
    schedule = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any) -> Any:
        nonlocal wake_ups
        wake_ups += 1
        return schedule(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        queues: list[asyncio.Queue[int]] = [asyncio.Queue() for _ in range(6)]
        gate = threading.Barrier(len(queues))

        def producer(queue: asyncio.Queue[int]) -> None:
            gate.wait()
            for i in range(200):
                box.post(queue, i)

        threads = [threading.Thread(target=producer, args=(q,)) for q in queues]
        for t in threads:
            t.start()
        await asyncio.to_thread(lambda: [t.join() for t in threads])
        received = [[await asyncio.wait_for(q.get(), 5) for _ in range(200)] for q in queues]
    finally:
        del loop.call_soon_threadsafe
    assert received == [list(range(200))] * len(queues)
    assert 1 <= wake_ups < 6 * 200  # the loop ran nothing while the producers posted: far fewer wake-ups


def test_a_closed_loop_refuses_posts() -> None:
    import asyncio

    from agent_mtp.service import _Mailbox

    loop = asyncio.new_event_loop()
    box = _Mailbox(loop)
    queue: asyncio.Queue[int] = asyncio.Queue()
    loop.close()
    with pytest.raises(RuntimeError):
        box.post(queue, 1)
    with pytest.raises(RuntimeError):  # and stays closed, holding nothing
        box.post(queue, 2)
    assert box._items == []


def test_shared_engine_prepares_its_runtime_then_freezes_what_loading_left_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first load of an engine prepares its runtime (else the first request pays it in its time to first
    token) and then takes the objects alive out of the collector's scans (their full collections stalled every
    stream), those the preparation made included; a second request for the same engine does neither again."""
    import gc

    from agent_mtp import service
    from agent_mtp.engine import MTPEngine

    class Loaded:
        def __init__(self) -> None:
            self.prepared: list[int] = []
            self.made: list[list[int]] = []

        def prepare_runtime(self) -> None:  # what the first generation would otherwise make, before the freeze
            self.prepared.append(gc.get_freeze_count())
            self.made = [[i] for i in range(3000)]

    loaded = Loaded()
    monkeypatch.setattr(MTPEngine, "from_pretrained", classmethod(lambda cls, *a, **k: loaded))
    monkeypatch.setattr(service, "_ENGINES", {})
    kept = [[i] for i in range(5000)]  # tracked objects alive before the load
    before = gc.get_freeze_count()
    try:
        assert service.shared_engine("freeze-test-model") is loaded
        frozen = gc.get_freeze_count()
        assert loaded.prepared == [before]  # prepared once, before the freeze, which takes what it made too
        assert frozen >= before + len(kept) + len(loaded.made)
        assert service.shared_engine("freeze-test-model") is loaded
        assert gc.get_freeze_count() == frozen and len(loaded.prepared) == 1
    finally:
        gc.unfreeze()  # the rest of the session collects as before
    del kept
