"""PolicyController: retries that switch mode, deadlines, retryable errors, events, streaming observe."""

from __future__ import annotations

from typing import Any

import pytest

from agent_mtp.engine.config import DecodeConfig
from agent_mtp.errors import DeadlineExceededError, PromptTooLongError, QualityError
from agent_mtp.events import MemoryRecorder, StepEvent
from agent_mtp.policy import MonitorVerdict, PolicyController, StepContext, json_validator
from agent_mtp.policy.monitors import RepetitionMonitor, ValidityMonitor
from tests.unit.test_policy_fakes import BAD_TEXT, NTP_TEXT, FakeClock, FakeEngine

TOOL_SCHEMA = {
    "type": "object",
    "required": ["name", "arguments"],
    "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object", "required": ["city"]}},
}
TOOL = StepContext(step_type="tool_call", run_id="run-1")


def _policy(**defaults: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "mode": "static",
        "k_max": 8,
        "retries": {"attempts": 2, "escalate": [{"mode": "ntp"}], "backoff": {"jitter_s": 0.0}},
        "monitors": {"ntp_agreement": {"enabled": False}, "likelihood": {"enabled": False}},
        "fallback": {"enabled": False},
    }
    for key, value in defaults.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return {"version": 1, "name": "test", "defaults": base}


def _controller(engine: FakeEngine, policy: dict[str, Any], **kwargs: Any) -> tuple[PolicyController, MemoryRecorder]:
    recorder = MemoryRecorder()
    clock = kwargs.pop("clock", FakeClock())
    kwargs.setdefault("monitors", [ValidityMonitor(), RepetitionMonitor()])
    return PolicyController(engine, policy, recorder=recorder, clock=clock, sleep=clock.sleep, **kwargs), recorder


def _event(recorder: MemoryRecorder) -> StepEvent:
    assert len(recorder.events) == 1
    event = recorder.events[0]
    assert isinstance(event, StepEvent)
    return event


def test_failed_tool_call_is_regenerated_in_ntp_and_returns_a_valid_call() -> None:
    engine = FakeEngine(texts={"static": BAD_TEXT})
    controller, recorder = _controller(engine, _policy())
    result = controller.run("weather?", TOOL, validators=[json_validator(TOOL_SCHEMA, name="tool_call")])
    assert engine.modes == ["static", "ntp"]
    assert result.text == NTP_TEXT
    assert result.outcome == "ok"
    assert result.fallback is True
    assert result.mode == "ntp"
    assert [a.monitor_failed for a in result.attempts] == [True, False]
    assert result.monitor_failures == ("validity",)
    assert "not JSON" in result.attempts[0].verdicts[0].detail
    event = _event(recorder)
    assert (event.step_type, event.mode, event.outcome, event.attempts) == ("tool_call", "ntp", "ok", 2)
    assert event.fallback and not event.breaker_open
    assert event.monitor_failures == ("validity",)
    assert event.run_id == "run-1"
    assert event.model == "fake-model"
    assert event.new_tokens == len(NTP_TEXT)
    assert any(d.startswith("retry (monitors failed) in ntp") for d in result.decisions)


def test_passing_output_is_not_retried() -> None:
    engine = FakeEngine(texts={"static": NTP_TEXT})
    controller, recorder = _controller(engine, _policy())
    result = controller.run("weather?", TOOL, validators=[json_validator(TOOL_SCHEMA)])
    assert engine.modes == ["static"]
    assert (result.outcome, result.fallback, len(result.attempts)) == ("ok", False, 1)
    assert _event(recorder).forward_passes == result.result.stats.forward_passes


def test_escalation_chain_raises_threshold_then_switches_to_ntp() -> None:
    engine = FakeEngine(texts={"confadapt": BAD_TEXT})
    policy = _policy(
        mode="confadapt",
        threshold=0.8,
        retries={
            "attempts": 3,
            "escalate": [{"threshold": 0.95}, {"mode": "ntp"}],
            "backoff": {"jitter_s": 0.0},
        },
    )
    controller, _ = _controller(engine, policy)
    result = controller.run("x", TOOL, validators=[json_validator()])
    assert [(c.config.mode, c.config.threshold) for c in engine.calls] == [
        ("confadapt", 0.8),
        ("confadapt", 0.95),
        ("ntp", 0.95),
    ]
    assert result.outcome == "ok"
    assert [c.mode for c in result.plan.configs] == ["confadapt", "confadapt", "ntp"]


def test_escalation_never_makes_a_retry_less_safe() -> None:
    policy = _policy(mode="ntp", retries={"attempts": 2, "escalate": [{"mode": "static", "threshold": 0.1}]})
    controller, _ = _controller(FakeEngine(), policy)
    configs = controller.plan(TOOL).configs
    assert [(c.mode, c.threshold) for c in configs] == [("ntp", 0.9), ("ntp", 0.9)]


def test_exhausted_budget_returns_last_output_with_monitor_failed() -> None:
    engine = FakeEngine(texts={"static": BAD_TEXT, "ntp": BAD_TEXT})
    controller, recorder = _controller(engine, _policy())
    result = controller.run("x", TOOL, validators=[json_validator()])
    assert engine.modes == ["static", "ntp"]
    assert result.outcome == "monitor_failed"
    assert _event(recorder).outcome == "monitor_failed"
    assert "retry budget spent after 2 attempt(s)" in result.decisions


def test_exhausted_budget_can_raise_quality_error_after_recording() -> None:
    engine = FakeEngine(texts={"static": BAD_TEXT, "ntp": BAD_TEXT})
    controller, recorder = _controller(engine, _policy(retries={"on_exhausted": "raise"}))
    with pytest.raises(QualityError, match=r"step tool_call: monitors validity still failed after 2 attempt"):
        controller.run("x", TOOL, validators=[json_validator()])
    assert _event(recorder).outcome == "monitor_failed"


def test_identical_greedy_retry_is_skipped() -> None:
    engine = FakeEngine(ntp_text=BAD_TEXT)
    controller, _ = _controller(engine, _policy(mode="verified", retries={"escalate": []}))
    result = controller.run("x", TOOL, validators=[json_validator()])
    assert engine.modes == ["verified"]
    assert result.outcome == "monitor_failed"
    assert any("would decode the same greedy output" in d for d in result.decisions)


def test_sampling_retry_repeats_the_same_settings() -> None:
    engine = FakeEngine(ntp_text=BAD_TEXT)
    controller, _ = _controller(engine, _policy(mode="verified", temperature=0.7, retries={"escalate": []}))
    controller.run("x", TOOL, validators=[json_validator()])
    assert engine.modes == ["verified", "verified"]


def test_retries_wait_with_exponential_backoff() -> None:
    engine = FakeEngine(texts={"confadapt": BAD_TEXT})
    clock = FakeClock()
    backoff = {"multiplier_s": 0.1, "exp_base": 2.0, "max_s": 0.3, "jitter_s": 0.0}
    escalate = [{"threshold": 0.92}, {"threshold": 0.95}, {"threshold": 0.97}]
    policy = _policy(mode="confadapt", retries={"attempts": 4, "backoff": backoff, "escalate": escalate})
    controller, _ = _controller(engine, policy, clock=clock)
    controller.run("x", TOOL, validators=[json_validator()])
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.3])


def test_validators_may_return_bools_and_constraints_are_fresh_per_attempt() -> None:
    engine = FakeEngine(texts={"static": BAD_TEXT})
    made: list[object] = []

    def factory() -> object:
        made.append(object())
        return made[-1]

    controller, _ = _controller(engine, _policy())
    result = controller.run("x", TOOL, validators=[lambda text: text == NTP_TEXT], constraint_factory=factory)  # type: ignore[arg-type]
    assert len(made) == 2
    assert [c.constraint for c in engine.calls] == made
    assert result.attempts[0].verdicts[0].detail == "<lambda>: rejected"


def test_deadline_keeps_partial_output_and_reports_timeout() -> None:
    clock = FakeClock()
    engine = FakeEngine(clock=clock, seconds_per_token=1.0)
    controller, recorder = _controller(engine, _policy(mode="ntp", max_time_s=5), clock=clock)
    result = controller.run("x", TOOL)
    assert engine.calls[0].config.max_time == 5
    assert result.result.finish_reason == "timeout"
    assert result.text == NTP_TEXT[:5]
    assert result.outcome == "timeout"
    assert len(result.attempts) == 1  # timeouts are not in the default retry_on
    event = _event(recorder)
    assert event.timeout and event.outcome == "timeout"
    assert event.latency_s == pytest.approx(5.0)


def test_timeouts_retry_when_listed_and_attempt_deadlines_fit_the_step_budget() -> None:
    clock = FakeClock()
    engine = FakeEngine(clock=clock, seconds_per_token=1.0)
    policy = _policy(
        mode="static",
        max_time_s=5,
        retries={
            "attempts": 2,
            "max_delay_s": 7,
            "retry_on": ["timeout"],
            "backoff": {"multiplier_s": 0.0, "jitter_s": 0.0},
        },
    )
    controller, _ = _controller(engine, policy, clock=clock)
    result = controller.run("x", TOOL)
    assert [c.config.max_time for c in engine.calls] == [5, pytest.approx(2.0)]
    assert [c.config.mode for c in engine.calls] == ["static", "ntp"]
    assert result.outcome == "timeout"
    assert result.text == NTP_TEXT[:2]


def test_stop_after_delay_ends_retries() -> None:
    engine = FakeEngine(texts={"static": BAD_TEXT})
    controller, _ = _controller(engine, _policy(retries={"attempts": 5, "max_delay_s": 1e-9}))
    result = controller.run("x", TOOL, validators=[json_validator()])
    assert engine.modes == ["static"]
    assert result.outcome == "monitor_failed"


def test_retryable_engine_error_is_retried() -> None:
    engine = FakeEngine(errors=[DeadlineExceededError("no token before the deadline")])
    controller, recorder = _controller(engine, _policy())
    result = controller.run("x", TOOL)
    assert engine.modes == ["static", "ntp"]
    assert result.outcome == "ok"
    assert result.attempts[0].error is not None
    assert "raised DeadlineExceededError" in result.decisions[1]
    assert _event(recorder).attempts == 2


def test_retryable_error_on_every_attempt_is_raised_after_the_budget() -> None:
    engine = FakeEngine(errors=[DeadlineExceededError("a"), DeadlineExceededError("b")])
    controller, recorder = _controller(engine, _policy())
    with pytest.raises(DeadlineExceededError, match="b"):
        controller.run("x", TOOL)
    event = _event(recorder)
    assert (event.outcome, event.attempts) == ("error", 2)
    assert event.error == "DeadlineExceededError: b"


def test_bad_input_is_not_retried_and_is_recorded() -> None:
    engine = FakeEngine(errors=[PromptTooLongError("too long", prompt_tokens=9000, context_window=8192)])
    controller, recorder = _controller(engine, _policy(retries={"attempts": 3}))
    with pytest.raises(PromptTooLongError):
        controller.run("x", TOOL)
    assert engine.modes == ["static"]
    assert _event(recorder).outcome == "error"


def test_a_broken_recorder_or_monitor_does_not_fail_the_step() -> None:
    class Broken:
        name = "broken"
        costly = False

        def sample_rate(self, settings: object) -> float:
            return 1.0

        def check(self, sample: object) -> MonitorVerdict:
            raise RuntimeError("bug in a monitor")

    class BadRecorder:
        def record(self, event: object) -> None:
            raise RuntimeError("bug in a recorder")

    controller = PolicyController(FakeEngine(), _policy(), recorder=BadRecorder(), monitors=[Broken()])
    assert controller.run("x", TOOL).outcome == "ok"


def test_repetition_loop_triggers_a_retry() -> None:
    engine = FakeEngine(texts={"static": "ab" * 40})
    controller, _ = _controller(engine, _policy())
    result = controller.run("x", TOOL)
    assert engine.modes == ["static", "ntp"]
    assert result.attempts[0].failed_monitors == ("repetition",)


def test_costly_monitors_are_sampled_and_skipped_after_a_cheap_failure() -> None:
    engine = FakeEngine(texts={"static": BAD_TEXT})
    policy = _policy(monitors={"ntp_agreement": {"enabled": True, "sample_rate": 1.0, "min_agreement": 0.9}})
    controller, _ = _controller(engine, policy, monitors=None)
    result = controller.run("x", TOOL, validators=[json_validator()])
    # attempt 1 failed validity, so no NTP re-decode; attempt 2 is NTP (exact): agreement not applicable
    assert engine.modes == ["static", "ntp"]
    assert [v.monitor for v in result.attempts[0].verdicts] == ["validity", "repetition"]


def test_ntp_agreement_failure_triggers_the_fallback_retry() -> None:
    engine = FakeEngine(texts={"static": NTP_TEXT.replace("Paris", "Lyon!")})
    policy = _policy(monitors={"ntp_agreement": {"enabled": True, "sample_rate": 1.0, "min_agreement": 0.99}})
    controller, _ = _controller(engine, policy, monitors=None)
    result = controller.run("x", TOOL)
    assert engine.modes == ["static", "ntp", "ntp"]  # attempt, NTP re-decode for the monitor, retry
    verdict = result.attempts[0].verdicts[-1]
    assert verdict.monitor == "ntp_agreement" and not verdict.passed and verdict.costly
    assert engine.calls[1].config.max_new_tokens == len(NTP_TEXT)


def test_likelihood_baseline_is_learned_from_exact_outputs() -> None:
    engine = FakeEngine(texts={"static": BAD_TEXT + "}}"})
    policy = _policy(monitors={"likelihood": {"enabled": True, "sample_rate": 1.0, "max_drop": 1.0}})
    controller, _ = _controller(engine, policy, monitors=None)
    first = controller.run("x", TOOL, validators=[json_validator()])
    # no baseline yet: the static attempt fails validity anyway; the NTP retry is scored: the baseline
    assert first.attempts[1].verdicts[-1].monitor == "likelihood"
    engine.texts = {"static": '{"name": "other"}'}
    second = controller.run("x", TOOL, validators=[json_validator()])
    verdict = second.attempts[0].verdicts[-1]
    assert verdict.monitor == "likelihood" and not verdict.passed
    assert verdict.score == pytest.approx(-3.0) and verdict.limit == pytest.approx(-1.2)


def test_observe_reports_a_streamed_step() -> None:
    engine = FakeEngine()
    controller, recorder = _controller(engine, _policy())
    plan = controller.plan(TOOL)
    assert plan.config == DecodeConfig(mode="static", k_max=8, max_new_tokens=512)
    streamed = engine.generate("x", plan.config)
    result = controller.observe(plan, streamed, validators=[json_validator(TOOL_SCHEMA)])
    assert (result.outcome, len(result.attempts), result.mode) == ("ok", 1, "static")
    assert result.verdicts[0].monitor == "validity"
    assert _event(recorder).outcome == "ok"
    given = controller.observe(plan, streamed, verdicts=[MonitorVerdict("tool_call", False, detail="bad args")])
    assert given.outcome == "monitor_failed"
    assert given.metadata()["monitor_failures"] == ["tool_call"]


def test_metadata_is_json_ready() -> None:
    import json

    engine = FakeEngine(texts={"static": BAD_TEXT})
    controller, _ = _controller(engine, _policy())
    meta = controller.run("x", TOOL, validators=[json_validator()]).metadata()
    json.dumps(meta)
    assert meta["attempts"] == 2 and meta["fallback"] is True and meta["breaker"] == "closed"
    assert meta["attempt_details"][0]["monitors"][0]["passed"] is False


def test_model_label_is_a_valid_telemetry_key_part():
    from agent_mtp.policy.controller import model_label
    from agent_mtp.telemetry.config import is_valid_key_part

    for model_id in ("SmolLM2-135M-Instruct", "org/model", "/tmp/my models/x:1", "::", "a" * 300):
        label = model_label(model_id)
        assert is_valid_key_part(label), (model_id, label)
    assert model_label("org/model") == "org/model"


def test_one_attempt_through_the_public_api_and_no_private_reach_ins() -> None:
    """A caller that runs its own retry loop (the step runner) uses plan/attempt/report/now, nothing private."""
    import ast
    import inspect

    from agent_mtp.policy import controller as controller_module

    engine = FakeEngine(texts={"static": BAD_TEXT})
    controller, recorder = _controller(engine, _policy())
    plan = controller.plan(TOOL)
    record = controller.attempt(plan, 1, plan.config, "weather?", validators=[json_validator(TOOL_SCHEMA)])
    assert record.result is not None and record.monitor_failed and record.error is None
    assert controller.report(plan, record) is None  # fallback disabled: the breaker does not change
    assert controller.now() >= plan.started_at and recorder.events == []  # attempts record no event
    tree = ast.parse(inspect.getsource(controller_module._StepRun))
    private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")]
    private = [name for name in private if not name.startswith("__") and name != "_config"]
    assert private == [], f"_StepRun reaches into {private}"
