"""Attention for passes of packed MTP slots: real keys dense, slot keys only inside the slot's own region.

A student or teacher pass appends S slots to L cached real tokens. Each slot sees a prefix of its document's real
tokens and at most k_max - 1 slots of its own region, so the dense [S, L + S] mask that SDPA receives is mostly
masked in its [S, S] part (with hundreds of regions per step, most of the keys a dense kernel scores are thrown away,
forward and backward). This attention scores the L real keys densely with an additive mask and the slot keys only in
a band of width W = k_max - 1 below the diagonal, with one softmax over both: the same attention, in
O(S * (L + W)) instead of O(S * (L + S)).

It is registered with transformers' ``AttentionInterface`` as ``agent_mtp_slots``; a model switched to it
(:func:`use_slot_attention`) runs plain SDPA in every pass without an active :func:`slot_layout`, so evaluation and
decoding are untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

ATTENTION_NAME = "agent_mtp_slots"


@dataclass(frozen=True)
class SlotLayout:
    n_real: int
    real_bias: torch.Tensor
    """[S, L] float32: 0 where slot s may see real token l, -inf elsewhere."""
    band_index: torch.Tensor
    """[S, W] long: index (among the S slots) of the key at band offset w (s - w, clamped at 0)."""
    band_bias: torch.Tensor
    """[S, W] float32: 0 where that key is visible, -inf elsewhere."""
    blocks: tuple[tuple[int, int, int, int], ...] = ()
    """(s0, s1, l0, l1): slots s0..s1-1 see no real key outside l0..l1-1 (their document's prefix), so each block
    scores only those keys. Empty: one block of all slots and all real keys."""

    @classmethod
    def from_rows(cls, rows: torch.Tensor, n_real: int) -> SlotLayout | None:
        """Layout of a [S, L + S] bool mask, or None when the slot part is not a band below the diagonal."""
        slots = rows[:, n_real:]
        n = slots.shape[0]
        s = torch.arange(n, device=rows.device)
        offset = s[:, None] - s[None, :]  # [S, S] query - key
        if bool((slots & (offset < 0)).any()):
            return None
        width = int(offset[slots].max()) + 1 if bool(slots.any()) else 1
        w = torch.arange(width, device=rows.device)
        band_index = (s[:, None] - w[None, :]).clamp(min=0)
        visible = slots.gather(1, band_index) & (s[:, None] - w[None, :] >= 0)
        zero = torch.zeros((), device=rows.device)
        return cls(
            n_real=n_real,
            real_bias=torch.where(rows[:, :n_real], zero, float("-inf")),
            band_index=band_index,
            band_bias=torch.where(visible, zero, float("-inf")),
            blocks=_document_blocks(rows[:, :n_real]),
        )


MAX_BLOCKS = 32


def _document_blocks(real: torch.Tensor) -> tuple[tuple[int, int, int, int], ...]:
    """Runs of consecutive slots whose first visible real key is the same (one document's slots, since regions are
    packed in order), each with the real-key range its slots can see. Packed documents make the [S, L] real part
    block-diagonal: a slot sees only its own document's prefix, a small share of L. Falls back to one block when
    the layout has more than ``MAX_BLOCKS`` runs."""
    n_slots, n_real = real.shape
    if n_slots == 0 or n_real == 0:
        return ()
    seen = real.any(1)
    index = torch.arange(n_real, device=real.device)
    first = torch.where(real, index, n_real).amin(1)
    last = torch.where(real, index, -1).amax(1)
    first = torch.where(seen, first, -1)  # slots that see no real key form runs with an empty key range
    starts = [0] + [int(s) for s in (first[1:] != first[:-1]).nonzero().squeeze(1).add(1).tolist()]
    if len(starts) > MAX_BLOCKS:
        return ()
    blocks = []
    for s0, s1 in zip(starts, [*starts[1:], n_slots], strict=True):
        l0 = int(first[s0])  # the same for every slot of the run
        blocks.append((s0, s1, 0, 0) if l0 < 0 else (s0, s1, l0, int(last[s0:s1].max()) + 1))
    return tuple(blocks)


_LAYOUT: ContextVar[SlotLayout | None] = ContextVar("agent_mtp_slot_layout", default=None)


@contextmanager
def slot_layout(rows: torch.Tensor, n_real: int, *, enabled: bool = True) -> Iterator[None]:
    """Run the enclosed forward with banded slot attention (for models switched by :func:`use_slot_attention`);
    ``enabled=False`` runs it with dense SDPA (the reference)."""
    token = _LAYOUT.set(SlotLayout.from_rows(rows, n_real) if enabled else None)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def slot_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: banded slot attention when a matching layout is active, else SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = _LAYOUT.get()
    n_slots = query.shape[2]
    if (
        layout is None
        or query.shape[0] != 1
        or layout.band_index.shape[0] != n_slots
        or key.shape[2] != layout.n_real + n_slots
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _banded(query, key, value, layout, scale), None


def _banded(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SlotLayout, scale: float
) -> torch.Tensor:
    """[1, S, H, D] attention output; query [1, H, S, D], key/value [1, KVH, L + S, D] (grouped-query heads).

    Scores stay in the activations' dtype (matmuls accumulate in fp32; the softmax kernel computes in fp32) and the
    scale is applied to the queries, which keeps the elementwise work on [S, L] scores to one add and one softmax.
    """
    _, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    n_real = layout.n_real
    q = (query * scale).reshape(1, kv_heads, group, n, dim)
    k_real, v_real = key[:, :, :n_real], value[:, :, :n_real]
    k_band = key[:, :, n_real:][:, :, layout.band_index]  # [1, KVH, S, W, D]
    v_band = value[:, :, n_real:][:, :, layout.band_index]
    real_bias, band_bias = layout.real_bias.to(query.dtype), layout.band_bias.to(query.dtype)
    parts = []
    for s0, s1, l0, l1 in layout.blocks or ((0, n, 0, n_real),):
        parts.append(
            _block(
                q[:, :, :, s0:s1],
                (k_real[:, :, l0:l1], v_real[:, :, l0:l1], real_bias[s0:s1, l0:l1]),
                (k_band[:, :, s0:s1], v_band[:, :, s0:s1], band_bias[s0:s1]),
            )
        )
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 3)  # [1, KVH, G, S, D]
    return out.reshape(1, heads, n, dim).transpose(1, 2).contiguous()


def _block(
    q: torch.Tensor,
    real: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    band: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """[1, KVH, G, s, D]: one block of slots over its real keys (dense, additive bias) and its band keys, one
    softmax over both."""
    _, kv_heads, group, n, dim = q.shape
    k_real, v_real, real_bias = real
    k_band, v_band, band_bias = band
    n_keys = k_real.shape[2]
    s_real = (q.reshape(1, kv_heads, group * n, dim) @ k_real.transpose(-1, -2)).view(1, kv_heads, group, n, n_keys)
    s_band = torch.einsum("bkgsd,bkswd->bkgsw", q, k_band)
    p = torch.cat([s_real + real_bias, s_band + band_bias], -1).softmax(-1)
    out = (p[..., :n_keys].reshape(1, kv_heads, group * n, n_keys) @ v_real).view(1, kv_heads, group, n, dim)
    return out + torch.einsum("bkgsw,bkswd->bkgsd", p[..., n_keys:], v_band)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, slot_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def use_slot_attention(model: Any) -> None:
    """Switch ``model`` (a transformers model with SDPA attention) to banded slot attention for training passes."""
    _register()
    model.set_attn_implementation(ATTENTION_NAME)
