"""The maths of one pass: picking tokens and deciding how many proposed tokens to accept. Pure functions."""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Softmax of ``logits`` [..., V] at ``temperature`` (greedy: temperature 0 -> plain softmax), nucleus-filtered."""
    scaled = logits.float() / temperature if temperature > 0 else logits.float()
    probs = torch.softmax(scaled, dim=-1)
    if temperature > 0 and top_p < 1.0:
        probs = _nucleus(probs, top_p)
    return probs


def top_probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The largest of :func:`probabilities` in each row: [..., V] -> [...]. ``amax``, not ``max(-1).values``: on one
    thread the latter also builds the indices and took ~250 us for three 49k-logit rows where this takes ~95 (the
    decode loop reads a verified pass's mask confidences this way, between passes)."""
    return probabilities(logits, temperature, top_p).amax(-1)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p  # always keeps the top token
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    filtered = probs * keep
    return filtered / filtered.sum(-1, keepdim=True)


def pick(probs: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax (temperature 0) or one sample per row. probs [n, V] -> ids [n]."""
    if temperature <= 0:
        return probs.argmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def confadapt_accept_length(top1_probs: torch.Tensor, threshold: float) -> int:
    """ConfAdapt: the longest run from position 1 whose top-1 probabilities are all >= threshold; at least 1.

    top1_probs [k]: the top-1 softmax probability at each proposed position, computed independently.
    """
    confident = (top1_probs >= threshold).long()  # [k]
    run = int(confident.cumprod(0).sum())
    return max(run, 1)


def verify_greedy(draft: list[int], targets: list[int]) -> int:
    """Number of draft tokens that equal the model's own greedy tokens at the same positions (matching prefix)."""
    accepted = 0
    for proposed, target in zip(draft, targets, strict=False):
        if proposed != target:
            break
        accepted += 1
    return accepted


def accept_or_resample(probs: torch.Tensor, draft_token: int, generator: torch.Generator | None) -> tuple[bool, int]:
    """Lossless speculative sampling for a deterministic draft (q = one-hot at ``draft_token``).

    Accept with probability p(draft); on rejection sample from p with the draft token removed (the residual
    max(p - q, 0), renormalised). The output distribution is exactly p.
    """
    p_draft = float(probs[draft_token])
    u = float(torch.rand((), generator=generator))
    if u < p_draft:
        return True, draft_token
    residual = probs.clone()
    residual[draft_token] = 0.0
    total = float(residual.sum())
    if total <= 0.0:
        return True, draft_token
    return False, int(torch.multinomial(residual / total, 1, generator=generator))


def expected_accepted(rates: list[float]) -> list[float]:
    """E[tokens] for k = 1..len(rates)+1 given per-position conditional acceptance rates of positions 2..k."""
    out = [1.0]
    run = 1.0
    for rate in rates:
        run *= rate
        out.append(out[-1] + run)
    return out
