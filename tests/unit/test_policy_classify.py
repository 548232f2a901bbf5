"""Step classification: explicit step type wins, then the policy's rules (data, not code), then the
default."""

from __future__ import annotations

import pytest

from agent_mtp.policy import PolicyController, StepContext, classify, load_policy, parse_policy
from tests.unit.test_policy_fakes import FakeEngine

DEFAULT = load_policy("default")


@pytest.mark.parametrize(
    ("context", "step_type", "reason"),
    [
        (
            StepContext(tools_bound=True, tool_choice="any", last_role="user"),
            "tool_call",
            "rule 0 (forced tool choice)",
        ),
        (
            StepContext(tool_names=("get_weather",), tool_choice="get_weather"),
            "tool_call",
            "rule 0 (forced tool choice)",
        ),
        (StepContext(tools_bound=True, tool_choice="required"), "tool_call", "rule 0 (forced tool choice)"),
        (StepContext(structured_output=True, last_role="user"), "formatting", "rule 1 (structured output)"),
        (StepContext(tools_bound=True, last_role="tool"), "reasoning", "rule 2 (after a tool result)"),
        (
            StepContext(tools_bound=True, tool_choice="auto", last_role="human"),
            "tool_call",
            "rule 3 (tools offered to a user turn)",
        ),
        (StepContext(tools_bound=True, tool_choice="none", last_role="user"), "final_answer", "default"),
        (StepContext(last_role="user", num_messages=1), "final_answer", "default"),
        (StepContext(last_role="ai"), "final_answer", "default"),
    ],
)
def test_default_rules(context: StepContext, step_type: str, reason: str) -> None:
    decided = classify(DEFAULT, context)
    assert (decided.step_type, decided.reason) == (step_type, reason)


def test_explicit_step_type_wins_over_every_rule() -> None:
    ctx = StepContext(step_type="formatting", tools_bound=True, tool_choice="any")
    assert classify(DEFAULT, ctx).step_type == "formatting"
    assert classify(DEFAULT, ctx).reason == "explicit"
    assert classify(DEFAULT, StepContext(step_type="my_own_step")).step_type == "my_own_step"


def test_context_normalises_langchain_words() -> None:
    ctx = StepContext(last_role="human", tool_choice="required", tool_names=["a", "b"])  # type: ignore[arg-type]
    assert ctx.last_role == "user"
    assert ctx.tool_choice == "any"
    assert ctx.tools_bound is True
    assert ctx.tool_names == ("a", "b")
    assert StepContext(tool_choice="lookup").tool_choice_kind == "named"
    assert StepContext().tool_choice_kind == "unset"


def test_rules_are_data_with_user_defined_step_types() -> None:
    policy = parse_policy(
        """
version: 1
steps:
  summarize: {mode: ntp}
  search_call: {threshold: 0.99}
classification:
  default: reasoning
  rules:
    - name: search tools
      step_type: search_call
      when: {tool_names: [web_search, news_search], tool_choice: [any, named]}
    - name: long chats get summarised
      step_type: summarize
      when: {min_messages: 20, last_role: [user]}
"""
    )
    assert classify(policy, StepContext(tool_names=("web_search",), tool_choice="any")).step_type == "search_call"
    assert classify(policy, StepContext(tool_names=("calculator",), tool_choice="any")).step_type == "reasoning"
    assert classify(policy, StepContext(num_messages=25, last_role="user")).step_type == "summarize"
    assert classify(policy, StepContext(num_messages=5, last_role="user")).step_type == "reasoning"
    controller = PolicyController(FakeEngine(), policy)
    plan = controller.plan(StepContext(num_messages=30, last_role="user"))
    assert (plan.step_type, plan.config.mode) == ("summarize", "ntp")
    assert plan.decisions[0] == "step type summarize (rule 1 (long chats get summarised))"


def test_decision_is_visible_in_the_result_metadata() -> None:
    controller = PolicyController(FakeEngine(), "default")
    result = controller.run("hi", StepContext(tools_bound=True, tool_choice="any"))
    meta = result.metadata()
    assert meta["step_type"] == "tool_call"
    assert meta["step_type_reason"] == "rule 0 (forced tool choice)"
    assert meta["mode"] == "verified"
    assert controller.classify(StepContext(last_role="tool")) == "reasoning"
