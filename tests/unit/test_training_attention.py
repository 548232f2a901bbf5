"""Banded slot attention equals dense SDPA with the packed mask: logits, loss and gradients."""

from __future__ import annotations

import pytest
import torch

from agent_mtp.training.attention import MAX_BLOCKS, SlotLayout, use_slot_attention
from agent_mtp.training.objective import ObjectiveConfig, distill_gated
from agent_mtp.training.packing import Region, mask_attention_rows, pack_documents
from tests.unit.test_training_objective import MASK, tiny_adapter, tiny_model


def _seq() -> object:
    docs = [[5, 9, 14, 3, 22, 7, 11, 40, 2], [2, 8, 33, 17, 6, 1]]
    return pack_documents(docs, [Region(1, 3), Region(3, 3), Region(4, 1), Region(7, 2), Region(10, 3), Region(12, 3)])


def _step(slot_attention: bool, teacher: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = tiny_model(seed=31)
    adapter = tiny_adapter(model, seed=32)
    if slot_attention:
        use_slot_attention(model)
    cfg = ObjectiveConfig(k_max=4, teacher=teacher)  # type: ignore[arg-type]
    out = distill_gated(model, adapter, _seq(), cfg, mask_token_id=MASK)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in adapter.trainable_parameters() if p.grad is not None]


@pytest.mark.parametrize("teacher", ["soft", "hard"])  # the full-logits path and the fused head loss
def test_banded_attention_matches_dense_sdpa_loss_and_gradients(teacher: str) -> None:
    dense_loss, dense_grads = _step(False, teacher)
    band_loss, band_grads = _step(True, teacher)
    torch.testing.assert_close(band_loss, dense_loss, atol=1e-5, rtol=1e-5)
    assert len(band_grads) == len(dense_grads) > 0
    for a, b in zip(band_grads, dense_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_layout_of_packed_rows_is_a_band_of_the_region_width() -> None:
    seq = _seq()
    rows = mask_attention_rows(seq)  # type: ignore[arg-type]
    layout = SlotLayout.from_rows(rows, seq.n_real)  # type: ignore[attr-defined]
    assert layout is not None
    assert layout.band_index.shape == (seq.n_masks, 3)  # type: ignore[attr-defined]
    visible = torch.isfinite(layout.band_bias).sum(1).tolist()
    assert visible == [1, 2, 3, 1, 2, 3, 1, 1, 2, 1, 2, 3, 1, 2, 3]  # j of each slot: itself and earlier slots
    # one block per document: its slots and the real keys up to its last anchor (document 2 starts at token 9)
    assert layout.blocks == ((0, 9, 0, 8), (9, 15, 9, 13))  # type: ignore[attr-defined]


def test_too_many_document_blocks_fall_back_to_one_dense_block() -> None:
    n = MAX_BLOCKS + 2
    real = torch.zeros(n, n, dtype=torch.bool)
    real[torch.arange(n), torch.arange(n)] = True  # every slot sees a different single key: n runs
    rows = torch.cat([real, torch.eye(n, dtype=torch.bool)], 1)
    layout = SlotLayout.from_rows(rows, n)
    assert layout is not None and layout.blocks == ()


def test_a_mask_that_is_not_a_band_falls_back() -> None:
    rows = torch.ones(3, 5, dtype=torch.bool)  # slot 0 sees slot 2 (a later one): not a band below the diagonal
    assert SlotLayout.from_rows(rows, 2) is None


def test_document_blocks_cover_each_run_of_slots_with_its_visible_keys() -> None:
    real = torch.tensor(
        [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool
    )  # document A (keys 0-1), a slot that sees no real key, document B (keys 2-3)
    rows = torch.cat([real, torch.eye(5, dtype=torch.bool)], 1)
    layout = SlotLayout.from_rows(rows, 4)
    assert layout is not None
    assert layout.blocks == ((0, 2, 0, 2), (2, 3, 0, 0), (3, 5, 2, 4))
