"""Events that the policy layer emits and telemetry records: a small, dependency-free interface.

The policy layer calls ``recorder.record(StepEvent(...))`` after every step; telemetry implements :class:`Recorder`
and ships the aggregates to Redis. Neither side imports the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

Outcome = Literal["ok", "timeout", "error", "monitor_failed"]
InterventionKind = Literal["manual_intervention", "user_visible_failure"]


@dataclass(frozen=True)
class StepEvent:
    """What happened in one agent step (one chat-model call), after retries and fallbacks."""

    step_type: str
    """Step type decided by the policy (tool_call, reasoning, formatting, final_answer or a user name)."""
    mode: str
    """Decode mode that produced the returned output (ntp, static, confadapt, verified)."""
    outcome: Outcome
    """ok, timeout (deadline hit, partial output), error (raised), or monitor_failed (returned even though a
    monitor failed)."""
    latency_s: float
    """Wall time of the whole step including retries."""
    model: str = "default"
    new_tokens: int = 0
    forward_passes: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of the returned attempt."""
    cached_prompt_tokens: int = 0
    """Of those, the tokens whose keys and values came from the engine's prefix cache (not prefilled)."""
    attempts: int = 1
    """1 + number of retries."""
    fallback: bool = False
    """True when the output came from a safer mode than the policy's first choice (retry switch or open breaker)."""
    breaker_open: bool = False
    """True when the step type's breaker forced NTP."""
    timeout: bool = False
    monitor_failures: tuple[str, ...] = ()
    """Names of monitors that failed on any attempt of this step."""
    ntp_equivalent_s: float | None = None
    """Estimated time plain NTP would have taken (for speedup), when known."""
    ttft_s: float | None = None
    error: str | None = None
    run_id: str | None = None
    timestamp: float = field(default_factory=time.time)


@dataclass(frozen=True)
class InterventionEvent:
    """Reported by the application: a person stepped in, or a user saw a failure."""

    kind: InterventionKind
    step_type: str = "unknown"
    model: str = "default"
    run_id: str | None = None
    note: str = ""
    timestamp: float = field(default_factory=time.time)


@runtime_checkable
class Recorder(Protocol):
    """Receives events. Implementations must be O(1), thread-safe and must never raise."""

    def record(self, event: StepEvent | InterventionEvent) -> None: ...


class MemoryRecorder:
    """Keeps events in a list (tests, single-process use). Thread-safe via the GIL's atomic list.append."""

    def __init__(self) -> None:
        self.events: list[StepEvent | InterventionEvent] = []

    def record(self, event: StepEvent | InterventionEvent) -> None:
        self.events.append(event)


class NullRecorder:
    """Drops every event."""

    def record(self, event: StepEvent | InterventionEvent) -> None:
        return None
