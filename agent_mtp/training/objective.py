"""The online self-distillation objective (student-forced, hard teacher by default).

For every region (prefix ending at its anchor, k - 1 masks):
  1. the student reads prefix + masks and rolls out its argmax block y' = (y'_1 .. y'_k)
     (y'_1 is the prediction at the anchor, y'_{j+1} the prediction at mask j);
  2. the teacher reads prefix + y'_1 .. y'_{k-1} and gives its argmax t_{j+1} at the position holding y'_j;
  3. loss = weighted cross-entropy of the student's prediction at mask j against t_{j+1}
     (soft option: KL(teacher || student); prefix option: only slots up to the student's first miss).

Gated adapters take the fast path: real tokens run the exact base model whatever the adapter does, so they are run
once without gradient and their KV cache is shared by the student pass (masks only, with gradient) and the teacher
pass (the student's block only, LoRA off). Full fine-tuning runs the whole packed sequence through the student and
a frozen teacher copy.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from agent_mtp.engine.adapter import MTPAdapter
from agent_mtp.training.packing import (
    PackedSequence,
    anchors,
    as_4d,
    mask_attention_rows,
    mask_positions,
    packed_attention,
    packed_positions,
    slot_index,
    slot_weights,
)


@dataclass(frozen=True)
class ObjectiveConfig:
    k_max: int = 8
    """Largest block trained (k randomised per region in [2, k_max], or all k_max - 1 masks with expected weights)."""
    k_sampling: Literal["expected", "random"] = "expected"
    """"expected": every region gets k_max - 1 masks and slot j weighs (K - j)/K; "random": k drawn per region."""
    teacher: Literal["hard", "soft"] = "hard"
    """Hard: CE against the teacher's argmax. Soft: KL(teacher || student) over the vocabulary."""
    slots: Literal["all", "prefix"] = "all"
    """"prefix" (ablation): only slots up to and including the student's first disagreement with the teacher."""
    bf16: bool = False
    """Run the student's forward under bf16 autocast (real-token and teacher passes stay in the model's dtype)."""


@dataclass
class StepOutput:
    loss: torch.Tensor
    slots: int
    """Supervised mask slots in this step."""
    agree: torch.Tensor
    """[K-1] fraction of slots j whose student argmax equals the teacher's target."""
    count: torch.Tensor
    """[K-1] slots per j."""


def distill_gated(
    model: Any, adapter: MTPAdapter, seq: PackedSequence, cfg: ObjectiveConfig, *, mask_token_id: int
) -> StepOutput:
    """Fast path for gated adapters (see module docstring). Gradient reaches only adapter parameters."""
    n_masks = seq.n_masks
    dev = _device(model)
    region, j = (t.to(dev) for t in slot_index(seq))
    rows = as_4d(mask_attention_rows(seq)).to(dev)  # [1, 1, M, L + M]
    pos = mask_positions(seq)[None].to(dev)  # [1, M]
    with torch.no_grad():
        real = model(
            input_ids=seq.ids[None].to(dev),
            attention_mask=as_4d(_real_attention(seq)).to(dev),
            position_ids=seq.positions[None].to(dev),
            use_cache=True,
            logits_to_keep=anchors(seq).to(dev),
        )
    cache = real.cache
    ntp = _argmax(real.logits[0], mask_token_id)  # [R]: y'_1 of every region
    masks = torch.full((1, n_masks), mask_token_id, dtype=torch.long, device=dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if cfg.bf16 else nullcontext()
    with autocast:
        student = model(input_ids=masks, attention_mask=rows, position_ids=pos, cache=cache, use_cache=True).logits[0]
    cache.crop(-n_masks)
    student = student.float()  # [M, V]
    block = _teacher_inputs(ntp, _argmax(student.detach(), mask_token_id), region, j)
    with torch.no_grad(), adapter.disabled():
        teacher = model(
            input_ids=block[None], attention_mask=rows, position_ids=pos, cache=cache, use_cache=True
        ).logits[0]
    cache.crop(-n_masks)
    return _slot_loss(student, teacher.float(), seq, cfg, mask_token_id)


def distill_full(
    student_model: Any, teacher_model: Any, seq: PackedSequence, cfg: ObjectiveConfig, *, mask_token_id: int
) -> StepOutput:
    """Full fine-tune: the whole packed sequence through the student (with gradient) and a frozen teacher copy.
    The anchor's own prediction (token 1) is a slot too, since real tokens change under full fine-tuning."""
    n_real, n_masks = seq.n_real, seq.n_masks
    dev = _device(student_model)
    region, j = (t.to(dev) for t in slot_index(seq))
    attn = as_4d(packed_attention(seq)).to(dev)
    pos = packed_positions(seq)[None].to(dev)
    keep = torch.cat([anchors(seq), torch.arange(n_real, n_real + n_masks)]).to(dev)  # [R + M]
    real_ids = seq.ids.to(dev)
    ids = torch.cat([real_ids, torch.full((n_masks,), mask_token_id, dtype=torch.long, device=dev)])[None]
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if cfg.bf16 else nullcontext()
    with autocast:
        logits = student_model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=keep).logits[0]
    logits = logits.float()
    n_regions = len(seq.regions)
    at_anchor, at_masks = logits[:n_regions], logits[n_regions:]
    ntp = _argmax(at_anchor.detach(), mask_token_id)
    block = _teacher_inputs(ntp, _argmax(at_masks.detach(), mask_token_id), region, j)
    with torch.no_grad():
        t_ids = torch.cat([real_ids, block])[None]
        t_logits = teacher_model(input_ids=t_ids, attention_mask=attn, position_ids=pos, logits_to_keep=keep).logits[0]
    t_logits = t_logits.float()
    out = _slot_loss(at_masks, t_logits[n_regions:], seq, cfg, mask_token_id)
    ntp_loss = _hard_or_soft(at_anchor, t_logits[:n_regions], cfg, mask_token_id).mean()
    total_weight = float(slot_weights(seq, cfg.k_max, expected=cfg.k_sampling == "expected").sum())
    out.loss = (out.loss * total_weight + ntp_loss * n_regions) / (total_weight + n_regions)
    return out


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _real_attention(seq: PackedSequence) -> torch.Tensor:
    i = torch.arange(seq.n_real)
    return (seq.doc_ids[:, None] == seq.doc_ids[None, :]) & (i[None, :] <= i[:, None])


def _argmax(logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Argmax that never picks the mask token (its row may exist in a tied lm_head)."""
    if mask_token_id < logits.shape[-1]:
        logits = logits.clone()
        logits[..., mask_token_id] = float("-inf")
    return logits.argmax(-1)


def _teacher_inputs(ntp: torch.Tensor, drafts: torch.Tensor, region: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """[M] the student's block y'_1 .. y'_{k-1} laid out like the masks: slot (r, 1) holds y'_1 = NTP of region r,
    slot (r, j) holds y'_j = the draft of mask (r, j - 1)."""
    previous = torch.cat([drafts.new_zeros(1), drafts[:-1]])  # draft of the slot before, same region when j > 1
    return torch.where(j == 1, ntp[region], previous)


def _hard_or_soft(
    student: torch.Tensor, teacher: torch.Tensor, cfg: ObjectiveConfig, mask_token_id: int
) -> torch.Tensor:
    """[N] per-slot loss."""
    if cfg.teacher == "soft":
        t = teacher.clone()
        if mask_token_id < t.shape[-1]:
            t[..., mask_token_id] = -1e9  # finite: kl_div gives NaN for a -inf log target
        return F.kl_div(F.log_softmax(student, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    return F.cross_entropy(student, _argmax(teacher, mask_token_id), reduction="none")


def _slot_loss(
    student: torch.Tensor, teacher: torch.Tensor, seq: PackedSequence, cfg: ObjectiveConfig, mask_token_id: int
) -> StepOutput:
    region, j = (t.to(student.device) for t in slot_index(seq))
    weights = slot_weights(seq, cfg.k_max, expected=cfg.k_sampling == "expected").to(student.device)
    per_slot = _hard_or_soft(student, teacher, cfg, mask_token_id)
    hit = (_argmax(student.detach(), mask_token_id) == _argmax(teacher, mask_token_id)).float()
    if cfg.slots == "prefix":
        weights = weights * _up_to_first_miss(hit, region)
    loss = (per_slot * weights).sum() / weights.sum().clamp(min=1e-8)
    k = int(j.max())
    count = torch.zeros(k, device=hit.device).index_add_(0, j - 1, torch.ones_like(hit))
    agree = torch.zeros(k, device=hit.device).index_add_(0, j - 1, hit) / count.clamp(min=1)
    return StepOutput(loss, int(j.shape[0]), agree.cpu(), count.cpu())


def _up_to_first_miss(hit: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
    """[M] 1 for slots before or at the first miss of their region, else 0."""
    keep = torch.ones_like(hit)
    misses_before = torch.zeros_like(hit)
    for r in region.unique():
        idx = (region == r).nonzero().squeeze(1)
        miss = 1 - hit[idx]
        misses_before[idx] = torch.cumsum(miss, 0) - miss
    keep[misses_before > 0] = 0
    return keep
