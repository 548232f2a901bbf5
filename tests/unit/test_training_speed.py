"""`measure_speed`: interleaved step variants on a tiny model report slots, rates and the teacher's share."""

from __future__ import annotations

from agent_mtp.training.data import Record
from agent_mtp.training.speed import measure_speed, parse_variant
from tests.unit.test_training_objective import MASK, tiny_adapter, tiny_model


def _records() -> list[Record]:
    return [
        Record(f"r{i}", "agent", "list", "train", [5, 9, 14, 3 + i], [22, 7, 11, 40, 2, 8, 33, 17, 6, 1])
        for i in range(6)
    ]


def test_measure_speed_reports_every_variant_with_its_slots_and_teacher_share() -> None:
    model = tiny_model(seed=41)
    adapter = tiny_adapter(model, seed=42)
    variants = [
        parse_variant("reference:regions=8,seq_len=32,k_max=4,bf16=0,reuse=0,attn=dense"),
        parse_variant("fast:regions=8,seq_len=32,k_max=4,dtype=bf16,embedding=0"),
        parse_variant("upper:regions=8,seq_len=32,k_max=4,dtype=bf16,embedding=0,train_layers=1-1"),
        parse_variant("cached:regions=8,seq_len=32,k_max=4,dtype=bf16,embedding=0,cache=1"),
    ]
    results = measure_speed(model, adapter, _records(), variants, rounds=2, warmup=0, mask_token_id=MASK)
    assert [r.name for r in results] == ["reference", "fast", "upper", "cached"]
    for r in results:
        assert r.slots_per_step == 8 * 3 and r.slots_per_s > 0 and r.seconds_per_step > 0
    assert results[0].teacher_share == 1.0  # no reuse: the teacher runs every slot
    assert 0.0 <= results[1].teacher_share <= 1.0
    assert results[3].teacher_share == results[1].teacher_share  # the cache changes no target
    assert adapter.mask_embedding.requires_grad  # restored after the frozen-embedding variant
    assert all(p.grad is None for p in adapter.trainable_parameters())
    assert all(p.requires_grad for p in adapter.trainable_parameters())  # restored after the upper-layer variant
    assert parse_variant("u:train_layers=16-29").train_layers == tuple(range(16, 30))
