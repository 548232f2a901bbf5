"""The service: one request path from messages to a result, used by every front end (the LangChain chat model, the
server).

    service = Service(engine, recorder=recorder)            # one per engine + telemetry sink (see shared_service)
    result = service.generate(Request(messages=[{"role": "user", "content": "hi"}], policy="default"))
    result.text, result.tool_calls, result.finish_reason, result.stats, result.policy, result.usage
    for delta in service.stream(request): ...                # one delta per forward pass, the last has .result
    await service.agenerate(request); async for delta in service.astream(request): ...

A request names its messages, tools, tool choice, response format, limits (max tokens, stop strings, deadline,
sampling), a policy and an optional step-type hint. The policy controller runs every request: ``policy=None`` is
the trivial policy (``Request.decode``, one fixed :class:`DecodeConfig`, no monitors, no retries, no breaker), not a
second code path, so every step, streamed or not, with or without a policy, yields exactly one
:class:`~agent_mtp.events.StepEvent`, recorded by the controller.

Errors are :mod:`agent_mtp.errors` types; front ends map them to their own (LangChain's, HTTP statuses).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import gc
import json
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, SkipValidation

from agent_mtp.engine import DecodeConfig, DecodeStats, GenerationResult, MTPEngine
from agent_mtp.engine.batching import BatchedEngine
from agent_mtp.engine.grammar import CompiledGrammar, GrammarSpec, compile_for_engine
from agent_mtp.engine.loading import DEFAULT_MODEL_ALIASES
from agent_mtp.engine.prompt import render_messages
from agent_mtp.errors import ConfigError, DeadlineExceededError, EmptyPromptError
from agent_mtp.events import Recorder
from agent_mtp.policy import (
    MonitorVerdict,
    Policy,
    PolicyController,
    PolicyResult,
    StepContext,
    StepPlan,
    json_validator,
    load_policy,
    resolve_policy_path,
)
from agent_mtp.policy.schema import (
    ClassificationSettings,
    FallbackSettings,
    MonitorSettings,
    RetrySettings,
    StepSettings,
    check_decode_settings,
)
from agent_mtp.tools import (
    ToolCallStream,
    ToolSpec,
    normalize_tool_choice,
    parse_tool_calls,
    tool_call_grammar,
    tool_specs,
    tools_system_block,
    validation_errors,
)

__all__ = [
    "FIXED_POLICY",
    "Delta",
    "Limits",
    "Request",
    "Result",
    "Service",
    "Usage",
    "check_policy",
    "checked_tool_choice",
    "default_recorder",
    "prompt_ids",
    "shared_engine",
    "shared_service",
    "tool_plan",
]

DEFAULT_MAX_TOKENS = 256
PolicyLike = str | Path | Policy | Mapping[str, Any]


def _fixed_policy() -> Policy:
    off = {"enabled": False}
    monitors = MonitorSettings.model_validate(
        {"validity": off, "repetition": off, "ntp_agreement": off, "likelihood": off}
    )
    settings = StepSettings(
        retries=RetrySettings(attempts=1, escalate=[]), monitors=monitors, fallback=FallbackSettings(enabled=False)
    )
    return Policy(
        name="fixed",
        description="The trivial policy: the request's own DecodeConfig, no monitors, no retries, no breaker.",
        defaults=settings,
        steps={"unclassified": StepSettings()},
        classification=ClassificationSettings(rules=[], default="unclassified"),
    )


FIXED_POLICY = _fixed_policy()
"""What ``policy=None`` runs: one step type (``unclassified`` unless the request names one), nothing checked."""


# ------------------------------------------------------------------------------------------------ request
@dataclass(frozen=True)
class Limits:
    """Request-level settings applied on top of the policy's (or the fixed) decode settings; checked at
    construction (:class:`~agent_mtp.errors.ConfigError` names the bad value)."""

    max_tokens: int | None = None
    """Most tokens to generate (None: the policy's limit, or the fixed config's)."""
    stop: tuple[str, ...] = ()
    """Stop strings, added to the config's own."""
    timeout: float | None = None
    """Deadline in seconds (the tighter of this and the config's ``max_time``)."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_decode_settings(
            "Limits", max_tokens=self.max_tokens, timeout=self.timeout, temperature=self.temperature
        )  # the policy schema's ranges
        self.apply(DecodeConfig())

    def apply(self, config: DecodeConfig) -> DecodeConfig:
        changes: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
        if self.stop:
            changes["stop"] = tuple(dict.fromkeys([*config.stop, *self.stop]))
        if self.max_tokens is not None:
            changes["max_new_tokens"] = self.max_tokens
        if self.timeout is not None:
            changes["max_time"] = min(self.timeout, config.max_time) if config.max_time else self.timeout
        return config.replace(**changes)


class Request(BaseModel):
    """One step of an agent: what to answer and under which rules."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    messages: tuple[Mapping[str, Any], ...]
    """``{"role": system|user|assistant|tool, "content": str}``; rendered by the engine's one renderer."""
    tools: tuple[Mapping[str, Any], ...] = ()
    """OpenAI-format tools (``{"type": "function", "function": {...}}``)."""
    tool_choice: str | None = None
    """None/"auto", "any", "none" or a tool name (see :func:`agent_mtp.tools.normalize_tool_choice`)."""
    parallel_tool_calls: bool = False
    response_format: Mapping[str, Any] | None = None
    """OpenAI-style (``json_schema`` / ``json_object`` / ``text``) or a bare JSON schema."""
    structured_output: bool = False
    """The caller parses the answer into a schema (a hint for the policy's step classification)."""
    limits: InstanceOf[Limits] = Limits()
    policy: Annotated[PolicyLike | None, SkipValidation] = "default"
    """A shipped name, a YAML path, a Policy or a mapping (kept as given: controllers are shared per policy
    object); None: the trivial policy with ``decode``."""
    decode: InstanceOf[DecodeConfig] = Field(default_factory=lambda: DecodeConfig(max_new_tokens=DEFAULT_MAX_TOKENS))
    """Decode settings of the trivial policy (only read when ``policy`` is None)."""
    step_type: str | None = None
    """Explicit step type (wins over the policy's classification rules)."""
    run_id: str | None = None
    """Carried into the StepEvent."""
    jump_forward: bool = True
    """Append grammar-forced tokens without a forward pass."""
    on_timeout: Literal["raise", "return"] = "raise"
    """raise: a deadline raises DeadlineExceededError; return: the partial output, finish_reason "timeout"."""


# ------------------------------------------------------------------------------------------------ result
@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int = 0
    """Input tokens whose keys and values came from the engine's prefix cache (not prefilled again)."""

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class Result:
    """What a step produced."""

    text: str
    """Everything the model wrote (tool-call blocks included)."""
    content: str
    """The text outside tool calls (equal to ``text`` without tools)."""
    tool_calls: list[Any]
    """Complete, valid calls: ``{"name", "args", "id", "type": "tool_call"}``."""
    invalid_tool_calls: list[Any]
    finish_reason: str
    """stop, length, timeout, or tool_calls (stopped after a call)."""
    generation: GenerationResult
    usage: Usage
    model: str
    policy: dict[str, Any] | None
    """The policy's decision (step type, mode, attempts, monitors, ...); None for the trivial policy."""
    event: Any = None
    """The StepEvent recorded for the step."""

    @property
    def stats(self) -> DecodeStats:
        return self.generation.stats


@dataclass(frozen=True)
class Delta:
    """One forward pass of a stream: new content and complete tool-call chunks; the last carries ``result``."""

    content: str
    tool_call_chunks: list[Any]
    token_ids: tuple[int, ...]
    usage: Usage
    """Output tokens of this delta; input (and cached input) tokens on the last delta only."""
    finish_reason: str | None = None
    result: Result | None = None


# ------------------------------------------------------------------------------------------------ the service
@dataclass
class _Prepared:
    request: Request
    prompt_ids: list[int]
    specs: list[ToolSpec]
    grammar: CompiledGrammar | None
    validators: tuple[Callable[[str], Any], ...]
    context: StepContext


class Service:
    """The request path over one engine; thread-safe.

    ``concurrency``: "serial" (default) lets the engine serialise generations behind its lock; "batched" runs
    concurrent requests in shared forward passes (:class:`~agent_mtp.engine.batching.BatchedEngine`: continuous
    batching, greedy output unchanged; what the server uses). :meth:`close` stops the batch scheduler."""

    def __init__(
        self,
        engine: MTPEngine,
        *,
        recorder: Recorder | None = None,
        breaker_store: str | None = None,
        concurrency: Literal["serial", "batched"] = "serial",
    ):
        if concurrency not in ("serial", "batched"):
            raise ConfigError(f"concurrency={concurrency!r} is invalid; use 'serial' or 'batched'.")
        self.engine = engine
        self.decoder: Any = BatchedEngine(engine) if concurrency == "batched" else engine
        """What decodes: the engine, or the engine behind a batch scheduler."""
        self.recorder = recorder if recorder is not None else default_recorder()
        """Where the one StepEvent per step goes; given None: :func:`default_recorder` (the process-wide telemetry
        when ``AGENT_MTP_REDIS_URL`` is set, else nothing; pass ``NullRecorder()`` to record nothing)."""
        self.breaker_store = breaker_store
        self._controllers: dict[Any, tuple[Any, PolicyController]] = {}
        self._lock = threading.Lock()

    # -- public ---------------------------------------------------------------------------------------------------
    def generate(self, request: Request) -> Result:
        """Run one step (with the policy's retries and monitors) and return its result."""
        call = self._prepare(request)
        controller, plan = self._plan(call)
        outcome = controller.execute(
            plan,
            call.prompt_ids,
            constraint_factory=call.grammar.constraint if call.grammar is not None else None,
            validators=call.validators,
        )
        _check_timeout(request, outcome.result)
        return self._result(call, outcome, self._parse(call, outcome.result.text))

    def stream(self, request: Request, *, cancel: threading.Event | None = None) -> Iterator[Delta]:
        """One :class:`Delta` per forward pass (decoded with the plan's first attempt: no retries once text was
        shown); the policy then observes the output (monitors, breaker, the one event). Setting ``cancel`` stops
        the stream at the next pass (no event: the step did not finish)."""
        call = self._prepare(request)
        controller, plan = self._plan(call)
        constraint = call.grammar.constraint() if call.grammar is not None else None
        parser = ToolCallStream(call.specs) if call.specs else None
        text: list[str] = []
        ids: list[int] = []
        first, tool_calls = True, 0
        for piece in self.decoder.stream(call.prompt_ids, plan.config, constraint=constraint):
            if cancel is not None and cancel.is_set():
                return
            text.append(piece.text)
            ids += piece.token_ids
            if first and piece.finish_reason == "timeout":
                assert piece.stats is not None
                _check_timeout(request, GenerationResult("".join(text), ids, "timeout", piece.stats))
            delta = parser.feed(piece.text) if parser else None
            content = delta.content if delta else piece.text
            chunks = list(delta.tool_call_chunks) if delta else []
            usage = Usage(0, len(piece.token_ids))  # input tokens on the last delta, once the cache hit is known
            first = False
            if piece.finish_reason is None:
                tool_calls += len(chunks)
                yield Delta(content, chunks, tuple(piece.token_ids), usage)
                continue
            if parser is not None:
                tail = parser.finish()
                content += tail.content
                chunks += tail.tool_call_chunks
            tool_calls += len(chunks)
            assert piece.stats is not None
            generation = GenerationResult("".join(text), ids, piece.finish_reason, piece.stats)
            outcome = controller.observe(plan, generation, prompt=call.prompt_ids, validators=call.validators)
            result = self._result(call, outcome, self._parse(call, generation.text), streamed_calls=tool_calls)
            usage = dataclasses.replace(result.usage, output_tokens=len(piece.token_ids))
            yield Delta(content, chunks, tuple(piece.token_ids), usage, result.finish_reason, result)
            return

    async def agenerate(self, request: Request) -> Result:
        """:meth:`generate` in a worker thread (the event loop never blocks)."""
        return await asyncio.to_thread(self.generate, request)

    async def astream(self, request: Request) -> AsyncIterator[Delta]:
        """:meth:`stream` driven by one worker thread per stream; deltas arrive through a queue, the event loop
        never blocks, and leaving early cancels the decode at its next pass."""
        cancel = threading.Event()
        async for delta in _iterate_in_thread(self.stream(request, cancel=cancel), cancel):
            yield delta

    async def astream_bursts(self, request: Request) -> AsyncIterator[list[Delta]]:
        """:meth:`astream`, the deltas that had arrived when the consumer came back for more handed over together
        (at least one, in order): a front end that sends one message per burst instead of one per delta keeps up
        with a greedy run's tokens, which arrive at once, and with many streams on one event loop."""
        cancel = threading.Event()
        async for burst in _iterate_in_thread(self.stream(request, cancel=cancel), cancel, bursts=True):
            yield burst

    def close(self) -> None:
        """Stop the batch scheduler (concurrency="batched"); in-flight generations get an error."""
        if isinstance(self.decoder, BatchedEngine):
            self.decoder.close()

    def prompt_ids(self, request: Request) -> list[int]:
        """The token ids the model reads for ``request`` (tool block and answer-format instruction included)."""
        return prompt_ids(self.engine.tokenizer, request)

    # -- internals ------------------------------------------------------------------------------------------------
    def _prepare(self, request: Request) -> _Prepared:
        ids = prompt_ids(self.engine.tokenizer, request)
        answer_schema, json_answer = answer_format(request.response_format)
        specs, choice, use_tools = tool_plan(request.tools, request.tool_choice)
        spec = _grammar_spec(specs, choice, request.parallel_tool_calls, answer_schema, json_answer, use_tools)
        grammar = compile_for_engine(self.engine, spec, jump_forward=request.jump_forward) if spec else None
        context = StepContext(
            step_type=request.step_type,
            tools_bound=use_tools,
            tool_choice=choice,
            structured_output=bool(request.structured_output or json_answer),
            last_role=str(request.messages[-1]["role"]),
            num_messages=len(request.messages),
            tool_names=tuple(s.name for s in specs) if use_tools else (),
            run_id=request.run_id,
        )
        validators = _validators(specs if use_tools else [], choice, answer_schema, json_answer)
        return _Prepared(request, ids, specs if use_tools else [], grammar, validators, context)

    def _plan(self, call: _Prepared) -> tuple[PolicyController, StepPlan]:
        request = call.request
        controller = self._controller(request.policy)
        plan = controller.plan(call.context)
        if request.policy is None:  # the trivial policy decodes with the request's own settings
            config = request.limits.apply(request.decode)
            return controller, dataclasses.replace(plan, policy_config=config, configs=(config,))
        limits = request.limits
        configs = tuple(limits.apply(c) for c in plan.configs)
        return controller, dataclasses.replace(plan, configs=configs, policy_config=limits.apply(plan.policy_config))

    def _controller(self, policy: PolicyLike | None) -> PolicyController:
        key = str(policy) if isinstance(policy, (str, Path)) else id(policy)
        with self._lock:
            entry = self._controllers.get(key)
            if entry is None or entry[0] is not policy:
                source = FIXED_POLICY if policy is None else policy
                controller = PolicyController(
                    self.decoder, source, recorder=self.recorder, breaker_store=self.breaker_store
                )
                entry = (policy, controller)
                self._controllers[key] = entry
        return entry[1]

    def _parse(self, call: _Prepared, text: str) -> tuple[str, list[Any], list[Any]]:
        if not call.specs:
            return text, [], []
        parsed = parse_tool_calls(text, call.specs)
        return parsed.content, list(parsed.tool_calls), list(parsed.invalid_tool_calls)

    def _result(
        self,
        call: _Prepared,
        outcome: PolicyResult,
        parsed: tuple[str, list[Any], list[Any]],
        *,
        streamed_calls: int | None = None,
    ) -> Result:
        generation = outcome.result
        content, calls, invalid = parsed
        has_calls = bool(calls) if streamed_calls is None else streamed_calls > 0
        finish = "tool_calls" if has_calls and generation.finish_reason == "stop" else generation.finish_reason
        return Result(
            text=generation.text,
            content=content,
            tool_calls=calls,
            invalid_tool_calls=invalid,
            finish_reason=finish,
            generation=generation,
            usage=Usage(len(call.prompt_ids), len(generation.token_ids), generation.stats.cached_prompt_tokens),
            model=self.engine.model_id,
            policy=None if call.request.policy is None else dict(outcome.metadata()),
            event=outcome.event,
        )


# ------------------------------------------------------------------------------------------------ sharing
_ENGINES: dict[tuple[str, str | None, str], MTPEngine] = {}
_SERVICES: dict[tuple[int, int, str | None], tuple[MTPEngine, Any, Service]] = {}
_SHARED_LOCK = threading.Lock()
_CHECKED_POLICIES: dict[tuple[str, float], bool] = {}


def shared_engine(model: str, *, adapter: str | None = "auto", dtype: str = "float32") -> MTPEngine:
    """The process-wide engine for ``model`` (loaded and its runtime prepared on first use; every front end naming
    it shares it)."""
    key = (model_key(model), adapter, dtype)
    with _SHARED_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = MTPEngine.from_pretrained(model, adapter=adapter, dtype=dtype)
            engine.prepare_runtime()  # with the load, not in the first request's time to first token
            _ENGINES[key] = engine
            freeze_loaded_objects()
    return engine


def freeze_loaded_objects() -> None:
    """Take every object alive now out of the cyclic garbage collector's scans (``gc.freeze``), after collecting the
    garbage there is: the model's modules, the tokenizer and the imported libraries (~380k objects with the default
    model) stay for the process's life, and a long-lived process (a server, a Ray replica, an agent) otherwise walks
    all of them in every full collection, 160-230 ms with the GIL held while every stream waits (measured: one such
    pause in 30 s of 8 clients' `verified` requests; a full collection after the freeze took under 1 ms). Frozen
    objects are still freed by reference counting; only a cycle among them that becomes garbage later is kept."""
    gc.collect()
    gc.freeze()


def loaded_engine(model: str) -> MTPEngine | None:
    """The shared engine of ``model`` if one is loaded already (any adapter, any dtype)."""
    with _SHARED_LOCK:
        return next((e for (name, _, _), e in _ENGINES.items() if name == model_key(model)), None)


def model_key(model: str) -> str:
    return "default" if model.lower() in DEFAULT_MODEL_ALIASES else model


def shared_service(engine: MTPEngine, *, recorder: Any = None, breaker_store: str | None = None) -> Service:
    """The process-wide service of ``engine`` + ``recorder`` + ``breaker_store`` (so policy controllers, their
    breakers and learned baselines are shared by every front end that uses the same three). ``recorder=None``:
    :func:`default_recorder`."""
    recorder = recorder if recorder is not None else default_recorder()
    key = (id(engine), id(recorder), breaker_store)
    with _SHARED_LOCK:
        entry = _SERVICES.get(key)
        if entry is None or entry[0] is not engine or entry[1] is not recorder:
            entry = (engine, recorder, Service(engine, recorder=recorder, breaker_store=breaker_store))
            _SERVICES[key] = entry
    return entry[2]


def default_recorder() -> Recorder | None:
    """The recorder of a front end given none: the process-wide telemetry when ``AGENT_MTP_REDIS_URL`` is set
    (:func:`agent_mtp.telemetry.process_telemetry`: one flusher thread per process), else None (events dropped)."""
    from agent_mtp.telemetry import process_telemetry  # Redis is imported only by processes that record

    return process_telemetry()


def check_policy(policy: PolicyLike) -> None:
    """Validate a policy once per file version (so constructing a front end per request stays cheap)."""
    if not isinstance(policy, (str, Path)):
        load_policy(policy)
        return
    path = resolve_policy_path(policy)
    key = (str(path), path.stat().st_mtime if path.exists() else 0.0)
    if key not in _CHECKED_POLICIES:
        load_policy(policy)
        _CHECKED_POLICIES[key] = True


# ------------------------------------------------------------------------------------------------ prompts
class ToolPlan(NamedTuple):
    specs: list[ToolSpec]
    choice: str | None
    """None/"auto", "any", "none" or a tool name (normalised)."""
    use_tools: bool
    """Tools are described in the prompt and may be called (bound, and tool_choice is not "none")."""


def tool_plan(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> ToolPlan:
    """The checked tools and tool choice of a request (see :func:`checked_tool_choice`)."""
    specs = tool_specs(list(tools))
    choice = checked_tool_choice(tool_choice, [s.name for s in specs])
    return ToolPlan(specs, choice, bool(specs) and choice != "none")


def checked_tool_choice(tool_choice: Any, names: Sequence[str]) -> str | None:
    """The normalised tool choice; one that forces a call (``"any"``, ``True``, a name) with no tools bound is an
    error, not free text. Without tools "auto"/"none" mean nothing and become None."""
    choice = normalize_tool_choice(tool_choice, names)
    if names:
        return choice
    if choice not in (None, "auto", "none"):
        msg = (
            f"tool_choice={tool_choice!r} asks for a tool call but no tools are bound; "
            "bind at least one tool or drop tool_choice."
        )
        raise ConfigError(msg)
    return None


def prompt_ids(tokenizer: Any, request: Request) -> list[int]:
    """Token ids of ``request``'s messages with the tool block and answer-format instruction as a system block."""
    answer_schema, json_answer = answer_format(request.response_format)
    specs = tool_plan(request.tools, request.tool_choice).specs
    if not request.messages:
        raise EmptyPromptError("There are no messages to answer; pass at least one message.")
    if not any(_has_content(m) for m in request.messages):
        msg = (
            f"All {len(request.messages)} message(s) are empty, so there is nothing to answer; send some text "
            "(an empty conversation such as invoke('') is refused, not answered with an empty turn)."
        )
        raise EmptyPromptError(msg)
    blocks = []
    # The same system block at every step of an agent, whatever this step's tool_choice (the grammar enforces it):
    # the conversation so far stays a token prefix of the next step's prompt, for the engine's prefix cache.
    if specs:
        blocks.append(tools_system_block(specs, parallel=request.parallel_tool_calls))
    if json_answer:
        blocks.append(_json_block(answer_schema, alongside_tools=bool(specs)))
    messages = with_system_block([dict(m) for m in request.messages], "\n\n".join(blocks) or None)
    return render_messages(tokenizer, messages)


def _has_content(message: Mapping[str, Any]) -> bool:
    content = message.get("content")
    return bool(content.strip()) if isinstance(content, str) else bool(content)


def with_system_block(messages: list[dict[str, Any]], block: str | None) -> list[dict[str, Any]]:
    """``block`` appended to the leading system message (or as a new leading one)."""
    if not block:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def answer_format(response_format: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, bool]:
    """(schema, wants JSON) from an OpenAI-style ``response_format`` or a bare JSON schema."""
    if response_format is None:
        return None, False
    if not isinstance(response_format, Mapping):
        raise ConfigError(f"response_format={response_format!r} is not a dict or a schema class.")
    if response_format.get("type") == "object":
        return dict(response_format), True  # a bare JSON schema
    kind = response_format.get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise ConfigError("response_format json_schema needs {'json_schema': {'schema': {...}}}.")
        return dict(schema), True
    if kind == "json_object":
        schema = response_format.get("schema")
        return (dict(schema) if isinstance(schema, Mapping) else None), True
    if kind == "text":
        return None, False
    raise ConfigError(f"response_format type {kind!r} is not supported; use json_schema or json_object.")


def _json_block(schema: Mapping[str, Any] | None, *, alongside_tools: bool) -> str:
    head = "When you give your final answer, answer" if alongside_tools else "Answer"
    if schema is None:
        return f"{head} with a JSON object only."
    return f"{head} with a JSON object only, matching this JSON schema:\n{json.dumps(schema, ensure_ascii=False)}"


def _grammar_spec(
    specs: list[ToolSpec],
    choice: str | None,
    parallel: bool,
    answer_schema: dict[str, Any] | None,
    json_answer: bool,
    use_tools: bool,
) -> GrammarSpec | None:
    if use_tools:
        return tool_call_grammar(specs, choice, parallel=parallel, answer_schema=answer_schema if json_answer else None)
    if json_answer:
        return GrammarSpec.json_schema(answer_schema) if answer_schema is not None else GrammarSpec.json_object()
    if specs:  # tool_choice="none": text that cannot contain the call syntax
        return tool_call_grammar(specs, "none")
    return None


def _validators(
    specs: list[ToolSpec], choice: str | None, answer_schema: dict[str, Any] | None, json_answer: bool
) -> tuple[Callable[[str], Any], ...]:
    """Checks for the policy's validity monitor (the grammar guarantees syntax; these check semantics)."""
    if specs:
        forced = choice not in (None, "auto")

        def tool_calls_valid(text: str) -> Any:
            errors = validation_errors(text, specs, require_call=forced)
            return MonitorVerdict("tool_calls", not errors, detail="; ".join(errors)[:300])

        return (tool_calls_valid,)
    if json_answer:
        return (json_validator(answer_schema, name="json_answer"),)
    return ()


def _check_timeout(request: Request, result: GenerationResult) -> None:
    if result.finish_reason == "timeout" and request.on_timeout == "raise":
        msg = (
            f"The deadline passed after {result.stats.wall_s:.2f} s and {result.stats.new_tokens} tokens, before "
            "the output was complete; raise timeout (or the policy's max_time_s), lower max_tokens, or set "
            "on_timeout='return' to get the partial output."
        )
        raise DeadlineExceededError(msg, partial_text=result.text)


# ------------------------------------------------------------------------------------------------ async
_DONE = object()


class _Mailbox:
    """Hands items from worker threads to one event loop's queues with one wake-up per burst, however many streams
    it carries. After a batched pass every sequence's decode thread delivers its delta within a millisecond or two;
    a wake-up of its own for each (``call_soon_threadsafe``: a self-pipe write, a loop iteration, a GIL hand-over)
    cost the server ~170 us of event-loop CPU per streamed chunk at 8 clients, inside the gap where the next pass
    waits for the sequences (measured from /proc; a stream's own SSE work is ~15 us a chunk)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # a strong one would keep the loop's _MAILBOXES entry alive for ever
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Any], Any]] = []
        self._closed = False

    def post(self, queue: asyncio.Queue[Any], item: Any) -> None:
        """Put ``item`` on ``queue`` on the loop's thread, after every item posted before it; raises RuntimeError
        once the loop is closed (nobody is listening any more)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("The event loop is closed.")
            self._items.append((queue, item))
            if len(self._items) > 1:  # a wake-up is on its way and will deliver this one too
                return
        try:
            loop = self._loop()
            if loop is None:
                raise RuntimeError("The event loop is gone.")
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._closed = True
                self._items.clear()
            raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()
_MAILBOXES_LOCK = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    with _MAILBOXES_LOCK:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = _Mailbox(loop)
        return box


async def _iterate_in_thread(
    iterator: Iterator[Any], cancel: threading.Event, *, bursts: bool = False
) -> AsyncIterator[Any]:
    """Drive a blocking iterator in one worker thread; items arrive through a queue, the event loop never
    blocks. Stopping early sets ``cancel`` so the worker stops at its next item (releasing the engine). ``bursts``:
    yield lists, each item with those queued behind it (an error or the end after them comes next)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()
    mailbox = _mailbox(loop)

    def put(item: Any, error: BaseException | None) -> None:
        try:
            mailbox.post(queue, (item, error))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            cancel.set()

    def work() -> None:
        try:
            for item in iterator:
                if cancel.is_set():
                    break
                put(item, None)
        except BaseException as e:
            put(None, e)
        else:
            put(_DONE, None)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    context = contextvars.copy_context()
    worker = loop.run_in_executor(None, context.run, work)
    try:
        while True:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _DONE:
                break
            if not bursts:
                yield item
                continue
            burst = [item]
            while not queue.empty():
                following = queue.get_nowait()
                if following[1] is not None or following[0] is _DONE:
                    queue.put_nowait(following)  # the queue was drained up to it: it is read next, in order
                    break
                burst.append(following[0])
            yield burst
    finally:
        cancel.set()
        if worker.done():
            worker.result()
