"""Draft sources for verified decoding, behind one small protocol (in the spirit of CandidateGenerator).

A draft is a list of proposed next tokens plus a score: the expected number of them the NTP path will accept.
Each pass the decode loop asks every enabled source, verifies the best-scoring draft for free in the next forward
pass, and reports back how many tokens of it were accepted (``update``), so sources learn their own hit rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    source: str
    score: float
    """Expected accepted tokens (the selection criterion)."""
    confidences: tuple[float, ...] = ()
    """The model's top-1 probability per token (MTP drafts)."""
    match: int = 0
    """Prompt-lookup drafts: how many context tokens the match covered (a one-token match is a weak signal)."""


class DraftSource(Protocol):
    name: str

    def propose(self, context: list[int], max_len: int) -> Draft | None:
        """Propose up to ``max_len`` tokens that follow ``context`` (prompt + output so far)."""
        ...

    def update(self, draft: Draft, accepted: int) -> None:
        """Learn from how many tokens of ``draft`` the model accepted."""
        ...


@dataclass
class HitRate:
    """Running estimate of P(draft token accepted | previous accepted), with a prior."""

    accepted: float = 1.0
    proposed: float = 2.0

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed

    def update(self, proposed_positions: int, accepted: int) -> None:
        # Each position up to the first rejection is one Bernoulli trial.
        trials = min(proposed_positions, accepted + 1)
        self.accepted = 0.98 * self.accepted + accepted
        self.proposed = 0.98 * self.proposed + trials


@dataclass
class NgramDraftSource:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n = max..1) and propose
    what followed it. Training-free; agents copy names, ids and tool results all the time."""

    ngram_max: int = 3
    draft_len: int = 10
    name: str = "ngram"
    hits: HitRate = field(default_factory=HitRate)

    def propose(self, context: list[int], max_len: int) -> Draft | None:
        length = min(self.draft_len, max_len)
        if length < 1:
            return None
        for n in range(min(self.ngram_max, len(context) - 1), 0, -1):
            tokens = _lookup(context, n, length)
            if tokens:
                score = _geometric_sum(self.hits.rate, len(tokens))
                return Draft(tuple(tokens), self.name, score, match=n)
        return None

    def update(self, draft: Draft, accepted: int) -> None:
        self.hits.update(len(draft.tokens), accepted)


def _lookup(context: list[int], n: int, length: int) -> list[int]:
    """Tokens after the most recent earlier match of context[-n:] (excluding the suffix itself)."""
    suffix = context[-n:]
    for start in range(len(context) - n - 1, -1, -1):
        if context[start : start + n] == suffix:
            follow = context[start + n : start + n + length]
            if follow:
                return follow
    return []


def _geometric_sum(rate: float, length: int) -> float:
    return sum(rate**i for i in range(1, length + 1))


@dataclass
class MTPDraftSource:
    """The mask predictions of the previous pass (tokens 2..k of its block), scored by their confidences."""

    name: str = "mtp"
    pending: Draft | None = None

    def offer(self, tokens: list[int], confidences: list[float]) -> None:
        """Store the block the masks just predicted; it is only valid right after the pass that made it."""
        self.pending = (
            Draft(tuple(tokens), self.name, _chain_score(confidences), tuple(confidences)) if tokens else None
        )

    def advance(self, tokens: list[int]) -> None:
        """``tokens`` joined the sequence without a pass (the grammar forced them): the pending block stays valid
        past them if it predicted them (its rest is the next draft), else it is dropped."""
        draft, n = self.pending, len(tokens)
        if draft is None or n == 0:
            return
        if len(draft.tokens) <= n or list(draft.tokens[:n]) != tokens:
            self.pending = None
            return
        confidences = draft.confidences[n:]
        self.pending = Draft(draft.tokens[n:], self.name, _chain_score(confidences), confidences)

    def propose(self, context: list[int], max_len: int) -> Draft | None:
        draft, self.pending = self.pending, None
        if draft is None or max_len < 1:
            return None
        if len(draft.tokens) > max_len:
            draft = Draft(draft.tokens[:max_len], draft.source, draft.score, draft.confidences[:max_len])
        return draft

    def update(self, draft: Draft, accepted: int) -> None:
        return None


def _chain_score(confidences: Sequence[float]) -> float:
    """Expected accepted tokens of a block whose token i is right with probability ``confidences[i]`` given the
    ones before it."""
    score, run = 0.0, 1.0
    for c in confidences:
        run *= c
        score += run
    return score


def choose_draft(candidates: list[Draft | None]) -> Draft | None:
    """The draft expected to pay most; ties go to the longer one."""
    real = [d for d in candidates if d is not None and d.tokens]
    if not real:
        return None
    return max(real, key=lambda d: (d.score, len(d.tokens)))
