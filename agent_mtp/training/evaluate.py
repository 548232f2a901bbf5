"""Held-out evaluation during training: tokens/forward (ConfAdapt tau 0.8/0.9, verified), agreement with NTP,
tool-call JSON validity. Runs the real engine on the model being trained."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.engine import MTPEngine
from agent_mtp.training.data import Record

JSON_KINDS = frozenset({"tool_call", "json_object"})


@dataclass(frozen=True)
class EvalPrompt:
    kind: str
    prompt_ids: list[int]


def eval_prompts(records: Sequence[Record], n: int) -> list[EvalPrompt]:
    """A fixed, kind-balanced choice of ``n`` held-out prompts (round-robin over kinds, in file order)."""
    by_kind: dict[str, list[Record]] = {}
    for r in records:
        by_kind.setdefault(r.kind, []).append(r)
    chosen: list[EvalPrompt] = []
    kinds = sorted(by_kind)
    while len(chosen) < n and any(by_kind.values()):
        for kind in kinds:
            if by_kind[kind] and len(chosen) < n:
                chosen.append(EvalPrompt(kind, by_kind[kind].pop(0).prompt_ids))
    return chosen


def variants(k_max: int, max_new_tokens: int) -> dict[str, DecodeConfig]:
    base = DecodeConfig(mode="ntp", k_max=k_max, max_new_tokens=max_new_tokens)
    return {
        "ntp": base,
        "verified": base.replace(mode="verified", drafts=("mtp",), cost_aware=False),
        "confadapt_0.9": base.replace(mode="confadapt", threshold=0.9),
        "confadapt_0.8": base.replace(mode="confadapt", threshold=0.8),
    }


def evaluate(engine: MTPEngine, prompts: Sequence[EvalPrompt], *, k_max: int, max_new_tokens: int) -> dict[str, Any]:
    """Metrics over ``prompts``: ``tpf_<variant>`` (generated tokens / forward passes, pooled), ``agree_<variant>``
    (fraction of NTP tokens reproduced before the first divergence), ``json_valid_<variant>`` on JSON kinds,
    ``verified_exact`` (verified output == NTP output on every prompt).

    Verified mode runs with ``cost_aware=False`` (every pass verifies the whole MTP draft and appends k_max - 1
    masks): the planner's choices depend on this machine's measured cost curve, so with it the figure
    would measure the machine as much as the adapter. ``agent-mtp bench`` measures the planned engine."""
    outputs: dict[str, list[tuple[list[int], str, int]]] = {}
    was_training = engine.model.training
    engine.model.eval()
    try:
        with torch.no_grad():
            for name, cfg in variants(k_max, max_new_tokens).items():
                outputs[name] = []
                for p in prompts:
                    r = engine.generate(p.prompt_ids, cfg)
                    outputs[name].append((r.token_ids, r.text, r.stats.forward_passes))
    finally:
        engine.model.train(was_training)
    metrics: dict[str, Any] = {}
    ntp = outputs["ntp"]
    for name, outs in outputs.items():
        tokens = sum(len(ids) for ids, _, _ in outs)
        passes = sum(n for _, _, n in outs)
        metrics[f"tpf_{name}"] = round(tokens / max(passes, 1), 4)
        metrics[f"agree_{name}"] = round(_mean([_agreement(a[0], b[0]) for a, b in zip(outs, ntp, strict=True)]), 4)
        json_outs = [text for (_, text, _), p in zip(outs, prompts, strict=True) if p.kind in JSON_KINDS]
        if json_outs:
            metrics[f"json_valid_{name}"] = round(_mean([float(is_json(t)) for t in json_outs]), 4)
    metrics["verified_exact"] = all(a[0] == b[0] for a, b in zip(outputs["verified"], ntp, strict=True))
    return metrics


def _agreement(ids: list[int], reference: list[int]) -> float:
    if not reference:
        return 1.0
    n = 0
    for a, b in zip(ids, reference, strict=False):
        if a != b:
            break
        n += 1
    return n / len(reference)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def is_json(text: str) -> bool:
    """Does the text hold a JSON object (bare, or in a ``` fence)?"""
    candidates = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    for c in candidates:
        c = c.strip()
        start = c.find("{")
        if start < 0:
            continue
        try:
            json.JSONDecoder().raw_decode(c[start:])
            return True
        except json.JSONDecodeError:
            continue
    return False


@torch.no_grad()
def draft_tokens_per_forward(
    model: Any, prompt_ids: list[int], ntp_ids: list[int], *, mask_token_id: int, k: int
) -> float:
    """Tokens/forward of greedy self-verification with the full mask draft every pass and no cost planning: each
    pass yields its NTP token plus the drafts that match the NTP continuation. An upper bound the engine's
    cost-aware ``verified`` mode approaches as the adapter gets confident; cheap on tiny models (no KV cache)."""
    device = next(model.parameters()).device
    t, passes = 0, 0
    while t < len(ntp_ids):
        ids = torch.tensor([prompt_ids + ntp_ids[:t] + [mask_token_id] * (k - 1)], device=device)
        logits = model(input_ids=ids).logits[0, -(k - 1) :]
        logits[:, mask_token_id] = float("-inf")
        drafts = logits.argmax(-1).tolist()
        accepted = 1
        for d, truth in zip(drafts, ntp_ids[t + 1 :], strict=False):
            if d != truth:
                break
            accepted += 1
        t += accepted
        passes += 1
    return len(ntp_ids) / max(passes, 1)
