"""The online self-distillation objective (student-forced, hard teacher by default).

For every region (prefix ending at its anchor, k - 1 masks):
  1. the student reads prefix + masks and rolls out its argmax block y' = (y'_1 .. y'_k)
     (y'_1 is the prediction at the anchor, y'_{j+1} the prediction at mask j);
  2. the teacher reads prefix + y'_1 .. y'_{k-1} and gives its argmax t_{j+1} at the position holding y'_j;
  3. loss = weighted cross-entropy of the student's prediction at mask j against t_{j+1}
     (soft option: KL(teacher || student); prefix option: only slots up to the student's first miss).

Gated adapters take the fast path: real tokens run the exact base model whatever the adapter does, so they are run
once without gradient and their KV cache is shared by the student pass (masks only, with gradient) and the teacher
pass (the student's block only, LoRA off). The real-token pass is the teacher on the data: wherever the student's
block so far equals the document's own next tokens, the teacher's logits at that slot are the real pass's logits at
the matching real token, so the teacher pass only runs the slots after a region's first departure from the data
(exactly the same targets; the share of skipped slots grows as the student learns). Since that pass depends only on
the base model and the record, a ``RealPassStore`` (``training/real_cache.py``) can compute it once per record and
hand every later step its KV cache and argmax. With the hard teacher the student's output head and cross-entropy are
fused and chunked (``training/head_loss.py``), so no [slots, vocabulary] logits are kept. Full fine-tuning runs the
whole packed sequence through the student and a frozen teacher copy.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from agent_mtp.engine.adapter import MTPAdapter
from agent_mtp.errors import TrainingError
from agent_mtp.training.attention import slot_layout
from agent_mtp.training.head_loss import HeadStatistics, argmax_without_mask, head_cross_entropy, head_statistics
from agent_mtp.training.packing import (
    PackedSequence,
    anchors,
    as_4d,
    mask_attention_rows,
    mask_positions,
    packed_attention,
    packed_positions,
    slot_attention_rows,
    slot_index,
    slot_weights,
)
from agent_mtp.training.precision import ExactTargetHead
from agent_mtp.training.real_cache import RealPassStore, model_device


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
    reuse_real_pass: bool = True
    """Take the teacher's logits from the real-token pass where the student's block follows the data (gated path;
    identical targets, fewer teacher tokens). False runs the teacher on every slot (the reference)."""
    banded_attention: bool = True
    """Slot passes use banded slot attention (``training/attention.py``) on models switched to it by
    ``use_slot_attention``; False (or an unswitched model) runs dense SDPA with the packed mask."""


@dataclass
class StepOutput:
    loss: torch.Tensor
    slots: int
    """Supervised mask slots in this step."""
    agree: torch.Tensor
    """[K-1] fraction of slots j whose student argmax equals the teacher's target."""
    count: torch.Tensor
    """[K-1] slots per j."""
    teacher_slots: int | None = None
    """Slots the teacher pass had to run (the others took their targets from the real-token pass)."""


def distill_gated(
    model: Any,
    adapter: MTPAdapter,
    seq: PackedSequence,
    cfg: ObjectiveConfig,
    *,
    mask_token_id: int,
    store: RealPassStore | None = None,
) -> StepOutput:
    """Fast path for gated adapters (see module docstring). Gradient reaches only adapter parameters. ``store``
    (hard teacher only): read the real-token pass from a per-record cache instead of running it."""
    n_masks = seq.n_masks
    dev = model_device(model)
    region, j = (t.to(dev) for t in slot_index(seq))
    region_anchors = anchors(seq).to(dev)  # [R]
    anchor = region_anchors[region]  # [M] the anchor of each slot's region
    data_index, in_doc = _data_index(seq, anchor, j)
    if store is not None:
        if cfg.teacher != "hard":
            raise TrainingError("the real-pass cache keeps no logits: use it with the hard teacher only.")
        real = _RealPass(*store.real_pass(seq))
    else:
        keep = torch.cat([region_anchors, data_index[in_doc]]) if cfg.reuse_real_pass else region_anchors
        real = _run_real_pass(model, seq, keep.unique(), mask_token_id, keep_logits=cfg.teacher == "soft")
    cache, real_argmax = real.cache, real.argmax
    ntp = real_argmax[region_anchors]  # [R]: y'_1 of every region
    masks = torch.full((1, n_masks), mask_token_id, dtype=torch.long, device=dev)
    rows = as_4d(mask_attention_rows(seq)).to(dev)  # [1, 1, M, L + M]
    pos = mask_positions(seq)[None].to(dev)  # [1, M]
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if cfg.bf16 else nullcontext()
    with autocast, slot_layout(rows[0, 0], seq.n_real, enabled=cfg.banded_attention):
        student = _student_pass(model, adapter, masks, rows, pos, cache, cfg)
    cache.crop(-n_masks)
    block = _teacher_inputs(ntp, student.drafts, region, j)
    if cfg.reuse_real_pass:
        follows = _follows_data(seq, block, region, j, data_index, in_doc)
    else:
        follows = torch.zeros_like(block, dtype=torch.bool)
    target = torch.empty_like(block)  # the teacher's argmax per slot
    target[follows] = real_argmax[data_index[follows]]
    soft = None  # soft teacher only: the teacher's logits per slot
    if real.logits is not None and real.row_of is not None:
        soft = real.logits.new_empty((n_masks, real.logits.shape[-1]))
        soft[follows] = real.logits[real.row_of[data_index[follows]]]
    rest = (~follows).nonzero().squeeze(1)
    if rest.numel():
        slots = _Slots(block, anchor, region, j, pos[0])
        logits = _teacher_pass(model, adapter, seq, cache, slots, follows, rest, banded=cfg.banded_attention)
        target[rest] = argmax_without_mask(logits, mask_token_id)
        if soft is not None:
            soft[rest] = logits
    if student.logits is not None:
        out = _slot_loss(student.logits, target, soft.float() if soft is not None else None, seq, cfg, mask_token_id)
    else:
        assert student.hidden is not None and student.stats is not None
        per_slot = head_cross_entropy(student.hidden, _student_head_weight(model, cfg), student.stats, target)
        out = _weighted_loss(per_slot, student.drafts == target, seq, cfg)
    out.teacher_slots = int(rest.numel())
    return out


@dataclass(frozen=True)
class _RealPass:
    """The real tokens' pass: their KV cache and the teacher's argmax after each real token (-1 where not computed);
    the soft teacher also keeps the logits of the computed rows (``row_of``: real index -> logits row, -1 if none)."""

    cache: Any
    argmax: torch.Tensor
    logits: torch.Tensor | None = None
    row_of: torch.Tensor | None = None


def _run_real_pass(
    model: Any, seq: PackedSequence, keep: torch.Tensor, mask_token_id: int, *, keep_logits: bool
) -> _RealPass:
    """Run the real tokens (no gradient) with logits only at the sorted real indices ``keep``."""
    dev = keep.device
    with torch.no_grad():
        out = model(
            input_ids=seq.ids[None].to(dev),
            attention_mask=as_4d(_real_attention(seq)).to(dev),
            position_ids=seq.positions[None].to(dev),
            use_cache=True,
            logits_to_keep=keep,
        )
    logits = out.logits[0]  # [len(keep), V]
    argmax = torch.full((seq.n_real,), -1, dtype=torch.long, device=dev)
    argmax[keep] = argmax_without_mask(logits, mask_token_id)
    if not keep_logits:
        return _RealPass(out.cache, argmax)
    row_of = torch.full((seq.n_real,), -1, dtype=torch.long, device=dev)
    row_of[keep] = torch.arange(keep.shape[0], device=dev)
    return _RealPass(out.cache, argmax, logits, row_of)


@dataclass(frozen=True)
class _Student:
    """The student pass: full fp32 logits (soft teacher), or final hidden states with their fused head statistics
    (hard teacher); ``drafts`` is its argmax per slot either way."""

    drafts: torch.Tensor
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    stats: HeadStatistics | None = None


def _student_pass(
    model: Any,
    adapter: MTPAdapter,
    masks: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    cache: Any,
    cfg: ObjectiveConfig,
) -> _Student:
    """The student reads the masks (with gradient). The hard teacher's path runs the decoder without the CausalLM
    wrapper and computes the head inside the fused cross-entropy (``training/head_loss.py``: no [M, V] logits are
    kept); the wrapper's pre-hook sets the gate, so it is set here (every position of this pass is a mask)."""
    if cfg.teacher == "soft":  # the KL needs the student's full distributions
        out = model(input_ids=masks, attention_mask=rows, position_ids=pos, cache=cache, use_cache=True)
        logits = out.logits[0].float()  # [M, V]
        return _Student(drafts=argmax_without_mask(logits.detach(), adapter.mask_token_id), logits=logits)
    with adapter.gate_override(torch.ones_like(masks, dtype=torch.bool)):
        decoded = model.get_decoder()(
            input_ids=masks, attention_mask=rows, position_ids=pos, cache=cache, use_cache=True
        )
    hidden = decoded.last_hidden_state[0]  # [M, H]
    stats = head_statistics(hidden, _student_head_weight(model, cfg), mask_token_id=adapter.mask_token_id)
    return _Student(drafts=stats.argmax, hidden=hidden, stats=stats)


def _student_head_weight(model: Any, cfg: ObjectiveConfig) -> torch.Tensor:
    """The output head the student's logits use: the bf16 twin's low-precision head, else the model's own weight
    (cast to bf16 under the autocast option, as autocast does for the plain head)."""
    head = model.get_output_embeddings()
    weight = head.low if isinstance(head, ExactTargetHead) else head.weight
    return weight.to(torch.bfloat16) if cfg.bf16 else weight


def _data_index(seq: PackedSequence, anchor: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M] packed index of the real token that slot (r, j)'s teacher input y'_j would be if the student followed the
    data (anchor + j, clamped), and whether that token exists in the anchor's document."""
    index = anchor + j
    inside = index < seq.n_real
    index = index.clamp(max=seq.n_real - 1)
    doc = seq.doc_ids.to(anchor.device)
    return index, inside & (doc[index] == doc[anchor])


def _follows_data(
    seq: PackedSequence,
    block: torch.Tensor,
    region: torch.Tensor,
    j: torch.Tensor,
    data_index: torch.Tensor,
    in_doc: torch.Tensor,
) -> torch.Tensor:
    """[M] True where the student's block y'_1 .. y'_j of the slot's region equals the document's next j tokens, so
    the teacher's input at that slot is the real prefix up to ``data_index`` (already run)."""
    match = in_doc & (block == seq.ids.to(block.device)[data_index])
    first_miss = _first_miss(match, region, j, n_regions=len(seq.regions))
    return j < first_miss[region]


def _first_miss(match: torch.Tensor, region: torch.Tensor, j: torch.Tensor, *, n_regions: int) -> torch.Tensor:
    """[R] smallest j whose slot does not match, per region (a large number when all match)."""
    first = torch.full((n_regions,), torch.iinfo(torch.long).max, dtype=torch.long, device=j.device)
    miss = ~match
    return first.scatter_reduce(0, region[miss], j[miss], reduce="amin")


@dataclass(frozen=True)
class _Slots:
    """Per-slot tensors of a step: the student's block (teacher inputs), anchor, region, j and position id."""

    block: torch.Tensor
    anchor: torch.Tensor
    region: torch.Tensor
    j: torch.Tensor
    pos: torch.Tensor


def _teacher_pass(
    model: Any,
    adapter: MTPAdapter,
    seq: PackedSequence,
    cache: Any,
    slots: _Slots,
    follows: torch.Tensor,
    rest: torch.Tensor,
    *,
    banded: bool,
) -> torch.Tensor:
    """Teacher logits for the slots ``rest`` (those after their region's first departure from the data). The block's
    tokens before the departure are the real tokens up to anchor + first_miss - 1, so the slots see the real prefix up
    to there (from the cache) and the rest of their region's block."""
    region, j = slots.region[rest], slots.j[rest]
    first_miss = _first_miss(follows, slots.region, slots.j, n_regions=len(seq.regions))
    seen_to = slots.anchor[rest] + first_miss[region] - 1
    rows = as_4d(slot_attention_rows(seq.doc_ids, seen_to, region, j))
    with torch.no_grad(), adapter.disabled(), slot_layout(rows[0, 0], seq.n_real, enabled=banded):
        ids, pos = slots.block[rest][None], slots.pos[rest][None]
        logits = model(input_ids=ids, attention_mask=rows, position_ids=pos, cache=cache, use_cache=True).logits[0]
    cache.crop(-int(rest.numel()))
    return logits


def distill_full(
    student_model: Any, teacher_model: Any, seq: PackedSequence, cfg: ObjectiveConfig, *, mask_token_id: int
) -> StepOutput:
    """Full fine-tune: the whole packed sequence through the student (with gradient) and a frozen teacher copy.
    The anchor's own prediction (token 1) is a slot too, since real tokens change under full fine-tuning."""
    n_real, n_masks = seq.n_real, seq.n_masks
    dev = model_device(student_model)
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
    ntp = argmax_without_mask(at_anchor.detach(), mask_token_id)
    block = _teacher_inputs(ntp, argmax_without_mask(at_masks.detach(), mask_token_id), region, j)
    with torch.no_grad():
        t_ids = torch.cat([real_ids, block])[None]
        t_logits = teacher_model(input_ids=t_ids, attention_mask=attn, position_ids=pos, logits_to_keep=keep).logits[0]
    t_logits = t_logits.float()
    t_masks = t_logits[n_regions:]
    out = _slot_loss(at_masks, argmax_without_mask(t_masks, mask_token_id), t_masks, seq, cfg, mask_token_id)
    t_anchor = t_logits[:n_regions]
    ntp_loss = _hard_or_soft(
        at_anchor, argmax_without_mask(t_anchor, mask_token_id), t_anchor, cfg, mask_token_id
    ).mean()
    total_weight = float(slot_weights(seq, cfg.k_max, expected=cfg.k_sampling == "expected").sum())
    out.loss = (out.loss * total_weight + ntp_loss * n_regions) / (total_weight + n_regions)
    return out


def _real_attention(seq: PackedSequence) -> torch.Tensor:
    i = torch.arange(seq.n_real)
    return (seq.doc_ids[:, None] == seq.doc_ids[None, :]) & (i[None, :] <= i[:, None])


def _teacher_inputs(ntp: torch.Tensor, drafts: torch.Tensor, region: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """[M] the student's block y'_1 .. y'_{k-1} laid out like the masks: slot (r, 1) holds y'_1 = NTP of region r,
    slot (r, j) holds y'_j = the draft of mask (r, j - 1)."""
    previous = torch.cat([drafts.new_zeros(1), drafts[:-1]])  # draft of the slot before, same region when j > 1
    return torch.where(j == 1, ntp[region], previous)


def _hard_or_soft(
    student: torch.Tensor,
    target: torch.Tensor,
    teacher: torch.Tensor | None,
    cfg: ObjectiveConfig,
    mask_token_id: int,
) -> torch.Tensor:
    """[N] per-slot loss: CE against the teacher's argmax ``target`` (hard), or KL(teacher || student) (soft, needs
    the ``teacher`` logits)."""
    if cfg.teacher == "soft":
        if teacher is None:
            raise TrainingError("the soft teacher needs the teacher's logits (internal: pass them to _slot_loss)")
        t = teacher.clone()
        if mask_token_id < t.shape[-1]:
            t[..., mask_token_id] = -1e9  # finite: kl_div gives NaN for a -inf log target
        return F.kl_div(F.log_softmax(student, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    return F.cross_entropy(student, target, reduction="none")


def _slot_loss(
    student: torch.Tensor,
    target: torch.Tensor,
    teacher: torch.Tensor | None,
    seq: PackedSequence,
    cfg: ObjectiveConfig,
    mask_token_id: int,
) -> StepOutput:
    per_slot = _hard_or_soft(student, target, teacher, cfg, mask_token_id)
    return _weighted_loss(per_slot, argmax_without_mask(student.detach(), mask_token_id) == target, seq, cfg)


def _weighted_loss(per_slot: torch.Tensor, hits: torch.Tensor, seq: PackedSequence, cfg: ObjectiveConfig) -> StepOutput:
    """Weighted mean of the per-slot losses and the per-j agreement (``hits``: student argmax == target)."""
    region, j = (t.to(per_slot.device) for t in slot_index(seq))
    weights = slot_weights(seq, cfg.k_max, expected=cfg.k_sampling == "expected").to(per_slot.device)
    hit = hits.float()
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
