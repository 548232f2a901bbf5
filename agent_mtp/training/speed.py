"""Trainer speed: supervised mask slots per second of training-step variants, measured side by side in one process.

Each round runs one step of every variant on the same packed sequence (interleaved, so a busy machine slows all
variants alike); a step is the full distillation objective plus ``loss.backward()`` (the optimizer update is left out
so that every variant sees the same adapter, and it costs under 1% of a step). The result is the median seconds per
step, supervised slots per second, and the share of slots that needed the teacher pass.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agent_mtp.engine.adapter import MTPAdapter
from agent_mtp.errors import TrainingError
from agent_mtp.training.attention import use_slot_attention
from agent_mtp.training.data import Record
from agent_mtp.training.objective import ObjectiveConfig, distill_gated
from agent_mtp.training.precision import low_precision_twin
from agent_mtp.training.real_cache import RealPassStore
from agent_mtp.training.trainer import TrainConfig, sample_sequence


@dataclass(frozen=True)
class SpeedVariant:
    name: str
    objective: ObjectiveConfig
    regions: int
    seq_len: int = 384
    train_embedding: bool = True
    """False: the mask embedding is frozen, so the backward pass stops at the lowest LoRA layer."""
    model_dtype: str = "fp32"
    """"bf16": the step runs on the bf16 twin (``training/precision.py``)."""
    train_layers: tuple[int, ...] | None = None
    """LoRA layers with gradient (None: all); the backward pass stops at the lowest one."""
    real_cache: bool = False
    """Read the real-token pass from a per-record store (``training/real_cache.py``). Measured in the steady state:
    the step's records are put in the store before the step is timed (as they are from a record's second draw on)."""


@dataclass(frozen=True)
class SpeedResult:
    name: str
    seconds_per_step: float
    slots_per_step: float
    slots_per_s: float
    teacher_share: float
    """Share of slots that ran the teacher pass (1.0 without real-pass reuse)."""


def parse_variant(text: str) -> SpeedVariant:
    """``name:key=value,...`` with keys regions, seq_len, k_max, bf16, reuse, embedding, cache (0/1 for the booleans;
    cache: real-token pass from the per-record store), dtype (fp32 | bf16: the base weights), attn (band | dense: slot
    attention) and train_layers (e.g. 16-29: the LoRA layers with gradient)."""
    name, _, spec = text.partition(":")
    fields: dict[str, str] = {}
    for part in filter(None, spec.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise TrainingError(f"variant {text!r}: {part!r} is not key=value (e.g. 'fast:regions=256,bf16=1').")
        fields[key.strip()] = value.strip()
    known = {"regions", "seq_len", "k_max", "bf16", "reuse", "embedding", "dtype", "attn", "train_layers", "cache"}
    if fields.get("attn", "band") not in ("band", "dense"):
        raise TrainingError(f"variant {text!r}: attn={fields['attn']!r}; use band or dense.")
    if fields.get("dtype", "fp32") not in ("fp32", "bf16"):
        raise TrainingError(f"variant {text!r}: dtype={fields['dtype']!r}; use fp32 or bf16.")
    unknown = set(fields) - known
    if unknown or not name:
        raise TrainingError(f"variant {text!r}: name it and use only {', '.join(sorted(known))} (got {unknown}).")
    try:
        objective = ObjectiveConfig(
            k_max=int(fields.get("k_max", 4)),
            bf16=fields.get("bf16", "1") == "1",
            reuse_real_pass=fields.get("reuse", "1") == "1",
            banded_attention=fields.get("attn", "band") == "band",
        )
        return SpeedVariant(
            name,
            objective,
            regions=int(fields.get("regions", 160)),
            seq_len=int(fields.get("seq_len", 384)),
            train_embedding=fields.get("embedding", "1") == "1",
            model_dtype=fields.get("dtype", "fp32"),
            train_layers=_layer_range(fields["train_layers"]) if "train_layers" in fields else None,
            real_cache=fields.get("cache", "0") == "1",
        )
    except ValueError as e:
        raise TrainingError(f"variant {text!r}: {e}") from e


def measure_speed(
    model: Any,
    adapter: MTPAdapter,
    records: Sequence[Record],
    variants: Sequence[SpeedVariant],
    *,
    rounds: int = 5,
    warmup: int = 1,
    mask_token_id: int,
    on_round: Callable[[int], None] | None = None,
) -> list[SpeedResult]:
    """Median step time of each variant over ``rounds`` interleaved rounds (after ``warmup`` untimed rounds)."""
    if not variants:
        raise TrainingError("measure_speed: give at least one variant.")
    if rounds < 1:
        raise TrainingError(f"rounds={rounds}: measure at least one round.")
    runners = {"fp32": (model, adapter)}
    if any(v.model_dtype == "bf16" for v in variants):
        runners["bf16"] = low_precision_twin(model, adapter, mask_token_id=mask_token_id)
    for step_model, _ in runners.values():
        use_slot_attention(step_model)  # dense SDPA unless a variant's objective asks for banded slot attention
    stores = {
        dtype: RealPassStore(step_model, mask_token_id, adapter=step_adapter)
        for dtype, (step_model, step_adapter) in runners.items()
    }
    seconds: dict[str, list[float]] = {v.name: [] for v in variants}
    slots: dict[str, list[int]] = {v.name: [] for v in variants}
    teacher: dict[str, list[int]] = {v.name: [] for v in variants}
    for r in range(warmup + rounds):
        for v in variants:
            cfg = replace(TrainConfig(), objective=v.objective, regions=v.regions, seq_len=v.seq_len, seed=r)
            seq = sample_sequence(records, r, cfg)
            adapter.mask_embedding.requires_grad_(v.train_embedding)
            adapter.set_trainable_layers(v.train_layers)
            step_model, step_adapter = runners[v.model_dtype]
            store = stores[v.model_dtype] if v.real_cache else None
            if store is not None:
                store.real_pass(seq)  # untimed: the steady state, where the step's records are already stored
            t0 = time.perf_counter()
            out = distill_gated(step_model, step_adapter, seq, v.objective, mask_token_id=mask_token_id, store=store)
            out.loss.backward()
            elapsed = time.perf_counter() - t0
            for p in adapter.trainable_parameters():
                p.grad = None
            if r >= warmup:
                seconds[v.name].append(elapsed)
                slots[v.name].append(out.slots)
                teacher[v.name].append(out.teacher_slots if out.teacher_slots is not None else out.slots)
        if on_round is not None:
            on_round(r)
    adapter.mask_embedding.requires_grad_(True)
    adapter.set_trainable_layers(None)
    return [_result(v.name, seconds[v.name], slots[v.name], teacher[v.name]) for v in variants]


def _layer_range(text: str) -> tuple[int, ...]:
    """ "16-29" -> 16..29 (a range: commas separate the variant's keys)."""
    lo, sep, hi = text.partition("-")
    return tuple(range(int(lo), int(hi) + 1)) if sep else (int(lo),)


def _result(name: str, seconds: list[float], slots: list[int], teacher: list[int]) -> SpeedResult:
    step = statistics.median(seconds)
    per_step = sum(slots) / len(slots)
    return SpeedResult(
        name=name,
        seconds_per_step=round(step, 3),
        slots_per_step=per_step,
        slots_per_s=round(statistics.median(n / t for n, t in zip(slots, seconds, strict=True)), 1),
        teacher_share=round(sum(teacher) / max(1, sum(slots)), 3),
    )
