"""The planner: before every forward pass, one object decides which draft to verify and how many masks to append
(so k = 1 + masks), for every mode, from one acceptance-rate estimator and the machine's cost curve.

* ``ntp``: no draft, no masks.
* ``static`` / ``confadapt`` with an int ``k_max``: ``k_max - 1`` masks. With ``k_max="auto"``: the k that
  maximises expected tokens per unit of time, E[accepted | k] / cost, the cost being what the masks add to this
  pass plus re-feeding the accepted mask tokens in the next (see :meth:`Planner._choose_k`).
* ``verified``, cost-aware (``DecodeConfig.cost_aware``, the default): verification is free only in forward
  passes, not in time (on a CPU an 18-token pass costs ~2x a 1-token pass), so each pass maximises

      value = 1 + E[accepted draft tokens] + P(whole draft accepted) * E[next MTP draft] * FUTURE_CREDIT
      cost  = 1 + real(pending + draft length) - real(pending) + masks_added(masks)
      masks_added(m) = draft(1 + m) - 1 + max(0, real(n + m) - real(n) - (real(1 + m) - 1)),  n = pending + length

  (value / cost) over {no draft, each source's draft} x their prefixes x mask counts: the draft's rows at what
  they add to the pass as real tokens (``CostCurve.real``), as a one-token pass carries them (a prefill's own cost
  does not make them cheap), and the masks at what draft-only masks add to a one-token pass (``CostCurve.draft``:
  the first mask turns the adapter on in every layer, so it costs more than a draft token; further masks less:
  they are computed on an 8-bit grid where the fast runtime can). A weak adapter is used sparingly and a strong
  one fully, without any setting changing;
  output stays exact whatever is chosen. Where no option could beat the plain pass
  (:meth:`Planner.plain_if_hopeless`) the sources are not asked.
* ``verified``, not cost-aware: the best-scoring draft and ``k_max - 1`` masks (the k rule above with "auto").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from agent_mtp.engine.acceptance import expected_accepted
from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.drafts import Draft, choose_draft

_UNSET = object()
FUTURE_CREDIT = 0.5
"""Masks pay off one pass later (as the next draft), and that verification costs time then: count half."""
EXPLORE_OVERHEAD = 0.03
"""Exploring verified passes add at most this share to the average pass's cost (alone on a CPU: every mask; in a
pass shared with other sequences, where rows are dear, fewer)."""
AUTO_K_CAP = 16
"""Most tokens per pass that ``k_max="auto"`` considers."""


@dataclass
class AcceptanceRates:
    """Running acceptance estimates (EWMA): per mask position, P(accepted | the positions before it accepted),
    and for prompt-lookup drafts one rate per kind of match: the context's last two or more tokens matched
    (``ngram``), or only its last token (``ngram_short``). Measured on the agent suites (verified, shipped adapter):
    first tokens of one-token matches were accepted 19% of the time, of longer matches 67%; one rate for both
    made the planner verify weak drafts and trim strong ones."""

    positions: list[float]
    ngram: float = 0.5
    ngram_short: float = 0.2
    grammar: float = 0.8
    """Drafts of the grammar's forced text (the token jump-forward leaves to the model)."""

    def observe_positions(self, proposed: int, accepted: int) -> None:
        """``proposed`` positions beyond the first were offered and the first ``accepted`` of them kept; each
        position up to the first rejection is one trial."""
        for j in range(min(proposed, accepted + 1, len(self.positions))):
            hit = 1.0 if j < accepted else 0.0
            self.positions[j] = 0.9 * self.positions[j] + 0.1 * hit

    def observe_grammar(self, draft: Draft, accepted: int) -> None:
        """Learn from a grammar draft's tokens beyond those its plan forced (those are certain)."""
        planned = sum(c >= 1.0 for c in draft.confidences)
        trials = min(len(draft.tokens) - planned, accepted - planned + 1)
        if trials > 0:
            self.grammar = 0.9 * self.grammar + 0.1 * (accepted - planned) / trials

    def observe_ngram(self, proposed: int, accepted: int, *, match: int) -> None:
        trials = min(proposed, accepted + 1)
        old = self.ngram_rate(match)
        rate = 0.9 * old + 0.1 * (accepted / trials if trials else old)
        if match == 1:
            self.ngram_short = rate
        else:
            self.ngram = rate

    def ngram_rate(self, match: int) -> float:
        """P(a prompt-lookup draft token accepted | the ones before it) for a match over ``match`` tokens."""
        return self.ngram_short if match == 1 else self.ngram

    def draft_probs(self, draft: Draft) -> list[float]:
        """P(token i of ``draft`` accepted | tokens before it accepted); MTP drafts blend in their confidences."""
        if draft.source == "mtp":
            conf = list(draft.confidences) if draft.confidences else [0.5] * len(draft.tokens)
            blended = [0.5 * c + 0.5 * r for c, r in zip(conf, self.positions, strict=False)]
            return blended + [0.0] * max(len(draft.tokens) - len(self.positions), 0)
        if draft.source == "grammar":
            certain = [c >= 1.0 for c in draft.confidences]
            return [1.0 if i < len(certain) and certain[i] else self.grammar for i in range(len(draft.tokens))]
        return [self.ngram_rate(draft.match)] * len(draft.tokens)


@dataclass(frozen=True)
class Plan:
    """What the next pass feeds beyond the pending tokens."""

    draft: Draft | None
    masks: int

    @property
    def draft_tokens(self) -> list[int]:
        return list(self.draft.tokens) if self.draft is not None else []


@dataclass
class Planner:
    """Decides draft and masks per pass and learns from what was accepted. One per generation.

    ``curve`` is None when nothing needs it (fixed k, not cost-aware): then no cost is ever looked up.
    """

    mode: str
    k_cap: int
    """Most tokens per pass (``k_max``, or :data:`AUTO_K_CAP` for "auto")."""
    auto_k: bool = False
    """static / confadapt: choose k per pass from the cost curve (``k_max="auto"``)."""
    cost_aware: bool = False
    """verified: plan draft and masks from the cost curve."""
    curve: CostCurve | None = None
    rates: AcceptanceRates = field(default_factory=lambda: AcceptanceRates([]))
    explore_every: int = 16
    """Every n-th pass tries the largest k (so the rates keep learning); 0 never."""
    masks: bool = True
    """Whether mask rows can give anything: ``verified`` without the ``mtp`` draft source discards what they
    predict, so its passes never carry one (``drafts=("ngram", "grammar")`` fed three masks on 63% of its passes
    before: without them it makes 1.13-1.17x the tokens a second alone, 0.85x -> 0.95x ``ntp`` beside 15 other
    sequences; Zen 5)."""
    _passes: int = 0
    _cheapest_kept: tuple[CostCurve | None, dict[tuple[int, int], float | None]] = field(
        default_factory=lambda: (None, {}), repr=False
    )

    @classmethod
    def for_config(cls, cfg: DecodeConfig, curve: CostCurve | None) -> Planner:
        """The planner of one generation; ``curve`` is needed when :func:`needs_cost_curve` says so."""
        k_cap = AUTO_K_CAP if cfg.k_max == "auto" else int(cfg.k_max)
        auto_k = cfg.k_max == "auto" and cfg.mode != "ntp"
        cost_aware = cfg.mode == "verified" and cfg.cost_aware
        masks = cfg.mode != "verified" or "mtp" in cfg.drafts
        if cost_aware:  # a verified pass: rates of MTP drafts and n-grams, explore more often
            positions = [0.5] * max(k_cap - 1, 0) if masks else []
            return cls(cfg.mode, k_cap, auto_k, True, curve, AcceptanceRates(positions), 8, masks)
        return cls(cfg.mode, k_cap, auto_k, False, curve, AcceptanceRates([0.6] * (k_cap - 1)), 16, masks)

    def plan(self, pending: int, drafts: list[Draft], budget: int) -> Plan:
        """The next pass for ``pending`` uncached tokens, the sources' ``drafts`` and ``budget`` tokens left."""
        if self.cost_aware:
            return self._plan_verified(pending, drafts, budget - 1)
        draft = choose_draft(list(drafts)) if self.mode == "verified" else None
        length = len(draft.tokens) if draft is not None else 0
        k = self._choose_k(pending + length) if self.masks else 1
        return Plan(draft, min(k - 1, max(budget - 1 - length, 0)))

    def plain_if_hopeless(self, pending: int, p_max: float, room: int, *, masks_only: bool = False) -> Plan | None:
        """The plain pass (no draft, no masks) when nothing the draft sources could propose can beat it, else
        None (then ask them and :meth:`plan`). Hopeless: a verified, cost-aware pass that does not explore, where
        every row an option could add (a draft token or a mask, the first or a further one) adds more than
        ``p_max`` (the largest acceptance probability any draft token or mask could have): an option of n rows
        then expects at most n * p_max more tokens for more than n * p_max more cost. Skips the sources' lookups
        and the search, which a sequence beside 7 others ran on every pass (~90 us of Python there, after a pass
        that left the caches cold) for passes where they never paid, and lets it take greedy runs. Rows are priced
        at the cheapest average of an option's rows, not at the cheapest single step, which after a step (the row
        that opens a tile chunk beside 7 other sequences) is nearly free though no option reaches it without
        paying the step. ``room``: tokens left minus one. ``masks_only``: the only options are masks (no draft is
        pending and the prompt lookup has no match): they are then scored as :meth:`plan` scores them, not bounded
        by ``p_max``: the bound (a mask at FUTURE_CREDIT x its rate, 0.25 at the prior, against a 0.19 row) let
        passes of the loop's own through that then chose no mask, each ~0.3 ms of Python more than a greedy run's
        pass."""
        if not self.cost_aware or self.curve is None or room <= 0:
            return None
        # an exploring pass: a plan of its own where it can afford masks; where rows are too dear for even one
        # (beside other sequences) it would explore nothing and is plain like the rest, so a greedy run goes on
        # through it (16 clients in one process: verified 0.93x NTP exploring every 8th pass, 0.99x never)
        exploring = self.explore_every and (self._passes + 1) % self.explore_every == 0
        if exploring and self._explore_masks(pending, 0, room, self.curve.cost) > 0:
            return None
        if self._best(pending, [], room)[2] > 0 if masks_only else self.could_pay(pending, p_max, room):
            return None
        self._passes += 1
        return Plan(None, 0)

    def could_pay(self, pending: int, p_max: float, room: int) -> bool:
        """Whether an option whose every row is accepted with probability at most ``p_max`` could beat the plain
        pass (:meth:`plain_if_hopeless`'s test, without its exploring pass and without counting a pass): True where
        there is no cost curve to tell."""
        if not self.cost_aware or self.curve is None or room <= 0:
            return True
        # every option's rows: a draft (at most AUTO_K_CAP - 1 mask tokens, or a 10-token n-gram) plus masks; an
        # option of L draft tokens and m masks costs at least real[L] + added[m] (the planner's floor), so it adds
        # at least (L + m) times the smaller of the two kinds' cheapest average row: where rows cost in steps (AMX
        # tile chunks of 8; a shared pass's first extra row opens one), that is the step shared by the rows it
        # opens for, not the cheap row after it
        cheapest = self._cheapest_row(pending, min(room, 2 * AUTO_K_CAP) + 1)
        return cheapest is None or p_max >= cheapest * (1.0 - 1e-6)  # (rounding of equal steps)

    def _cheapest_row(self, pending: int, rows: int) -> float | None:
        """:meth:`could_pay`'s cheapest average row (None: no row to add). A stored or live curve is a value, so its
        answers are kept per (pending, rows): a verified sequence asks before every greedy run and pass, twice where
        the prompt lookup is watched (0.85% of a single sequence's wall in py-spy on Zen 4, recomputed each time); a
        shared pass's curve moves with the load and is asked afresh."""
        curve = self.curve
        assert curve is not None
        keep = type(curve) is CostCurve
        if keep and self._cheapest_kept[0] is curve:
            found = self._cheapest_kept[1].get((pending, rows), _UNSET)
            if found is not _UNSET:
                return cast("float | None", found)
        if curve.prices_masks_apart:
            real = _marginal(curve.real_costs(pending, rows))
            added = curve.mask_costs(min(rows, AUTO_K_CAP)) if self.masks else ()
            averages = [(c[n] - c[0]) / n for c in (real, added) for n in range(1, len(c))]
        else:  # rows alike: the cheapest row is a mask (draft-only masks cost the curve's share of a row)
            costs = _marginal(curve.costs(pending, rows))
            share = self._mask_share if self.masks else 1.0
            averages = [(costs[n] - costs[0]) * share / n for n in range(1, len(costs))]
        cheapest = min(averages) if averages else None
        if keep:
            if self._cheapest_kept[0] is not curve:
                self._cheapest_kept = (curve, {})
            self._cheapest_kept[1][(pending, rows)] = cheapest
        return cheapest

    def plain_run(self, limit: int, room: int) -> int:
        """Right after :meth:`plain_if_hopeless` chose a plain pass: how many plain passes in a row (that one
        included, at most ``limit``) come before the next exploring pass that can afford a mask, for a greedy run
        to make at once (``room``: tokens left minus one, as there); the ones after the first are counted as made
        (:meth:`unplanned` takes back those a run that ends early did not make)."""
        run = max(limit, 1)
        if self.explore_every and self.curve is not None and self._explore_masks(1, 0, room, self.curve.cost) > 0:
            run = min(run, self.explore_every - self._passes % self.explore_every)
        self._passes += run - 1
        return run

    def unplanned(self, passes: int) -> None:
        """A greedy run that :meth:`plain_run` counted made ``passes`` fewer passes (the prompt lookup's watch or a
        stop token ended it): they are not counted, so the next exploring pass comes when it would have pass by
        pass."""
        self._passes = max(self._passes - passes, 0)

    def observe(self, plan: Plan, proposed: int, accepted: int) -> None:
        """``proposed`` tokens beyond the first were checked (draft or masks); the first ``accepted`` were kept."""
        if self.mode == "verified":
            if self.cost_aware and plan.draft is not None:
                if plan.draft.source == "mtp":
                    self.rates.observe_positions(len(plan.draft.tokens), accepted)
                elif plan.draft.source == "grammar":
                    self.rates.observe_grammar(plan.draft, accepted)
                else:
                    self.rates.observe_ngram(len(plan.draft.tokens), accepted, match=plan.draft.match)
        elif self.auto_k:
            self.rates.observe_positions(proposed, accepted)

    # -- k for static / confadapt (and verified when not cost-aware) -----------------------------------------------
    def _choose_k(self, fed_without_masks: int) -> int:
        """k for static / confadapt (and verified when not cost-aware). With ``k_max="auto"``: the k maximising
        E[tokens | k] / cost, where cost = the masks' marginal cost on this pass (:func:`_marginal`: what they add,
        not the pass's own cost, which made masks look free after a prefill or forced text) + re-feeding the
        accepted mask tokens next pass (their keys and values came from mask rows, so they are fed again as real
        tokens: each one a row of the next pass). Measured before on a 2-core Zen 3 (2 tokens 1.57x one): pricing
        against the whole pass chose 3-9 masks after every prefill and forced run, none accepted, and ConfAdapt ran
        0.84-0.96x NTP."""
        if self.mode == "ntp":
            return 1
        if not self.auto_k:
            return self.k_cap
        assert self.curve is not None, 'k_max="auto" needs a cost curve'
        self._passes += 1
        if self.explore_every and self._passes % self.explore_every == 0:
            return 1 + self._explore_masks(fed_without_masks, 0, self.k_cap - 1, self.curve.cost)
        return self._best_k(fed_without_masks)

    def plain_k_run(self, limit: int) -> int:
        """static / confadapt with ``k_max="auto"``, a pass of one pending token: how many passes in a row, from the
        next one, :meth:`_choose_k` would make without masks (at most ``limit``, up to the next exploring pass),
        counted as made (:meth:`unplanned` takes back those a run that ends early did not make); 0 where the next pass
        takes masks. The rates learn only from passes with masks, so a k of 1 holds until an exploring pass: a
        greedy run of the runner's own makes those passes, as ``ntp``'s, instead of one decode step in Python each
        (paired on Zen 4 over the quick suite: ConfAdapt 0.880x ``ntp`` with runs, 0.876x pass by pass; what it
        loses there is its mask passes, docs/benchmarks.md)."""
        if self.mode == "ntp" or self.mode == "verified" or not self.auto_k or self.curve is None or limit < 1:
            return 0
        following = self._passes + 1
        if self.explore_every and following % self.explore_every == 0:
            return 0
        if self._best_k(1) != 1:
            return 0
        run = limit
        if self.explore_every:  # passes before the next exploring one
            run = min(run, self.explore_every - following % self.explore_every)
        self._passes += run
        return run

    def _best_k(self, fed_without_masks: int) -> int:
        """The k maximising E[tokens | k] / cost (see :meth:`_choose_k`)."""
        assert self.curve is not None, 'k_max="auto" needs a cost curve'
        gains = expected_accepted(self.rates.positions)
        here = _marginal(self.curve.costs(fed_without_masks, self.k_cap))  # [m]: this pass with m masks
        refeed = self.curve.costs(1, self.k_cap)  # [a]: the next pass feeding a accepted mask tokens too
        best_k, best_value = 1, 0.0
        for k in range(1, self.k_cap + 1):
            value = gains[k - 1] / (here[k - 1] + _interpolated(refeed, gains[k - 1] - 1.0) - refeed[0])
            if value > best_value + 1e-9:
                best_k, best_value = k, value
        return best_k

    # -- verified: draft and masks --------------------------------------------------------------------------------
    def _plan_verified(self, pending: int, candidates: list[Draft], room: int) -> Plan:
        """``room`` = tokens left minus one."""
        assert self.curve is not None, "cost-aware verification needs a cost curve"
        self._passes += 1
        winner, length, masks = self._best(pending, candidates, room)
        draft = _prefix(winner, length) if winner is not None else None
        if self.explore_every and self._passes % self.explore_every == 0 and masks == 0:
            masks = self._explore_masks(pending, length, room, self.curve.cost)
        return Plan(draft, masks)

    def _best(self, pending: int, candidates: list[Draft], room: int) -> tuple[Draft | None, int, int]:
        """The option that scores best: (candidate, draft length, masks); (None, 0, 0) where none beats the plain
        pass."""
        assert self.curve is not None, "cost-aware verification needs a cost curve"
        most_masks = max(self.k_cap - 1, 0) if self.masks else 0
        longest = max((min(len(c.tokens), room) for c in candidates), default=0)
        top = max(min(most_masks, room), 0)
        apart = self.curve.prices_masks_apart
        # [i]: + i draft tokens (+ masks, where every row is priced alike)
        real = _marginal(
            self.curve.real_costs(pending, longest + top + 1) if apart else self.curve.costs(pending, longest + top + 1)
        )
        added = self.curve.mask_costs(top + 1) if apart else ()  # [m]: what m masks add to a one-token pass
        one = self.curve.real_costs(1, top + 1) if apart else ()  # [m]: a one-token pass with m more real rows
        share = self._mask_share
        # A pass costs at least as much with more rows (every curve the engine builds): then, for one draft option,
        # once even its largest value over this pass's cost cannot beat the best, no more masks can.
        prune = list(added) == sorted(added) and list(real) == sorted(real)  # (a kept range is a tuple)
        gain = [0.0, *_cumulative(self.rates.positions)]  # gain[m]: expected MTP draft tokens from m masks
        best = -1.0
        chosen: tuple[Draft | None, int, int] = (None, 0, 0)  # (candidate, draft length, masks)
        options: list[tuple[Draft | None, int, float, float]] = [(None, 0, 0.0, 1.0)]  # + expected, P(all)
        for candidate in candidates:
            expected, run = 0.0, 1.0  # E[accepted] and P(all accepted) of each prefix, one token at a time
            for length, p in enumerate(self.rates.draft_probs(candidate)[: min(len(candidate.tokens), room)], 1):
                run *= p
                expected += run
                options.append((candidate, length, expected, run))
        for option, length, expected, p_all in options:
            top_masks = max(min(most_masks, room - length), 0)
            ceiling = 1.0 + expected + p_all * gain[top_masks] * FUTURE_CREDIT
            for masks in range(top_masks + 1):
                if apart:
                    here = real[length] + added[masks]  # a floor that grows with masks: the prune reads it
                    if prune and ceiling / here <= best + 1e-12:
                        break
                    # on a longer pass (a draft, a prefill) rows may cost more than on a one-token pass: the masks
                    # add that excess too
                    here += max(0.0, real[length + masks] - real[length] - (one[masks] - 1.0))
                else:  # rows alike, each mask at the curve's share of a row
                    here = real[length] + share * (real[length + masks] - real[length])
                    if prune and ceiling / here <= best + 1e-12:
                        break
                future = p_all * gain[masks] * FUTURE_CREDIT
                score = (1.0 + expected + future) / here
                if score > best + 1e-12:
                    best, chosen = score, (option, length, masks)
        return chosen

    def _explore_masks(self, pending: int, length: int, room: int, cost: Callable[[int], float]) -> int:
        """Masks an exploring pass adds to a draft of ``length``: as many as fit in the exploration allowance,
        which is measured against a one-token pass (what a decode pass of this sequence costs), so that exploring
        costs at most EXPLORE_OVERHEAD on average however long the draft or the pass is (a prefill's own cost is
        no allowance for rows), and fewer masks when rows are dear (a pass shared with other sequences)."""
        fed = pending + length
        allowance = EXPLORE_OVERHEAD * self.explore_every * cost(1)
        most = max(min(self.k_cap - 1, room - length), 0) if self.masks else 0
        masks = 0
        while masks < most and self._masks_add(fed, masks + 1, cost) <= allowance:
            masks += 1
        return masks

    def _masks_add(self, fed: int, masks: int, cost: Callable[[int], float]) -> float:
        """What ``masks`` masks add to a pass feeding ``fed`` tokens: on the draft-mask curve where ``verified``'s
        are priced apart (:attr:`CostCurve.draft`, which the live curve corrects from this process's passes), else
        as rows of ``cost`` at :attr:`_mask_share`."""
        if self.mode == "verified" and self.curve is not None and self.curve.prices_masks_apart:
            return self.curve.mask_costs(masks + 1)[masks]
        return self._mask_share * (cost(fed + masks) - cost(fed))

    @property
    def _mask_share(self) -> float:
        """What a mask row adds to a pass as a share of an exact row (:attr:`CostCurve.mask_share`): ``verified``'s
        masks are only drafts, which the fast runtime's record paths compute on an 8-bit grid; other modes commit
        mask tokens, computed exactly."""
        return self.curve.mask_share if self.mode == "verified" and self.curve is not None else 1.0


def needs_cost_curve(cfg: DecodeConfig) -> bool:
    """True when the planner of ``cfg`` reads the cost curve (so an engine measures it only then)."""
    return (cfg.k_max == "auto" and cfg.mode != "ntp") or (cfg.mode == "verified" and cfg.cost_aware)


def _marginal(costs: Sequence[float]) -> Sequence[float]:
    """A pass's costs with ``i`` extra rows (``costs[0]``: the pass without them) as a one-token pass would carry
    them: ``1 + costs[i] - costs[0]``. The same costs where the pass feeds one token (cost 1); where it feeds many
    (a prefill, forced tokens), the rows are priced at what they add, not against the pass's own large cost, which
    made masks look nearly free on a prefill beside 7 other sequences (4 masks on an 86-token prefill whose every
    row costs the batch as much as a decode pass of this sequence; measured, 8 clients in-process)."""
    if not costs or costs[0] == 1.0:
        return costs
    base = costs[0] - 1.0
    return [c - base for c in costs]


def _interpolated(costs: Sequence[float], at: float) -> float:
    """``costs`` (at 0, 1, 2, ...) linearly interpolated at ``at`` (clamped to the range)."""
    at = min(max(at, 0.0), len(costs) - 1.0)
    low = int(at)
    if low + 1 >= len(costs):
        return costs[-1]
    return costs[low] + (costs[low + 1] - costs[low]) * (at - low)


def _cumulative(rates: list[float]) -> list[float]:
    out, total, run = [], 0.0, 1.0
    for r in rates:
        run *= r
        total += run
        out.append(total)
    return out


def _prefix(draft: Draft, length: int) -> Draft:
    return replace(draft, tokens=draft.tokens[:length], confidences=draft.confidences[:length])
