"""The policy with the real default model: a reckless setting trips the fallback yet returns a valid tool call;
policies/exact.yaml gives outputs identical to NTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.grammar import GrammarSpec, compile_for_engine
from agent_mtp.events import MemoryRecorder, StepEvent
from agent_mtp.policy import PolicyController, StepContext, json_validator, load_policy
from agent_mtp.policy.loading import PRESETS_DIR
from agent_mtp.policy.schema import deep_merge

pytestmark = pytest.mark.integration

TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "arguments"],
}
SYSTEM = "You call tools. Tool: get_weather(city: string). Reply with a JSON tool call."
TOOL_CALL = StepContext(tools_bound=True, tool_choice="get_weather", last_role="user", tool_names=("get_weather",))

RECKLESS: dict[str, Any] = {
    "version": 1,
    "name": "reckless",
    "steps": {
        "tool_call": {
            "mode": "static",  # accept all 8 proposals of every pass, whatever their confidence
            "k_max": 8,
            "max_new_tokens": 64,
            "retries": {"attempts": 2, "escalate": [{"mode": "ntp"}], "backoff": {"multiplier_s": 0.0}},
            "monitors": {
                "ntp_agreement": {"sample_rate": 1.0, "min_agreement": 0.9},
                "likelihood": {"enabled": False},
            },
            "fallback": {"window": 2, "min_samples": 2, "margin": 0.5, "cooldown_s": 600, "probe_rate": 0.01},
        }
    },
}


@pytest.fixture(scope="session")
def engine() -> Iterator[MTPEngine]:
    yield MTPEngine.from_pretrained("default")


def _messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_reckless_static_tool_calls_trip_the_fallback_yet_return_valid_calls(engine: MTPEngine) -> None:
    grammar = compile_for_engine(engine, GrammarSpec.json_schema(TOOL_SCHEMA))
    recorder = MemoryRecorder()
    controller = PolicyController(engine, RECKLESS, recorder=recorder, seed=0)
    validate = json_validator(TOOL_SCHEMA, name="tool_call")
    cities = ["Paris", "Tokyo", "Berlin"]
    results = [
        controller.run(
            _messages(f"What is the weather in {city}?"),
            TOOL_CALL,
            constraint_factory=grammar.constraint,
            validators=[validate],
        )
        for city in cities
    ]

    for city, res in zip(cities, results, strict=True):
        assert res.step_type == "tool_call"
        verdict = validate(res.text)
        assert not isinstance(verdict, bool) and verdict.passed, res.text
        call = json.loads(res.text)
        assert call["name"] == "get_weather"
        ntp = engine.generate(
            _messages(f"What is the weather in {city}?"),
            DecodeConfig(mode="ntp", max_new_tokens=64),
            constraint=grammar.constraint(),
        )
        assert res.result.token_ids == ntp.token_ids  # the returned call is the model's own NTP call

    # steps 1 and 2: the reckless static output failed a monitor (which one depends on the adapter: an invalid or
    # looping call, or a schema-valid call that disagrees with NTP) -> regenerated in NTP
    reckless_failures = {"validity", "repetition", "ntp_agreement"}
    for res in results[:2]:
        assert res.attempts[0].config.mode == "static"
        assert set(res.attempts[0].failed_monitors) & reckless_failures, res.attempts[0]
        assert res.mode == "ntp" and res.fallback and res.outcome == "ok"
    assert any(d.startswith("breaker opened") for d in results[1].decisions)
    # step 3: the breaker is open, the step runs NTP from the start
    third = results[2]
    assert third.plan.breaker_open and [a.config.mode for a in third.attempts] == ["ntp"]
    assert controller.breaker_status("tool_call").state == "open"
    events = [e for e in recorder.events if isinstance(e, StepEvent)]
    assert [(e.attempts, e.fallback, e.breaker_open) for e in events] == [
        (2, True, False),
        (2, True, False),
        (1, True, True),
    ]
    assert set(events[0].monitor_failures) & reckless_failures


def _exact_policy(max_new_tokens: int) -> Any:
    raw = yaml.safe_load((PRESETS_DIR / "exact.yaml").read_text())
    return load_policy(deep_merge(raw, {"defaults": {"max_new_tokens": max_new_tokens}}))


def test_exact_policy_outputs_equal_ntp(engine: MTPEngine) -> None:
    policy = _exact_policy(max_new_tokens=40)  # the shipped file, with a shorter cap to keep CPU time low
    controller = PolicyController(engine, policy)
    grammar = compile_for_engine(engine, GrammarSpec.json_schema(TOOL_SCHEMA))
    cases: list[tuple[Any, StepContext, Any]] = [
        ("List three primary colours, one per line.", StepContext(last_role="user"), None),
        (
            [
                {"role": "system", "content": "Think step by step."},
                {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many now?"},
            ],
            StepContext(last_role="tool"),
            None,
        ),
        (_messages("Is it raining in Oslo?"), TOOL_CALL, grammar.constraint),
    ]
    for prompt, ctx, factory in cases:
        res = controller.run(prompt, ctx, constraint_factory=factory)
        assert res.mode == "verified" and len(res.attempts) == 1
        reference = engine.generate(
            prompt, DecodeConfig(mode="ntp", max_new_tokens=40), constraint=factory() if factory else None
        )
        assert res.result.token_ids == reference.token_ids, (res.step_type, res.text, reference.text)
        assert res.text == reference.text


def test_calibrate_command_writes_a_loadable_policy(tmp_path: Any) -> None:
    import typer
    from typer.testing import CliRunner

    from agent_mtp.policy.cli import register

    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """test app"""

    register(app)
    out = tmp_path / "calibrated.yaml"
    args = ["calibrate", "--policy", "default", "--suite", "smoke", "--limit", "1"]
    res = CliRunner().invoke(app, [*args, "--thresholds", "0.9,0.5", "--k", "4", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    policy = load_policy(out)
    text = out.read_text()
    assert "# not calibrated: tool_call: mode verified is exact" in text
    for step in ("reasoning", "final_answer"):
        assert f"{step}:" in res.output
        settings = policy.effective(step)
        assert settings.mode in ("confadapt", "verified")
        assert settings.monitors.likelihood.baseline is not None and settings.monitors.likelihood.baseline < 0
    report = json.loads(res.output[res.output.index("{") :])
    trials = report["steps"]["reasoning"]["trials"]
    assert trials and all(0.0 <= t["agreement"] <= 1.0 and t["tokens_per_forward"] >= 1.0 for t in trials)
