"""The per-record real-pass cache: same step as running the real tokens, prefixes, disk, budget, model identity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agent_mtp.engine.adapter import MTPAdapter
from agent_mtp.errors import TrainingError
from agent_mtp.training.objective import ObjectiveConfig, StepOutput, distill_gated
from agent_mtp.training.packing import PackedSequence, Region, pack_documents
from agent_mtp.training.precision import low_precision_twin
from agent_mtp.training.real_cache import RealPassStore
from tests.unit.test_training_objective import MASK, tiny_adapter, tiny_model

RECORDS = [[5, 9, 14, 3, 22, 7, 40, 12], [11, 4, 30, 18, 2, 50], [8, 8, 21, 33, 6, 17, 25]]


def packed(order: tuple[int, ...] = (0, 1, 2), cut_last: int = 0) -> PackedSequence:
    """The records in ``order``, the last one cut short by ``cut_last`` tokens, with regions in every document."""
    sources = [RECORDS[i] for i in order]
    docs = [list(s) for s in sources]
    if cut_last:
        docs[-1] = docs[-1][:-cut_last]
    regions, start = [], 0
    for d in docs:
        regions += [Region(start + 1, 3), Region(start + len(d) - 2, 2)]
        start += len(d)
    return pack_documents(docs, regions, sources=sources)


def step(
    model: torch.nn.Module,
    adapter: MTPAdapter,
    seq: PackedSequence,
    store: RealPassStore | None = None,
    **cfg: Any,
) -> tuple[StepOutput, list[torch.Tensor]]:
    """One objective + backward; the loss output and the adapter's gradients (then cleared)."""
    out = distill_gated(model, adapter, seq, ObjectiveConfig(k_max=4, **cfg), mask_token_id=MASK, store=store)
    out.loss.backward()
    grads = [p.grad.clone() for p in adapter.trainable_parameters() if p.grad is not None]
    for p in adapter.trainable_parameters():
        p.grad = None
    return out, grads


@pytest.mark.parametrize("cut_last", [0, 3])
def test_cached_step_equals_running_the_real_tokens(cut_last: int) -> None:
    model = tiny_model()
    adapter = tiny_adapter(model)
    store = RealPassStore(model, MASK, adapter=adapter)
    seq = packed((2, 0, 1), cut_last=cut_last)
    ref, ref_grads = step(model, adapter, seq)
    assert len(ref_grads) == len(adapter.trainable_parameters())  # every adapter tensor got a gradient
    for _ in range(2):  # computed, then read back
        got, grads = step(model, adapter, seq, store)
        assert torch.allclose(got.loss, ref.loss, atol=1e-6)
        assert torch.equal(got.agree, ref.agree) and got.teacher_slots == ref.teacher_slots
        for a, b in zip(grads, ref_grads, strict=True):
            assert torch.allclose(a, b, atol=1e-6)
    assert store.stats.computed == 3 and store.stats.hits == 3


def test_cached_step_without_data_reuse_matches_too() -> None:
    model = tiny_model()
    adapter = tiny_adapter(model)
    seq = packed()
    ref, _ = step(model, adapter, seq, reuse_real_pass=False)
    got, _ = step(model, adapter, seq, RealPassStore(model, MASK, adapter=adapter), reuse_real_pass=False)
    assert torch.allclose(got.loss, ref.loss, atol=1e-6) and got.teacher_slots == ref.teacher_slots


def test_entries_are_the_records_own_pass_whatever_the_packing() -> None:
    """A record's entry does not depend on its neighbours or its place in the pack, and it is the base model's pass
    (the adapter's LoRA never acts on real tokens)."""
    model = tiny_model()
    adapter = tiny_adapter(model)
    store = RealPassStore(model, MASK, adapter=adapter)
    cache_a, argmax_a = store.real_pass(packed((0, 1, 2)))
    alone = RealPassStore(model, MASK)
    adapter.detach(model)
    cache_b, argmax_b = alone.real_pass(packed((1,)))
    n0 = len(RECORDS[0])
    n1 = len(RECORDS[1])
    assert torch.equal(argmax_a[n0 : n0 + n1], argmax_b)
    for la, lb in zip(cache_a.layers, cache_b.layers, strict=True):
        assert torch.allclose(la.keys[:, :, n0 : n0 + n1], lb.keys, atol=1e-6)
        assert torch.allclose(la.values[:, :, n0 : n0 + n1], lb.values, atol=1e-6)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([RECORDS[1]])).logits[0]
    assert torch.equal(argmax_b, logits.argmax(-1))


def test_entries_persist_on_disk_for_the_next_run(tmp_path: Path) -> None:
    model = tiny_model()
    adapter = tiny_adapter(model)
    first = RealPassStore(model, MASK, adapter=adapter, directory=tmp_path)
    seq = packed()
    cache_a, argmax_a = first.real_pass(seq)
    assert first.stats.computed == 3 and first.stats.disk_bytes > 0
    second = RealPassStore(model, MASK, adapter=adapter, directory=tmp_path)
    cache_b, argmax_b = second.real_pass(seq)
    assert second.stats.computed == 0 and second.stats.disk_reads == 3
    assert torch.equal(argmax_a, argmax_b)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(cache_a.layers, cache_b.layers, strict=True))
    torn = next(tmp_path.rglob("*.pt"))
    torn.write_bytes(b"not a tensor file")
    third = RealPassStore(model, MASK, adapter=adapter, directory=tmp_path)
    _, argmax_c = third.real_pass(seq)
    assert third.stats.computed == 1 and torch.equal(argmax_c, argmax_a)


def test_another_model_or_dtype_never_reads_the_entries(tmp_path: Path) -> None:
    model = tiny_model(seed=0)
    store = RealPassStore(model, MASK, directory=tmp_path)
    other = RealPassStore(tiny_model(seed=5), MASK, directory=tmp_path)
    adapter = tiny_adapter(model)
    twin, _ = low_precision_twin(model, adapter, mask_token_id=MASK)
    bf16 = RealPassStore(twin, MASK, directory=tmp_path)
    assert len({store.directory, other.directory, bf16.directory}) == 3
    store.real_pass(packed())
    other.real_pass(packed())
    assert other.stats.computed == 3 and other.stats.disk_reads == 0


def test_memory_budget_evicts_least_recently_used() -> None:
    model = tiny_model()
    probe = RealPassStore(model, MASK)
    probe.real_pass(packed((0,)))
    one = probe.stats.memory_bytes
    store = RealPassStore(model, MASK, memory_bytes=2 * one + one // 2)  # room for about two records
    store.real_pass(packed((0,)))
    store.real_pass(packed((1,)))
    store.real_pass(packed((2,)))  # evicts record 0 (least recently used)
    assert store.stats.evicted >= 1 and store.stats.memory_bytes <= store.memory_bytes
    store.real_pass(packed((0,)))
    assert store.stats.computed == 4  # record 0 again: computed, not remembered


def test_bad_use_is_a_clear_error() -> None:
    model = tiny_model()
    adapter = tiny_adapter(model)
    store = RealPassStore(model, MASK, adapter=adapter)
    unsourced = pack_documents([RECORDS[0]], [Region(2, 3)])
    with pytest.raises(TrainingError, match="no sources"):
        distill_gated(model, adapter, unsourced, ObjectiveConfig(k_max=4), mask_token_id=MASK, store=store)
    with pytest.raises(TrainingError, match="hard teacher"):
        soft = ObjectiveConfig(k_max=4, teacher="soft")
        distill_gated(model, adapter, packed(), soft, mask_token_id=MASK, store=store)
    with pytest.raises(TrainingError, match="budget"):
        RealPassStore(model, MASK, memory_bytes=-1)
    with pytest.raises(ValueError, match="prefix"):
        pack_documents([[1, 2, 3]], [Region(1, 1)], sources=[[1, 2, 4]])
