"""`agent-mtp policy validate|show`, and calibration with a scripted engine (threshold -> agreement)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from agent_mtp.engine.config import DecodeConfig
from agent_mtp.policy import calibrate, load_policy, write_calibrated_policy
from agent_mtp.policy.cli import register
from agent_mtp.policy.loading import PRESETS_DIR
from agent_mtp.policy.suites import SUITES, CalibrationPrompt, load_suite
from tests.unit.test_policy_fakes import NTP_TEXT, FakeEngine


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """test app"""

    register(app)
    return app


runner = CliRunner()


def test_validate_ok_and_error_exit_codes(tmp_path: Path) -> None:
    ok = runner.invoke(_app(), ["policy", "validate", str(PRESETS_DIR / "default.yaml")])
    assert ok.exit_code == 0, ok.output
    assert "OK:" in ok.output and "tool_call" in ok.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefaults:\n  threshold: 2\n")
    res = runner.invoke(_app(), ["policy", "validate", str(bad)])
    assert res.exit_code == 1
    assert "line 3, defaults.threshold: 2 is not allowed" in res.output


def test_show_prints_effective_settings_per_step_type() -> None:
    res = runner.invoke(_app(), ["policy", "show", "latency", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["steps"]["tool_call"]["threshold"] == 0.7
    assert data["steps"]["reasoning"]["threshold"] == 0.5
    assert data["steps"]["tool_call"]["fallback"]["window"] == 20  # inherited from defaults
    table = runner.invoke(_app(), ["policy", "show", "default"])
    assert table.exit_code == 0
    for name in ("tool_call", "reasoning", "formatting", "final_answer", "forced tool choice"):
        assert name in table.output


def _threshold_engine() -> FakeEngine:
    """ConfAdapt output equals NTP at threshold >= 0.8, is half wrong below; lower thresholds take more
    tokens/pass."""

    def text(config: DecodeConfig) -> str:
        if config.mode != "confadapt" or config.threshold >= 0.8:
            return NTP_TEXT
        return NTP_TEXT[: len(NTP_TEXT) // 2] + "x" * (len(NTP_TEXT) // 2)

    return FakeEngine(texts=text)


def test_calibrate_finds_lowest_threshold_meeting_target_and_best_k() -> None:
    suite = [CalibrationPrompt("reasoning", "a"), CalibrationPrompt("reasoning", "b")]
    report = calibrate(_threshold_engine(), "default", suite, thresholds=[0.95, 0.9, 0.8, 0.7, 0.6], k_values=[2, 4])
    cal = report.steps["reasoning"]
    assert (cal.threshold, cal.k_max) == (0.8, 4)  # k 4 gives more tokens per pass in the scripted engine
    assert cal.agreement == 1.0 and cal.target == 0.97
    assert [(t.k_max, t.threshold) for t in cal.trials][:4] == [(2, 0.95), (2, 0.9), (2, 0.8), (2, 0.7)]
    assert cal.baseline_logprob == pytest.approx(-0.2)


def test_calibrate_skips_exact_steps_and_falls_back_to_verified_when_no_threshold_works() -> None:
    suite = [CalibrationPrompt("tool_call", "a"), CalibrationPrompt("final_answer", "b")]
    engine = FakeEngine(texts={"confadapt": "nothing like it"})
    report = calibrate(engine, "default", suite, thresholds=[0.9, 0.5], k_values=[4])
    assert "tool_call" in report.skipped  # verified in the default policy
    cal = report.steps["final_answer"]
    assert cal.threshold is None and len(cal.trials) == 1


def test_written_policy_loads_and_carries_measurements(tmp_path: Path) -> None:
    suite = [CalibrationPrompt("reasoning", "a"), CalibrationPrompt("final_answer", "b")]
    engine = _threshold_engine()
    report = calibrate(engine, "latency", suite, thresholds=[0.9, 0.8, 0.7], k_values=[4], target=0.95)
    out = write_calibrated_policy("latency", report, tmp_path / "new.yaml")
    text = out.read_text()
    assert text.startswith("# Calibrated from")
    assert "# calibrated: threshold 0.8, k_max 4: agreement with NTP 1.000 (target 0.95)" in text
    policy = load_policy(out)
    reasoning = policy.effective("reasoning")
    assert (reasoning.mode, reasoning.threshold, reasoning.k_max, reasoning.target_agreement) == (
        "confadapt",
        0.8,
        4,
        0.95,
    )
    assert reasoning.monitors.likelihood.baseline == pytest.approx(-0.2)
    assert policy.effective("tool_call").threshold == 0.7  # untouched step keeps its setting
    raw = yaml.safe_load(text)
    assert raw["name"] == "latency"


def test_suites() -> None:
    assert {p.step_type for p in SUITES["agent"]} == {"tool_call", "reasoning", "formatting", "final_answer"}
    assert len(load_suite("smoke")) == 4


def test_suite_files(tmp_path: Path) -> None:
    path = tmp_path / "suite.jsonl"
    path.write_text('{"step_type": "reasoning", "prompt": "2+2?", "max_new_tokens": 8}\n')
    assert load_suite(str(path)) == [CalibrationPrompt("reasoning", "2+2?", 8)]
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="record 0 needs keys step_type and prompt"):
        load_suite(str(path))
    with pytest.raises(ValueError, match="neither a built-in"):
        load_suite("nope")
