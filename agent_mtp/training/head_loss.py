"""The student's output head and hard-teacher cross-entropy, fused and chunked.

The plain path materialises the student's logits ([slots, vocabulary], 49k columns here), casts them to fp32 for the
cross-entropy, and in the backward pass materialises the same-sized gradient and casts it back (2 x slots x 49k x 4
bytes at peak: 0.3 GB at 768 slots). The student's argmax is needed
before the targets exist (the teacher reads the student's block), so the work splits in two:

1. :func:`head_statistics`, rows in chunks, no [slots, V] tensor kept: logits of the chunk in the head's dtype, their
   log-sum-exp and argmax in fp32, and, when the hidden states need a gradient, the softmax-weighted mix of the head's
   rows ``E[w] = softmax(logits) @ W`` (the gradient of the log-sum-exp, computed while the chunk is hot);
2. the cross-entropy against targets known later: ``CE = lse - h . W[target]``; its gradient is
   ``E[w] - W[target]`` per row, the first term from step 1, the second by autograd through a gather of W's rows.

Same products as the plain path (the forward matmul and the backward's input-gradient matmul), no vocabulary-wide
copies. The mask token's row takes part in the log-sum-exp (as in the plain cross-entropy) and never in the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agent_mtp.errors import TrainingError

CPU_CHUNK = 128
"""Rows per chunk on a CPU: [128, 49k] fp32 logits (25 MB) stay near the cache."""
GPU_CHUNK = 2048
"""Rows per chunk on an accelerator: fewer, larger kernels (400 MB of fp32 logits at a 49k vocabulary)."""


@dataclass(frozen=True)
class HeadStatistics:
    lse: torch.Tensor
    """[N] fp32 log-sum-exp of each row's logits; differentiable with respect to the hidden states."""
    argmax: torch.Tensor
    """[N] argmax over the vocabulary without the mask token."""


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, mask_token_id: int, chunk: int, with_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        argmax = torch.empty(rows, dtype=torch.long, device=hidden.device)
        mixed = torch.empty_like(hidden, dtype=weight.dtype) if with_grad else None
        h = hidden.to(weight.dtype)
        for start in range(0, rows, chunk):
            part = slice(start, min(rows, start + chunk))
            logits = (h[part] @ weight.T).float()
            argmax[part] = argmax_without_mask(logits, mask_token_id)
            lse[part] = torch.logsumexp(logits, -1)
            if mixed is not None:
                probs = logits.sub_(lse[part, None]).exp_()  # in place: the chunk's logits are done
                mixed[part] = probs.to(weight.dtype) @ weight
        if mixed is not None:
            ctx.save_for_backward(mixed)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(argmax)
        return lse, argmax

    @staticmethod
    def backward(ctx: Any, grad_lse: torch.Tensor, _grad_argmax: torch.Tensor) -> tuple[Any, ...]:
        (mixed,) = ctx.saved_tensors
        grad = mixed.float() * grad_lse[:, None]
        return grad.to(ctx.hidden_dtype), None, None, None, None


def head_statistics(
    hidden: torch.Tensor, weight: torch.Tensor, *, mask_token_id: int, chunk: int | None = None
) -> HeadStatistics:
    """Log-sum-exp and argmax of ``hidden @ weight.T`` ([N, H] x [V, H]) row chunk by row chunk, in ``weight``'s
    dtype (fp32 accumulation, fp32 softmax). Gradient flows to ``hidden`` only (the head is frozen). ``chunk``:
    rows per chunk (default by device: ``CPU_CHUNK`` or ``GPU_CHUNK``)."""
    if chunk is None:
        chunk = CPU_CHUNK if hidden.device.type == "cpu" else GPU_CHUNK
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise TrainingError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: need [N, H] and [V, H].")
    if chunk < 1:
        raise TrainingError(f"chunk={chunk}: use at least 1 row per chunk.")
    with_grad = torch.is_grad_enabled() and hidden.requires_grad
    lse, argmax = _LogSumExp.apply(hidden, weight.detach(), mask_token_id, chunk, with_grad)
    return HeadStatistics(lse=lse, argmax=argmax)


def head_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, stats: HeadStatistics, target: torch.Tensor
) -> torch.Tensor:
    """[N] cross-entropy of the logits ``hidden @ weight.T`` against ``target`` (from :func:`head_statistics`)."""
    picked = weight.detach()[target]  # [N, H]
    dot = (hidden.to(weight.dtype).float() * picked.float()).sum(-1)
    target_logit = dot.to(weight.dtype).float()  # rounded like the head's matmul output, so CE >= 0 as in the lse
    return stats.lse - target_logit


def argmax_without_mask(logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Argmax over the last dimension that never picks the mask token (its row may exist in a tied lm_head). No copy
    when the mask token is the last row (the usual case: ``<mask>`` is added at the end of the vocabulary)."""
    if mask_token_id == logits.shape[-1] - 1:
        return logits[..., :-1].argmax(-1)
    if 0 <= mask_token_id < logits.shape[-1]:
        logits = logits.clone()
        logits[..., mask_token_id] = float("-inf")
    return logits.argmax(-1)
