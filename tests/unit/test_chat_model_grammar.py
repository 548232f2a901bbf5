"""Grammar-constrained MTP decoding (xgrammar): always-valid output in every mode, verified == NTP token for token
with jump-forward on, jump-forward accounting, special tokens never allowed, matcher state discipline."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from agent_mtp.engine import DecodeConfig
from agent_mtp.engine.grammar import GrammarConstraint, GrammarSpec, compile_for_engine
from agent_mtp.tools import parse_tool_calls, render_tool_call, tool_call_grammar, tool_specs
from tests.unit.test_chat_model_helpers import shared_tiny_engine

BOOK_TABLE = {
    "type": "function",
    "function": {
        "name": "book_table",
        "description": "Book a restaurant table.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Zürich"]},
                "people": {"type": "integer", "minimum": 1, "maximum": 12},
                "note": {"type": "string", "maxLength": 6},
                "vip": {"type": "boolean"},
            },
            "required": ["city", "people", "note", "vip"],
        },
    },
}
GET_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
        },
    },
}
SPECS = tool_specs([BOOK_TABLE, GET_TIME])
PROMPTS = [
    [{"role": "user", "content": "Book a table for two in Paris."}],
    [{"role": "system", "content": "You book tables."}, {"role": "user", "content": "What time is it in Oslo?"}],
]


@pytest.fixture(scope="module")
def engine():
    return shared_tiny_engine()


def forced_grammar(engine, *, jump_forward: bool = True):
    return compile_for_engine(engine, tool_call_grammar(SPECS, "any"), jump_forward=jump_forward)


def assert_valid_call(text: str) -> None:
    parsed = parse_tool_calls(text, SPECS)
    assert parsed.invalid_tool_calls == [], text
    (call,) = parsed.tool_calls
    schema = next(s.parameters for s in SPECS if s.name == call["name"])
    jsonschema.validate(call["args"], schema)
    assert parsed.content == ""


# -- the matcher behind the protocol -------------------------------------------------------------------------------
def test_special_and_mask_tokens_are_never_allowed_inside_a_string(engine):
    constraint = forced_grammar(engine).constraint()
    opening = engine.tokenizer.encode(
        '<tool_call>\n{"name": "book_table", "arguments": {"city": "Paris", "people": 2, "note": "'
    )
    for token in opening:
        assert constraint.accept(token), engine.tokenizer.decode([token])
    allowed = constraint.allowed_mask(engine.model.get_output_embeddings().weight.shape[0])
    assert allowed.dtype == torch.bool and allowed.any()
    for special in [0, 1, 2, engine.mask_token_id]:  # <|endoftext|>, <|im_start|>, <|im_end|>, <mask>
        assert not allowed[special]
        assert not constraint.accept(special)
    assert constraint.num_accepted == len(opening)


def test_rejected_token_leaves_the_state_unchanged_and_rollback_restores_it(engine):
    constraint = forced_grammar(engine, jump_forward=False).constraint()
    width = engine.model.get_output_embeddings().weight.shape[0]
    start = constraint.allowed_mask(width).clone()
    assert not constraint.accept(engine.tokenizer.encode("hello")[0])
    assert torch.equal(constraint.allowed_mask(width), start)
    ids = engine.tokenizer.encode("<tool_call>\n{")
    assert all(constraint.accept(t) for t in ids)
    constraint.rollback(len(ids))
    assert constraint.num_accepted == 0
    assert torch.equal(constraint.allowed_mask(width), start)


def test_allows_agrees_with_the_mask_in_every_state_and_after_rollback(engine):
    """``allows`` reads one bit of the bitmask the mask is unpacked from (banned tokens cleared): for every token
    of the logits' width, in planned and unplanned states, after rejected tokens and rollbacks, both agree."""
    width = engine.model.get_output_embeddings().weight.shape[0]
    for jump_forward in (True, False):
        constraint = forced_grammar(engine, jump_forward=jump_forward).constraint()
        ids = engine.tokenizer.encode('<tool_call>\n{"name": "book_table", "arguments": {"city": "Oslo", "note": "')
        states = 0
        for step in range(len(ids) + 1):
            mask = constraint.allowed_mask(width)
            allows = torch.tensor([constraint.allows(t) for t in range(width)])
            assert torch.equal(allows, mask), (jump_forward, step)
            states += 1
            if step == len(ids) or not constraint.accept(ids[step]):
                break
        assert states > 5
        assert not constraint.allows(engine.mask_token_id) and not constraint.allows(width + 3)
        constraint.rollback(constraint.num_accepted)
        assert torch.equal(torch.tensor([constraint.allows(t) for t in range(width)]), constraint.allowed_mask(width))


def test_packed_bits_round_trip():
    from agent_mtp.engine.grammar import _pack, _unpack

    mask = torch.rand(1000) < 0.5
    mask[31] = mask[63] = True  # the sign bit of a word
    assert torch.equal(_unpack(torch.from_numpy(_pack(mask)), 1000), mask)


def test_forced_tokens_do_not_advance_and_drive_the_mask(engine):
    constraint = forced_grammar(engine).constraint()
    width = engine.model.get_output_embeddings().weight.shape[0]
    forced = constraint.forced_tokens()
    assert forced and constraint.num_accepted == 0
    assert engine.tokenizer.decode(forced).startswith("<tool_call>")
    mask = constraint.allowed_mask(width)
    assert mask.sum() == 1 and mask[forced[0]]  # a planned state allows only the plan's next token
    assert constraint.forced_tokens() == forced  # asking twice changes nothing


def test_the_forced_draft_is_the_whole_forced_text_and_does_not_advance(engine):
    """Jump-forward leaves the forced text's last token to the model (it may merge with what follows); the forced
    draft offers it to verification, after the planned tokens, without moving the matcher."""
    constraint = forced_grammar(engine).constraint()
    plan, draft = constraint.forced_tokens(), constraint.forced_draft()
    assert len(draft) == len(plan) + 1 and draft[: len(plan)] == plan
    assert engine.tokenizer.decode(draft) == constraint.matcher.find_jump_forward_string()
    assert constraint.num_accepted == 0 and constraint.forced_draft() == draft
    for token in plan:
        assert constraint.accept(token)
    assert constraint.forced_tokens() == [] and constraint.forced_draft() == draft[len(plan) :]
    assert constraint.accept(draft[-1])  # the model may write it: the draft is a legal continuation
    constraint.rollback(len(plan) + 1)
    assert constraint.forced_draft() == draft  # the cached draft follows the state back


def test_the_stop_token_is_forced_after_a_closed_call(engine):
    constraint = forced_grammar(engine).constraint()
    for token in engine.tokenizer.encode(render_tool_call("get_time", {"tz": "UTC"})):
        assert constraint.accept(token)
    assert constraint.forced_tokens() == [2]  # <|im_end|>
    assert constraint.accept(2) and constraint.is_terminated()
    assert not constraint.allowed_mask(10).any()


def test_auto_grammar_allows_text_or_a_constrained_call(engine):
    grammar = compile_for_engine(engine, tool_call_grammar(SPECS, "auto"))
    text = grammar.constraint()
    assert all(text.accept(t) for t in engine.tokenizer.encode("Hello there, no tools needed."))
    assert text.accept(2) and text.is_terminated()
    call = grammar.constraint()
    prefix = engine.tokenizer.encode('Sure. <tool_call>\n{"name": "book_table", "arguments": {"city": "')
    assert all(call.accept(t) for t in prefix)
    assert not call.accept(engine.tokenizer.encode("Rome")[0])  # not in the enum
    assert not call.accept(2)  # an open call cannot end the output


def test_compiled_grammars_are_cached_per_tokenizer_and_spec(engine):
    spec = tool_call_grammar(SPECS, "any")
    assert forced_grammar(engine).compiled is compile_for_engine(engine, spec).compiled
    other = compile_for_engine(engine, GrammarSpec.json_schema({"type": "object"}))
    assert other.compiled is not forced_grammar(engine).compiled


def test_constraint_satisfies_the_engine_protocol(engine):
    from agent_mtp.engine import TokenConstraint

    assert isinstance(forced_grammar(engine).constraint(), TokenConstraint)
    assert isinstance(forced_grammar(engine).constraint(), GrammarConstraint)


# -- decoding under the grammar ------------------------------------------------------------------------------------
MODES = [
    DecodeConfig(mode="ntp"),
    DecodeConfig(mode="static", k_max=6),
    DecodeConfig(mode="confadapt", threshold=0.0, k_max=8),
    DecodeConfig(mode="confadapt", threshold=0.5, k_max=4),
    DecodeConfig(mode="verified", k_max=6),
    DecodeConfig(mode="confadapt", threshold=0.0, k_max=8, temperature=1.0, seed=3),
    DecodeConfig(mode="verified", k_max=6, temperature=1.0, seed=4),
]


@pytest.mark.parametrize("jump_forward", [True, False])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("config", MODES, ids=lambda c: f"{c.mode}-t{c.threshold}-T{c.temperature}")
def test_constrained_output_is_always_a_valid_call(engine, config, prompt, jump_forward):
    grammar = forced_grammar(engine, jump_forward=jump_forward)
    result = engine.generate(prompt, config.replace(max_new_tokens=120), constraint=grammar.constraint())
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] == 2
    assert_valid_call(result.text)


def _logits_for(rows: list[int], width: int, *, confidence: list[float]) -> torch.Tensor:
    """[len(rows), width] logits whose argmax at row i is rows[i] with softmax mass about confidence[i]."""
    logits = torch.zeros(len(rows), width)
    for i, (token, p) in enumerate(zip(rows, confidence, strict=True)):
        logits[i, token] = float(torch.log(torch.tensor(p * (width - 1) / (1 - p))))
    return logits


def test_a_block_is_cut_at_the_first_token_the_grammar_rejects(engine):
    """One pass of static / confadapt under the grammar: proposals are offered in order, the block stops at the
    first rejected one, the matcher keeps exactly the accepted tokens, and ConfAdapt applies to the valid prefix."""
    from agent_mtp.engine.decode import _propose_and_accept

    width = engine.model.get_output_embeddings().weight.shape[0]
    tok = engine.tokenizer
    prefix = tok.encode('<tool_call>\n{"name": "book_table", "arguments": {"city": "Paris", "people": 2, "note": "')
    good = [tok.encode(c)[0] for c in "abc"]  # legal inside the note string (maxLength 6)
    bad = tok.encode("\n")[0]  # a raw newline is never legal inside a JSON string
    rows = [good[0], good[1], bad, good[2]]

    def fresh() -> GrammarConstraint:
        constraint = forced_grammar(engine, jump_forward=False).constraint()
        assert all(constraint.accept(t) for t in prefix)
        return constraint

    for top in (None, rows):  # greedy tokens from the logits, or from the runner's argmax (the fast runtime)
        constraint = fresh()
        block = _logits_for(rows, width, confidence=[0.9] * 4)
        static = _propose_and_accept(block, top, 3, DecodeConfig(mode="static", k_max=4), constraint, None)
        assert static.new_tokens == rows[:2]
        assert constraint.num_accepted == len(prefix) + 2

        constraint = fresh()
        confident = _propose_and_accept(
            _logits_for(rows, width, confidence=[0.99, 0.5, 0.99, 0.99]),
            top,
            3,
            DecodeConfig(mode="confadapt", threshold=0.9, k_max=4),
            constraint,
            None,
        )
        assert confident.new_tokens == rows[:1]  # position 2 is legal but not confident: rolled back
        assert constraint.num_accepted == len(prefix) + 1


def test_multi_token_passes_happen_under_a_grammar(engine):
    """Where the grammar allows free text (tool_choice auto), random mask proposals are legal and kept."""
    grammar = compile_for_engine(engine, tool_call_grammar(SPECS, "auto"), jump_forward=False)
    result = engine.generate(
        PROMPTS[0], DecodeConfig(mode="static", k_max=8, max_new_tokens=40), constraint=grammar.constraint()
    )
    assert max(result.stats.accept_histogram) > 1
    assert result.stats.forward_passes < result.stats.new_tokens
    assert parse_tool_calls(result.text, SPECS).invalid_tool_calls == [] or result.finish_reason == "length"


@pytest.mark.parametrize("jump_forward", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_constrained_verified_equals_constrained_ntp_token_for_token(seed, jump_forward):
    engine = shared_tiny_engine(seed)
    grammar = forced_grammar(engine, jump_forward=jump_forward)
    for prompt in PROMPTS:
        ntp = engine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=120), constraint=grammar.constraint())
        verified = engine.generate(
            prompt, DecodeConfig(mode="verified", k_max=8, max_new_tokens=120), constraint=grammar.constraint()
        )
        assert verified.token_ids == ntp.token_ids
        assert verified.text == ntp.text
        assert_valid_call(ntp.text)


def test_grammar_drafts_save_passes_and_keep_verified_exact(engine):
    grammar = forced_grammar(engine)
    for prompt in PROMPTS:
        ntp = engine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=120), constraint=grammar.constraint())
        runs = {
            drafts: engine.generate(
                prompt,
                DecodeConfig(mode="verified", k_max=8, max_new_tokens=120, drafts=drafts),
                constraint=grammar.constraint(),
            )
            for drafts in [("mtp", "ngram", "grammar"), ("mtp", "ngram")]
        }
        with_grammar, without = runs[("mtp", "ngram", "grammar")], runs[("mtp", "ngram")]
        assert with_grammar.token_ids == without.token_ids == ntp.token_ids
        assert with_grammar.stats.draft_stats["grammar"]["accepted"] > 0
        assert "grammar" not in without.stats.draft_stats
        assert with_grammar.stats.forward_passes < without.stats.forward_passes


def test_json_schema_grammar_verified_equals_ntp(engine):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 12}, "score": {"type": "integer", "maximum": 99}},
        "required": ["answer", "score"],
    }
    grammar = compile_for_engine(engine, GrammarSpec.json_schema(schema))
    prompt = "Reply in JSON."
    ntp = engine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=60), constraint=grammar.constraint())
    verified = engine.generate(
        prompt, DecodeConfig(mode="verified", max_new_tokens=60), constraint=grammar.constraint()
    )
    assert verified.token_ids == ntp.token_ids
    jsonschema.validate(json.loads(ntp.text), schema)


def test_json_schema_property_order_is_the_order_the_output_follows(engine):
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
    }
    grammar = compile_for_engine(engine, GrammarSpec.json_schema(schema))
    result = engine.generate("JSON please.", DecodeConfig(max_new_tokens=30), constraint=grammar.constraint())
    assert result.text.startswith('{"zeta": ')
    assert list(json.loads(result.text)) == ["zeta", "alpha"]


def test_jump_forward_tokens_are_counted_apart_from_forward_passes(engine):
    prompt = PROMPTS[0]
    with_jf = engine.generate(
        prompt, DecodeConfig(mode="ntp", max_new_tokens=120), constraint=forced_grammar(engine).constraint()
    )
    without = engine.generate(
        prompt,
        DecodeConfig(mode="ntp", max_new_tokens=120),
        constraint=forced_grammar(engine, jump_forward=False).constraint(),
    )
    assert without.stats.jump_forward_tokens == 0
    assert without.stats.forward_passes == without.stats.new_tokens
    jumped = with_jf.stats.jump_forward_tokens
    assert jumped >= len(engine.tokenizer.encode('<tool_call>\n{"name": "')) - 1
    # NTP makes one token per pass; every other token came from jump-forward
    assert with_jf.stats.forward_passes == with_jf.stats.new_tokens - jumped
    assert with_jf.stats.tokens_per_forward == pytest.approx(1.0)
    assert with_jf.stats.forward_passes < without.stats.forward_passes


def test_forced_strings_are_tokenized_once_per_vocabulary(engine, monkeypatch):
    """A schema's forced strings recur in every request and at every pass: the vocabulary remembers their ids, so
    the tokenizer's Python ``encode`` (a third of ``verified``'s Python between batched passes) runs once a string."""
    compiled = forced_grammar(engine)
    vocab = compiled.vocab
    calls: list[str] = []
    real = vocab.tokenizer.encode

    def counting(text, **kwargs):
        calls.append(text)
        return real(text, **kwargs)

    monkeypatch.setattr(vocab.tokenizer, "encode", counting)
    vocab._encoded.clear()
    first = compiled.constraint()
    plan, draft = first.forced_tokens(), first.forced_draft()
    assert calls == [first.matcher.find_jump_forward_string()]  # both read one tokenization
    second = compiled.constraint()
    assert (second.forced_tokens(), second.forced_draft()) == (plan, draft)
    assert len(calls) == 1
    assert list(vocab.encode(calls[0])) == real(calls[0], add_special_tokens=False)


class _CountingMatcher:
    """An xgrammar matcher whose calls are counted (each one gives the GIL away and waits to get it back)."""

    def __init__(self, matcher, calls):
        self._matcher, self._calls = matcher, calls

    def __getattr__(self, name):
        method = getattr(self._matcher, name)

        def counted(*args, **kwargs):
            self._calls[name] = self._calls.get(name, 0) + 1
            return method(*args, **kwargs)

        return counted


@pytest.mark.parametrize("mode", ["ntp", "verified"])
def test_the_matcher_is_asked_each_state_question_once(engine, mode):
    """xgrammar's matcher methods release the GIL: beside a batched server's other busy threads each call waits to
    get it back (``is_terminated`` 0.16 us alone, 51 us beside one spinning thread). Whether the matcher has
    terminated and its jump-forward string are asked once per grammar state (the plan and the forced draft share one
    look at the forced text), not at every check: a schema's model step made 14.3 matcher calls, now 7.8."""
    calls: dict[str, int] = {}
    compiled = forced_grammar(engine)
    constraint = compiled.constraint()
    constraint.matcher = _CountingMatcher(constraint.matcher, calls)
    result = engine.generate(PROMPTS[0], DecodeConfig(mode=mode, max_new_tokens=120), constraint=constraint)
    states = len(result.token_ids) + 1  # every accepted token makes a state, and the start is one
    assert result.finish_reason == "stop"
    assert calls["is_terminated"] <= states
    assert calls["find_jump_forward_string"] <= states
    fresh = compiled.constraint()
    expected = engine.generate(PROMPTS[0], DecodeConfig(mode=mode, max_new_tokens=120), constraint=fresh)
    assert result.token_ids == expected.token_ids


def test_a_grammar_never_allows_the_mask_token(engine):
    """The decode loop leaves the mask token's logit alone on constrained greedy passes where the grammar rules it out
    in every state (a special token): the grammar's fallback argmax never sees it."""
    constraint = forced_grammar(engine).constraint()
    assert constraint.never_allows(engine.mask_token_id)
    assert not constraint.allowed_mask(engine.mask_token_id + 1)[engine.mask_token_id]
    plan = constraint.forced_tokens()
    assert plan and not constraint.never_allows(plan[0])
