"""Quality monitors: each looks at one generation and gives a verdict (pass/fail with a score and a reason).

Cheap monitors run on every generation: ``validity`` (the caller's validators, e.g. tool-call arguments
against their JSON schema, plus an optional JSON parse) and ``repetition`` (a token loop). Costly monitors run
on a sampled fraction: ``ntp_agreement`` re-decodes the prompt with NTP and compares the tokens;
``likelihood`` scores the output with one teacher-forced pass of the exact NTP path and compares the mean
log-prob to the step type's baseline. A monitor returns None when it has nothing to say (no validators, exact
mode, no baseline yet).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from agent_mtp.engine.config import LOSSY_MODES, DecodeConfig
from agent_mtp.engine.constraints import TokenConstraint
from agent_mtp.engine.results import GenerationResult
from agent_mtp.policy.schema import StepSettings


@dataclass(frozen=True)
class MonitorVerdict:
    """One monitor's judgement of one output."""

    monitor: str
    passed: bool
    score: float | None = None
    """What was measured (agreement ratio, mean log-prob, loop span ...), when there is a number."""
    limit: float | None = None
    """The threshold the score was compared with."""
    detail: str = ""
    costly: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"monitor": self.monitor, "passed": self.passed}
        if self.score is not None:
            out["score"] = round(self.score, 4)
        if self.limit is not None:
            out["limit"] = round(self.limit, 4)
        if self.detail:
            out["detail"] = self.detail
        return out


Validator = Callable[[str], "MonitorVerdict | bool"]
"""Called with the output text; returns a verdict (or a bool). Supplied by the caller, e.g. tool-call
validity."""


class EngineLike(Protocol):
    """The part of :class:`agent_mtp.engine.MTPEngine` that the policy layer uses."""

    model_id: str

    def generate(
        self, prompt: Any, config: DecodeConfig, *, constraint: TokenConstraint | None = None
    ) -> GenerationResult: ...

    def encode_prompt(self, prompt: Any) -> list[int]: ...

    def score(self, prompt_ids: list[int], continuation_ids: list[int]) -> list[float]: ...


@dataclass(frozen=True)
class MonitorInput:
    """Everything a monitor may look at for one attempt."""

    prompt: Any
    result: GenerationResult
    config: DecodeConfig
    step_type: str
    settings: StepSettings
    engine: EngineLike
    prompt_ids: Callable[[], list[int]]
    """Token ids of the prompt (encoded once, on first use)."""
    constraint_factory: Callable[[], TokenConstraint] | None = None
    validators: Sequence[Validator] = ()
    baseline_logprob: float | None = None
    """The likelihood baseline learned online for this step type (used when the policy sets none)."""


@runtime_checkable
class Monitor(Protocol):
    """A quality check. ``sample_rate`` (0 = off, 1 = every generation) is read from the step's settings."""

    name: str
    costly: bool

    def sample_rate(self, settings: StepSettings) -> float: ...

    def check(self, sample: MonitorInput) -> MonitorVerdict | None: ...


# --------------------------------------------------------------------------------------------------- validity
class ValidityMonitor:
    name = "validity"
    costly = False

    def sample_rate(self, settings: StepSettings) -> float:
        m = settings.monitors.validity
        return m.sample_rate if m.enabled else 0.0

    def check(self, sample: MonitorInput) -> MonitorVerdict | None:
        validators: list[Validator] = list(sample.validators)
        if sample.settings.monitors.validity.require_json:
            validators.append(json_validator())
        if not validators:
            return None
        verdicts = [_as_verdict(v(sample.result.text), getattr(v, "__name__", "validator")) for v in validators]
        failed = [v for v in verdicts if not v.passed]
        detail = "; ".join(f"{v.monitor}: {v.detail}" if v.detail else v.monitor for v in failed)
        return MonitorVerdict(self.name, not failed, score=float(len(verdicts) - len(failed)), detail=detail)


def json_validator(schema: Mapping[str, Any] | None = None, *, name: str = "json") -> Validator:
    """A validator: the text must parse as JSON and, when ``schema`` is given, match it (jsonschema)."""
    checker = None
    if schema is not None:
        import jsonschema

        checker = jsonschema.validators.validator_for(schema)(schema)

    def validate(text: str) -> MonitorVerdict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return MonitorVerdict(name, False, detail=f"not JSON: {exc.msg} at char {exc.pos}")
        if checker is not None:
            error = next(iter(checker.iter_errors(value)), None)
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "<root>"
                return MonitorVerdict(name, False, detail=f"schema: {where}: {error.message}")
        return MonitorVerdict(name, True)

    validate.__name__ = name
    return validate


def _as_verdict(value: MonitorVerdict | bool, name: str) -> MonitorVerdict:
    if isinstance(value, MonitorVerdict):
        return value
    return MonitorVerdict(name, bool(value), detail="" if value else "rejected")


# ------------------------------------------------------------------------------------------------- repetition
class RepetitionMonitor:
    name = "repetition"
    costly = False

    def sample_rate(self, settings: StepSettings) -> float:
        m = settings.monitors.repetition
        return m.sample_rate if m.enabled else 0.0

    def check(self, sample: MonitorInput) -> MonitorVerdict | None:
        m = sample.settings.monitors.repetition
        period, span = longest_loop(sample.result.token_ids, max_period=m.max_period, min_repeats=m.min_repeats)
        passed = span < m.min_span_tokens
        detail = "" if passed else f"{span} tokens repeat a {period}-token unit {span / period:.1f} times"
        return MonitorVerdict(self.name, passed, score=float(span), limit=float(m.min_span_tokens), detail=detail)


def longest_loop(token_ids: Sequence[int], *, max_period: int, min_repeats: int) -> tuple[int, int]:
    """(period, span) of the longest stretch that repeats a unit of <= max_period tokens >= min_repeats times.

    A stretch of span s is periodic with period p when ids[i] == ids[i - p] for the s - p positions after its
    first unit; it holds s / p copies of the unit. Returns (0, 0) when there is none.
    """
    ids = list(token_ids)
    best = (0, 0)
    for period in range(1, min(max_period, len(ids) // 2) + 1):
        run = 0
        for i in range(period, len(ids)):
            run = run + 1 if ids[i] == ids[i - period] else 0
            span = run + period
            if run and span >= min_repeats * period and span > best[1]:
                best = (period, span)
    return best


# ---------------------------------------------------------------------------------------------- NTP agreement
class NtpAgreementMonitor:
    name = "ntp_agreement"
    costly = True

    def sample_rate(self, settings: StepSettings) -> float:
        m = settings.monitors.ntp_agreement
        return m.sample_rate if m.enabled else 0.0

    def check(self, sample: MonitorInput) -> MonitorVerdict | None:
        if sample.config.mode not in LOSSY_MODES or sample.config.temperature > 0:
            return None  # exact modes agree by construction; sampled outputs are not comparable token by token
        ids = list(sample.result.token_ids)
        reference_config = sample.config.replace(mode="ntp", max_new_tokens=max(1, len(ids)), max_time=None)
        constraint = sample.constraint_factory() if sample.constraint_factory is not None else None
        reference = sample.engine.generate(sample.prompt, reference_config, constraint=constraint)
        score = agreement(ids, reference.token_ids)
        limit = sample.settings.monitors.ntp_agreement.min_agreement
        detail = "" if score >= limit else f"agrees with NTP on {score:.0%} of tokens"
        return MonitorVerdict(self.name, score >= limit, score=score, limit=limit, detail=detail, costly=True)


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Share of tokens two outputs have in common, in [0, 1] (difflib ratio 2M/T; 1.0 iff identical)."""
    if not tokens and not reference:
        return 1.0
    return difflib.SequenceMatcher(None, list(tokens), list(reference), autojunk=False).ratio()


# ------------------------------------------------------------------------------------------------- likelihood
class LikelihoodMonitor:
    name = "likelihood"
    costly = True

    def sample_rate(self, settings: StepSettings) -> float:
        m = settings.monitors.likelihood
        return m.sample_rate if m.enabled else 0.0

    def check(self, sample: MonitorInput) -> MonitorVerdict | None:
        ids = list(sample.result.token_ids)
        if not ids:
            return None
        logprobs = sample.engine.score(sample.prompt_ids(), ids)
        mean = sum(logprobs) / len(logprobs)
        m = sample.settings.monitors.likelihood
        if sample.config.mode not in LOSSY_MODES:
            return MonitorVerdict(self.name, True, score=mean, detail="exact mode (baseline sample)", costly=True)
        baseline = m.baseline if m.baseline is not None else sample.baseline_logprob
        if baseline is None:
            return None
        limit = baseline - m.max_drop
        detail = "" if mean >= limit else f"mean log-prob {mean:.2f} < baseline {baseline:.2f} - {m.max_drop}"
        return MonitorVerdict(self.name, mean >= limit, score=mean, limit=limit, detail=detail, costly=True)


def builtin_monitors() -> list[Monitor]:
    """The four monitors every controller runs (cheap ones first)."""
    return [ValidityMonitor(), RepetitionMonitor(), NtpAgreementMonitor(), LikelihoodMonitor()]
