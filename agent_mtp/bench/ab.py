"""A/B runs: the same prompts under two policies, through the policy controller, as an agent would run them.

    report = run_ab(engine, load_suite("agent"), "policies/exact.yaml", "policies/default.yaml", recorder=telemetry)
    report.sides["a"].summary.p95_latency_s, report.sides["b"].timeout_ratio, ...

Each prompt runs once per side, the side order alternating from prompt to prompt (drift cancels). Every step goes
through ``PolicyController.plan`` / ``execute`` (classification by the prompt's step type, breaker, deadlines,
monitors, retries), with the prompt's grammar and validators like AgentMTPChat gives them; ``max_new_tokens`` is
capped at the prompt's own budget so both sides generate the same amount. The controller records one
``StepEvent`` per step on ``recorder`` (a :class:`agent_mtp.telemetry.Telemetry` writes them to Redis when
``AGENT_MTP_REDIS_URL`` is set), labelled ``<model>/ab-<side>-<policy name>`` so the dashboard tells the sides apart.
Quality is scored afterwards exactly like ``agent-mtp bench`` scores it (against untimed NTP decodes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from dataclasses import replace as dc_replace
from typing import Any

from agent_mtp.bench.core import Run, Variant, VariantSummary, json_safe, machine_info, score_runs, summarise
from agent_mtp.bench.scoring import tool_call_valid
from agent_mtp.bench.suites import BenchPrompt, prompt_grammar
from agent_mtp.errors import AgentMTPError
from agent_mtp.events import NullRecorder, Recorder, StepEvent

SIDES = ("a", "b")
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_./-]+")


@dataclass
class ABStep:
    """One policy step of one side: the run (speed, output, quality) and what the policy did."""

    side: str
    run: Run
    step_type: str
    mode: str
    outcome: str
    attempts: int
    fallback: bool
    breaker_open: bool
    timeout: bool
    monitor_failures: tuple[str, ...] = ()
    error: str | None = None


@dataclass
class ABSide:
    """Everything measured on one side."""

    label: str
    policy: str
    source: str
    summary: VariantSummary
    """Speed and quality, computed like ``agent-mtp bench`` (wall time = the whole step, retries included)."""
    requests: int
    timeout_ratio: float
    retry_rate: float
    """Steps that needed more than one attempt."""
    fallback_rate: float
    error_rate: float
    monitor_failure_rate: float
    modes: dict[str, int] = field(default_factory=dict)
    """Mode that produced the returned output -> steps."""
    suite_summaries: dict[str, VariantSummary] = field(default_factory=dict)


@dataclass
class ABReport:
    machine: dict[str, Any]
    settings: dict[str, Any]
    sides: dict[str, ABSide]
    steps: list[ABStep]

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "machine": self.machine,
                "settings": self.settings,
                "sides": {k: asdict(v) for k, v in self.sides.items()},
                "steps": [asdict(s) for s in self.steps],
            }
        )


class LabelledRecorder:
    """Forwards events with ``model`` replaced by a label (so two policies on one model stay apart)."""

    def __init__(self, inner: Recorder, label: str) -> None:
        self.inner = inner
        self.label = label

    def record(self, event: Any) -> None:
        if isinstance(event, StepEvent):
            event = dc_replace(event, model=self.label)
        self.inner.record(event)


def side_label(model_id: str, side: str, policy_name: str) -> str:
    """``<model>/ab-<side>-<policy>`` restricted to the characters telemetry keys allow."""
    label = _KEY_UNSAFE.sub("-", f"{model_id}/ab-{side}-{policy_name}").lstrip("-_./")
    return label[:128] or f"ab-{side}"


def run_ab(
    engine: Any,
    prompts: Sequence[BenchPrompt],
    policy_a: Any,
    policy_b: Any,
    *,
    recorder: Recorder | None = None,
    grammar: bool = True,
    seed: int = 0,
    on_step: Callable[[ABStep], None] | None = None,
    on_score: Callable[[int, int], None] | None = None,
) -> ABReport:
    """Run ``prompts`` under both policies (a path, a shipped name, a mapping or a Policy) and compare."""
    from agent_mtp.policy import PolicyController, load_policy

    sink: Recorder = recorder if recorder is not None else NullRecorder()
    controllers = {}
    for side, source in zip(SIDES, (policy_a, policy_b), strict=True):
        policy = load_policy(source)
        label = side_label(str(engine.model_id), side, policy.name)
        controllers[side] = PolicyController(engine, policy, recorder=LabelledRecorder(sink, label), seed=seed)
    sources = {"a": _source(policy_a), "b": _source(policy_b)}
    steps: list[ABStep] = []
    for i, prompt in enumerate(prompts):
        for side in SIDES if i % 2 == 0 else tuple(reversed(SIDES)):
            step = run_step(engine, controllers[side], side, prompt, grammar=grammar)
            steps.append(step)
            if on_step is not None:
                on_step(step)
    score_runs(engine, prompts, [s.run for s in steps], grammar=grammar, progress=on_score)
    sides = {
        side: _side(side, controllers[side].policy.name, sources[side], [s for s in steps if s.side == side])
        for side in SIDES
    }
    settings = {
        "model": engine.model_id,
        "prompts": len(prompts),
        "grammar": grammar,
        "policies": {side: sources[side] for side in SIDES},
    }
    return ABReport(machine_info(), settings, sides, steps)


def run_step(engine: Any, controller: Any, side: str, prompt: BenchPrompt, *, grammar: bool = True) -> ABStep:
    """One prompt as one agent step under ``controller``'s policy."""
    from agent_mtp.policy import StepContext, json_validator

    ids = engine.encode_prompt(prompt.prompt_messages())
    compiled = prompt_grammar(engine, prompt) if grammar else None
    validators: list[Callable[[str], Any]] = []
    if prompt.tools:
        validators.append(_tool_validator(prompt))
    elif prompt.response_schema is not None:
        validators.append(json_validator(prompt.response_schema))
    context = StepContext(
        step_type=prompt.policy_step_type,
        tools_bound=bool(prompt.tools),
        tool_choice=prompt.tool_choice,
        structured_output=prompt.response_schema is not None,
        last_role=prompt.messages[-1]["role"],
        num_messages=len(prompt.messages),
        tool_names=tuple(str(t.get("function", t).get("name")) for t in prompt.tools),
        run_id=f"ab-{side}-{prompt.id}",
    )
    plan = controller.plan(context)
    budget = prompt.max_new_tokens
    capped = tuple(c.replace(max_new_tokens=min(c.max_new_tokens, budget)) for c in plan.configs)
    plan = dc_replace(plan, configs=capped)
    name = f"{side}:{controller.policy.name}"
    try:
        res = controller.execute(plan, ids, constraint_factory=compiled, validators=validators)
    except AgentMTPError as e:
        run = Run(name, prompt.id, [], 0.0, float("nan"), 0, prompt.suite, prompt.score)
        return ABStep(side, run, plan.step_type, plan.config.mode, "error", 1, False, False, False, error=str(e))
    stats = res.result.stats
    run = Run(
        name,
        prompt.id,
        res.result.token_ids,
        res.latency_s,
        stats.ttft_s,
        stats.forward_passes,
        prompt.suite,
        prompt.score,
        jump_forward_tokens=stats.jump_forward_tokens,
    )
    event = res.event
    return ABStep(
        side,
        run,
        res.step_type,
        res.mode,
        res.outcome,
        len(res.attempts),
        res.fallback,
        event.breaker_open,
        event.timeout,
        tuple(event.monitor_failures),
    )


def _tool_validator(prompt: BenchPrompt) -> Callable[[str], bool]:
    def tool_calls_valid(text: str) -> bool:
        return tool_call_valid(text, prompt.tools)

    return tool_calls_valid


def _side(side: str, policy: str, source: str, steps: list[ABStep]) -> ABSide:
    name = f"{side}:{policy}"
    variant = [Variant(name)]
    ok_runs = [s.run for s in steps if s.outcome != "error"]
    summary = summarise(ok_runs, variant)
    empty = VariantSummary(name, 0, 0, 0.0, 0.0, 0.0, float("nan"), float("nan"), float("nan"))
    by_suite: dict[str, list[Run]] = {}
    for r in ok_runs:
        by_suite.setdefault(r.suite, []).append(r)
    n = max(len(steps), 1)
    modes: dict[str, int] = {}
    for s in steps:
        modes[s.mode] = modes.get(s.mode, 0) + 1
    return ABSide(
        label=side,
        policy=policy,
        source=source,
        summary=summary[0] if summary else empty,
        requests=len(steps),
        timeout_ratio=sum(s.timeout for s in steps) / n,
        retry_rate=sum(s.attempts > 1 for s in steps) / n,
        fallback_rate=sum(s.fallback for s in steps) / n,
        error_rate=sum(s.outcome == "error" for s in steps) / n,
        monitor_failure_rate=sum(bool(s.monitor_failures) for s in steps) / n,
        modes=modes,
        suite_summaries={suite: summarise(rs, variant)[0] for suite, rs in by_suite.items()},
    )


def _source(policy: Any) -> str:
    return str(policy) if isinstance(policy, str) else type(policy).__name__
