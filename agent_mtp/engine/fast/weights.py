"""Weights prepared once for the fast runtime: fused, reordered and pre-packed GEMM operands.

On a CPU a plain ``F.linear`` over 2-16 rows costs 2-3x one row; the same weights pre-packed once for oneDNN cost
~1-1.5x (ARCHITECTURE.md section 5), which is what makes a multi-token pass nearly as cheap as a one-token pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 8
"""Rows oneDNN lays the packed weights out for: measured here, packing for 8 rows is as fast as the default at 1-4
rows and ~8% faster at 8 (a hint of 1 is ~1.5x slower everywhere)."""


def _can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear:
    """``y = x W^T + b`` with ``W`` pre-packed for oneDNN once (plain ``F.linear`` where oneDNN cannot run)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, prepack: bool = True) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.bias = bias.detach().contiguous() if bias is not None else None
        self.packed = prepack and _can_prepack(weight)
        dense = weight.detach().contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(dense, PACK_BATCH_HINT) if self.packed else dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] -> [n, out]."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class LowRank:
    """A gated adapter's delta for one fused GEMM: ``y[mask rows] += (x A^T) B^T`` (scale folded into ``B``).

    The LoRA factors of the GEMM's parts (q, k, v or gate, up) are stacked: ``A`` [sum r, in], and ``B`` is block
    diagonal [sum out, sum r], so one pair of small GEMMs serves the whole fused projection."""

    a_t: torch.Tensor  # [in, R]
    b_t: torch.Tensor  # [R, out]

    def apply(self, y: torch.Tensor, x: torch.Tensor, rows: slice | torch.Tensor) -> None:
        """Add the delta to ``y`` at ``rows`` (a slice: contiguous mask rows; a tensor: row indices), in place."""
        if isinstance(rows, slice):
            y[rows].addmm_(torch.mm(x[rows], self.a_t), self.b_t)
        else:
            y.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), self.a_t), self.b_t))


def stack_low_rank(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None], out_sizes: Sequence[int]
) -> LowRank | None:
    """Fuse the (A [r, in], B [out, r], scale) factors of the parts of one GEMM; None where no part has any."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    in_features = int(present[0][0].shape[1])
    total_rank = sum(int(p[0].shape[0]) for p in present)
    a = torch.zeros(total_rank, in_features, dtype=torch.float32)
    b = torch.zeros(sum(out_sizes), total_rank, dtype=torch.float32)
    r0, o0 = 0, 0
    for part, size in zip(parts, out_sizes, strict=True):
        if part is not None:
            lora_a, lora_b, scale = part
            r = int(lora_a.shape[0])
            a[r0 : r0 + r] = lora_a.detach().float()
            b[o0 : o0 + size, r0 : r0 + r] = lora_b.detach().float() * scale
            r0 += r
        o0 += size
    return LowRank(a.t().contiguous(), b.t().contiguous())


def rope_pair_order(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that puts the two halves HF's ``rotate_half`` pairs up (i, i + d/2) next to each other in every head,
    so RoPE becomes one complex multiply. q and k are reordered alike, so q . k (and attention) is unchanged."""
    half = head_dim // 2
    within = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)  # [d]: 0, d/2, 1, ...
    return (torch.arange(num_heads)[:, None] * head_dim + within[None, :]).reshape(-1)
