"""Policy files: shipped presets, defaults + overrides, and error messages that name file, line, field,
allowed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from agent_mtp.engine.config import DecodeConfig
from agent_mtp.errors import PolicyError
from agent_mtp.policy import BUILTIN_STEP_TYPES, Policy, StepSettings, load_policy, parse_policy
from agent_mtp.policy.loading import PRESETS_DIR


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def _error(tmp_path: Path, text: str) -> str:
    path = _write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    return str(info.value)


@pytest.mark.parametrize("name", ["default", "latency", "exact"])
def test_shipped_policies_load_and_start_with_a_comment_header(name: str) -> None:
    policy = load_policy(name)
    assert policy.name == name
    assert list(policy.step_types[:4]) == list(BUILTIN_STEP_TYPES)
    text = (PRESETS_DIR / f"{name}.yaml").read_text()
    header = [line for line in text.splitlines()[:5]]
    assert all(line.startswith("#") for line in header)
    assert "use it" in text.lower()


def test_exact_policy_is_verified_everywhere_and_default_is_lossless_for_tool_calls() -> None:
    exact = load_policy("exact")
    assert {exact.effective(s).mode for s in exact.step_types} == {"verified"}
    assert all(exact.effective(s).temperature == 0 for s in exact.step_types)
    default = load_policy("default")
    assert default.effective("tool_call").mode == "verified"
    assert default.effective("reasoning").mode == "confadapt"


def test_overrides_merge_over_defaults_at_any_depth(tmp_path: Path) -> None:
    policy = load_policy(
        _write(
            tmp_path,
            """
            version: 1
            defaults:
              threshold: 0.8
              retries: {attempts: 3, backoff: {max_s: 5}}
              monitors: {ntp_agreement: {sample_rate: 0.5}}
            steps:
              tool_call:
                threshold: 0.95
                retries: {attempts: 2}
                monitors: {ntp_agreement: {min_agreement: 0.99}}
              summarize: {}
            """,
        )
    )
    tool = policy.effective("tool_call")
    assert tool.threshold == 0.95
    assert tool.retries.attempts == 2
    assert tool.retries.backoff.max_s == 5  # inherited from defaults, not the schema default
    assert tool.monitors.ntp_agreement.sample_rate == 0.5
    assert tool.monitors.ntp_agreement.min_agreement == 0.99
    assert policy.effective("reasoning").threshold == 0.8
    assert policy.effective("summarize") == policy.defaults
    assert "summarize" in policy.step_types
    assert policy.effective("never_named") == policy.defaults


def test_lists_replace_rather_than_merge(tmp_path: Path) -> None:
    policy = parse_policy(
        """
version: 1
defaults:
  retries: {attempts: 3, escalate: [{threshold: 0.97}, {mode: ntp}]}
steps:
  tool_call:
    retries: {escalate: [{mode: verified}]}
"""
    )
    assert [e.mode for e in policy.effective("tool_call").retries.escalate] == ["verified"]
    assert [e.threshold for e in policy.effective("reasoning").retries.escalate] == [0.97, None]


def test_decode_config_carries_the_step_settings() -> None:
    settings = StepSettings(mode="static", threshold=0.5, k_max=4, max_new_tokens=32, max_time_s=2.5)
    cfg = settings.decode_config()
    assert cfg == DecodeConfig(
        mode="static", threshold=0.5, k_max=4, max_new_tokens=32, max_time=2.5, drafts=("mtp", "ngram", "grammar")
    )


def test_unknown_key_names_file_line_field_and_suggests(tmp_path: Path) -> None:
    msg = _error(
        tmp_path,
        """
        version: 1
        defaults:
          mode: confadapt
          threshhold: 0.9
        """,
    )
    assert "policy.yaml, line 4, defaults.threshhold" in msg
    assert "unknown field 'threshhold'" in msg
    assert "did you mean 'threshold'" in msg
    assert "Allowed fields here: mode, threshold, k_max" in msg


def test_wrong_type_names_line_and_what_is_allowed(tmp_path: Path) -> None:
    msg = _error(
        tmp_path,
        """
        version: 1
        steps:
          tool_call:
            retries:
              attempts: "three"
        """,
    )
    assert "line 5, steps.tool_call.retries.attempts" in msg
    assert "'three' is not allowed" in msg
    assert "an int in [1, 10]" in msg


def test_strings_are_not_coerced_to_numbers(tmp_path: Path) -> None:
    msg = _error(tmp_path, "version: 1\ndefaults:\n  threshold: '0.9'\n")
    assert "line 3, defaults.threshold" in msg
    assert "valid number" in msg


def test_bad_threshold_is_rejected_with_its_range(tmp_path: Path) -> None:
    msg = _error(tmp_path, "version: 1\nsteps:\n  reasoning:\n    threshold: 1.5\n")
    assert "line 4, steps.reasoning.threshold: 1.5 is not allowed" in msg
    assert "less than or equal to 1" in msg
    assert "a number in [0, 1]" in msg


def test_bad_mode_lists_the_modes(tmp_path: Path) -> None:
    msg = _error(tmp_path, "version: 1\ndefaults:\n  mode: turbo\n")
    assert "line 3, defaults.mode: 'turbo' is not allowed" in msg
    assert "'ntp', 'static', 'confadapt' or 'verified'" in msg


def test_k_max_union_error_is_one_message(tmp_path: Path) -> None:
    msg = _error(tmp_path, "version: 1\ndefaults:\n  k_max: fast\n")
    assert msg.count("defaults.k_max") == 1
    assert 'an int in [1, 64] or "auto"' in msg


def test_every_problem_is_reported_in_line_order(tmp_path: Path) -> None:
    msg = _error(
        tmp_path,
        """
        version: 1
        defaults:
          k_max: 0
        steps:
          Bad Name: {}
          tool_call:
            monitors:
              repetition: {min_repeats: 1}
        """,
    )
    assert "(3 problems)" in msg
    lines = [line for line in msg.splitlines() if "line " in line]
    assert [int(line.split("line ")[1].split(",")[0]) for line in lines] == [3, 5, 8]
    assert "steps.Bad Name" in msg and "pattern" in msg


def test_undeclared_step_type_in_a_rule(tmp_path: Path) -> None:
    msg = _error(
        tmp_path,
        """
        version: 1
        classification:
          rules:
            - step_type: tool_cal
              when: {tools_bound: true}
        """,
    )
    assert "line 4, classification.rules[0].step_type" in msg
    assert "step type 'tool_cal' is not declared" in msg
    assert "tool_call" in msg


def test_missing_required_rule_field(tmp_path: Path) -> None:
    msg = _error(tmp_path, "version: 1\nclassification:\n  rules:\n    - when: {}\n")
    assert "line 4, classification.rules[0].step_type: required field 'step_type' is missing" in msg


def test_cross_field_check_on_the_effective_settings(tmp_path: Path) -> None:
    msg = _error(tmp_path, "version: 1\nsteps:\n  reasoning:\n    fallback: {window: 5}\n")
    assert "line 4, steps.reasoning.fallback.min_samples: min_samples (10) must be <= window (5)" in msg


def test_duplicate_key_and_yaml_syntax_errors(tmp_path: Path) -> None:
    msg = _error(tmp_path, "version: 1\ndefaults:\n  mode: ntp\n  mode: static\n")
    assert "line 4, defaults: key 'mode' appears twice" in msg
    msg = _error(tmp_path, "version: 1\ndefaults: [\n")
    assert "policy.yaml, line 3: not valid YAML" in msg


def test_empty_file_and_missing_file(tmp_path: Path) -> None:
    assert "the policy is empty" in _error(tmp_path, "# nothing\n")
    with pytest.raises(PolicyError, match=r"does not exist.*default, latency, exact"):
        load_policy(tmp_path / "nope.yaml")


def test_policy_objects_and_mappings_are_checked_too() -> None:
    assert load_policy({"version": 1, "defaults": {"mode": "ntp"}}).defaults.mode == "ntp"
    with pytest.raises(PolicyError, match=r"policy mapping, defaults\.k_max"):
        load_policy({"defaults": {"k_max": 100}})
    bad = Policy(steps={"reasoning": StepSettings.model_validate({"fallback": {"window": 2}})})
    with pytest.raises(PolicyError, match=r"policy object, steps\.reasoning\.fallback\.min_samples"):
        load_policy(bad)


def test_the_docs_walk_through_is_a_valid_policy() -> None:
    import re

    docs = (PRESETS_DIR.parent / "docs" / "policies.md").read_text()
    example = re.findall(r"```yaml\n(.*?)```", docs, re.S)[0]
    policy = parse_policy(example, source="docs/policies.md")
    assert "lookup_summary" in policy.step_types
    assert policy.effective("tool_call").mode == "verified"


def test_public_api_is_pinned() -> None:
    import agent_mtp.policy as policy_pkg

    assert {"PolicyController", "StepContext", "StepPlan", "PolicyResult", "load_policy", "json_validator"} <= set(
        policy_pkg.__all__
    )
    assert all(hasattr(policy_pkg, name) for name in policy_pkg.__all__)
