"""Pure planning maths: acceptance rules, n-gram lookup, draft choice, cost-aware planning."""

from __future__ import annotations

import torch

from agent_mtp.engine.acceptance import confadapt_accept_length, expected_accepted, verify_greedy
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.drafts import Draft, NgramDraftSource, choose_draft
from agent_mtp.engine.planner import VerifyPlanner

STEEP = CostCurve(((1, 1.0), (4, 1.5), (8, 1.9), (16, 2.1), (32, 2.5)))


def test_confadapt_rule():
    assert confadapt_accept_length(torch.tensor([0.95, 0.92, 0.5, 0.99]), 0.9) == 2
    assert confadapt_accept_length(torch.tensor([0.5, 0.99, 0.99]), 0.9) == 1  # at least one
    assert confadapt_accept_length(torch.tensor([0.91, 0.91, 0.91]), 0.9) == 3
    assert confadapt_accept_length(torch.tensor([1.0, 1.0]), 1.01) == 1


def test_verify_greedy_and_expectation():
    assert verify_greedy([1, 2, 3], [1, 2, 4]) == 2
    assert verify_greedy([5], [6]) == 0
    assert expected_accepted([0.5, 0.5]) == [1.0, 1.5, 1.75]


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    source = NgramDraftSource(ngram_max=3, draft_len=4)
    context = [1, 2, 3, 9, 9, 7, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]
    draft = source.propose(context, max_len=10)
    assert draft is not None and draft.tokens == (4, 5, 6, 0)
    assert source.propose([1, 2, 3], max_len=10) is None
    assert source.propose(context, max_len=2).tokens == (4, 5)


def test_choose_draft_prefers_higher_score():
    a, b = Draft((1,), "mtp", 0.2), Draft((1, 2, 3), "ngram", 1.5)
    assert choose_draft([a, b, None]) is b
    assert choose_draft([None]) is None


def test_planner_skips_masks_when_drafts_rarely_pay_on_a_cpu_curve():
    planner = VerifyPlanner(STEEP, k_cap=8, explore_every=0, mtp_rates=[0.05] * 7)
    draft, masks = planner.plan(1, [], room=50)
    assert draft is None and masks == 0


def test_planner_uses_masks_when_they_pay():
    planner = VerifyPlanner(STEEP, k_cap=8, explore_every=0, mtp_rates=[0.95] * 7)
    _, masks = planner.plan(1, [], room=50)
    assert masks >= 3


def test_planner_takes_long_good_ngram_drafts_and_everything_on_a_flat_curve():
    ngram = Draft(tuple(range(10)), "ngram", 5.0)
    planner = VerifyPlanner(STEEP, k_cap=8, explore_every=0, ngram_rate=0.9, mtp_rates=[0.05] * 7)
    draft, _ = planner.plan(1, [ngram], room=50)
    assert draft is not None and len(draft.tokens) >= 5
    flat = VerifyPlanner(CostCurve.flat(), k_cap=8, explore_every=0, mtp_rates=[0.3] * 7)
    _, masks = flat.plan(1, [], room=50)
    assert masks == 7


def test_planner_learns_hit_rates():
    planner = VerifyPlanner(STEEP, k_cap=4, explore_every=0)
    draft = Draft((1, 2, 3), "mtp", 1.0)
    for _ in range(20):
        planner.observe(draft, 0)
    assert planner.mtp_rates[0] < 0.1
    for _ in range(20):
        planner.observe(Draft((1, 2), "ngram", 1.0), 2)
    assert planner.ngram_rate > 0.9


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
