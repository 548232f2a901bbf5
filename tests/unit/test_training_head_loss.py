"""The fused, chunked head cross-entropy equals the plain logits -> cross-entropy path (values and gradients)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from agent_mtp.errors import TrainingError
from agent_mtp.training.head_loss import head_cross_entropy, head_statistics


def _plain(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, mask_token_id: int) -> tuple[Any, ...]:
    logits = (hidden.to(weight.dtype) @ weight.T).float()
    ce = F.cross_entropy(logits, target, reduction="none")
    masked = logits.detach().clone()
    masked[:, mask_token_id] = float("-inf")
    return ce, masked.argmax(-1)


@pytest.mark.parametrize("mask_token_id", [39, 7])  # the last row (usual) and a row inside the vocabulary
@pytest.mark.parametrize("chunk", [3, 128])  # chunk boundaries inside the rows, and one chunk
def test_fused_equals_plain_in_fp32(mask_token_id: int, chunk: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 16)
    weight[mask_token_id] += 3.0  # the mask row would win the argmax if it were not excluded
    hidden_plain = torch.randn(11, 16, requires_grad=True)
    hidden_fused = hidden_plain.detach().clone().requires_grad_(True)
    target = torch.randint(0, 39, (11,))
    slot_weight = torch.rand(11)

    ce_plain, argmax_plain = _plain(hidden_plain, weight, target, mask_token_id)
    stats = head_statistics(hidden_fused, weight, mask_token_id=mask_token_id, chunk=chunk)
    ce_fused = head_cross_entropy(hidden_fused, weight, stats, target)

    torch.testing.assert_close(ce_fused, ce_plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(stats.argmax, argmax_plain)
    assert not bool((stats.argmax == mask_token_id).any())
    (ce_plain * slot_weight).sum().backward()
    (ce_fused * slot_weight).sum().backward()
    assert hidden_plain.grad is not None and hidden_fused.grad is not None
    torch.testing.assert_close(hidden_fused.grad, hidden_plain.grad, atol=1e-5, rtol=1e-5)


def test_fused_bf16_head_matches_plain_bf16_path() -> None:
    """A bf16 head (the training twin's): same argmax, CE within bf16 rounding, gradient close, gradient in the
    hidden states' dtype, and CE never below zero."""
    torch.manual_seed(1)
    weight = torch.randn(300, 32).to(torch.bfloat16)
    hidden_plain = torch.randn(20, 32, dtype=torch.bfloat16, requires_grad=True)
    hidden_fused = hidden_plain.detach().clone().requires_grad_(True)
    target = torch.randint(0, 299, (20,))
    ce_plain, argmax_plain = _plain(hidden_plain, weight, target, 299)
    stats = head_statistics(hidden_fused, weight, mask_token_id=299, chunk=8)
    ce_fused = head_cross_entropy(hidden_fused, weight, stats, target)
    assert torch.equal(stats.argmax, argmax_plain)
    torch.testing.assert_close(ce_fused, ce_plain, atol=0.1, rtol=0.02)
    assert bool((ce_fused >= -1e-6).all())
    ce_plain.sum().backward()
    ce_fused.sum().backward()
    assert hidden_fused.grad is not None and hidden_fused.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hidden_fused.grad.float(), hidden_plain.grad.float(), atol=0.05, rtol=0.05)


def test_no_gradient_pass_keeps_nothing_for_backward() -> None:
    weight, hidden = torch.randn(10, 4), torch.randn(5, 4, requires_grad=True)
    with torch.no_grad():
        stats = head_statistics(hidden, weight, mask_token_id=9)
    assert not stats.lse.requires_grad
    torch.testing.assert_close(stats.lse, torch.logsumexp(hidden.detach() @ weight.T, -1))


def test_bad_shapes_and_chunk_are_clear_errors() -> None:
    with pytest.raises(TrainingError, match=r"need \[N, H\] and \[V, H\]"):
        head_statistics(torch.randn(5, 4), torch.randn(10, 3), mask_token_id=9)
    with pytest.raises(TrainingError, match="chunk=0"):
        head_statistics(torch.randn(5, 4), torch.randn(10, 4), mask_token_id=9, chunk=0)
