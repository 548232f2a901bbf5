"""Retries as tenacity values built from a policy's ``retries`` section, and the record of one attempt."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base

from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.results import GenerationResult
from agent_mtp.policy.monitors import MonitorVerdict
from agent_mtp.policy.schema import MODE_SAFETY, DecodeOverride, RetrySettings


@dataclass(frozen=True)
class AttemptRecord:
    """One try at a step: the settings used, what came back (or what was raised) and the monitors' verdicts."""

    index: int
    """1 for the first attempt."""
    config: DecodeConfig
    result: GenerationResult | None
    verdicts: tuple[MonitorVerdict, ...] = ()
    error: BaseException | None = None
    probe: bool = False
    """True when this attempt was a half-open breaker probe."""
    latency_s: float = 0.0

    @property
    def monitor_failed(self) -> bool:
        return any(not v.passed for v in self.verdicts)

    @property
    def timed_out(self) -> bool:
        return self.result is not None and self.result.finish_reason == "timeout"

    @property
    def failed_monitors(self) -> tuple[str, ...]:
        return tuple(v.monitor for v in self.verdicts if not v.passed)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "attempt": self.index,
            "mode": self.config.mode,
            "threshold": self.config.threshold,
            "k_max": self.config.k_max,
            "probe": self.probe,
            "latency_s": round(self.latency_s, 6),
            "monitors": [v.to_dict() for v in self.verdicts],
        }
        if self.result is not None:
            out["finish_reason"] = self.result.finish_reason
            out["tokens_per_forward"] = round(self.result.stats.tokens_per_forward, 4)
        if self.error is not None:
            out["error"] = f"{type(self.error).__name__}: {self.error}"
        return out


def is_retryable_error(exc: BaseException) -> bool:
    """Errors marked ``is_retryable`` (e.g. DeadlineExceededError) and TimeoutError; never bad input or bugs."""
    return bool(getattr(exc, "is_retryable", False)) or isinstance(exc, TimeoutError)


def build_retrying(
    settings: RetrySettings,
    *,
    should_retry: Callable[[AttemptRecord], bool],
    sleep: Callable[[float], None] = time.sleep,
) -> Retrying:
    """A tenacity ``Retrying`` from the policy: stop after ``attempts`` (or ``max_delay_s``), exponential
    backoff with jitter, retry on retryable errors (when ``retry_on`` has ``retryable_error``) and on attempts
    for which ``should_retry`` says so (failed monitors, timeouts). When the budget is spent the last attempt
    is returned (or its error raised)."""
    stop: stop_base = stop_after_attempt(settings.attempts)
    if settings.max_delay_s is not None:
        stop = stop | stop_after_delay(settings.max_delay_s)
    b = settings.backoff
    retry_errors = "retryable_error" in settings.retry_on
    return Retrying(
        stop=stop,
        wait=wait_exponential_jitter(multiplier=b.multiplier_s, exp_base=b.exp_base, max=b.max_s, jitter=b.jitter_s),
        retry=retry_if_exception(lambda e: retry_errors and is_retryable_error(e))
        | retry_if_result(lambda r: isinstance(r, AttemptRecord) and should_retry(r)),
        retry_error_callback=_last_outcome,
        sleep=sleep,
    )


def _last_outcome(state: RetryCallState) -> Any:
    assert state.outcome is not None
    return state.outcome.result()  # re-raises the last error when the last attempt raised


def escalate(config: DecodeConfig, override: DecodeOverride | None) -> DecodeConfig:
    """The next attempt's settings: ``override`` applied, but never a less safe mode or a lower threshold."""
    if override is None:
        return config
    changes: dict[str, Any] = {}
    if override.mode is not None and MODE_SAFETY[override.mode] >= MODE_SAFETY[config.mode]:
        changes["mode"] = override.mode
    if override.threshold is not None and override.threshold >= config.threshold:
        changes["threshold"] = override.threshold
    if override.k_max is not None:
        changes["k_max"] = override.k_max
    return config.replace(**changes) if changes else config


def retry_configs(first: DecodeConfig, settings: RetrySettings) -> tuple[DecodeConfig, ...]:
    """Settings of every attempt, the first included (``escalate[i]`` applies to retry i+1; the last repeats)."""
    configs = [first]
    for i in range(settings.attempts - 1):
        override = settings.escalate[min(i, len(settings.escalate) - 1)] if settings.escalate else None
        configs.append(escalate(configs[-1], override))
    return tuple(configs)
