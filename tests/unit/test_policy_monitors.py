"""Quality monitors: each gives a clear verdict on one output."""

from __future__ import annotations

from typing import Any

import pytest

from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.results import DecodeStats, GenerationResult
from agent_mtp.policy import MonitorInput, StepSettings, agreement, json_validator
from agent_mtp.policy.monitors import (
    LikelihoodMonitor,
    NtpAgreementMonitor,
    RepetitionMonitor,
    ValidityMonitor,
    longest_loop,
)
from tests.unit.test_policy_fakes import NTP_TEXT, FakeEngine


def _sample(text: str, *, mode: str = "static", settings: StepSettings | None = None, **kw: Any) -> MonitorInput:
    engine = kw.pop("engine", FakeEngine())
    ids = [ord(c) for c in text]
    result = GenerationResult(text, ids, "stop", DecodeStats(mode=mode, new_tokens=len(ids)))
    return MonitorInput(
        prompt="p",
        result=result,
        config=DecodeConfig(mode=mode),  # type: ignore[arg-type]
        step_type="tool_call",
        settings=settings or StepSettings(),
        engine=engine,
        prompt_ids=lambda: [1, 2, 3],
        **kw,
    )


def test_longest_loop_finds_periodic_stretches() -> None:
    assert longest_loop([1, 2, 3, 4, 5, 6], max_period=4, min_repeats=2) == (0, 0)
    assert longest_loop([9, 1, 2, 1, 2, 1, 2, 1, 2, 7], max_period=4, min_repeats=4) == (2, 8)
    assert longest_loop([5] * 10, max_period=4, min_repeats=3) == (1, 10)
    assert longest_loop([1, 2, 3] * 3, max_period=2, min_repeats=2) == (0, 0)  # period 3 > max_period


def test_repetition_monitor_verdicts() -> None:
    monitor = RepetitionMonitor()
    ok = monitor.check(_sample("The weather in Paris is sunny with a light breeze from the west."))
    assert ok is not None and ok.passed
    looped = monitor.check(_sample("Answer: " + "I think " * 12))
    assert looped is not None and not looped.passed
    assert "repeat a 8-token unit" in looped.detail
    assert looped.limit == 24


def test_json_validator_with_schema() -> None:
    schema = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    check = json_validator(schema, name="args")
    assert check('{"city": "Paris"}').passed  # type: ignore[union-attr]
    bad = check('{"city": 3}')
    assert not bad.passed and "schema: city: 3 is not of type 'string'" in bad.detail  # type: ignore[union-attr]
    broken = check('{"city": "Par')
    assert not broken.passed and broken.detail.startswith("not JSON")  # type: ignore[union-attr]
    assert json_validator()("[1, 2]").passed  # type: ignore[union-attr]


def test_validity_monitor_combines_validators_and_require_json() -> None:
    monitor = ValidityMonitor()
    assert monitor.check(_sample("hello")) is None  # nothing to validate
    strict = StepSettings.model_validate({"monitors": {"validity": {"require_json": True}}})
    verdict = monitor.check(_sample("hello", settings=strict))
    assert verdict is not None and not verdict.passed and "json: not JSON" in verdict.detail
    verdict = monitor.check(_sample("hello", validators=[lambda t: True, lambda t: t.startswith("h")]))
    assert verdict is not None and verdict.passed and verdict.score == 2


def test_agreement_ratio() -> None:
    assert agreement([], []) == 1.0
    assert agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert agreement([1, 2, 3], [4, 5, 6]) == 0.0
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == pytest.approx(0.75)


def test_ntp_agreement_redecodes_with_ntp_and_compares() -> None:
    engine = FakeEngine()
    monitor = NtpAgreementMonitor()
    same = monitor.check(_sample(NTP_TEXT, engine=engine))
    assert same is not None and same.passed and same.score == 1.0
    assert engine.calls[-1].config.mode == "ntp"
    assert engine.calls[-1].config.max_new_tokens == len(NTP_TEXT)
    different = monitor.check(_sample("something else entirely", engine=engine))
    assert different is not None and not different.passed and different.costly
    assert monitor.check(_sample(NTP_TEXT, mode="verified", engine=engine)) is None


def test_ntp_agreement_uses_a_fresh_constraint() -> None:
    engine = FakeEngine()
    made: list[object] = []
    NtpAgreementMonitor().check(_sample(NTP_TEXT, engine=engine, constraint_factory=lambda: made.append(1) or made))
    assert engine.calls[-1].constraint is made


def test_likelihood_against_configured_and_learned_baseline() -> None:
    engine = FakeEngine()
    monitor = LikelihoodMonitor()
    configured = StepSettings.model_validate({"monitors": {"likelihood": {"baseline": -0.5, "max_drop": 1.0}}})
    good = monitor.check(_sample(NTP_TEXT, engine=engine, settings=configured))
    assert good is not None and good.passed and good.score == pytest.approx(-0.2)
    bad = monitor.check(_sample("zzz", engine=engine, settings=configured))
    assert bad is not None and not bad.passed and bad.limit == pytest.approx(-1.5)
    assert monitor.check(_sample("zzz", engine=engine)) is None  # no baseline anywhere yet
    learned = monitor.check(_sample("zzz", engine=engine, baseline_logprob=-2.5))
    assert learned is not None and learned.passed
    exact = monitor.check(_sample("zzz", mode="ntp", engine=engine))
    assert exact is not None and exact.passed and exact.score == pytest.approx(-3.0)
    assert engine.scored[-1] == [ord("z")] * 3
