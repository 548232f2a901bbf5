"""agent-mtp errors as LangChain's exception classes (each also keeps its :mod:`agent_mtp.errors` type)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NoReturn

from langchain_core.exceptions import (
    ContextOverflowError,
    ModelInvalidRequestError,
    ModelNotFoundError,
    ModelTimeoutError,
)
from pydantic import ValidationError

from agent_mtp.errors import (
    AgentMTPError,
    ConfigError,
    DeadlineExceededError,
    GrammarError,
    ModelLoadError,
    PolicyError,
    PromptError,
    PromptTooLongError,
    TelemetryError,
)

SECRET_SETTINGS = frozenset({"breaker_store"})
"""Settings whose values an error message never echoes."""


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


class MTPPolicyError(MTPInvalidRequestError, PolicyError):
    """The policy (a file, a shipped name, a mapping) is invalid; the message names the file, line and field."""


class MTPModelNotFoundError(ModelNotFoundError, ModelLoadError):
    """The model or its tokenizer cannot be loaded."""


def map_error(error: Exception) -> Exception:
    """Engine / service errors -> LangChain's exception types (which also keep the agent-mtp type)."""
    if isinstance(error, (ContextOverflowError, ModelTimeoutError, ModelInvalidRequestError, ModelNotFoundError)):
        return error
    if isinstance(error, PromptTooLongError):
        return MTPContextOverflowError(
            str(error), prompt_tokens=error.prompt_tokens, context_window=error.context_window
        )
    if isinstance(error, DeadlineExceededError):
        return MTPTimeoutError(str(error), partial_text=error.partial_text)
    if isinstance(error, PolicyError):
        return MTPPolicyError(str(error))
    if isinstance(error, (PromptError, ConfigError, GrammarError, TelemetryError)):
        return MTPInvalidRequestError(str(error))
    if isinstance(error, ModelLoadError):
        return MTPModelNotFoundError(str(error))
    return error


def raise_mapped(error: Exception) -> NoReturn:
    mapped = map_error(error)
    if mapped is error:
        raise error
    raise mapped from error


def mapped(stream: Iterator[Any]) -> Iterator[Any]:
    """``stream`` with agent-mtp errors raised as LangChain's."""
    try:
        yield from stream
    except AgentMTPError as e:
        raise_mapped(e)


def construction_error(error: ValidationError) -> Exception:
    """pydantic's ``ValidationError`` from ``AgentMTPChat(...)`` as an agent-mtp error of LangChain's class: the
    agent-mtp error a validator raised (a bad policy, a bad Redis URL, an out-of-range setting), else
    :class:`MTPInvalidRequestError` naming the setting (never echoing the value of a secret one)."""
    first = error.errors()[0]
    original = (first.get("ctx") or {}).get("error")
    if isinstance(original, AgentMTPError):
        return map_error(original)
    name = str(first["loc"][0]) if first["loc"] else ""
    shown = "" if not name or name in SECRET_SETTINGS else f"={first.get('input')!r}"
    setting = name or "the settings"
    msg = f"AgentMTPChat: {setting}{shown} is invalid: {first['msg']}; see the settings in docs/langchain.md."
    return MTPInvalidRequestError(msg)
