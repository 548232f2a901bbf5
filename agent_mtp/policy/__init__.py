"""Per-step-type decoding policies: YAML schema, step classification, quality monitors, the NTP-fallback
breaker, deadlines and retries, and calibration. The policy wraps the engine from outside; the engine never
imports it.

Using it from a chat model (``AgentMTPChat``)::

    from agent_mtp.policy import PolicyController, StepContext, json_validator

    controller = PolicyController(
        engine,                                 # MTPEngine (generate, encode_prompt, score, model_id)
        "policies/default.yaml",                # or a Policy, a mapping, or a shipped name: "default"
        recorder=recorder,                      # agent_mtp.events.Recorder: one StepEvent per step
        breaker_store="redis://host:6379/0",    # or a BreakerStore, or None: breaker state per process
    )
    ctx = StepContext(
        step_type=None,             # explicit step type from the call's config/metadata (wins over rules)
        tools_bound=True,
        tool_choice="any",          # None | "auto" | "any" | "none" | "required" | a tool name
        structured_output=False,    # with_structured_output / a response schema was requested
        last_role="user",           # system | user | assistant | tool (human / ai accepted too)
        num_messages=3,
        tool_names=("get_weather",),
        run_id=str(run_id),         # carried into the StepEvent
    )

    controller.classify(ctx) -> str               # the step type, by the policy's rules
    plan = controller.plan(ctx) -> StepPlan       # .step_type, .reason, .settings (effective StepSettings),
                                                  # .config (DecodeConfig of attempt 1, after the breaker),
                                                  # .configs (every attempt), .breaker, .probe
    res = controller.run(                         # = controller.execute(controller.plan(ctx), prompt, ...)
        prompt, ctx,
        constraint_factory=make_grammar,          # zero-arg: a fresh TokenConstraint per attempt, or None
        validators=(json_validator(schema),),     # Callable[[str], MonitorVerdict | bool]
    )
    res -> PolicyResult:
        .result (GenerationResult), .text, .step_type, .attempts (list[AttemptRecord]),
        .outcome ("ok" | "timeout" | "monitor_failed"), .fallback, .verdicts (on the returned output),
        .config / .mode (settings that produced it), .decisions (list[str]), .latency_s,
        .event (the StepEvent recorded), .metadata() (JSON for response_metadata)

    # Streaming: decode with plan.config yourself, then report the outcome (cheap monitors, breaker, event):
    plan = controller.plan(ctx)
    for chunk in engine.stream(prompt, plan.config, constraint=...): ...
    res = controller.observe(plan, result, prompt=prompt, validators=(...,))  # or verdicts=[...]

Errors: a bad policy raises :class:`agent_mtp.errors.PolicyError` naming the file, line and field. ``run`` /
``execute`` re-raise non-retryable engine errors (after recording the event, outcome "error") and raise
:class:`agent_mtp.errors.QualityError` only when the policy says ``retries.on_exhausted: raise``.
"""

from __future__ import annotations

from agent_mtp.policy.breaker import (
    BreakerStatus,
    BreakerStore,
    MemoryBreakerStore,
    RedisBreakerStore,
)
from agent_mtp.policy.calibrate import CalibrationReport, calibrate, write_calibrated_policy
from agent_mtp.policy.classify import Classification, StepContext, classify
from agent_mtp.policy.controller import PolicyController, PolicyResult, StepPlan
from agent_mtp.policy.loading import PRESET_NAMES, load_policy, parse_policy, resolve_policy_path
from agent_mtp.policy.monitors import (
    EngineLike,
    Monitor,
    MonitorInput,
    MonitorVerdict,
    Validator,
    agreement,
    builtin_monitors,
    json_validator,
)
from agent_mtp.policy.retries import AttemptRecord, build_retrying
from agent_mtp.policy.schema import BUILTIN_STEP_TYPES, Policy, StepSettings

__all__ = [
    "BUILTIN_STEP_TYPES",
    "PRESET_NAMES",
    "AttemptRecord",
    "BreakerStatus",
    "BreakerStore",
    "CalibrationReport",
    "Classification",
    "EngineLike",
    "MemoryBreakerStore",
    "Monitor",
    "MonitorInput",
    "MonitorVerdict",
    "Policy",
    "PolicyController",
    "PolicyResult",
    "RedisBreakerStore",
    "StepContext",
    "StepPlan",
    "StepSettings",
    "Validator",
    "agreement",
    "build_retrying",
    "builtin_monitors",
    "calibrate",
    "classify",
    "json_validator",
    "load_policy",
    "parse_policy",
    "resolve_policy_path",
    "write_calibrated_policy",
]
