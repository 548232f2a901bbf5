"""Threshold calibration: per step type, the lowest ConfAdapt threshold (and the k) whose output agrees with
NTP at least as often as the policy's target, measured on a prompt suite, written into a new policy file.

Agreement is measured per suite prompt as the share of tokens the ConfAdapt output has in common with the
greedy NTP output of the same prompt (:func:`~agent_mtp.policy.monitors.agreement`), pooled over the prompts
weighted by length. Thresholds are tried from the highest down; the search for a k stops at the first
threshold that misses the target (agreement falls as the threshold falls). Among the k values, the one with
the most tokens per forward pass wins.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent_mtp.engine.config import LOSSY_MODES, DecodeConfig
from agent_mtp.policy.loading import PolicySource, load_policy, parse_policy, resolve_policy_path
from agent_mtp.policy.monitors import EngineLike
from agent_mtp.policy.schema import Policy
from agent_mtp.policy.suites import CalibrationPrompt

DEFAULT_THRESHOLDS: tuple[float, ...] = (0.99, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)
DEFAULT_TARGET = 0.97


@dataclass(frozen=True)
class Trial:
    k_max: int
    threshold: float
    agreement: float
    tokens_per_forward: float


@dataclass
class StepCalibration:
    step_type: str
    target: float
    prompts: int
    threshold: float | None
    """Lowest threshold that met the target (None: none did, the step is switched to verified)."""
    k_max: int | None
    agreement: float | None
    tokens_per_forward: float | None
    baseline_logprob: float | None
    """Mean log-prob per token of the NTP outputs (the likelihood monitor's baseline)."""
    trials: list[Trial] = field(default_factory=list)

    def comment(self) -> list[str]:
        n = f"{self.prompts} prompt(s)"
        if self.threshold is None:
            best = max(self.trials, key=lambda t: t.agreement, default=None)
            seen = f"; best agreement {best.agreement:.3f} at threshold {best.threshold:g}" if best else ""
            return [f"calibrated: no threshold reached agreement {self.target:g} on {n}{seen}; using verified"]
        assert self.agreement is not None and self.tokens_per_forward is not None
        return [
            f"calibrated: threshold {self.threshold:g}, k_max {self.k_max}: agreement with NTP "
            f"{self.agreement:.3f} (target {self.target:g}), "
            f"{self.tokens_per_forward:.2f} tokens/forward on {n}"
        ]


@dataclass
class CalibrationReport:
    suite: str
    model_id: str
    steps: dict[str, StepCalibration]
    skipped: dict[str, str] = field(default_factory=dict)
    """Step types in the suite not calibrated, with why."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "model_id": self.model_id,
            "steps": {
                name: {
                    "target": s.target,
                    "threshold": s.threshold,
                    "k_max": s.k_max,
                    "agreement": s.agreement,
                    "tokens_per_forward": s.tokens_per_forward,
                    "baseline_logprob": s.baseline_logprob,
                    "prompts": s.prompts,
                    "trials": [t.__dict__ for t in s.trials],
                }
                for name, s in self.steps.items()
            },
            "skipped": dict(self.skipped),
        }


def calibrate(
    engine: EngineLike,
    policy: PolicySource,
    suite: Sequence[CalibrationPrompt],
    *,
    suite_name: str = "custom",
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    k_values: Sequence[int] | None = None,
    target: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> CalibrationReport:
    """Measure agreement and tokens/forward per step type of ``suite`` and pick thresholds (see module
    docstring).

    ``target`` applies to step types whose settings have no ``target_agreement`` (default 0.97). Step types in
    an exact mode (ntp, verified) are calibrated only when they set ``target_agreement`` themselves.
    ``k_values`` default to the step type's ``k_max`` (4 and 8 when it is "auto").
    """
    pol = load_policy(policy)
    say = progress or (lambda _msg: None)
    by_step: dict[str, list[CalibrationPrompt]] = {}
    for item in suite:
        by_step.setdefault(item.step_type, []).append(item)
    report = CalibrationReport(suite_name, str(getattr(engine, "model_id", "model")), {})
    for step_type, prompts in by_step.items():
        settings = pol.effective(step_type)
        if settings.mode not in LOSSY_MODES and settings.target_agreement is None:
            report.skipped[step_type] = f"mode {settings.mode} is exact and sets no target_agreement"
            continue
        goal = settings.target_agreement or target or DEFAULT_TARGET
        ks = list(k_values) if k_values else ([settings.k_max] if isinstance(settings.k_max, int) else [4, 8])
        say(f"{step_type}: {len(prompts)} prompt(s), target agreement {goal:g}, k in {ks}")
        report.steps[step_type] = _calibrate_step(engine, pol, step_type, prompts, goal, thresholds, ks, say)
    return report


def _calibrate_step(
    engine: EngineLike,
    policy: Policy,
    step_type: str,
    prompts: list[CalibrationPrompt],
    goal: float,
    thresholds: Sequence[float],
    ks: list[int],
    say: Callable[[str], None],
) -> StepCalibration:
    base = policy.effective(step_type).decode_config(max_time=None)
    references = [
        engine.generate(p.prompt, base.replace(mode="ntp", max_new_tokens=p.max_new_tokens)).token_ids for p in prompts
    ]
    baseline = _baseline_logprob(engine, prompts, references)
    trials: list[Trial] = []
    best: Trial | None = None
    for k in ks:
        lowest: Trial | None = None  # the lowest threshold meeting the goal for this k
        for tau in sorted(thresholds, reverse=True):
            trial = _trial(engine, base.replace(mode="confadapt", k_max=k, threshold=tau), prompts, references)
            trials.append(trial)
            say(
                f"  k_max {k} threshold {tau:g}: agreement {trial.agreement:.3f}, "
                f"{trial.tokens_per_forward:.2f} tokens/forward"
            )
            if trial.agreement < goal:
                break
            lowest = trial
        if lowest is not None and (best is None or lowest.tokens_per_forward > best.tokens_per_forward):
            best = lowest
    return StepCalibration(
        step_type=step_type,
        target=goal,
        prompts=len(prompts),
        threshold=best.threshold if best else None,
        k_max=best.k_max if best else None,
        agreement=best.agreement if best else None,
        tokens_per_forward=best.tokens_per_forward if best else None,
        baseline_logprob=baseline,
        trials=trials,
    )


def _trial(
    engine: EngineLike, config: DecodeConfig, prompts: list[CalibrationPrompt], references: list[list[int]]
) -> Trial:
    matched = total = tokens = passes = 0
    for prompt, ref in zip(prompts, references, strict=True):
        out = engine.generate(prompt.prompt, config.replace(max_new_tokens=prompt.max_new_tokens))
        blocks = difflib.SequenceMatcher(None, out.token_ids, ref, autojunk=False).get_matching_blocks()
        matched += 2 * sum(b.size for b in blocks)
        total += len(out.token_ids) + len(ref)
        tokens += out.stats.new_tokens - out.stats.jump_forward_tokens
        passes += out.stats.forward_passes
    assert isinstance(config.k_max, int)
    return Trial(config.k_max, config.threshold, matched / total if total else 1.0, tokens / max(passes, 1))


def _baseline_logprob(
    engine: EngineLike, prompts: list[CalibrationPrompt], references: list[list[int]]
) -> float | None:
    scores: list[float] = []
    for prompt, ref in zip(prompts, references, strict=True):
        if ref:
            scores.extend(engine.score(engine.encode_prompt(prompt.prompt), list(ref)))
    return sum(scores) / len(scores) if scores else None


# ------------------------------------------------------------------------------------------------- writing
def write_calibrated_policy(source: PolicySource, report: CalibrationReport, out: str | os.PathLike[str]) -> Path:
    """Write ``source`` with each calibrated step type's threshold/k_max (and likelihood baseline) set, and
    the measurements as comments. The result is validated before it is written. Returns the path written."""
    raw, where = _raw_policy(source)
    steps: dict[str, Any] = dict(raw.get("steps") or {})
    for name, cal in report.steps.items():
        body = dict(steps.get(name) or {})
        if cal.threshold is None:
            body["mode"] = "verified"
        else:
            body.update(mode="confadapt", threshold=cal.threshold, k_max=cal.k_max, target_agreement=cal.target)
        if cal.baseline_logprob is not None:
            monitors = dict(body.get("monitors") or {})
            likelihood = dict(monitors.get("likelihood") or {})
            likelihood["baseline"] = round(cal.baseline_logprob, 4)
            monitors["likelihood"] = likelihood
            body["monitors"] = monitors
        steps[name] = body
    raw["steps"] = steps
    text = _render(raw, report, where)
    parse_policy(text, source=os.fspath(out))  # never write a policy that does not load
    path = Path(out)
    path.write_text(text, encoding="utf-8")
    return path


def _raw_policy(source: PolicySource) -> tuple[dict[str, Any], str]:
    if isinstance(source, Policy):
        return source.model_dump(mode="json", exclude_unset=True), "a Policy object"
    if isinstance(source, Mapping):
        return dict(source), "a mapping"
    path = resolve_policy_path(source)
    load_policy(path)
    return dict(yaml.safe_load(path.read_text(encoding="utf-8"))), str(path)


def _render(raw: dict[str, Any], report: CalibrationReport, where: str) -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# Calibrated from {where} on suite {report.suite!r} with model {report.model_id} ({stamp}).",
        "# Written by `agent-mtp calibrate`; comments of the source file are not carried over.",
        *(f"# not calibrated: {name}: {why}" for name, why in report.skipped.items()),
        "",
    ]
    for key, value in raw.items():
        if key != "steps":
            lines.append(_dump({key: value}).rstrip())
            continue
        lines.append("steps:")
        for name, body in value.items():
            cal = report.steps.get(name)
            if cal is not None:
                lines.extend(f"  # {c}" for c in cal.comment())
            lines.extend("  " + line for line in _dump({name: body}).rstrip().splitlines())
    return "\n".join(lines) + "\n"


def _dump(value: Any) -> str:
    return yaml.safe_dump(value, sort_keys=False, default_flow_style=False, allow_unicode=True)
