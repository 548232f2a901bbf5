"""What a generation returns: text, ids, finish reason and the statistics measured while decoding."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "timeout"]


@dataclass
class DecodeStats:
    """Measured during one generation.

    The prefill pass counts as a forward pass (it yields the first token, and with masks the first block), so plain
    NTP has exactly 1.0 tokens per forward."""

    mode: str = "ntp"
    forward_passes: int = 0
    """Forward passes of the model, including the prefill pass."""
    new_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens whose keys and values came from the prefix cache (not prefilled)."""
    accept_histogram: dict[int, int] = field(default_factory=dict)
    """tokens accepted in a pass -> number of passes."""
    draft_stats: dict[str, dict[str, int]] = field(default_factory=dict)
    """per draft source: {"proposed": n, "accepted": n, "passes": n}."""
    jump_forward_tokens: int = 0
    """Tokens appended without a forward pass (grammar jump-forward)."""
    k_used: dict[int, int] = field(default_factory=dict)
    """k (tokens proposed per pass) -> number of passes; shows what k_max="auto" chose."""
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    wall_s: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per forward pass (the paper's "Eff. k"); jump-forward tokens are excluded."""
        passes = max(self.forward_passes, 1)
        return (self.new_tokens - self.jump_forward_tokens) / passes

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "forward_passes": self.forward_passes,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "accept_histogram": {str(k): v for k, v in sorted(self.accept_histogram.items())},
            "draft_stats": self.draft_stats,
            "jump_forward_tokens": self.jump_forward_tokens,
            "k_used": {str(k): v for k, v in sorted(self.k_used.items())},
            "prefill_s": round(self.prefill_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "wall_s": round(self.wall_s, 6),
        }


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: DecodeStats

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON shape printed by ``agent-mtp generate --json``."""
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


@dataclass(frozen=True)
class StreamChunk:
    """One forward pass worth of output."""

    text: str
    """Text delta (may be empty when bytes of a character or a possible stop string are held back)."""
    token_ids: tuple[int, ...]
    """Tokens accepted in this pass."""
    source: str = "ntp"
    """What proposed the accepted tokens beyond the first: ntp, mtp, ngram, grammar, jump_forward."""
    finish_reason: FinishReason | None = None
    """Set on the last chunk only."""
    stats: DecodeStats | None = None
    """Set on the last chunk only."""
