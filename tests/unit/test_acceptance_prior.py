"""The acceptance prior: verified generations of one engine start from the rates the earlier ones measured."""

from __future__ import annotations

import random
import threading

import pytest

from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.drafts import Draft
from agent_mtp.engine.planner import (
    DEFAULT_CALIBRATION,
    PRIOR_MEMORY,
    AcceptancePrior,
    AcceptanceRates,
    Plan,
    Planner,
    calibrated,
)

DEAR = CostCurve(((1, 1.0), (2, 1.6), (4, 2.8), (8, 5.2), (16, 10.0), (32, 19.6)))
"""Every row adds 0.6 of a one-token pass: a draft token must be accepted more than 60% of the time to pay."""
VERIFIED = DecodeConfig(mode="verified", k_max=4)


def test_a_fresh_prior_gives_the_fixed_guesses_and_the_old_blend() -> None:
    """Before anything is measured a generation plans as before the prior existed: the same starting rates, and an
    MTP draft token's probability is the blend 0.5 * confidence + 0.5 * the position's rate, however far the
    generation's own rates have moved."""
    rates = AcceptancePrior().snapshot(3)
    assert rates.positions == [0.5] * 3 and rates.start == (0.5,) * 3
    assert (rates.ngram, rates.ngram_short, rates.grammar) == (0.5, 0.2, 0.8)
    assert rates.calibration == DEFAULT_CALIBRATION
    rng = random.Random(3)
    for _ in range(50):
        positions = [rng.random() for _ in range(3)]
        confidences = tuple(rng.random() for _ in range(3))
        for fresh in (rates, AcceptanceRates([0.5] * 3)):
            fresh.positions = list(positions)
            probs = fresh.draft_probs(Draft((1, 2, 3), "mtp", 1.0, confidences))
            assert probs == pytest.approx([0.5 * c + 0.5 * r for c, r in zip(confidences, positions, strict=True)])


def test_the_calibration_learns_what_each_confidence_is_worth() -> None:
    """Confident masks whose tokens are always kept and half-confident ones whose tokens never are: the next
    generation trusts the first more and the second less than the blend did."""
    prior = AcceptancePrior()
    for _ in range(60):
        prior.observe_mtp((0.95,), 1)
        prior.observe_mtp((0.65,), 0)
    rates = prior.snapshot(3)
    sure, doubtful = (rates.draft_probs(Draft((7,), "mtp", 1.0, (c,)))[0] for c in (0.95, 0.65))
    assert sure > 0.9 and doubtful < 0.2
    assert sure > 0.5 * 0.95 + 0.25 and doubtful < 0.5 * 0.65 + 0.25
    assert rates.start[0] == pytest.approx(rates.positions[0]) and 0.45 < rates.positions[0] < 0.55
    # later tokens of a draft are a statistic of their own (accepted given the ones before): untouched here
    assert rates.calibration[1] == DEFAULT_CALIBRATION[1]


def test_a_generation_still_moves_from_where_it_started() -> None:
    """A generation whose own MTP drafts keep failing trusts them less than the prior says (by half what it
    learned), never below 0."""
    prior = AcceptancePrior()
    for _ in range(40):
        prior.observe_mtp((0.9, 0.9), 2)
    planner = Planner.for_config(VERIFIED, DEAR, prior)
    draft = Draft((1, 2), "mtp", 1.0, (0.9, 0.9))
    before = planner.rates.draft_probs(draft)
    assert before[0] == pytest.approx(calibrated(planner.rates.calibration, 0, 0.9))
    for _ in range(10):
        planner.observe(Plan(draft, 0), 2, 0)
    after = planner.rates.draft_probs(draft)
    moved = planner.rates.positions[0] - planner.rates.start[0]
    assert moved < -0.3 and after[0] == pytest.approx(max(before[0] + 0.5 * moved, 0.0))
    assert planner.rates.mtp_ceiling() >= max(planner.rates.draft_probs(Draft((1,), "mtp", 1.0, (1.0,))))


def test_what_one_generation_learns_the_next_one_starts_from() -> None:
    """A generation whose n-gram drafts were all accepted leaves a prior from which the next planner takes a
    three-token n-gram draft that a planner starting from the fixed guesses leaves out (output is the same either
    way: only the plan changes). Other modes neither read nor feed the prior."""
    prior = AcceptancePrior()
    draft = Draft((5, 6, 7), "ngram", 2.0, match=2)
    fresh = Planner.for_config(VERIFIED, DEAR, prior)
    fresh.explore_every = 0
    assert fresh.plan(1, [draft], budget=50).draft is None
    learning = Planner.for_config(VERIFIED, DEAR, prior)
    for _ in range(30):
        learning.observe(Plan(draft, 0), 3, 3)
    confadapt = Planner.for_config(DecodeConfig(mode="confadapt", k_max=4), None, prior)
    assert confadapt.prior is None
    confadapt.observe(Plan(None, 3), 3, 0)
    informed = Planner.for_config(VERIFIED, DEAR, prior)
    informed.explore_every = 0
    assert informed.rates.ngram > 0.9 and informed.rates.ngram_short == pytest.approx(0.2)
    chosen = informed.plan(1, [draft], budget=50).draft
    assert chosen is not None and chosen.tokens == draft.tokens


def test_grammar_drafts_feed_the_prior_with_their_unforced_tokens_only() -> None:
    prior = AcceptancePrior()
    planner = Planner.for_config(VERIFIED, DEAR, prior)
    planned = Draft((1, 2, 3, 4), "grammar", 4.0, (1.0, 1.0, 1.0, 0.5))
    for _ in range(30):
        planner.observe(Plan(planned, 0), 4, 3)  # the three forced tokens kept, the free one not
    assert prior.snapshot(3).grammar < 0.1
    assert prior.snapshot(3).ngram == 0.5


def test_the_prior_follows_a_changed_workload() -> None:
    """Counts halve at PRIOR_MEMORY trials: after as many failed trials as there were kept tokens the rate is low,
    not the average of all history (a draft rejected at its first token is one trial)."""
    prior = AcceptancePrior()
    draft_len = 4
    for _ in range(int(PRIOR_MEMORY)):
        prior.observe_ngram(draft_len, draft_len, match=3)
    assert prior.snapshot(1).ngram > 0.95
    for _ in range(draft_len * int(PRIOR_MEMORY)):
        prior.observe_ngram(draft_len, 0, match=3)
    assert prior.snapshot(1).ngram < 0.2


def test_concurrent_generations_lose_no_observation() -> None:
    prior = AcceptancePrior()

    def feed() -> None:
        for _ in range(40):
            prior.observe_ngram(1, 1, match=1)

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the guess (0.2 over 4 trials) plus 160 hits in 160 trials, below the memory's bound
    assert prior.snapshot(1).ngram_short == pytest.approx((0.8 + 160) / (4 + 160))
