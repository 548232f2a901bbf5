"""Serving chat completions: an OpenAI request -> a service ``Request``; a result or a stream -> OpenAI bodies.

Every request goes through :class:`agent_mtp.service.Service` (policy, monitors, breaker, one telemetry event per
step), exactly like :class:`~agent_mtp.AgentMTPChat`. Admission is a bounded queue in front of ``max_active``
decoding slots: a request beyond ``max_active + max_queue`` gets 429 with ``Retry-After``; a request's deadline
counts from its arrival, queueing included.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from agent_mtp.engine import DecodeConfig
from agent_mtp.policy.loading import PRESET_NAMES
from agent_mtp.server.errors import ServerError, from_exception, overloaded
from agent_mtp.server.protocol import (
    AgentMTPOptions,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceDelta,
    ChunkChoice,
    FunctionCall,
    ResponseMessage,
    ToolCall,
    ToolCallDelta,
    Usage,
    completion_id,
)
from agent_mtp.server.protocol import Choice as ResponseChoice
from agent_mtp.server.settings import ServerSettings
from agent_mtp.service import Delta, Limits, Request, Result, Service
from agent_mtp.tools import render_tool_call

DEFAULT_FIXED_MAX_TOKENS = 512


# ------------------------------------------------------------------------------------------------ admission
class Admission:
    """``max_active`` slots and a queue of ``max_queue`` requests waiting for one (asyncio; one event loop)."""

    def __init__(self, max_active: int, max_queue: int) -> None:
        self.max_active = max_active
        self.max_queue = max_queue
        self.active = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_active)
        self._mean_s = 1.0
        """EWMA of how long a slot is held (for Retry-After)."""

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self._mean_s * (self.waiting + 1) / self.max_active))

    async def acquire(self) -> Lease:
        """Wait for a decoding slot; raises the 429 ServerError when the queue is full."""
        if self.active + self.waiting >= self.max_active + self.max_queue:
            raise overloaded(self.retry_after_s(), self.active, self.waiting)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.active += 1
        return Lease(self)

    def _release(self, held_s: float) -> None:
        self.active -= 1
        self._slots.release()
        self._mean_s = 0.8 * self._mean_s + 0.2 * held_s

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a decoding slot for the block."""
        lease = await self.acquire()
        try:
            yield
        finally:
            lease.release()


class Lease:
    """One held slot; :meth:`release` is idempotent (a stream releases it when it ends, fails, is cancelled, or
    is dropped without ever being read)."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission
        self._started = time.perf_counter()

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._release(time.perf_counter() - self._started)


class LeasedStream:
    """An async iterator of SSE events that releases its slot when the events end, fail or are cancelled, and when
    the response is dropped before it was read (a client gone before the first byte)."""

    def __init__(self, events: AsyncIterator[str], lease: Lease) -> None:
        self._events = events
        self._lease = lease

    def __aiter__(self) -> LeasedStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await self._events.__anext__()
        except BaseException:  # StopAsyncIteration, errors, cancellation (the client left)
            self._lease.release()
            raise

    def __del__(self) -> None:
        self._lease.release()


# ------------------------------------------------------------------------------------------------ serving
@dataclass(frozen=True)
class _Call:
    request: Request
    id: str
    created: int


class ChatServing:
    """Turns chat-completion requests into service calls and their results into OpenAI responses."""

    def __init__(self, service: Service, settings: ServerSettings) -> None:
        self.service = service
        self.settings = settings
        self.admission = Admission(settings.max_active, settings.max_queue)
        self.model_names = {settings.model_name, settings.model, service.engine.model_id}

    # -- requests -------------------------------------------------------------------------------------------------
    def to_service_request(self, body: ChatCompletionRequest, *, timeout: float) -> Request:
        """The service ``Request`` of an OpenAI request (raises ServerError naming a bad field)."""
        if body.model not in self.model_names:
            msg = f"model={body.model!r} is not served here; use {self.settings.model_name!r} (see GET /v1/models)."
            raise ServerError(404, msg, param="model", code="model_not_found")
        options = body.agent_mtp or AgentMTPOptions()
        policy, decode = self._policy(options, body.token_limit)
        limits = Limits(
            max_tokens=body.token_limit,
            stop=body.stop_strings,
            timeout=timeout,
            temperature=body.temperature if body.temperature is not None else 0.0,
            top_p=body.top_p if body.top_p is not None else 1.0,
            seed=body.seed,
        )
        return Request(
            messages=tuple(_message(m, i) for i, m in enumerate(body.messages)),
            tools=tuple(t.model_dump(exclude_none=True) for t in body.tools or ()),
            tool_choice=_tool_choice(body),
            parallel_tool_calls=bool(body.parallel_tool_calls),
            response_format=_response_format(body),
            structured_output=body.response_format is not None and body.response_format.type != "text",
            limits=limits,
            policy=policy,
            decode=decode,
            step_type=options.step_type,
            run_id=options.run_id,
            on_timeout="return",
        )

    def _policy(self, options: AgentMTPOptions, max_tokens: int | None) -> tuple[str | None, DecodeConfig]:
        asked = options.policy is not None or options.mode is not None or options.threshold is not None
        if asked and not self.settings.allow_policy_override:
            msg = "This server does not take per-request policies (allow_policy_override is off); drop agent_mtp."
            raise ServerError(400, msg, param="agent_mtp.policy", code="policy_override_disabled")
        policy = options.policy if options.policy is not None else self.settings.policy
        if options.mode is not None or options.threshold is not None or options.k_max is not None:
            policy = "none"
        if options.policy is not None and options.policy not in (*PRESET_NAMES, "none", self.settings.policy):
            names = ", ".join([*PRESET_NAMES, "none"])
            msg = f"agent_mtp.policy={options.policy!r} is not offered here; use one of {names}."
            raise ServerError(400, msg, param="agent_mtp.policy", code="invalid_policy")
        fields: dict[str, Any] = {"mode": options.mode or self.settings.mode}
        if options.threshold is not None:
            fields["threshold"] = options.threshold
        if options.k_max is not None:
            fields["k_max"] = options.k_max
        fields["max_new_tokens"] = max_tokens or DEFAULT_FIXED_MAX_TOKENS
        try:
            decode = DecodeConfig(**fields)
        except ValueError as e:
            raise ServerError(400, str(e), param="agent_mtp", code="invalid_value") from e
        return (None if policy == "none" else policy), decode

    def deadline_s(self, body: ChatCompletionRequest) -> float:
        asked = body.agent_mtp.timeout if body.agent_mtp is not None else None
        limit = self.settings.request_timeout_s
        return min(asked, limit) if asked is not None else limit

    # -- non-streaming --------------------------------------------------------------------------------------------
    async def complete(self, body: ChatCompletionRequest) -> ChatCompletion:
        arrived = time.perf_counter()
        deadline = self.deadline_s(body)
        self.to_service_request(body, timeout=deadline)  # a bad request fails before it queues
        async with self.admission.slot():
            left = max(deadline - (time.perf_counter() - arrived), 1e-3)
            request = self.to_service_request(body, timeout=left)
            try:
                result = await self.service.agenerate(request)
            except Exception as e:
                raise from_exception(e) from e
        return self.completion(result, request)

    def completion(self, result: Result, request: Request) -> ChatCompletion:
        calls = [_tool_call(c) for c in result.tool_calls]
        message = ResponseMessage(content=result.content if (result.content or not calls) else None, tool_calls=calls)
        return ChatCompletion(
            model=self.settings.model_name,
            choices=[ResponseChoice(message=message, finish_reason=_finish_reason(result.finish_reason))],
            usage=_usage(result),
            agent_mtp=_extension(result, request),
        )

    # -- streaming ------------------------------------------------------------------------------------------------
    async def stream(self, body: ChatCompletionRequest) -> AsyncIterator[str]:
        """Server-sent events: OpenAI chunks, then ``data: [DONE]``. Admission and validation happen before the
        first event (so they are ordinary HTTP errors); a failure later is sent as an error event. Leaving early
        (the client disconnected) stops the decode at its next pass and frees the slot at once."""
        arrived = time.perf_counter()
        deadline = self.deadline_s(body)
        self.to_service_request(body, timeout=deadline)
        lease = await self.admission.acquire()
        try:
            left = max(deadline - (time.perf_counter() - arrived), 1e-3)
            call = _Call(self.to_service_request(body, timeout=left), completion_id(), int(time.time()))
        except BaseException:
            lease.release()
            raise
        return LeasedStream(self._events(body, call), lease)

    async def _events(self, body: ChatCompletionRequest, call: _Call) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        try:
            yield self._chunk(call, ChoiceDelta(role="assistant", content=""))
            index = 0
            # the deltas that arrived together (a greedy run's tokens, a busy event loop's backlog) go out as one
            # write, their text as one chunk: each message costs the serializer, the socket and, behind Ray Serve,
            # the handle's relay, whatever it carries
            async for burst in self.service.astream_bursts(call.request):
                events: list[str] = []
                text: list[str] = []
                for delta in burst:
                    if delta.content and not delta.tool_call_chunks:
                        text.append(delta.content)
                    elif delta.content or delta.tool_call_chunks:
                        self._flush_text(call, text, events)
                        calls = [_tool_call_delta(c, index + i) for i, c in enumerate(delta.tool_call_chunks)]
                        index += len(calls)
                        events.append(
                            self._chunk(call, ChoiceDelta(content=delta.content or None, tool_calls=calls or None))
                        )
                    if delta.result is not None:
                        self._flush_text(call, text, events)
                        events.append(self._last(call, delta, include_usage))
                self._flush_text(call, text, events)
                if events:  # (deltas without content or tool calls send nothing, as before)
                    yield "".join(events)
            yield "data: [DONE]\n\n"
        except Exception as e:
            error = from_exception(e)
            yield f"data: {json.dumps(error.body())}\n\n"

    def _chunk(self, call: _Call, delta: ChoiceDelta, finish: str | None = None, **extra: Any) -> str:
        chunk = ChatCompletionChunk(
            id=call.id,
            created=call.created,
            model=self.settings.model_name,
            choices=[ChunkChoice(delta=delta, finish_reason=finish)],
            **extra,
        )
        data = chunk.model_dump(exclude_none=True)
        data["choices"][0]["finish_reason"] = finish  # null until the last chunk, as OpenAI sends it
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _flush_text(self, call: _Call, text: list[str], events: list[str]) -> None:
        """Append one content chunk of the ``text`` gathered so far to ``events`` and empty it (nothing if none)."""
        if text:
            events.append(self._chunk(call, ChoiceDelta(content="".join(text))))
            text.clear()

    def _last(self, call: _Call, delta: Delta, include_usage: bool) -> str:
        result = delta.result
        assert result is not None
        events = self._chunk(
            call, ChoiceDelta(), _finish_reason(result.finish_reason), agent_mtp=_extension(result, call.request)
        )
        if include_usage:
            usage = ChatCompletionChunk(
                id=call.id, created=call.created, model=self.settings.model_name, choices=[], usage=_usage(result)
            )
            events += f"data: {usage.model_dump_json(exclude_none=True)}\n\n"
        return events


# ------------------------------------------------------------------------------------------------ helpers
def _message(message: ChatMessage, index: int) -> dict[str, Any]:
    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    text = message.text()
    if message.role == "assistant" and message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            try:
                args = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as e:
                param = f"messages.{index}.tool_calls.{j}.function.arguments"
                raise ServerError(
                    400,
                    f"{param} is not JSON ({e.msg}); send the arguments as a JSON object.",
                    param=param,
                    code="invalid_value",
                ) from e
            if not isinstance(args, dict):
                param = f"messages.{index}.tool_calls.{j}.function.arguments"
                raise ServerError(400, f"{param} must be a JSON object.", param=param, code="invalid_value")
            calls.append(render_tool_call(call.function.name, args))
        text = "\n".join(p for p in [text, *calls] if p)
    return {"role": role, "content": text}


def _tool_choice(body: ChatCompletionRequest) -> str | None:
    choice = body.tool_choice
    if choice is None:
        return None
    if isinstance(choice, str):
        return choice
    names = [t.function.name for t in body.tools or ()]
    if choice.function.name not in names:
        msg = f"tool_choice names {choice.function.name!r}, which is not in tools ({names})."
        raise ServerError(400, msg, param="tool_choice", code="invalid_value")
    return choice.function.name


def _response_format(body: ChatCompletionRequest) -> dict[str, Any] | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    assert fmt.json_schema is not None
    return {"type": "json_schema", "json_schema": {"name": fmt.json_schema.name, "schema": fmt.json_schema.schema_}}


def _finish_reason(reason: str) -> str:
    """OpenAI's finish reasons: a deadline cut the output short like a token limit ("length"); the engine's own
    reason is in ``agent_mtp.finish_reason``."""
    return "length" if reason == "timeout" else reason


def _usage(result: Result) -> Usage:
    stats = result.stats
    return Usage(
        prompt_tokens=result.usage.input_tokens,
        completion_tokens=result.usage.output_tokens,
        total_tokens=result.usage.total_tokens,
        prompt_tokens_details={"cached_tokens": stats.cached_prompt_tokens},  # type: ignore[arg-type]
    )


def _extension(result: Result, request: Request) -> dict[str, Any]:
    """The ``agent_mtp`` response field: the engine's finish reason, MTP statistics, the policy and its decision."""
    name = None if request.policy is None else str(request.policy)
    return {
        "finish_reason": result.finish_reason,
        "stats": result.stats.to_dict(),
        "policy_name": name,
        "policy": result.policy,
    }


def _tool_call(call: Any) -> ToolCall:
    args = json.dumps(call["args"], ensure_ascii=False)
    return ToolCall(id=call.get("id"), function=FunctionCall(name=call["name"], arguments=args))


def _tool_call_delta(chunk: Any, index: int) -> ToolCallDelta:
    return ToolCallDelta(
        index=index,
        id=chunk.get("id"),
        function={"name": chunk.get("name") or "", "arguments": chunk.get("args") or ""},
    )
