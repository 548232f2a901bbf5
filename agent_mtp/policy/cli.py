"""`agent-mtp policy validate|show` and `agent-mtp calibrate`; wired into the main app by ``register(app)``."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agent_mtp.errors import AgentMTPError, PolicyError
from agent_mtp.policy.loading import load_policy
from agent_mtp.policy.schema import Policy, StepSettings

_out = Console()

policy_app = typer.Typer(help="Check and inspect policy files.", no_args_is_help=True)

FileArg = Annotated[str, typer.Argument(help="A policy YAML file, or a shipped name: default, latency, exact.")]


def register(app: typer.Typer) -> None:
    """Add `policy validate`, `policy show` and `calibrate` to the `agent-mtp` app."""
    app.add_typer(policy_app, name="policy")
    app.command("calibrate")(calibrate_command)


def _load_or_exit(file: str) -> Policy:
    try:
        return load_policy(file)
    except PolicyError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc


@policy_app.command("validate")
def validate_command(file: FileArg) -> None:
    """Check a policy file; on error print the file, line, field and what is allowed, and exit 1."""
    policy = _load_or_exit(file)
    typer.echo(f"OK: {file}: policy {policy.name!r}, step types: {', '.join(policy.step_types)}")


@policy_app.command("show")
def show_command(
    file: FileArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the effective settings as JSON.")] = False,
) -> None:
    """Print each step type's effective settings (defaults merged with its overrides) and the rules."""
    policy = _load_or_exit(file)
    if as_json:
        payload = {
            "name": policy.name,
            "steps": {name: policy.effective(name).model_dump(mode="json") for name in policy.step_types},
            "classification": policy.classification.model_dump(mode="json", exclude_none=True),
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    _out.print(_settings_table(policy))
    _out.print(_rules_table(policy))


def _settings_table(policy: Policy) -> Table:
    table = Table(title=f"policy {policy.name!r}: effective settings per step type")
    table.add_column("step type", no_wrap=True)
    for col in ("decode", "limits", "retries", "monitors", "fallback (breaker)"):
        table.add_column(col, overflow="fold")
    for name in policy.step_types:
        s = policy.effective(name)
        cells = (_decode_cell(s), _limits_cell(s), _retry_cell(s), _monitor_cell(s), _fallback_cell(s))
        table.add_row(name, *(escape(c) for c in cells))
    return table


def _decode_cell(s: StepSettings) -> str:
    parts: list[str] = [s.mode]
    if s.mode in ("static", "confadapt"):
        parts.append(f"tau {s.threshold:g}")
    if s.mode != "ntp":
        parts.append(f"k {s.k_max}")
    if s.mode == "verified":
        parts.append("drafts " + "+".join(s.drafts))
    if s.temperature:
        parts.append(f"T {s.temperature:g}")
    if s.target_agreement is not None:
        parts.append(f"target {s.target_agreement:g}")
    return ", ".join(parts)


def _limits_cell(s: StepSettings) -> str:
    deadline = f"{s.max_time_s:g} s" if s.max_time_s is not None else "no deadline"
    return f"{s.max_new_tokens} tokens, {deadline}"


def _retry_cell(s: StepSettings) -> str:
    r = s.retries
    steps = [", ".join(f"{k}={v}" for k, v in e.model_dump(exclude_none=True).items()) for e in r.escalate]
    text = f"{r.attempts} attempts on {'/'.join(r.retry_on)}"
    if r.max_delay_s is not None:
        text += f", <= {r.max_delay_s:g} s"
    if steps and r.attempts > 1:
        text += "; then " + " -> ".join(f"[{s}]" for s in steps)
    return text + ("" if r.on_exhausted == "return" else "; raise when exhausted")


def _monitor_cell(s: StepSettings) -> str:
    m = s.monitors
    out = []
    for name, mon in (("validity", m.validity), ("repetition", m.repetition)):
        if mon.enabled:
            out.append(f"{name} {mon.sample_rate:.0%}")
    if m.ntp_agreement.enabled:
        out.append(f"ntp_agreement {m.ntp_agreement.sample_rate:.0%} >= {m.ntp_agreement.min_agreement:g}")
    if m.likelihood.enabled:
        base = f"{m.likelihood.baseline:g}" if m.likelihood.baseline is not None else "learned"
        out.append(f"likelihood {m.likelihood.sample_rate:.0%} (baseline {base} - {m.likelihood.max_drop:g})")
    return "\n".join(out) or "none"


def _fallback_cell(s: StepSettings) -> str:
    f = s.fallback
    if not f.enabled:
        return "off"
    if s.mode not in ("static", "confadapt"):
        return f"n/a ({s.mode} is exact)"
    return (
        f"trip < {f.baseline - f.margin:.2f} pass rate over {f.min_samples}..{f.window} samples; "
        f"{f.mode} {f.cooldown_s:g} s; probes {f.probe_rate:.0%}, close after {f.probes_to_close}"
    )


def _rules_table(policy: Policy) -> Table:
    table = Table(title="classification (explicit step_type wins; first matching rule; else default)")
    table.add_column("#")
    table.add_column("rule")
    table.add_column("when")
    table.add_column("step type")
    for i, rule in enumerate(policy.classification.rules):
        when = ", ".join(f"{k}={v}" for k, v in rule.when.model_dump(exclude_none=True).items())
        table.add_row(str(i), escape(rule.name), escape(when), rule.step_type)
    table.add_row("-", "default", "", policy.classification.default)
    return table


def calibrate_command(
    policy: Annotated[str, typer.Option("--policy", help="Policy file (or shipped name) to calibrate.")],
    suite: Annotated[str, typer.Option("--suite", help="Prompt suite: agent, smoke, or a .json/.jsonl file.")],
    out: Annotated[str, typer.Option("--out", help="Where to write the calibrated policy YAML.")],
    model: Annotated[str, typer.Option("--model", help="Model for MTPEngine.from_pretrained.")] = "default",
    thresholds: Annotated[str | None, typer.Option(help="Comma-separated thresholds to try.")] = None,
    k: Annotated[str | None, typer.Option("--k", help="Comma-separated k_max values to try.")] = None,
    target: Annotated[float | None, typer.Option(help="Agreement target where a step sets none.")] = None,
    limit: Annotated[int | None, typer.Option(help="Use at most this many prompts per step type.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Also print the measurements as JSON.")] = False,
) -> None:
    """Per step type, find the lowest threshold (and k) meeting the agreement target; write a new policy."""
    from agent_mtp.policy.calibrate import DEFAULT_THRESHOLDS, calibrate, write_calibrated_policy
    from agent_mtp.policy.suites import load_suite

    try:
        pol = load_policy(policy)
        prompts = load_suite(suite)
        if limit is not None:
            prompts = _limit_per_step(prompts, limit)
        taus = _floats(thresholds, "--thresholds") if thresholds else list(DEFAULT_THRESHOLDS)
        ks = [int(x) for x in _floats(k, "--k")] if k else None
        engine = _engine(model)
        report = calibrate(
            engine,
            pol,
            prompts,
            suite_name=suite,
            thresholds=taus,
            k_values=ks,
            target=target,
            progress=lambda msg: typer.echo(msg, err=True),
        )
        path = write_calibrated_policy(policy, report, out)
    except AgentMTPError as exc:
        typer.echo(f"calibrate failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    for cal in report.steps.values():
        typer.echo(f"{cal.step_type}: {' '.join(cal.comment())}")
    typer.echo(f"wrote {path}")
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))


def _engine(model: str) -> Any:
    from agent_mtp.engine import MTPEngine  # imported late: loading a model is the slow part

    return MTPEngine.from_pretrained(model)


def _floats(text: str, option: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"{option}={text!r}: use comma-separated numbers like 0.9,0.8") from exc


def _limit_per_step(prompts: list[Any], limit: int) -> list[Any]:
    seen: dict[str, int] = {}
    kept = []
    for p in prompts:
        seen[p.step_type] = seen.get(p.step_type, 0) + 1
        if seen[p.step_type] <= limit:
            kept.append(p)
    return kept
