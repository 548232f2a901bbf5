"""Packed regions and the distillation loss on tiny random Llama models."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from agent_mtp.engine.adapter import MTPAdapter, new_adapter
from agent_mtp.training.objective import ObjectiveConfig, distill_full, distill_gated
from agent_mtp.training.packing import (
    PackedSequence,
    Region,
    mask_positions,
    pack_documents,
    packed_attention,
    packed_positions,
    slot_weights,
)

VOCAB = 64
MASK = 63


def tiny_model(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


def tiny_adapter(model: torch.nn.Module, seed: int = 1, rank: int = 4) -> MTPAdapter:
    adapter = new_adapter(model, base_model="tiny", mask_token="<mask>", mask_token_id=MASK, rank=rank, k_max_trained=4)
    torch.manual_seed(seed)
    with torch.no_grad():  # a non-identity adapter, so student != teacher
        for p in adapter.trainable_parameters():
            p.add_(0.3 * torch.randn_like(p))
    return adapter


def two_docs() -> PackedSequence:
    docs = [[5, 9, 14, 3, 22, 7], [11, 4, 30, 18, 2]]
    regions = [Region(2, 3), Region(4, 1), Region(6, 2), Region(9, 3)]  # region 2 and 3 live in document 1
    return pack_documents(docs, regions)


def test_positions_follow_the_decode_convention() -> None:
    seq = two_docs()
    assert seq.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    # anchor 2 (pos 2) -> masks at 3, 4, 5; anchor 4 -> 5; anchor 6 (doc 1, pos 0) -> 1, 2; anchor 9 (pos 3) -> 4, 5, 6
    assert mask_positions(seq).tolist() == [3, 4, 5, 5, 1, 2, 4, 5, 6]
    assert packed_positions(seq).shape[0] == seq.n_real + seq.n_masks


def test_attention_rules() -> None:
    seq = two_docs()
    allowed = packed_attention(seq)
    n = seq.n_real
    assert allowed[5, :6].all() and not allowed[5, 6:].any()  # doc 0 never sees doc 1
    assert allowed[6, 6] and not allowed[6, :6].any()
    row = allowed[n + 1]  # region 0, mask 2: reals 0..2 and masks 1..2 of region 0
    assert row.nonzero().squeeze(1).tolist() == [0, 1, 2, n, n + 1]
    row = allowed[n + 8]  # region 3, mask 3: doc 1 reals up to index 9, masks of region 3
    assert row.nonzero().squeeze(1).tolist() == [6, 7, 8, 9, n + 6, n + 7, n + 8]
    assert allowed.any(dim=1).all()  # no fully masked row (SDPA would give NaN)


def naive_region_logits(model: torch.nn.Module, docs: list[list[int]], seq: PackedSequence) -> torch.Tensor:
    """Each region on its own: its document's prefix + masks, ordinary causal attention."""
    starts = [0]
    for d in docs:
        starts.append(starts[-1] + len(d))
    out = []
    for r in seq.regions:
        doc = int(seq.doc_ids[r.anchor])
        prefix = docs[doc][: r.anchor - starts[doc] + 1]
        ids = torch.tensor([prefix + [MASK] * r.n_masks])
        with torch.no_grad():
            out.append(model(input_ids=ids).logits[0, len(prefix) :])
    return torch.cat(out)


def test_packed_student_equals_naive_per_region() -> None:
    model = tiny_model()
    adapter = tiny_adapter(model)
    docs = [[5, 9, 14, 3, 22, 7], [11, 4, 30, 18, 2]]
    seq = two_docs()
    expected = naive_region_logits(model, docs, seq)
    captured: list[torch.Tensor] = []
    # the final norm's output: the student pass computes its logits inside the fused head loss, not via lm_head
    handle = model.model.norm.register_forward_hook(lambda m, a, out: captured.append(out.detach()))
    distill_gated(model, adapter, seq, ObjectiveConfig(k_max=4), mask_token_id=MASK)
    handle.remove()
    with torch.no_grad():
        student = model.lm_head(captured[1][0])  # passes: real tokens, student (masks), teacher
    torch.testing.assert_close(student, expected, atol=1e-5, rtol=1e-5)
    # the full-sequence path lays out the same attention and positions
    ids = torch.cat([seq.ids, torch.full((seq.n_masks,), MASK)])[None]
    with torch.no_grad():
        full = model(
            input_ids=ids, attention_mask=packed_attention(seq)[None, None], position_ids=packed_positions(seq)[None]
        ).logits[0, seq.n_real :]
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-5)


def test_hard_loss_equals_hand_computed_value() -> None:
    model = tiny_model(seed=3)
    adapter = tiny_adapter(model, seed=4)
    docs = [[5, 9, 14, 3, 22, 7]]
    seq = pack_documents(docs, [Region(3, 2)])
    out = distill_gated(model, adapter, seq, ObjectiveConfig(k_max=4), mask_token_id=MASK)
    with torch.no_grad():
        prefix = docs[0][:4]
        s = model(input_ids=torch.tensor([[*prefix, MASK, MASK]])).logits[0]
        s[:, MASK] = float("-inf")
        y1, y2 = int(s[3].argmax()), int(s[4].argmax())  # the student's block: NTP token, then mask-1 draft
        with adapter.disabled():
            t = model(input_ids=torch.tensor([[*prefix, y1, y2]])).logits[0]
        t[:, MASK] = float("-inf")
        t2, t3 = int(t[4].argmax()), int(t[5].argmax())
        s = model(input_ids=torch.tensor([[*prefix, MASK, MASK]])).logits[0]
        ce1 = -F.log_softmax(s[4], -1)[t2]
        ce2 = -F.log_softmax(s[5], -1)[t3]
    w1, w2 = 3 / 4, 2 / 4  # (K - j) / K with K = 4
    expected = (w1 * ce1 + w2 * ce2) / (w1 + w2)
    assert float(out.loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert out.slots == 2


def test_slot_weights() -> None:
    seq = pack_documents([[1, 2, 3, 4]], [Region(1, 3)])
    assert slot_weights(seq, 4, expected=True).tolist() == [0.75, 0.5, 0.25]
    assert slot_weights(seq, 4, expected=False).tolist() == [1.0, 1.0, 1.0]


def test_gate_keeps_real_positions_exact_during_training() -> None:
    model = tiny_model(seed=5)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    adapter = tiny_adapter(model, seed=6)
    opt = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2)
    seq = pack_documents([ids[0].tolist()], [Region(2, 3), Region(4, 2)])
    for _ in range(3):
        out = distill_gated(model, adapter, seq, ObjectiveConfig(k_max=4), mask_token_id=MASK)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    with torch.no_grad():
        after = model(input_ids=ids).logits
        with_masks = torch.cat([ids, torch.tensor([[MASK, MASK]])], 1)
        mixed = model(input_ids=with_masks).logits[:, : ids.shape[1]]
        with adapter.disabled():
            base_mixed = model(input_ids=with_masks).logits[:, : ids.shape[1]]
    assert torch.equal(before, after)
    assert torch.equal(mixed, base_mixed)  # masks after the real tokens do not change them either


@pytest.mark.parametrize("teacher,slots", [("soft", "all"), ("hard", "prefix")])
def test_options_give_finite_losses_with_gradients(teacher: str, slots: str) -> None:
    model = tiny_model(seed=7)
    adapter = tiny_adapter(model, seed=8)
    seq = two_docs()
    cfg = ObjectiveConfig(k_max=4, teacher=teacher, slots=slots)  # type: ignore[arg-type]
    out = distill_gated(model, adapter, seq, cfg, mask_token_id=MASK)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert adapter.mask_embedding.grad is not None


def test_full_fine_tune_path_trains_student_only() -> None:
    student, teacher = tiny_model(seed=9), tiny_model(seed=9)
    student.requires_grad_(True)
    seq = two_docs()
    out = distill_full(student, teacher, seq, ObjectiveConfig(k_max=4, bf16=True), mask_token_id=MASK)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert student.model.embed_tokens.weight.grad is not None
    assert all(p.grad is None for p in teacher.parameters())


def _greedy_doc(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            logits[MASK] = float("-inf")
            ids.append(int(logits.argmax()))
    return ids


@pytest.mark.parametrize("teacher", ["hard", "soft"])
@pytest.mark.parametrize("data", ["greedy", "random"])
def test_reusing_the_real_pass_gives_the_reference_targets(data: str, teacher: str) -> None:
    model = tiny_model(seed=11)
    adapter = tiny_adapter(model, seed=12)
    with adapter.disabled():
        doc = _greedy_doc(model, [5, 9, 14], 14)
    if data == "random":
        doc = torch.randint(0, MASK, (17,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = pack_documents([doc, doc[:9]], [Region(2, 3), Region(5, 3), Region(9, 2), Region(14, 3), Region(19, 3)])
    cfg = ObjectiveConfig(k_max=4, teacher=teacher)  # type: ignore[arg-type]
    fast = distill_gated(model, adapter, seq, cfg, mask_token_id=MASK)
    ref = distill_gated(model, adapter, seq, replace(cfg, reuse_real_pass=False), mask_token_id=MASK)
    torch.testing.assert_close(fast.loss, ref.loss, atol=1e-5, rtol=1e-5)  # soft: the teacher's whole distribution
    assert torch.equal(fast.agree, ref.agree)
    assert ref.teacher_slots == seq.n_masks
    assert fast.teacher_slots is not None
    if data == "greedy":  # y'_1 is the NTP token = the document's next token, so every first slot is skipped
        assert fast.teacher_slots <= seq.n_masks - len(seq.regions)


def test_a_block_that_follows_the_data_needs_no_teacher_pass() -> None:
    model = tiny_model(seed=13)
    adapter = tiny_adapter(model, seed=14)
    prefix = [5, 9, 14, 3]
    with torch.no_grad():
        with adapter.disabled():
            ntp = _greedy_doc(model, prefix, 1)[-1]
        drafts = model(input_ids=torch.tensor([[*prefix, MASK, MASK, MASK]])).logits[0, len(prefix) :]
        drafts[:, MASK] = float("-inf")
    doc = [*prefix, ntp, *drafts.argmax(-1).tolist(), 7]  # the student's own block is the data
    seq = pack_documents([doc], [Region(len(prefix) - 1, 3)])
    fast = distill_gated(model, adapter, seq, ObjectiveConfig(k_max=4), mask_token_id=MASK)
    ref = distill_gated(model, adapter, seq, ObjectiveConfig(k_max=4, reuse_real_pass=False), mask_token_id=MASK)
    assert fast.teacher_slots == 0
    torch.testing.assert_close(fast.loss, ref.loss, atol=1e-5, rtol=1e-5)
