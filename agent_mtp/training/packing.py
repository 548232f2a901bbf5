"""Packed MTP regions: several (prefix, masks) regions of several documents in one training sequence.

Layout of one packed sequence: all real tokens first (documents back to back), then the mask slots region by region::

    real:  d0 d0 d0 d0 d1 d1 d1        real token i sees real j  iff  same document and j <= i
    masks: r0m1 r0m2 r1m1 r1m2 r1m3    mask (r, j) sees the real tokens of its document up to its anchor, and the
                                       masks (r, 1..j) of its own region

A region's anchor is the last real token of its prefix: its logits predict token 1 (NTP), mask j predicts token
j + 1 and gets the position id ``pos(anchor) + j`` it would have at inference (the decode convention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Region:
    anchor: int
    """Index (in the packed real tokens) of the last real token of the prefix."""
    n_masks: int
    """k - 1: mask slots appended for this region."""


@dataclass(frozen=True)
class PackedSequence:
    """Real tokens of one or more documents plus the regions trained on them."""

    ids: torch.Tensor  # [L] real token ids
    doc_ids: torch.Tensor  # [L] document index of each real token
    positions: torch.Tensor  # [L] position ids of the real tokens (restart at 0 per document)
    regions: tuple[Region, ...]
    sources: tuple[tuple[int, ...], ...] = ()
    """Per document, the whole record it was cut from (the document is a prefix of it); empty when unknown. Lets the
    real-token pass be read from a per-record cache (``training/real_cache.py``)."""

    @property
    def n_real(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_masks(self) -> int:
        return sum(r.n_masks for r in self.regions)

    @property
    def lengths(self) -> list[int]:
        """Tokens of each document in this sequence."""
        return torch.bincount(self.doc_ids, minlength=len(self.sources)).tolist()


def pack_documents(
    docs: Sequence[Sequence[int]], regions: Sequence[Region], *, sources: Sequence[Sequence[int]] | None = None
) -> PackedSequence:
    """Concatenate ``docs``; ``regions`` index into the concatenation (validated: anchors inside, >= 1 mask).
    ``sources``: the whole record each document was cut from (each document must be a prefix of its source)."""
    ids = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    doc_ids = torch.cat([torch.full((len(d),), i, dtype=torch.long) for i, d in enumerate(docs)])
    positions = torch.cat([torch.arange(len(d), dtype=torch.long) for d in docs])
    for r in regions:
        if not 0 <= r.anchor < len(ids) or r.n_masks < 1:
            raise ValueError(f"bad region {r}: anchor must be in [0, {len(ids)}) and n_masks >= 1")
    full: tuple[tuple[int, ...], ...] = ()
    if sources is not None:
        full = tuple(tuple(s) for s in sources)
        if len(full) != len(docs):
            raise ValueError(f"sources: {len(full)} given for {len(docs)} documents; give one per document")
        bad = [i for i, (d, s) in enumerate(zip(docs, full, strict=True)) if tuple(d) != s[: len(d)]]
        if bad:
            raise ValueError(f"sources: document {bad[0]} is not a prefix of its source record")
    return PackedSequence(ids, doc_ids, positions, tuple(regions), full)


def slot_index(seq: PackedSequence) -> tuple[torch.Tensor, torch.Tensor]:
    """For every mask slot in packed order: (region index, j) with j = 1..n_masks."""
    region = torch.cat([torch.full((r.n_masks,), i, dtype=torch.long) for i, r in enumerate(seq.regions)])
    j = torch.cat([torch.arange(1, r.n_masks + 1, dtype=torch.long) for r in seq.regions])
    return region, j


def anchors(seq: PackedSequence) -> torch.Tensor:
    return torch.tensor([r.anchor for r in seq.regions], dtype=torch.long)


def mask_positions(seq: PackedSequence) -> torch.Tensor:
    """[M] position id of each mask slot: position of its anchor + j."""
    region, j = slot_index(seq)
    return seq.positions[anchors(seq)[region]] + j


def packed_positions(seq: PackedSequence) -> torch.Tensor:
    """[L + M] position ids of the whole packed sequence."""
    return torch.cat([seq.positions, mask_positions(seq)])


def packed_attention(seq: PackedSequence) -> torch.Tensor:
    """[L + M, L + M] bool, True = may attend (rows are queries)."""
    n_real, n_masks = seq.n_real, seq.n_masks
    total = n_real + n_masks
    allowed = torch.zeros(total, total, dtype=torch.bool)
    i = torch.arange(n_real)
    same_doc = seq.doc_ids[:, None] == seq.doc_ids[None, :]
    allowed[:n_real, :n_real] = same_doc & (i[None, :] <= i[:, None])
    allowed[n_real:] = mask_attention_rows(seq)
    return allowed


def mask_attention_rows(seq: PackedSequence) -> torch.Tensor:
    """[M, L + M] bool: the rows of :func:`packed_attention` for the mask slots (what the cached student pass uses)."""
    region, j = slot_index(seq)
    return slot_attention_rows(seq.doc_ids, anchors(seq)[region], region, j)


def slot_attention_rows(
    doc_ids: torch.Tensor, anchor: torch.Tensor, region: torch.Tensor, j: torch.Tensor
) -> torch.Tensor:
    """[S, L + S] bool for S slots appended after L cached real tokens: slot s sees the real tokens of its anchor's
    document up to ``anchor[s]`` and the appended slots of its own region with ``j <= j[s]``."""
    real = torch.arange(doc_ids.shape[0], device=anchor.device)
    doc = doc_ids.to(anchor.device)
    sees_real = (doc[None, :] == doc[anchor][:, None]) & (real[None, :] <= anchor[:, None])
    sees_slot = (region[None, :] == region[:, None]) & (j[None, :] <= j[:, None])  # [S, S]
    return torch.cat([sees_real, sees_slot], dim=1)


def as_4d(allowed: torch.Tensor) -> torch.Tensor:
    """[Q, K] bool -> [1, 1, Q, K] as transformers expects a custom mask (passed to SDPA untouched)."""
    return allowed[None, None]


def slot_weights(seq: PackedSequence, k_max: int, *, expected: bool) -> torch.Tensor:
    """[M] loss weight of each mask slot. ``expected``: slot j weighs (K - j) / K, the expectation over a random
    k per region (with causal attention inside a region, the first j masks compute the same logits whatever k is);
    otherwise every slot weighs 1 (k was already drawn per region)."""
    _, j = slot_index(seq)
    if not expected:
        return torch.ones(j.shape[0])
    return (k_max - j).clamp(min=0).float() / k_max
