"""PolicyController: wraps an engine from outside and runs one agent step the way the policy says.

classify -> plan (settings of the step type, breaker state) -> attempts under a tenacity ``Retrying`` (each
attempt: fresh constraint, generate, monitors, breaker sample) -> one :class:`~agent_mtp.events.StepEvent`.
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_mtp.engine.config import LOSSY_MODES, DecodeConfig
from agent_mtp.engine.constraints import TokenConstraint
from agent_mtp.engine.results import GenerationResult
from agent_mtp.errors import QualityError
from agent_mtp.events import NullRecorder, Outcome, Recorder, StepEvent
from agent_mtp.policy.breaker import CLOSED, Breakers, BreakerStatus, BreakerStore, MemoryBreakerStore
from agent_mtp.policy.classify import StepContext, classify
from agent_mtp.policy.loading import PolicySource, load_policy
from agent_mtp.policy.monitors import (
    EngineLike,
    Monitor,
    MonitorInput,
    MonitorVerdict,
    Validator,
    builtin_monitors,
)
from agent_mtp.policy.retries import AttemptRecord, build_retrying, retry_configs
from agent_mtp.policy.schema import Policy, StepSettings

log = logging.getLogger(__name__)

ConstraintFactory = Callable[[], TokenConstraint]
_EWMA = 0.2


@dataclass(frozen=True)
class StepPlan:
    """What the controller will do for one step, decided before decoding (the chat model may stream with it)."""

    step_type: str
    reason: str
    """How the step type was decided: explicit, rule <i> (<name>) or default."""
    context: StepContext
    settings: StepSettings
    """The step type's effective settings."""
    policy_config: DecodeConfig
    """What the policy asks for when the breaker is closed."""
    configs: tuple[DecodeConfig, ...]
    """Settings of attempt 1, 2, ... (attempt 1 after the breaker; retries escalate from it)."""
    breaker: BreakerStatus
    probe: bool
    """True when attempt 1 is a half-open probe of the policy's mode."""
    decisions: tuple[str, ...]
    started_at: float
    """Controller clock when planned (latency of a streamed step is measured from here)."""

    @property
    def config(self) -> DecodeConfig:
        """Settings of the first attempt: use these to stream."""
        return self.configs[0]

    @property
    def breaker_open(self) -> bool:
        """True when the breaker forced the fallback mode for this step."""
        return self.breaker.state != "closed" and not self.probe

    def config_for(self, attempt: int) -> DecodeConfig:
        return self.configs[min(attempt, len(self.configs)) - 1]


@dataclass
class PolicyResult:
    """A step's output with everything the policy decided on the way."""

    result: GenerationResult
    step_type: str
    plan: StepPlan
    attempts: list[AttemptRecord]
    outcome: Outcome
    fallback: bool
    """True when the output came from safer settings than the policy's first choice (retry or open
    breaker)."""
    decisions: list[str]
    latency_s: float
    event: StepEvent
    verdicts: tuple[MonitorVerdict, ...] = field(default=())
    """Verdicts on the returned output (the last attempt)."""

    @property
    def text(self) -> str:
        return self.result.text

    @property
    def config(self) -> DecodeConfig:
        """Settings that produced the returned output."""
        return self.attempts[-1].config

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def monitor_failures(self) -> tuple[str, ...]:
        """Monitors that failed on any attempt."""
        return tuple(dict.fromkeys(name for a in self.attempts for name in a.failed_monitors))

    def metadata(self) -> dict[str, Any]:
        """JSON-ready summary for the response metadata (``response_metadata["agent_mtp"]``)."""
        return {
            "step_type": self.step_type,
            "step_type_reason": self.plan.reason,
            "mode": self.mode,
            "threshold": self.config.threshold,
            "k_max": self.config.k_max,
            "outcome": self.outcome,
            "attempts": len(self.attempts),
            "fallback": self.fallback,
            "breaker": self.plan.breaker.state,
            "probe": self.plan.probe,
            "monitors": [v.to_dict() for v in self.verdicts],
            "monitor_failures": list(self.monitor_failures),
            "decisions": list(self.decisions),
            "latency_s": round(self.latency_s, 6),
            "attempt_details": [a.to_dict() for a in self.attempts],
        }


class PolicyController:
    """Runs agent steps through an engine under a policy. Thread-safe; one per engine + policy.

    Args:
        engine: an :class:`~agent_mtp.engine.MTPEngine` (or anything with ``generate``, ``encode_prompt``, ``score``
            and ``model_id``).
        policy: a :class:`Policy`, a YAML path, a mapping, or a shipped name (``default``, ``latency``, ``exact``).
        recorder: receives one :class:`StepEvent` per step (default: dropped).
        breaker_store: where breaker state lives: a store, a Redis URL (shared by a fleet), or None (this process).
        monitors: the monitors to run (default: validity, repetition, ntp_agreement, likelihood).
        seed: seeds the sampling of costly monitors and of half-open probes.
        clock, sleep: injectable time (tests).
    """

    def __init__(
        self,
        engine: EngineLike,
        policy: PolicySource = "default",
        *,
        recorder: Recorder | None = None,
        breaker_store: BreakerStore | str | None = None,
        monitors: Sequence[Monitor] | None = None,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.engine = engine
        self.policy: Policy = load_policy(policy)
        self.recorder: Recorder = recorder if recorder is not None else NullRecorder()
        store = _make_store(breaker_store, clock)
        model_id = str(getattr(engine, "model_id", "model"))
        self.breakers = Breakers(store, namespace=f"{model_id}:{self.policy.name}")
        all_monitors = list(monitors) if monitors is not None else builtin_monitors()
        self.monitors: list[Monitor] = sorted(all_monitors, key=lambda m: m.costly)
        self._rng = random.Random(seed)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._ntp_token_s: float | None = None
        self._baselines: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ public
    def classify(self, context: StepContext) -> str:
        """The step type of a generation (explicit step_type, else the policy's rules, else its default)."""
        return classify(self.policy, context).step_type

    def plan(self, context: StepContext) -> StepPlan:
        """Decide step type and settings (after the breaker) for one step without running it."""
        started = self._clock()
        decided = classify(self.policy, context)
        settings = self.policy.effective(decided.step_type)
        policy_config = settings.decode_config()
        decisions = [f"step type {decided.step_type} ({decided.reason})"]
        status, probe, first = CLOSED, False, policy_config
        if settings.fallback.enabled and policy_config.mode in LOSSY_MODES:
            status = self.breakers.status(decided.step_type)
            if status.state == "half_open":
                probe = self._draw(settings.fallback.probe_rate)
            if status.state == "open" or (status.state == "half_open" and not probe):
                first = policy_config.replace(mode=settings.fallback.mode)
                decisions.append(f"breaker {status.state} ({status.reason}): {settings.fallback.mode}")
            elif probe:
                decisions.append(f"breaker half_open: probing {policy_config.mode}")
        return StepPlan(
            step_type=decided.step_type,
            reason=decided.reason,
            context=context,
            settings=settings,
            policy_config=policy_config,
            configs=retry_configs(first, settings.retries),
            breaker=status,
            probe=probe,
            decisions=tuple(decisions),
            started_at=started,
        )

    def run(
        self,
        prompt: Any,
        context: StepContext | None = None,
        *,
        constraint_factory: ConstraintFactory | None = None,
        validators: Sequence[Validator] = (),
    ) -> PolicyResult:
        """Classify, plan and execute one step (see :meth:`execute`)."""
        return self.execute(
            self.plan(context or StepContext()),
            prompt,
            constraint_factory=constraint_factory,
            validators=validators,
        )

    def execute(
        self,
        plan: StepPlan,
        prompt: Any,
        *,
        constraint_factory: ConstraintFactory | None = None,
        validators: Sequence[Validator] = (),
    ) -> PolicyResult:
        """Run a planned step: attempts with retries, monitors, breaker samples, one event.

        Raises what the engine raised when it is not retryable or the budget is spent (the event is recorded
        with outcome "error"), and :class:`QualityError` when monitors still fail and ``on_exhausted`` is
        ``raise``.
        """
        step = _StepRun(self, plan, prompt, constraint_factory, tuple(validators))
        retrying = build_retrying(plan.settings.retries, should_retry=step.should_retry, sleep=self._sleep)
        try:
            final: AttemptRecord = retrying(step.attempt)
        except Exception as exc:
            self._emit(plan, step.attempts, "error", step.decisions, error=exc)
            raise
        return self._finish(plan, step.attempts, final, step.decisions)

    def observe(
        self,
        plan: StepPlan,
        result: GenerationResult,
        *,
        prompt: Any = None,
        validators: Sequence[Validator] = (),
        verdicts: Sequence[MonitorVerdict] | None = None,
        costly: bool = False,
        constraint_factory: ConstraintFactory | None = None,
    ) -> PolicyResult:
        """Report a step that the caller decoded itself (streaming with ``plan.config``).

        Runs the cheap monitors (and the sampled costly ones when ``costly`` and ``prompt`` are given; pass
        the ``constraint_factory`` used for streaming so the NTP re-decode is constrained alike) unless
        ``verdicts`` are given, feeds the breaker and records the event. No retry: the output was already
        shown."""
        config = plan.config
        latency = self._clock() - plan.started_at
        if verdicts is None:
            run_costly = costly and prompt is not None
            verdicts = self._check(
                plan, config, prompt, result, constraint_factory, tuple(validators), costly=run_costly
            )
        record = AttemptRecord(1, config, result, tuple(verdicts), probe=plan.probe, latency_s=latency)
        decisions = list(plan.decisions)
        change = self.report(plan, record)
        if change:
            decisions.append(change)
        decisions.append(_attempt_summary(record))
        return self._finish(plan, [record], record, decisions)

    def now(self) -> float:
        """The controller's clock (monotonic unless injected): plans, latencies and deadlines are measured on it."""
        return self._clock()

    def attempt(
        self,
        plan: StepPlan,
        index: int,
        config: DecodeConfig,
        prompt: Any,
        *,
        constraint_factory: ConstraintFactory | None = None,
        validators: Sequence[Validator] = (),
    ) -> AttemptRecord:
        """Decode attempt ``index`` of a planned step with ``config`` and run the monitors on it. An engine error
        comes back in ``record.error`` (the caller decides whether to retry or raise); call :meth:`report` after
        a successful attempt."""
        probe = plan.probe and index == 1
        constraint = constraint_factory() if constraint_factory is not None else None
        t0 = self._clock()
        try:
            result = self.engine.generate(prompt, config, constraint=constraint)
        except Exception as exc:
            return AttemptRecord(index, config, None, error=exc, probe=probe, latency_s=self._clock() - t0)
        verdicts = self._check(plan, config, prompt, result, constraint_factory, tuple(validators))
        return AttemptRecord(index, config, result, verdicts, probe=probe, latency_s=self._clock() - t0)

    def report(self, plan: StepPlan, record: AttemptRecord) -> str | None:
        """Learn from a finished attempt (NTP speed, likelihood baseline) and feed the step type's breaker; returns
        the breaker's state change as a decision text (None when it did not change)."""
        self._learn(plan, record)
        return self._feed_breaker(plan, record)

    def breaker_status(self, step_type: str) -> BreakerStatus:
        return self.breakers.status(step_type)

    def reset_breaker(self, step_type: str) -> None:
        """Close the breaker of ``step_type`` (in the store, so for the fleet when it is Redis) and clear its
        window."""
        self.breakers.reset(step_type)

    # -------------------------------------------------------------------------------------------- internals
    def _draw(self, rate: float) -> bool:
        if rate >= 1:
            return True
        if rate <= 0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def _check(
        self,
        plan: StepPlan,
        config: DecodeConfig,
        prompt: Any,
        result: GenerationResult,
        constraint_factory: ConstraintFactory | None,
        validators: tuple[Validator, ...],
        *,
        costly: bool = True,
    ) -> tuple[MonitorVerdict, ...]:
        sample = MonitorInput(
            prompt=prompt,
            result=result,
            config=config,
            step_type=plan.step_type,
            settings=plan.settings,
            engine=self.engine,
            prompt_ids=_once(lambda: self.engine.encode_prompt(prompt)),
            constraint_factory=constraint_factory,
            validators=validators,
            baseline_logprob=self._baselines.get(plan.step_type),
        )
        verdicts: list[MonitorVerdict] = []
        for monitor in self.monitors:
            if monitor.costly and (not costly or any(not v.passed for v in verdicts)):
                continue  # costly checks only when asked for and when the cheap ones passed
            if not self._draw(monitor.sample_rate(plan.settings)):
                continue
            try:
                verdict = monitor.check(sample)
            except Exception as exc:  # a broken monitor must not fail the step
                log.warning("monitor %s raised %s: %s; skipped", monitor.name, type(exc).__name__, exc)
                continue
            if verdict is not None:
                verdicts.append(verdict)
        return tuple(verdicts)

    def _learn(self, plan: StepPlan, record: AttemptRecord) -> None:
        """Online estimates: NTP seconds per token (for ntp_equivalent_s) and the likelihood baseline per
        step."""
        if record.result is None or record.config.mode in LOSSY_MODES:
            return
        stats = record.result.stats
        with self._lock:
            if record.config.mode == "ntp" and stats.new_tokens > 1 and stats.wall_s > stats.prefill_s:
                per_token = (stats.wall_s - stats.prefill_s) / (stats.new_tokens - 1)
                self._ntp_token_s = _ewma(self._ntp_token_s, per_token)
            for v in record.verdicts:
                if v.monitor == "likelihood" and v.score is not None and math.isfinite(v.score):
                    self._baselines[plan.step_type] = _ewma(self._baselines.get(plan.step_type), v.score)

    def _feed_breaker(self, plan: StepPlan, record: AttemptRecord) -> str | None:
        fb = plan.settings.fallback
        if not fb.enabled or record.config.mode not in LOSSY_MODES or not record.verdicts:
            return None
        probe = record.probe and record.index == 1
        return self.breakers.record(plan.step_type, not record.monitor_failed, fb, probe=probe)

    def _finish(
        self, plan: StepPlan, attempts: list[AttemptRecord], final: AttemptRecord, decisions: list[str]
    ) -> PolicyResult:
        assert final.result is not None
        outcome: Outcome = "ok"
        if final.timed_out:
            outcome = "timeout"
        elif final.monitor_failed:
            outcome = "monitor_failed"
        event = self._emit(plan, attempts, outcome, decisions)
        result = PolicyResult(
            result=final.result,
            step_type=plan.step_type,
            plan=plan,
            attempts=attempts,
            outcome=outcome,
            fallback=event.fallback,
            decisions=decisions,
            latency_s=event.latency_s,
            event=event,
            verdicts=final.verdicts,
        )
        if outcome == "monitor_failed" and plan.settings.retries.on_exhausted == "raise":
            details = "; ".join(v.detail for v in final.verdicts if not v.passed)
            msg = (
                f"step {plan.step_type}: monitors {', '.join(final.failed_monitors)} still failed after "
                f"{len(attempts)} attempt(s) ({details}); "
                "raise retries.attempts or set retries.on_exhausted: return"
            )
            raise QualityError(msg)
        return result

    def _emit(
        self,
        plan: StepPlan,
        attempts: list[AttemptRecord],
        outcome: Outcome,
        decisions: list[str],
        *,
        error: BaseException | None = None,
    ) -> StepEvent:
        last = attempts[-1] if attempts else None
        config = last.config if last is not None else plan.config
        stats = last.result.stats if last is not None and last.result is not None else None
        if error is not None:
            decisions.append(f"failed: {type(error).__name__}: {error}")
        event = StepEvent(
            step_type=plan.step_type,
            mode=config.mode,
            outcome=outcome,
            latency_s=self._clock() - plan.started_at,
            model=model_label(str(getattr(self.engine, "model_id", "default"))),
            new_tokens=stats.new_tokens if stats else 0,
            forward_passes=stats.forward_passes if stats else 0,
            prompt_tokens=stats.prompt_tokens if stats else 0,
            cached_prompt_tokens=stats.cached_prompt_tokens if stats else 0,
            attempts=max(len(attempts), 1),
            fallback=_safer_than(config, plan.policy_config),
            breaker_open=plan.breaker_open,
            timeout=any(a.timed_out for a in attempts),
            monitor_failures=tuple(dict.fromkeys(n for a in attempts for n in a.failed_monitors)),
            ntp_equivalent_s=self._ntp_equivalent(config, stats),
            ttft_s=stats.ttft_s if stats else None,
            error=f"{type(error).__name__}: {error}" if error is not None else None,
            run_id=plan.context.run_id,
        )
        try:
            self.recorder.record(event)
        except Exception as exc:  # recorders must not raise; never let one fail a step
            log.warning("recorder %r raised %s; event dropped", self.recorder, exc)
        return event

    def _ntp_equivalent(self, config: DecodeConfig, stats: Any) -> float | None:
        if stats is None:
            return None
        if config.mode == "ntp":
            return float(stats.wall_s)
        if self._ntp_token_s is None:
            return None
        return float(stats.prefill_s) + stats.new_tokens * self._ntp_token_s


class _StepRun:
    """State of one executing step: the attempt function and the retry predicate tenacity calls."""

    def __init__(
        self,
        controller: PolicyController,
        plan: StepPlan,
        prompt: Any,
        constraint_factory: ConstraintFactory | None,
        validators: tuple[Validator, ...],
    ) -> None:
        self.c = controller
        self.plan = plan
        self.prompt = prompt
        self.constraint_factory = constraint_factory
        self.validators = validators
        self.attempts: list[AttemptRecord] = []
        self.decisions: list[str] = list(plan.decisions)
        self.started = controller.now()

    def attempt(self) -> AttemptRecord:
        index = len(self.attempts) + 1
        record = self.c.attempt(
            self.plan,
            index,
            self._config(index),
            self.prompt,
            constraint_factory=self.constraint_factory,
            validators=self.validators,
        )
        self.attempts.append(record)
        self.decisions.append(_attempt_summary(record))
        if record.error is not None:
            raise record.error
        change = self.c.report(self.plan, record)
        if change:
            self.decisions.append(change)
        return record

    def should_retry(self, record: AttemptRecord) -> bool:
        retry_on = self.plan.settings.retries.retry_on
        if record.monitor_failed and "monitor_failed" in retry_on:
            why = "monitors failed"
        elif record.timed_out and "timeout" in retry_on:
            why = "timeout"
        else:
            return False
        if record.index >= self.plan.settings.retries.attempts:
            self.decisions.append(f"retry budget spent after {record.index} attempt(s)")
            return False
        nxt = self.plan.config_for(record.index + 1)
        if why == "monitors failed" and nxt.temperature == 0 and _same_decode(nxt, record.config):
            self.decisions.append(f"no retry: {why} and the next attempt would decode the same greedy output")
            return False
        self.decisions.append(f"retry ({why}) in {_describe(nxt)}")
        return True

    def _config(self, index: int) -> DecodeConfig:
        """The attempt's settings; its deadline is cut to what is left of ``retries.max_delay_s``."""
        config = self.plan.config_for(index)
        max_delay = self.plan.settings.retries.max_delay_s
        if max_delay is None:
            return config
        left = max_delay - (self.c.now() - self.started)
        if left <= 0 or (config.max_time is not None and config.max_time <= left):
            return config
        return config.replace(max_time=left)


# ------------------------------------------------------------------------------------------------- helpers
def _make_store(store: BreakerStore | str | None, clock: Callable[[], float]) -> BreakerStore:
    if store is None:
        return MemoryBreakerStore(clock=clock)
    if isinstance(store, str):
        from agent_mtp.policy.breaker import RedisBreakerStore

        return RedisBreakerStore(store)
    return store


def _once(fn: Callable[[], list[int]]) -> Callable[[], list[int]]:
    cache: list[list[int]] = []

    def get() -> list[int]:
        if not cache:
            cache.append(fn())
        return cache[0]

    return get


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EWMA) * old + _EWMA * new


def _same_decode(a: DecodeConfig, b: DecodeConfig) -> bool:
    return a.replace(max_time=None) == b.replace(max_time=None)


def _safer_than(config: DecodeConfig, policy_config: DecodeConfig) -> bool:
    keys = ("mode", "threshold", "k_max")
    return any(getattr(config, k) != getattr(policy_config, k) for k in keys)


def _describe(config: DecodeConfig) -> str:
    if config.mode in LOSSY_MODES:
        return f"{config.mode} (threshold {config.threshold:g}, k_max {config.k_max})"
    return config.mode


def _attempt_summary(record: AttemptRecord) -> str:
    head = f"attempt {record.index}{' (probe)' if record.probe else ''} {_describe(record.config)}"
    if record.error is not None:
        return f"{head}: raised {type(record.error).__name__}: {record.error}"
    assert record.result is not None
    failed = [f"{v.monitor} ({v.detail})" if v.detail else v.monitor for v in record.verdicts if not v.passed]
    status = f"monitors failed: {', '.join(failed)}" if failed else "monitors passed"
    if record.timed_out:
        status = f"timeout; {status}"
    tpf = record.result.stats.tokens_per_forward
    return f"{head}: {record.result.finish_reason}, {tpf:.2f} tokens/forward, {status}"


def model_label(model_id: str) -> str:
    """A metrics-safe label for a model id: hub ids stay as they are, local paths lose their leading slashes and
    characters that cannot appear in a telemetry key."""
    label = re.sub(r"[^A-Za-z0-9_.\-/]", "_", model_id).lstrip("/._-")[:128]
    return label or "model"
