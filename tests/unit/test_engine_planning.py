"""Pure planning maths: acceptance rules, n-gram lookup, draft choice, cost-aware planning."""

from __future__ import annotations

import random

import pytest
import torch

from agent_mtp.engine.acceptance import (
    confadapt_accept_length,
    expected_accepted,
    probabilities,
    top_probabilities,
    verify_greedy,
)
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.drafts import Draft, NgramDraftSource, choose_draft
from agent_mtp.engine.planner import EXPLORE_OVERHEAD, AcceptanceRates, Plan, Planner

STEEP = CostCurve(((1, 1.0), (4, 1.5), (8, 1.9), (16, 2.1), (32, 2.5)))


def verify_planner(curve: CostCurve, k_cap: int, rates: list[float] | None = None, ngram: float = 0.5) -> Planner:
    positions = rates if rates is not None else [0.5] * (k_cap - 1)
    return Planner(
        "verified", k_cap, cost_aware=True, curve=curve, rates=AcceptanceRates(positions, ngram), explore_every=0
    )


def test_confadapt_rule():
    assert confadapt_accept_length(torch.tensor([0.95, 0.92, 0.5, 0.99]), 0.9) == 2
    assert confadapt_accept_length(torch.tensor([0.5, 0.99, 0.99]), 0.9) == 1  # at least one
    assert confadapt_accept_length(torch.tensor([0.91, 0.91, 0.91]), 0.9) == 3
    assert confadapt_accept_length(torch.tensor([1.0, 1.0]), 1.01) == 1


def test_top_probabilities_are_each_rows_largest_probability() -> None:
    """What the decode loop reads as a mask row's confidence (ConfAdapt's test, verified's draft weights): the
    largest tempered, nucleus-filtered probability of each row, the same values as ``probabilities(...).max(-1)``."""
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0)) * 4
    logits[1, 7] = 40.0  # a confident row
    for temperature, top_p in ((0.0, 1.0), (0.7, 0.9), (1.3, 1.0)):
        expected = probabilities(logits, temperature, top_p).max(-1).values
        got = top_probabilities(logits, temperature, top_p)
        assert got.shape == (3,) and torch.equal(got, expected)
    assert top_probabilities(logits, 0.0, 1.0)[1] > 0.999
    assert top_probabilities(logits[:0], 0.0, 1.0).shape == (0,)


def test_verify_greedy_and_expectation():
    assert verify_greedy([1, 2, 3], [1, 2, 4]) == 2
    assert verify_greedy([5], [6]) == 0
    assert expected_accepted([0.5, 0.5]) == [1.0, 1.5, 1.75]


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    source = NgramDraftSource(ngram_max=3, draft_len=4)
    context = [1, 2, 3, 9, 9, 7, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]
    draft = source.propose(context, max_len=10)
    assert draft is not None and draft.tokens == (4, 5, 6, 0) and draft.match == 3
    assert source.propose([1, 2, 3], max_len=10) is None
    assert source.propose(context, max_len=2).tokens == (4, 5)


def test_ngram_lookup_prefers_the_longest_match_then_the_latest():
    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    context = [5, 1, 2, 3, 7, 8, 2, 3, 6, 4, 9, 5, 1, 2, 3]
    draft = NgramDraftSource(ngram_max=8, draft_len=2).propose(context, max_len=10)
    assert draft is not None and draft.match == 4 and draft.tokens == (7, 8)  # [5, 1, 2, 3] beats the later [2, 3]
    assert NgramDraftSource(ngram_max=2, draft_len=2).propose(context, max_len=10).tokens == (6, 4)  # latest of 2


def test_ngram_index_follows_a_growing_context_and_rebuilds_for_another():
    """The source indexes the context incrementally; proposals always equal a fresh source's (a scan)."""
    import random

    rng = random.Random(0)
    growing = NgramDraftSource(ngram_max=5, draft_len=6)
    context = [rng.randrange(6), rng.randrange(6)]  # one list, extended in place (as the decode loop does)
    while len(context) < 300:
        assert growing.propose(context, 6) == NgramDraftSource(ngram_max=5, draft_len=6).propose(list(context), 6)
        context += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
    assert growing._context is context  # the same list throughout: its index was extended, never rebuilt
    other = [3, 1, 4, 1, 5, 9, 2, 6, 1, 4]  # not an extension of the last context: the index starts over
    assert growing.propose(other, 6) == NgramDraftSource(ngram_max=5, draft_len=6).propose(other, 6)
    draft = growing.propose(other, 6)
    assert draft is not None and (draft.tokens, draft.match) == ((1, 5, 9, 2, 6, 1), 2)


def test_ngram_match_length_of_a_tail_is_what_propose_finds_once_it_joins_the_context() -> None:
    """A greedy run asks after each of its tokens (not yet in the context) whether the lookup has a match: the
    answer is the match length :meth:`propose` reports for the context extended by those tokens (0 for none)."""
    rng = random.Random(1)
    for _ in range(200):
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
        tail = [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
        source = NgramDraftSource(ngram_max=rng.choice([1, 2, 3, 5]), draft_len=4)
        source.propose(context, 4)  # indexed up to here, as in the decode loop
        expected = NgramDraftSource(ngram_max=source.ngram_max, draft_len=4).propose(context + tail, 4)
        assert source.match_length(context, tail) == (expected.match if expected is not None else 0)
    assert source._context is context  # the tail was not indexed into the context's index


def test_choose_draft_prefers_higher_score():
    a, b = Draft((1,), "mtp", 0.2), Draft((1, 2, 3), "ngram", 1.5)
    assert choose_draft([a, b, None]) is b
    assert choose_draft([None]) is None


def test_planner_skips_masks_when_drafts_rarely_pay_on_a_cpu_curve():
    plan = verify_planner(STEEP, 8, [0.05] * 7).plan(1, [], budget=51)
    assert plan.draft is None and plan.masks == 0


def test_planner_uses_masks_when_they_pay():
    assert verify_planner(STEEP, 8, [0.95] * 7).plan(1, [], budget=51).masks >= 3


def test_planner_takes_long_good_ngram_drafts_and_everything_on_a_flat_curve():
    ngram = Draft(tuple(range(10)), "ngram", 5.0)
    draft = verify_planner(STEEP, 8, [0.05] * 7, ngram=0.9).plan(1, [ngram], budget=51).draft
    assert draft is not None and len(draft.tokens) >= 5
    assert verify_planner(CostCurve.flat(), 8, [0.3] * 7).plan(1, [], budget=51).masks == 7


def test_planner_learns_hit_rates():
    planner = verify_planner(STEEP, 4)
    draft = Draft((1, 2, 3), "mtp", 1.0)
    for _ in range(20):
        planner.observe(Plan(draft, 0), 3, 0)
    assert planner.rates.positions[0] < 0.1
    for _ in range(20):
        planner.observe(Plan(Draft((1, 2), "ngram", 1.0), 0), 2, 2)
    assert planner.rates.ngram > 0.9


def test_one_planner_decides_k_for_every_mode():
    from agent_mtp.engine.config import DecodeConfig

    ntp = Planner.for_config(DecodeConfig(mode="ntp", k_max=8), None)
    fixed = Planner.for_config(DecodeConfig(mode="confadapt", k_max=8), None)
    uncosted = Planner.for_config(DecodeConfig(mode="verified", k_max=8, cost_aware=False), None)
    ngram = Draft((1, 2, 3), "ngram", 2.0)
    assert ntp.plan(5, [], budget=50) == Plan(None, 0)
    assert fixed.plan(5, [], budget=50) == Plan(None, 7)
    assert fixed.plan(5, [], budget=3) == Plan(None, 2)  # never past the budget
    assert uncosted.plan(1, [Draft((4,), "mtp", 0.5), ngram], budget=50) == Plan(ngram, 7)


def test_cost_curve_measurement_ignores_contention_spikes():
    from agent_mtp.engine.cost import measure_cost_curve

    calls = {"count": 0}

    def forward_n(n: int) -> None:
        import time

        calls["count"] += 1
        # 1 ms + 0.1 ms per extra token, plus a 30 ms stall on some calls (another process took the core).
        time.sleep(0.001 + 0.0001 * (n - 1) + (0.03 if calls["count"] % 4 == 0 else 0.0))

    curve = measure_cost_curve(forward_n, points=(1, 2, 4, 8), repeats=5)
    costs = dict(curve.points)
    assert costs[1] == 1.0
    assert all(costs[n] <= n for n in costs)  # never superlinear
    assert costs[8] < 3.0  # the stalls did not leak into the curve
    assert costs[2] <= costs[4] <= costs[8]


def test_mtp_block_survives_the_grammar_forced_tokens_it_predicted() -> None:
    from agent_mtp.engine.drafts import MTPDraftSource

    source = MTPDraftSource()
    source.offer([5, 6, 7, 8], [0.9, 0.8, 0.7, 0.6])
    source.advance([5, 6])  # the grammar forced what the masks predicted: the rest is the next draft
    draft = source.propose([], 10)
    assert draft is not None and draft.tokens == (7, 8) and draft.confidences == (0.7, 0.6)
    assert abs(draft.score - (0.7 + 0.7 * 0.6)) < 1e-9
    source.offer([5, 6, 7], [0.9, 0.8, 0.7])
    source.advance([5, 9])  # forced something else: the block no longer follows the sequence
    assert source.propose([], 10) is None
    source.offer([5, 6], [0.9, 0.8])
    source.advance([5, 6])  # nothing left past the forced tokens
    assert source.propose([], 10) is None


def _exploring_planner(curve: CostCurve, ngram: float) -> Planner:
    planner = verify_planner(curve, 8, [0.01] * 7, ngram)
    planner.explore_every = 8  # the rates say masks never pay, so only exploring adds them
    planner._passes = 7  # the next pass is an exploring one
    return planner


def test_exploring_adds_masks_when_rows_are_cheap_and_none_when_they_are_dear():
    alone = CostCurve(((1, 1.0), (2, 1.12), (4, 1.13), (8, 1.31), (16, 1.57), (32, 2.1)))  # the fast runtime, alone
    assert verify_planner(alone, 8, [0.01] * 7, 0.01).plan(1, [], budget=51).masks == 0
    assert _exploring_planner(alone, 0.01).plan(1, [], budget=51).masks >= 3
    shared = CostCurve(((1, 1.0), (2, 1.4), (4, 2.2), (8, 3.8), (16, 7.0), (32, 13.4)))  # 8 sequences waiting
    assert _exploring_planner(shared, 0.01).plan(1, [], budget=51).masks == 0


def test_exploring_prices_verified_masks_on_the_draft_mask_curve():
    """Where draft-only masks have a curve of their own (which the live curve corrects from the process's own
    passes), an exploring pass buys masks by what they add there, not by the exact-mask curve."""
    exact = ((1, 1.0), (2, 1.12), (4, 1.13), (8, 1.31), (16, 1.57), (32, 2.1))
    dear = ((1, 1.0), (2, 1.6), (4, 2.4), (8, 3.6), (16, 6.0), (32, 11.0))
    dear_masks = CostCurve(exact, 0.6, real=exact, draft=dear)
    assert _exploring_planner(dear_masks, 0.01).plan(1, [], budget=51).masks == 0
    cheap_masks = CostCurve(dear, 0.6, real=dear, draft=exact)
    assert _exploring_planner(cheap_masks, 0.01).plan(1, [], budget=51).masks >= 3


def test_exploring_after_a_long_draft_is_priced_against_the_plain_pass():
    """A long accepted-looking draft makes the pass dear; exploring must not add masks in proportion to it."""
    steep = CostCurve(((1, 1.0), (2, 1.05), (4, 1.15), (8, 1.35), (16, 1.75), (32, 2.55)))
    ngram = Draft(tuple(range(10)), "ngram", 5.0)
    plan = _exploring_planner(steep, 0.99).plan(1, [ngram], budget=51)
    assert plan.draft is not None and len(plan.draft.tokens) >= 8
    fed = 1 + len(plan.draft.tokens)
    extra = steep.cost(fed + plan.masks) - steep.cost(fed)
    assert plan.masks >= 1 and extra <= EXPLORE_OVERHEAD * 8 * steep.cost(1) + 1e-9


def test_one_token_ngram_matches_have_their_own_acceptance_rate():
    """Prompt-lookup drafts from a one-token match are accepted far less often than from longer matches: the
    planner keeps a rate for each and learns them apart."""
    rates = AcceptanceRates([0.5] * 3, ngram=0.8, ngram_short=0.1)
    long, short = Draft((4, 5, 6), "ngram", 1.0, match=3), Draft((4, 5, 6), "ngram", 1.0, match=1)
    assert rates.draft_probs(long) == [0.8] * 3 and rates.draft_probs(short) == [0.1] * 3
    shared = CostCurve(((1, 1.0), (2, 1.3), (4, 1.9), (8, 3.1), (16, 5.5), (32, 10.3)))
    assert verify_planner(shared, 4, [0.1] * 3, 0.8).plan(1, [long], budget=51).draft is not None
    planner = verify_planner(shared, 4, [0.1] * 3, 0.8)
    planner.rates.ngram_short = 0.1
    assert planner.plan(1, [short], budget=51).draft is None
    planner.observe(Plan(short, 0), 3, 0)
    assert planner.rates.ngram_short < 0.1 and planner.rates.ngram == 0.8
    assert NgramDraftSource(ngram_max=3, draft_len=2).propose([7, 1, 2, 9, 1, 2], max_len=5).match == 2


def test_grammar_drafts_have_their_own_acceptance_rate():
    rates = AcceptanceRates([0.5] * 3, ngram=0.1, ngram_short=0.1, grammar=0.9)
    forced = Draft((4,), "grammar", 1.0)
    assert rates.draft_probs(forced) == [0.9]
    shared = CostCurve(((1, 1.0), (2, 1.3), (4, 1.9), (8, 3.1), (16, 5.5), (32, 10.3)))
    planner = Planner("verified", 4, cost_aware=True, curve=shared, rates=rates, explore_every=0)
    assert planner.plan(1, [forced], budget=51).draft == forced  # a likely token pays even when rows are dear
    for _ in range(30):
        planner.observe(Plan(forced, 0), 1, 0)
    assert rates.grammar < 0.1 and rates.ngram == 0.1
    assert planner.plan(1, [forced], budget=51).draft is None
    # tokens the grammar's plan forces are certain whatever the rate, and teach it nothing
    planned = Draft((7, 8, 9, 4), "grammar", 4.0, (1.0, 1.0, 1.0, 0.0))
    assert rates.draft_probs(planned) == [1.0, 1.0, 1.0, rates.grammar]
    before = rates.grammar
    planner.observe(Plan(planned, 0), 4, 4)
    assert before < rates.grammar < before + 0.1 + 1e-9
    planner.observe(Plan(Draft((7, 8), "grammar", 2.0, (1.0, 1.0)), 0), 2, 2)
    assert rates.grammar == pytest.approx(0.9 * before + 0.1)


def _softmax_tie(width: int, low: int, high: int) -> torch.Tensor:
    """Logits whose top two ids differ by 1e-8: their softmax probabilities round to one value."""
    row = torch.full((width,), -30.0)
    row[low], row[high] = 0.0, 1e-8
    probs = torch.softmax(row, -1)
    assert probs[low] == probs[high] and int(probs.argmax()) == low  # the tie the softmax makes
    return row


def test_greedy_tokens_come_from_the_logits_as_hf_generate_takes_them() -> None:
    """A softmax can round two different logits to one probability; greedy decoding (every mode, every position)
    must still pick the larger logit, as HF ``generate`` does, or ``ntp`` would not equal it."""
    from agent_mtp.engine.config import DecodeConfig
    from agent_mtp.engine.decode import _propose_and_accept, _State, _verify
    from agent_mtp.engine.results import DecodeStats

    tie = _softmax_tie(16, low=3, high=9)
    block = torch.stack([tie, tie, tie])
    for top in (None, [9, 9, 9]):  # from the logits here, or the runner's argmax (the fast runtime's, numpy's)
        ntp = _propose_and_accept(tie[None], top, 0, DecodeConfig(mode="ntp"), None, None)
        assert ntp.new_tokens == [9]
        static = _propose_and_accept(block, top, 2, DecodeConfig(mode="static", k_max=3), None, None)
        assert static.new_tokens == [9, 9, 9]
        cfg = DecodeConfig(mode="verified", k_max=3)
        state = _State(pending=[1], context=[1])
        draft = Draft((9,), "ngram", 1.0)
        verified = _verify(block, top, draft, 1, state, cfg, None, None, DecodeStats(mode="verified"))
        assert verified.new_tokens == [9, 9] and verified.accepted_beyond_first == 1
        mask_draft = state.mtp.propose([], 4)
        assert mask_draft is not None and mask_draft.tokens == (9,)  # the mask's prediction, the next pass's draft
    assert [int(i) for i in block.numpy().argmax(-1)] == [9, 9, 9]


class _OnlyEven:
    """A constraint that allows even token ids only (never terminates, forces nothing)."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        return torch.arange(vocab_size) % 2 == 0

    def accept(self, token_id: int) -> bool:
        if token_id % 2:
            return False
        self.taken.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.taken[len(self.taken) - num_tokens :]

    def is_terminated(self) -> bool:
        return False

    def forced_tokens(self) -> list[int]:
        return []


def test_the_runners_argmax_serves_greedy_rows_only_where_the_constraint_allows_it() -> None:
    """Greedy tokens come from the runner's argmax (computed where the logits were written) when the constraint
    allows that token, and from the masked row when it does not: the same tokens as masking every row."""
    from agent_mtp.engine.config import DecodeConfig
    from agent_mtp.engine.decode import _greedy, _masked_logits, _propose_and_accept

    torch.manual_seed(3)
    logits = torch.randn(6, 40)
    top = [int(i) for i in logits.numpy().argmax(-1)]
    assert any(t % 2 for t in top) and any(t % 2 == 0 for t in top)  # both cases occur
    for row in range(6):
        reference = int(_masked_logits(logits[row], _OnlyEven()).argmax())
        assert _greedy(logits, row, top, _OnlyEven()) == reference == _greedy(logits, row, None, _OnlyEven())
        assert _greedy(logits, row, top, None) == top[row]
    confadapt = DecodeConfig(mode="confadapt", k_max=3, threshold=0.0)
    constraint = _OnlyEven()
    result = _propose_and_accept(logits[:3], top[:3], 2, confadapt, constraint, None)
    plain = _propose_and_accept(logits[:3], None, 2, confadapt, _OnlyEven(), None)
    assert result.new_tokens == plain.new_tokens and constraint.taken == result.new_tokens


def _extra_cost(curve: CostCurve, pending: int, length: int, masks: int) -> float:
    """What a draft of ``length`` and ``masks`` masks add to a pass of ``pending`` tokens, as the planner's
    docstring prices them: every row alike, or (a curve with draft-only masks measured apart) the draft on the
    real-token curve and the masks on the draft curve plus what real rows add there beyond a one-token pass."""
    if curve.draft is None:
        return curve.cost(pending + length + masks) - curve.cost(pending)
    real = [p for p in curve.real or curve.points]

    def at(points: list[tuple[int, float]], n: int) -> float:
        return CostCurve(tuple(points)).cost(n)

    base, with_draft = at(real, pending), at(real, pending + length)
    excess = at(real, pending + length + masks) - with_draft - (at(real, 1 + masks) - 1.0)  # beyond a one-token pass
    masks_added = at(list(curve.draft), 1 + masks) - 1.0 + max(0.0, excess)
    return with_draft - base + masks_added


def _brute_force_plan(planner: Planner, pending: int, drafts: list[Draft], room: int) -> tuple[int, tuple[int, ...]]:
    """Every (draft prefix, masks) option scored as the planner's docstring says, best first in option order."""
    from agent_mtp.engine.planner import FUTURE_CREDIT

    assert planner.curve is not None
    options: list[tuple[tuple[int, ...], list[float]]] = [((), [])]
    for draft in drafts:
        probs = planner.rates.draft_probs(draft)
        options += [(draft.tokens[:n], probs[:n]) for n in range(1, min(len(draft.tokens), room) + 1)]
    gains, total, run = [], 0.0, 1.0
    for rate in planner.rates.positions:
        run *= rate
        total += run
        gains.append(total)
    best: tuple[float, tuple[int, ...], int] = (-1.0, (), 0)
    for tokens, probs in options:
        expected, p_all = 0.0, 1.0
        for p in probs:
            p_all *= p
            expected += p_all
        for masks in range(max(min(planner.k_cap - 1, room - len(tokens)), 0) + 1):
            future = p_all * (gains[masks - 1] if masks else 0.0) * FUTURE_CREDIT
            extra = _extra_cost(planner.curve, pending, len(tokens), masks)
            score = (1.0 + expected + future) / (1.0 + extra)  # extra rows at what they add to the pass
            if score > best[0] + 1e-12:
                best = (score, tokens, masks)
    return best[2], best[1]


def _random_points(rng: random.Random, start: float = 0.0) -> tuple[tuple[int, float], ...]:
    points, cost = [(1, 1.0)], 1.0
    for n in (2, 4, 8, 16, 32):
        cost += (start if n == 2 else 0.0) + rng.uniform(0.0, 0.4) * (n - points[-1][0])
        points.append((n, cost))
    return tuple(points)


@pytest.mark.parametrize("apart", [False, True], ids=["rows-alike", "masks-apart"])
def test_verified_planning_picks_what_scoring_every_option_picks(apart: bool) -> None:
    """The planner skips options that cannot win (it runs every pass, under the GIL beside other sequences'
    decode steps); what it picks must be what scoring every draft prefix and mask count picks, with every row
    priced alike or with draft tokens and masks priced on curves of their own (the first mask dear)."""
    rng = random.Random(7)
    for _ in range(400):
        points = _random_points(rng)
        curve = CostCurve(points)
        if apart:
            curve = CostCurve(points, real=_random_points(rng), draft=_random_points(rng, start=rng.uniform(0, 0.4)))
        k_cap = rng.choice([2, 4, 8, 16])
        planner = verify_planner(curve, k_cap, [rng.random() for _ in range(k_cap - 1)])
        planner.rates.ngram, planner.rates.ngram_short = rng.random(), rng.random()
        drafts = []
        for source in rng.sample(["mtp", "ngram", "grammar"], rng.randint(0, 3)):
            length = rng.randint(1, 10)
            tokens = tuple(rng.randrange(100) for _ in range(length))
            if source == "ngram":
                drafts.append(Draft(tokens, source, 1.0, match=rng.randint(1, 3)))
            else:
                confidences = tuple(rng.choice([1.0, rng.random()]) for _ in range(length))
                drafts.append(Draft(tokens, source, 1.0, confidences))
        pending, room = rng.choice([1, 1, 2, 3, 4, 40, 300]), rng.randint(0, 24)
        masks, tokens = _brute_force_plan(planner, pending, drafts, room)
        plan = planner.plan(pending, drafts, room + 1)
        assert (plan.masks, tuple(plan.draft_tokens)) == (masks, tokens)


def test_a_long_pass_prices_its_extra_rows_at_what_they_add() -> None:
    """A prefill beside 7 other sequences costs ~80 one-token passes, and each extra row ~0.93 of one: masks must
    be priced at that, not against the prefill's own cost (where they looked nearly free: 4 masks, measured)."""
    points = tuple((n, 1.0 + 0.93 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128))
    planner = verify_planner(CostCurve(points), 4, [0.6, 0.6, 0.6])
    planner.explore_every = 0
    assert planner.plan(86, [], 64).masks == 0
    assert planner.plan(1, [], 64).masks == 0  # the same rows after one token: priced alike
    cheap = verify_planner(
        CostCurve(tuple((n, 1.0 + 0.02 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 128))), 4, [0.6] * 3
    )
    cheap.explore_every = 0
    assert cheap.plan(86, [], 64).masks == 3  # where rows are nearly free (one sequence, a long pass) they still pay


def test_a_hopeless_pass_is_one_no_draft_could_win() -> None:
    """Where the planner declares a pass hopeless before the sources are asked (every acceptance probability below
    the cheapest average row of any option), scoring every option of any draft the sources could propose picks the
    plain pass; and the check does fire where rows are dear, after a step too (the row after it cheap)."""
    import random

    rng = random.Random(11)
    fired = stepped = 0
    for trial in range(600):
        points, cost, slope = [(1, 1.0)], 1.0, rng.uniform(0.0, 1.2)
        for n in (2, 4, 8, 16, 32):
            slope = slope * rng.uniform(0.9, 1.3)  # mostly growing: convex, as shared passes are
            cost += slope * (n - points[-1][0])
            points.append((n, cost))
        if trial % 3 == 0:  # a step, then cheap rows: the first extra row opens a tile chunk beside 7 sequences
            step, slope = rng.uniform(0.5, 6.0), rng.uniform(0.0, 0.1)
            points = [(1, 1.0), *((n, 1.0 + step + slope * (n - 2)) for n in (2, 4, 8, 16, 32))]
        k_cap = rng.choice([2, 4, 8])
        planner = verify_planner(CostCurve(tuple(points)), k_cap, [rng.random() for _ in range(k_cap - 1)])
        planner.rates.ngram, planner.rates.ngram_short = rng.random(), rng.random()
        pending, room = rng.choice([1, 1, 2, 40]), rng.randint(0, 24)
        p_max = max(planner.rates.ngram, planner.rates.ngram_short, *planner.rates.positions)
        mtp_p_max = max(p_max, 0.5 + 0.5 * max(planner.rates.positions))
        if planner.plain_if_hopeless(pending, mtp_p_max, room) is None:
            continue
        fired += 1
        stepped += trial % 3 == 0 and pending == 1 and room >= 2 and mtp_p_max > points[2][1] - points[1][1]
        for _ in range(5):
            length = rng.randint(1, 10)
            tokens = tuple(rng.randrange(100) for _ in range(length))
            drafts = [
                Draft(tokens, "ngram", 1.0, match=rng.randint(1, 3)),
                Draft(tokens, "mtp", 1.0, tuple(rng.random() for _ in range(length))),
            ]
            assert _brute_force_plan(planner, pending, drafts, room) == (0, ())
    assert fired > 60
    assert stepped > 5  # hopeless though a row after the step is cheaper than p_max: no option reaches it for free


def test_the_decode_loops_argmax_is_torchs() -> None:
    """The decode loop's row-wise argmax (numpy's, faster on one thread) picks what ``torch.argmax`` picks: the first
    of equal maxima, on views, with -inf (grammar-masked) entries and whole masked rows."""
    from agent_mtp.engine.decode import _argmax

    rows = torch.randn(5, 1000, generator=torch.Generator().manual_seed(3))
    rows[1, [10, 500]] = 9.0  # a tie: the lower id
    rows[2, :] = float("-inf")
    rows[3, ::2] = float("-inf")
    for view in (rows, rows[1:4], rows[:, 100:], rows.t().contiguous().t()):
        assert _argmax(view) == view.argmax(-1).tolist()
    assert _argmax(rows.double()) == rows.argmax(-1).tolist()  # other dtypes take torch's


def test_where_rows_are_dear_the_sources_are_not_asked_and_the_output_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verified generation whose every extra row costs more than any draft could return (a pass shared with many
    sequences) skips the draft sources' lookups, on its exploring passes too (they could not afford one mask), and
    takes its passes in greedy runs; its tokens stay the engine's NTP."""
    from agent_mtp.engine.config import DecodeConfig
    from agent_mtp.engine.fast import FastRunner
    from tests.tiny import tiny_engine

    engine = tiny_engine(adapter=True)
    dear = CostCurve(tuple((n, 1.0 + 1.1 * (n - 1)) for n in (1, 2, 4, 8, 16, 32)))

    class Shared(FastRunner):
        def share_curve(self, base: CostCurve) -> CostCurve:
            return dear

    asked: list[int] = []
    propose = NgramDraftSource.propose

    def counting(self: NgramDraftSource, context: list[int], max_len: int) -> Draft | None:
        asked.append(len(context))
        return propose(self, context, max_len)

    monkeypatch.setattr(NgramDraftSource, "propose", counting)
    prompt = list(range(5, 25)) * 3
    cfg = DecodeConfig(mode="verified", max_new_tokens=24, prefix_cache=False)
    runner = engine.new_runner()
    assert isinstance(runner, FastRunner)
    shared = Shared(runner.model)
    result = engine.generate(prompt, cfg, runner=shared)
    ntp = engine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=24, prefix_cache=False))
    assert result.token_ids == ntp.token_ids
    assert result.stats.forward_passes == len(result.token_ids)  # every pass a plain one
    assert len(asked) <= 1  # at most a last pass with no room for a draft asks (runs cover the others)
    asked.clear()
    engine.generate(prompt, cfg)  # alone, rows are cheap: every pass asks
    assert len(asked) >= 8


def _auto_k_planner(curve: CostCurve, rate: float, explore_every: int = 0) -> Planner:
    return Planner(
        "confadapt", 16, auto_k=True, curve=curve, rates=AcceptanceRates([rate] * 15), explore_every=explore_every
    )


ZEN3 = CostCurve(((1, 1.0), (2, 1.57), (4, 1.94), (8, 2.45), (16, 4.36), (32, 8.66)))
"""The engine's curve on a 2-core Zen 3 (AVX2): a second row costs more than half a one-token pass."""


def test_auto_k_prices_masks_at_what_they_add_not_against_a_long_pass() -> None:
    """After a prefill or forced text the pass is dear; masks must not look free beside it (they did: 3-9 masks
    after every prefill and forced run on the Zen 3 curve, none accepted). The decision for a 300-token pass is the
    decision for a one-token pass where the curve is straight there."""
    for rate in (0.3, 0.6, 0.9):
        one = _auto_k_planner(ZEN3, rate).plan(1, [], budget=100).masks
        long = _auto_k_planner(ZEN3, rate).plan(300, [], budget=100).masks
        assert long <= one
    assert _auto_k_planner(ZEN3, 0.6).plan(300, [], budget=100).masks == 0


def test_auto_k_counts_re_feeding_the_accepted_mask_tokens() -> None:
    """Accepted ConfAdapt tokens come from mask rows and are fed again as real tokens next pass. On a curve where a
    second row costs 0.57 of a pass, one mask pays only if 1 + p > 1.57 (1 + p): never; a long block pays only for
    a strong adapter (the curve flattens past 4 rows). Where rows are cheap masks pay even for a weak adapter;
    flat, every mask does."""
    steps = [_auto_k_planner(ZEN3, rate).plan(1, [], budget=100).masks for rate in (0.3, 0.5, 0.6, 0.99)]
    assert steps[:3] == [0, 0, 0] and steps[3] >= 7
    cheap = CostCurve(((1, 1.0), (2, 1.05), (4, 1.15), (8, 1.35), (16, 1.75), (32, 2.55)))
    assert _auto_k_planner(cheap, 0.3).plan(1, [], budget=100).masks >= 1
    assert _auto_k_planner(CostCurve.flat(), 0.5).plan(1, [], budget=100).masks == 15
    # without the re-feed the same planner took a mask at p = 0.6 here: 1.6 / 1.57 > 1
    assert _auto_k_planner(ZEN3, 0.6).plan(1, [], budget=100).masks == 0


def test_auto_k_explores_within_the_allowance_of_a_one_token_pass() -> None:
    """Every n-th pass tries more masks so the rates keep learning, at most EXPLORE_OVERHEAD of a one-token pass
    on average: none where one row is dearer than that (Zen 3), several where rows are cheap, and no more after a
    prefill than after a one-token pass."""
    cheap = CostCurve(((1, 1.0), (2, 1.05), (4, 1.15), (8, 1.35), (16, 1.75), (32, 2.55)))
    for curve, fed in ((ZEN3, 1), (ZEN3, 300), (cheap, 1), (cheap, 300)):
        planner = _auto_k_planner(curve, 0.01, explore_every=4)
        masks = [planner.plan(fed, [], budget=100).masks for _ in range(4)]
        assert masks[:3] == [0, 0, 0]
        extra = curve.cost(fed + masks[3]) - curve.cost(fed)
        assert extra <= EXPLORE_OVERHEAD * 4 * curve.cost(1) + 1e-9
        assert (masks[3] == 0) == (curve is ZEN3)


def test_cost_curve_measures_what_a_draft_only_mask_row_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake clock: an exact extra row adds 1.0, a draft-only mask row 0.4 (the 8-bit grid); the curve keeps the
    exact rows' costs and the masks' share of them, through JSON too."""
    from agent_mtp.engine import cost

    clock = {"now": 0.0}
    monkeypatch.setattr(cost.time, "perf_counter", lambda: clock["now"])

    def timed(per_row: float):
        def run(n: int) -> None:
            clock["now"] += 10.0 + per_row * (n - 1)

        return run

    curve = cost.measure_cost_curve(timed(1.0), points=(1, 2, 4, 8, 16), repeats=2, draft_masks_n=timed(0.4))
    assert dict(curve.points)[8] == pytest.approx(1.7) and curve.mask_share == pytest.approx(0.4)
    assert CostCurve.from_json(curve.to_json()) == curve
    assert CostCurve.from_json('{"points": [[1, 1.0], [4, 2.0]]}').mask_share == 1.0  # a curve cached before
    assert curve.draft is not None and dict(curve.draft)[8] == pytest.approx(1.28) and curve.real is None
    apart = cost.measure_cost_curve(
        timed(1.0), points=(1, 2, 4), repeats=2, draft_masks_n=timed(0.4), real_n=timed(0.2)
    )
    assert dict(apart.real or ())[4] == pytest.approx(1.06) and apart.prices_masks_apart
    assert CostCurve.from_json(apart.to_json()) == apart
    only_exact = cost.measure_cost_curve(timed(1.0), points=(1, 4), repeats=1)
    assert only_exact.mask_share == 1.0
    cheaper_than_nothing = cost.measure_cost_curve(timed(1.0), points=(1, 4), repeats=1, draft_masks_n=timed(-1.0))
    assert cheaper_than_nothing.mask_share == cost.MIN_MASK_SHARE  # noise never makes masks free
    with pytest.raises(ValueError, match="mask_share"):
        CostCurve(((1, 1.0),), 0.0)


def test_a_dear_first_mask_leaves_the_draft_and_a_cheap_one_is_bought() -> None:
    """Measured on Zen 5: a second real token adds 0.06 of a one-token pass, a first draft-only mask 0.21-0.30 (it
    turns the adapter on in every layer). One curve for both priced the mask below the draft token; the curves
    measured apart price each at what it adds."""
    real = ((1, 1.0), (2, 1.06), (4, 1.38), (8, 2.3), (16, 4.3), (32, 10.2))
    draft = ((1, 1.0), (2, 1.3), (4, 1.42), (8, 2.06), (16, 3.45), (32, 8.07))
    one_curve = CostCurve(((1, 1.0), (2, 1.25), (4, 1.57), (8, 2.6), (16, 4.7), (32, 11.0)), 0.66)
    apart = CostCurve(one_curve.points, 0.66, real, draft)
    assert apart.prices_masks_apart and not one_curve.prices_masks_apart
    assert apart.mask_costs(2)[1] == pytest.approx(0.3) and apart.real_costs(1, 2)[1] == pytest.approx(1.06)
    assert one_curve.real_costs(1, 3) == one_curve.costs(1, 3)  # without a real curve: the one curve
    # a weak draft (accepted 30% of the time) against a mask whose draft pays next pass at 60%
    weak = Draft((5,), "ngram", 1.0, match=1)
    for curve, expected in ((one_curve, (1, [])), (apart, (0, [5]))):
        planner = verify_planner(curve, 2, [0.6], ngram=0.5)
        planner.rates.ngram_short = 0.3
        plan = planner.plan(1, [weak], budget=40)
        assert (plan.masks, plan.draft_tokens) == expected
    # cheap masks on a one-token pass; on a prefill they also cost what real rows add there beyond it
    cheap_masks = CostCurve(one_curve.points, 0.66, real, ((1, 1.0), (32, 1.31)))
    prefill = verify_planner(cheap_masks, 8, [0.5] * 7).plan(200, [], budget=40)
    decode = verify_planner(cheap_masks, 8, [0.5] * 7).plan(1, [], budget=40)
    assert prefill.masks < decode.masks


def test_verified_planner_buys_more_masks_when_they_cost_less_and_other_modes_ignore_it() -> None:
    rates = [0.45] * 7
    full = verify_planner(STEEP, 8, rates).plan(1, [], budget=51).masks
    cheap = verify_planner(CostCurve(STEEP.points, 0.3), 8, rates).plan(1, [], budget=51).masks
    assert cheap > full
    ngram = Draft((4, 5, 6), "ngram", 2.0)
    with_draft = verify_planner(CostCurve(STEEP.points, 0.3), 8, rates, ngram=0.9).plan(1, [ngram], budget=51)
    assert with_draft.draft is not None and len(with_draft.draft.tokens) == 3  # draft rows still at full price
    confadapt = [
        Planner("confadapt", 8, auto_k=True, curve=curve, rates=AcceptanceRates([0.45] * 7), explore_every=0)
        for curve in (STEEP, CostCurve(STEEP.points, 0.3))
    ]
    assert confadapt[0].plan(1, [], budget=51) == confadapt[1].plan(1, [], budget=51)  # its masks are exact


def test_a_plain_run_stops_before_the_next_exploring_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy run after a hopeless pass covers the plain passes the planner would have made one at a time, and no
    more: the exploring pass after them still comes, at the same pass count, where it can afford a mask; where rows
    are too dear for one (beside other sequences), it is plain like the rest and the runs go on through it."""
    import agent_mtp.engine.planner as planning
    from agent_mtp.engine.config import DecodeConfig

    dear = CostCurve(tuple((n, float(n)) for n in (1, 2, 4, 8, 16, 32)))  # every row a whole pass: never pays
    shipped = planning.EXPLORE_OVERHEAD

    def explores(planner: Planner) -> bool:
        if planner.plain_if_hopeless(1, 0.9, 20) is not None:
            return False
        planner._passes += 1  # the exploring pass, as _plan_verified counts it
        return True

    def passes(overhead: float) -> tuple[list[int], list[int]]:
        monkeypatch.setattr(planning, "EXPLORE_OVERHEAD", overhead)
        one_by_one, runs = (Planner.for_config(DecodeConfig(mode="verified"), dear) for _ in range(2))
        assert one_by_one.explore_every == runs.explore_every == 8
        singles = [explores(one_by_one) for _ in range(24)]
        made, lengths = 0, []
        while made < 24:
            run = 0 if explores(runs) else runs.plain_run(4, 20)
            lengths.append(run)
            made += max(run, 1)
        return [i for i, explored in enumerate(singles) if explored], lengths

    assert passes(1.0) == ([7, 15, 23], [4, 3, 0, 4, 3, 0, 4, 3, 0])  # a mask affordable: 7 plain, the explorer
    assert passes(shipped) == ([], [4, 4, 4, 4, 4, 4])  # a mask dearer than the allowance
    assert Planner.for_config(DecodeConfig(mode="verified"), dear).plain_run(0, 20) == 1  # at least the chosen pass


def test_masks_alone_are_scored_as_the_plan_would_score_them() -> None:
    """Where only masks could be added (no draft pending, no lookup match), the hopeless test scores them as the
    plan does: the bound ``n * p_max`` said a mask worth 0.25 beats a 0.185 row and sent every such pass to the loop,
    which then chose no mask."""
    curve = CostCurve(
        ((1, 1.0), (2, 1.34), (4, 2.08)),
        0.67,
        real=((1, 1.0), (2, 1.185), (4, 1.81)),
        draft=((1, 1.0), (2, 1.267), (4, 1.71)),
    )
    planner = verify_planner(curve, 4)  # MTP positions at the 0.5 prior: a mask is worth 0.25 next pass
    assert planner.plan(1, [], budget=40).masks == 0
    assert planner.plain_if_hopeless(1, 0.25, 39) is None  # the bound lets it through
    assert planner.plain_if_hopeless(1, 0.25, 39, masks_only=True) == Plan(None, 0)
    keen = verify_planner(curve, 4, [0.95] * 3)  # masks that do pay are still planned
    assert keen.plan(1, [], budget=40).masks > 0
    assert keen.plain_if_hopeless(1, 0.475, 39, masks_only=True) is None


def test_a_run_that_ends_early_gives_back_the_passes_it_did_not_make() -> None:
    """A greedy run is counted as made when it is planned; one that the prompt lookup's watch ends after 2 of its 4
    passes gives the other 2 back, so the exploring pass still comes at the 8th pass made, as pass by pass."""
    from agent_mtp.engine.config import DecodeConfig

    cheap = CostCurve(((1, 1.0), (2, 1.05), (4, 1.1), (8, 1.3), (16, 1.6), (32, 2.2)))  # exploring affords masks
    for give_back in (True, False):
        planner = Planner.for_config(DecodeConfig(mode="verified"), cheap)
        made, first = 0, True
        while planner.plain_if_hopeless(1, 0.0, 20) is not None:
            run = planner.plain_run(4, 20)
            now = 2 if first else run  # the first run ends early
            if give_back and now < run:
                planner.unplanned(run - now)
            made, first = made + now, False
        assert made + 1 == (8 if give_back else 6)  # the exploring pass


def test_verified_without_the_mtp_source_never_feeds_masks() -> None:
    """``verified`` whose drafts leave out ``mtp`` discards what mask rows predict, so no pass may carry one: not the
    plan (whose mask rates would stay at their prior, never observed), not an exploring pass, not the hopeless test's
    cheapest row. The same curve and rates with ``mtp`` do buy masks, so the test can tell."""
    from agent_mtp.engine.config import DecodeConfig

    cheap = CostCurve(((1, 1.0), (2, 1.02), (4, 1.05), (8, 1.1), (16, 1.6), (32, 2.2)))  # masks nearly free
    with_mtp = Planner.for_config(DecodeConfig(mode="verified"), cheap)
    without = Planner.for_config(DecodeConfig(mode="verified", drafts=("ngram", "grammar")), cheap)
    assert with_mtp.masks and not without.masks and without.rates.positions == []
    assert with_mtp.plan(1, [], budget=40).masks > 0
    ngram = Draft((5, 6, 7), "ngram", 1.5, match=3)
    for planner in (without, Planner.for_config(DecodeConfig(mode="verified", drafts=("grammar",)), cheap)):
        plans = [planner.plan(1, [ngram] if i % 2 else [], budget=40) for i in range(24)]  # 3 exploring passes
        assert all(plan.masks == 0 for plan in plans)
        assert any(plan.draft is not None for plan in plans)  # a draft is still verified
        assert planner.plain_if_hopeless(1, 0.0, 39) == Plan(None, 0)  # nothing could pay: a plain pass (a run)
    not_cost_aware = Planner.for_config(DecodeConfig(mode="verified", cost_aware=False, drafts=("ngram",)), None)
    assert not_cost_aware.plan(1, [ngram], budget=40) == Plan(ngram, 0)


def test_could_pay_follows_the_curve_it_is_given():
    """The cheapest row is kept per curve value: a new curve (the live curve of the next generation, a test's) is
    priced afresh, the same one is not asked again."""
    dear = CostCurve(((1, 1.0), (2, 1.9), (4, 3.7), (8, 7.3), (16, 14.5), (32, 29.0)))
    cheap = CostCurve(((1, 1.0), (2, 1.05), (4, 1.1), (8, 1.2), (16, 1.5), (32, 2.0)))
    planner = verify_planner(dear, 8, [0.3] * 7, 0.3)
    assert not planner.could_pay(1, 0.5, 50)
    assert not planner.could_pay(1, 0.5, 50)
    planner.curve = cheap
    assert planner.could_pay(1, 0.5, 50)
    planner.curve = dear
    assert not planner.could_pay(1, 0.5, 50)
    assert planner.could_pay(1, 0.95, 50)  # the same rows at another rate: read from the kept row
