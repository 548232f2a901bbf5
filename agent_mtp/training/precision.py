"""Low-precision training twin: the frozen base weights in bf16, the adapter's fp32 master parameters shared.

On CPUs with AVX512-BF16 or AMX (and on GPUs) bf16 matmuls run 2-3x faster than fp32, and autocast alone gains
little on a CPU because it casts every weight on every forward. The twin is a bf16 copy of the base model made once;
the adapter attached to it uses the *same* ``nn.Parameter`` objects as the fp32 adapter (the LoRA layers cast them
to the activations' dtype on the fly), so the optimizer, checkpoints and the fp32 evaluation engine see one set of
weights. The twin's output head stays exact for the targets: passes without gradient (the real-token pass and the
teacher) compute logits with the fp32 head, so the teacher's argmax never suffers from bf16 rounding of logits; the
student's pass (with gradient) uses a bf16 head.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agent_mtp.engine.adapter import MTPAdapter


class ExactTargetHead(nn.Module):
    """Output head: fp32 weight when no gradient is recorded (targets), low-precision weight otherwise (student)."""

    def __init__(self, exact: torch.Tensor, low: torch.Tensor) -> None:
        super().__init__()
        self.exact = exact  # shared with the fp32 model: no copy
        self.low = low

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return F.linear(hidden.to(self.low.dtype), self.low)
        return F.linear(hidden.to(self.exact.dtype), self.exact)


def low_precision_twin(
    model: Any, adapter: MTPAdapter, *, mask_token_id: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[Any, MTPAdapter]:
    """A ``dtype`` copy of ``model``'s base weights running ``adapter``'s parameters (shared, not copied)."""
    adapter.detach(model)
    try:
        twin = copy.deepcopy(model)
    finally:
        adapter.attach(model, mask_token_id)
    exact = model.get_output_embeddings().weight
    twin.to(dtype)
    twin.set_output_embeddings(ExactTargetHead(exact.detach(), twin.get_output_embeddings().weight.detach()))
    twin_adapter = MTPAdapter(adapter.config, adapter.mask_embedding.detach())
    twin_adapter.attach(twin, mask_token_id)
    twin_adapter.mask_embedding = adapter.mask_embedding
    mine = adapter.layers()
    for key, layer in twin_adapter.layers().items():
        layer.lora_A, layer.lora_B = mine[key].lora_A, mine[key].lora_B
    return twin, twin_adapter
