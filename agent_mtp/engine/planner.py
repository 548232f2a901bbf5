"""Cost-aware planning of a verified pass: which draft to verify, how much of it, and how many masks to append.

Verification is free only in forward passes, not in time: on a CPU an 18-token pass costs ~2x a 1-token pass. Each
pass therefore maximises expected tokens per unit cost,

    value = 1 + E[accepted draft tokens] + P(whole draft accepted) * E[next MTP draft] * FUTURE_CREDIT
    cost  = cost_curve(pending + draft length + masks)

over the candidates {no draft, MTP draft, n-gram draft} x their prefixes x mask counts. Acceptance probabilities come
from running per-position hit rates (MTP blended with the model's own confidence), so a weak adapter is used
sparingly and a strong one fully, without any setting changing. Output stays exact whatever is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.drafts import Draft

FUTURE_CREDIT = 0.5
"""Masks pay off one pass later (as the next draft), and that verification costs time then: count half."""


@dataclass
class VerifyPlanner:
    curve: CostCurve
    k_cap: int
    ngram_rate: float = 0.5
    explore_every: int = 8
    mtp_rates: list[float] = field(default_factory=list)
    _passes: int = 0

    def __post_init__(self) -> None:
        if not self.mtp_rates:
            self.mtp_rates = [0.5] * max(self.k_cap - 1, 0)

    def plan(self, pending: int, candidates: list[Draft], room: int) -> tuple[Draft | None, int]:
        """Return (draft or None, number of masks) for the next pass. ``room`` = tokens left minus one."""
        self._passes += 1
        best: tuple[float, Draft | None, int] = (-1.0, None, 0)
        options: list[tuple[Draft | None, list[float]]] = [(None, [])]
        for candidate in candidates:
            probs = self._probs(candidate)
            for length in range(1, min(len(candidate.tokens), room) + 1):
                options.append((Draft(candidate.tokens[:length], candidate.source, candidate.score), probs[:length]))
        mask_gain = _cumulative(self.mtp_rates)
        for option, probs in options:
            expected, p_all = _expected(probs)
            length = len(option.tokens) if option else 0
            for masks in range(0, max(min(self.k_cap - 1, room - length), 0) + 1):
                future = p_all * (mask_gain[masks - 1] if masks else 0.0) * FUTURE_CREDIT
                score = (1.0 + expected + future) / self.curve.cost(pending + length + masks)
                if score > best[0] + 1e-12:
                    best = (score, option, masks)
        _, draft, masks = best
        if self.explore_every and self._passes % self.explore_every == 0 and masks == 0:
            masks = max(min(self.k_cap - 1, room - (len(draft.tokens) if draft else 0)), 0)
        return draft, masks

    def _probs(self, draft: Draft) -> list[float]:
        if draft.source == "mtp":
            conf = list(draft.confidences) if draft.confidences else [0.5] * len(draft.tokens)
            return [0.5 * c + 0.5 * r for c, r in zip(conf, self.mtp_rates, strict=False)] + [0.0] * max(
                len(draft.tokens) - len(self.mtp_rates), 0
            )
        return [self.ngram_rate] * len(draft.tokens)

    def observe(self, draft: Draft, accepted: int) -> None:
        """Update hit rates from how many tokens of a verified draft matched."""
        if draft.source == "mtp":
            for j in range(min(len(draft.tokens), accepted + 1, len(self.mtp_rates))):
                hit = 1.0 if j < accepted else 0.0
                self.mtp_rates[j] = 0.9 * self.mtp_rates[j] + 0.1 * hit
        else:
            trials = min(len(draft.tokens), accepted + 1)
            rate = accepted / trials if trials else self.ngram_rate
            self.ngram_rate = 0.9 * self.ngram_rate + 0.1 * rate


def _expected(probs: list[float]) -> tuple[float, float]:
    expected, run = 0.0, 1.0
    for p in probs:
        run *= p
        expected += run
    return expected, run


def _cumulative(rates: list[float]) -> list[float]:
    out, total, run = [], 0.0, 1.0
    for r in rates:
        run *= r
        total += run
        out.append(total)
    return out
