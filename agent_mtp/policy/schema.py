"""The policy file schema: pydantic models with ``extra="forbid"``, strict types, a default for every field.

A policy has ``defaults`` (a full :class:`StepSettings`) and per-step-type overrides under ``steps``; an
override names only the fields it changes, at any depth (``steps.tool_call.retries.attempts: 2``). Lists
replace, mappings merge. :meth:`Policy.effective` returns the merged settings of one step type.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from agent_mtp.engine.config import K_MAX_LIMIT, LOSSLESS_MODES, LOSSY_MODES, DecodeConfig, DraftName, Mode
from agent_mtp.errors import ConfigError

BUILTIN_STEP_TYPES: tuple[str, ...] = ("tool_call", "reasoning", "formatting", "final_answer")
MODE_SAFETY: dict[str, int] = {"static": 0, "confadapt": 1, "verified": 2, "ntp": 3}
"""Retries only move to a safer mode; every lossless mode ranks above every lossy one."""

PolicyMode = Mode
SafeMode = Literal["ntp", "verified"]
"""The lossless modes (what an open breaker falls back to)."""
DraftSource = DraftName
RetryOn = Literal["monitor_failed", "timeout", "retryable_error"]
Role = Literal["system", "user", "assistant", "tool"]
ToolChoiceKind = Literal["unset", "none", "auto", "any", "named"]
StepName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
KMax = Annotated[int, Field(ge=1, le=K_MAX_LIMIT)] | Literal["auto"]

_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)


class _Section(BaseModel):
    model_config = _CONFIG


def _default_retry_on() -> list[RetryOn]:
    return ["monitor_failed", "retryable_error"]


def _default_drafts() -> list[DraftSource]:
    return ["mtp", "ngram", "grammar"]


# ---------------------------------------------------------------------------------------------------- retries
class BackoffSettings(_Section):
    """Exponential backoff with jitter between attempts: min(max_s, multiplier_s * exp_base**n + U(0,
    jitter_s))."""

    multiplier_s: float = Field(default=0.05, ge=0, description="seconds before the first retry (>= 0)")
    exp_base: float = Field(default=2.0, ge=1, description="growth factor per retry (>= 1)")
    max_s: float = Field(default=2.0, ge=0, description="longest wait between attempts in seconds (>= 0)")
    jitter_s: float = Field(default=0.05, ge=0, description="random extra wait in [0, jitter_s] seconds (>= 0)")


class DecodeOverride(_Section):
    """What one retry changes; unset fields keep the previous attempt's value."""

    mode: PolicyMode | None = Field(default=None, description="ntp, static, confadapt or verified")
    threshold: float | None = Field(default=None, ge=0, le=1, description="a number in [0, 1]")
    k_max: KMax | None = Field(default=None, description=f'an int in [1, {K_MAX_LIMIT}] or "auto"')


class RetrySettings(_Section):
    attempts: int = Field(default=2, ge=1, le=10, description="total attempts including the first, an int in [1, 10]")
    max_delay_s: float | None = Field(
        default=None,
        gt=0,
        description="stop retrying once this many seconds passed since the first attempt (> 0 or null)",
    )
    backoff: BackoffSettings = BackoffSettings()
    retry_on: list[RetryOn] = Field(
        default_factory=_default_retry_on,
        description="list of monitor_failed, timeout, retryable_error",
    )
    escalate: list[DecodeOverride] = Field(
        default_factory=lambda: [DecodeOverride(mode="ntp")],
        description="per retry, the changes (mode/threshold/k_max); the last entry repeats; [] retries as is",
    )
    on_exhausted: Literal["return", "raise"] = Field(
        default="return", description="return (last output, outcome monitor_failed) or raise (QualityError)"
    )


# --------------------------------------------------------------------------------------------------- monitors
class _Monitor(_Section):
    enabled: bool = Field(default=True, description="true or false")
    sample_rate: float = Field(
        default=1.0, ge=0, le=1, description="fraction of generations checked, a number in [0, 1]"
    )


class ValidityMonitor(_Monitor):
    """Cheap: runs the caller's validators (tool-call / schema checks) on every output."""

    require_json: bool = Field(default=False, description="true: the output must also parse as JSON")


class RepetitionMonitor(_Monitor):
    """Cheap: fails when a unit of 1..max_period tokens repeats min_repeats times in a row over
    min_span_tokens."""

    min_repeats: int = Field(default=4, ge=2, description="an int >= 2")
    min_span_tokens: int = Field(default=24, ge=2, description="an int >= 2")
    max_period: int = Field(default=32, ge=1, le=512, description="an int in [1, 512]")


class NtpAgreementMonitor(_Monitor):
    """Costly: re-decodes with NTP and compares tokens (difflib ratio); only for lossy modes."""

    sample_rate: float = Field(default=0.05, ge=0, le=1, description="fraction of generations checked, in [0, 1]")
    min_agreement: float = Field(default=0.8, ge=0, le=1, description="a number in [0, 1]")


class LikelihoodMonitor(_Monitor):
    """Costly: one teacher-forced NTP pass over the output; mean log-prob vs the step type's baseline."""

    sample_rate: float = Field(default=0.1, ge=0, le=1, description="fraction of generations checked, in [0, 1]")
    baseline: float | None = Field(
        default=None,
        le=0,
        description="mean log-prob per token of NTP outputs (<= 0), or null to learn it online",
    )
    max_drop: float = Field(default=1.0, gt=0, description="allowed drop below the baseline in nats per token (> 0)")


class MonitorSettings(_Section):
    validity: ValidityMonitor = ValidityMonitor()
    repetition: RepetitionMonitor = RepetitionMonitor()
    ntp_agreement: NtpAgreementMonitor = NtpAgreementMonitor()
    likelihood: LikelihoodMonitor = LikelihoodMonitor()


# ---------------------------------------------------------------------------------------------------- breaker
class FallbackSettings(_Section):
    """The per-step-type breaker: closed -> open -> (cooldown in fallback mode) -> half-open probes -> closed."""

    enabled: bool = Field(default=True, description="true or false")
    mode: SafeMode = Field(default="ntp", description="mode used while the breaker is open: ntp or verified")
    window: int = Field(default=50, ge=1, description="recent lossy-mode generations kept per step type, an int >= 1")
    min_samples: int = Field(default=10, ge=1, description="samples needed before the breaker may trip, an int >= 1")
    baseline: float = Field(default=1.0, gt=0, le=1, description="expected monitor pass rate, a number in (0, 1]")
    margin: float = Field(default=0.2, ge=0, lt=1, description="trip when pass rate < baseline - margin; in [0, 1)")
    cooldown_s: float = Field(default=60.0, gt=0, description="seconds in fallback mode before probing (> 0)")
    probe_rate: float = Field(default=0.1, gt=0, le=1, description="fraction of half-open calls that probe, in (0, 1]")
    probes_to_close: int = Field(default=3, ge=1, description="passing probes needed to close, an int >= 1")
    half_open_ttl_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds the half-open state lasts without enough probes before it closes (> 0)",
    )


# ---------------------------------------------------------------------------------------------- step settings
class StepSettings(_Section):
    """Everything that decides how one step type decodes and is checked."""

    mode: PolicyMode = Field(default="confadapt", description="ntp, static, confadapt or verified")
    threshold: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="ConfAdapt confidence threshold tau, a number in [0, 1] (0.9 = paper default)",
    )
    k_max: KMax = Field(default=8, description=f'tokens proposed per pass: an int in [1, {K_MAX_LIMIT}] or "auto"')
    max_new_tokens: int = Field(default=512, ge=1, description="an int >= 1")
    max_time_s: float | None = Field(
        default=None,
        gt=0,
        description="per-attempt deadline in seconds enforced in the decode loop (> 0), or null",
    )
    temperature: float = Field(default=0.0, ge=0, description="0 = greedy, or a number > 0")
    drafts: list[DraftSource] = Field(
        default_factory=_default_drafts,
        description="draft sources for verified mode: mtp, ngram and/or grammar",
    )
    target_agreement: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="calibration target: accepted tokens agree with NTP at least this often, (0, 1]",
    )
    retries: RetrySettings = RetrySettings()
    monitors: MonitorSettings = MonitorSettings()
    fallback: FallbackSettings = FallbackSettings()

    def decode_config(self, **changes: Any) -> DecodeConfig:
        """The engine settings of this step (``changes`` override fields of the result)."""
        fields: dict[str, Any] = {
            "mode": self.mode,
            "threshold": self.threshold,
            "k_max": self.k_max,
            "max_new_tokens": self.max_new_tokens,
            "max_time": self.max_time_s,
            "temperature": self.temperature,
            "drafts": tuple(self.drafts),
        }
        fields.update(changes)
        return DecodeConfig(**fields)


# ------------------------------------------------------------------------------------ settings outside a file
SETTING_FIELDS: dict[str, str] = {
    "mode": "mode",
    "threshold": "threshold",
    "k_max": "k_max",
    "max_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "timeout": "max_time_s",
    "max_time": "max_time_s",
    "max_time_s": "max_time_s",
}
"""Names that front ends and requests use (``max_tokens``, ``timeout``) -> the :class:`StepSettings` field whose
range applies."""


def check_decode_settings(owner: str, **values: Any) -> None:
    """Refuse out-of-range decode settings given outside a policy file (a chat model's ``k_max=0``, a request's
    ``max_tokens=0``, ``threshold=1.5``) with the same rules a policy file gets, so a value is either accepted
    everywhere or refused everywhere. ``None`` means unset. Raises :class:`~agent_mtp.errors.ConfigError`
    naming ``owner``, the value and the allowed range."""
    given = {name: value for name, value in values.items() if value is not None}
    fields = {SETTING_FIELDS[name]: value for name, value in given.items()}
    try:
        StepSettings.model_validate(fields)
    except ValidationError as e:
        loc = e.errors()[0]["loc"]
        field = str(loc[0]) if loc else ""
        name = next((n for n in given if SETTING_FIELDS[n] == field), field)
        allowed = StepSettings.model_fields[field].description if field in StepSettings.model_fields else None
        msg = f"{owner}: {name}={given.get(name)!r} is invalid; allowed: {allowed or 'see docs/policies.md'}."
        raise ConfigError(msg) from None


# --------------------------------------------------------------------------------------------- classification
class RuleCondition(_Section):
    """All conditions that are set must hold (AND); a list means any of its values."""

    tools_bound: bool | None = Field(default=None, description="true or false")
    tool_choice: list[ToolChoiceKind] | None = Field(default=None, description="list of unset, none, auto, any, named")
    structured_output: bool | None = Field(default=None, description="true or false")
    last_role: list[Role] | None = Field(default=None, description="list of system, user, assistant, tool")
    min_messages: int | None = Field(default=None, ge=0, description="an int >= 0")
    max_messages: int | None = Field(default=None, ge=0, description="an int >= 0")
    tool_names: list[str] | None = Field(default=None, description="list of tool names; matches when any is bound")


class ClassificationRule(_Section):
    step_type: StepName = Field(description="a step type name (lower case, digits, underscores)")
    when: RuleCondition = Field(description="conditions on the agent context")
    name: str = Field(default="", description="a label shown in the decision")


def _default_rules() -> list[ClassificationRule]:
    return [
        ClassificationRule(
            name="forced tool choice", step_type="tool_call", when=RuleCondition(tool_choice=["any", "named"])
        ),
        ClassificationRule(
            name="structured output", step_type="formatting", when=RuleCondition(structured_output=True)
        ),
        ClassificationRule(name="after a tool result", step_type="reasoning", when=RuleCondition(last_role=["tool"])),
        ClassificationRule(
            name="tools offered to a user turn",
            step_type="tool_call",
            when=RuleCondition(tools_bound=True, tool_choice=["unset", "auto"], last_role=["user"]),
        ),
    ]


class ClassificationSettings(_Section):
    rules: list[ClassificationRule] = Field(
        default_factory=_default_rules, description="rules tried in order; the first match decides"
    )
    default: StepName = Field(default="final_answer", description="step type when no rule matches")


# ----------------------------------------------------------------------------------------------------- policy
class Policy(_Section):
    """A whole policy file. Build it from YAML with :func:`agent_mtp.policy.load_policy` (errors name the
    line)."""

    version: Literal[1] = Field(default=1, description="1")
    name: str = Field(default="custom", description="a label used in telemetry and breaker keys")
    description: str = Field(default="", description="free text")
    defaults: StepSettings = StepSettings()
    steps: dict[StepName, StepSettings] = Field(
        default_factory=dict, description="per-step-type overrides of `defaults`, keyed by step type"
    )
    classification: ClassificationSettings = ClassificationSettings()

    @cached_property
    def _effective(self) -> dict[str, StepSettings]:
        return {name: self._merge(name) for name in self.step_types}

    @property
    def step_types(self) -> list[str]:
        """Built-in step types, then the ones this policy names (in steps or rules)."""
        names = list(BUILTIN_STEP_TYPES)
        named = [*self.steps, *(r.step_type for r in self.classification.rules), self.classification.default]
        names.extend(n for n in dict.fromkeys(named) if n not in names)
        return names

    def effective(self, step_type: str) -> StepSettings:
        """The merged settings of ``step_type`` (``defaults`` for a name the policy does not mention)."""
        cached = self._effective.get(step_type)
        return cached if cached is not None else self._merge(step_type)

    def _merge(self, step_type: str) -> StepSettings:
        override = self.steps.get(step_type)
        if override is None:
            return self.defaults
        merged = deep_merge(self.defaults.model_dump(), override.model_dump(exclude_unset=True))
        return StepSettings.model_validate(merged, strict=False)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``: mappings merge key by key, everything else (lists too) replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


Problem = tuple[tuple[str | int, ...], str]
"""A semantic problem: the location in the file (as a key path) and what is wrong with what is allowed."""


def semantic_problems(policy: Policy) -> list[Problem]:
    """Checks that need more than one field: run after the schema validated (the loader adds file and line)."""
    problems: list[Problem] = []
    declared = set(BUILTIN_STEP_TYPES) | set(policy.steps)
    for i, rule in enumerate(policy.classification.rules):
        if rule.step_type not in declared:
            problems.append((("classification", "rules", i, "step_type"), _undeclared(rule.step_type, declared)))
        when = rule.when
        if when.min_messages is not None and when.max_messages is not None and when.min_messages > when.max_messages:
            problems.append(
                (
                    ("classification", "rules", i, "when", "min_messages"),
                    "min_messages must be <= max_messages",
                )
            )
    if policy.classification.default not in declared:
        problems.append((("classification", "default"), _undeclared(policy.classification.default, declared)))
    for name in ["defaults", *policy.steps]:
        settings = policy.defaults if name == "defaults" else policy.effective(name)
        prefix: tuple[str | int, ...] = ("defaults",) if name == "defaults" else ("steps", name)
        problems.extend((prefix + loc, msg) for loc, msg in _step_problems(settings))
    return problems


assert set(get_args(SafeMode)) == LOSSLESS_MODES, "SafeMode must list the engine's lossless modes"
assert set(MODE_SAFETY) == set(LOSSY_MODES | LOSSLESS_MODES), "MODE_SAFETY must rank every engine mode"
assert max(MODE_SAFETY[m] for m in LOSSY_MODES) < min(MODE_SAFETY[m] for m in LOSSLESS_MODES)


def _undeclared(name: str, declared: set[str]) -> str:
    return (
        f"step type {name!r} is not declared: add it under `steps:` (an empty mapping "
        f"`{name}: {{}}` uses the defaults) or use one of {', '.join(sorted(declared))}"
    )


def _step_problems(settings: StepSettings) -> list[Problem]:
    problems: list[Problem] = []
    fb = settings.fallback
    if fb.min_samples > fb.window:
        problems.append(
            (("fallback", "min_samples"), f"min_samples ({fb.min_samples}) must be <= window ({fb.window})")
        )
    if fb.margin >= fb.baseline:
        problems.append(
            (
                ("fallback", "margin"),
                f"margin ({fb.margin}) must be < baseline ({fb.baseline}) or it never trips",
            )
        )
    try:
        settings.decode_config()
    except ValueError as exc:
        problems.append(((), str(exc)))
    return problems
