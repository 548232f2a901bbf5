"""Decode settings: one frozen dataclass, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from agent_mtp.errors import ConfigError

Mode = Literal["ntp", "static", "confadapt", "verified"]
"""The decode modes (see :class:`DecodeConfig`); the one list that the policy schema and the chat model use."""
LOSSLESS: dict[str, bool] = {"ntp": True, "static": False, "confadapt": False, "verified": True}
"""Per mode: True when greedy output equals plain NTP output token for token."""
MODES: tuple[str, ...] = get_args(Mode)
LOSSY_MODES: frozenset[str] = frozenset(m for m in MODES if not LOSSLESS[m])
"""Modes whose output may differ from NTP (the policy's breaker and NTP-agreement monitor watch only these)."""
LOSSLESS_MODES: frozenset[str] = frozenset(m for m in MODES if LOSSLESS[m])
DraftName = Literal["mtp", "ngram", "grammar"]
DRAFT_SOURCES: tuple[str, ...] = get_args(DraftName)
K_MAX_LIMIT = 64


@dataclass(frozen=True)
class DecodeConfig:
    """How one generation decodes. Every field has a default; invalid values raise :class:`ConfigError`.

    Modes:
      * ``ntp``       plain next-token prediction with the KV cache (the reference).
      * ``static``    append ``k_max - 1`` masks and accept all ``k_max`` proposed tokens.
      * ``confadapt`` the paper's rule: accept the longest run, from position 1, whose top-1 probabilities are all
                      ``>= threshold`` (at least one token).
      * ``verified``  lossless: drafts (MTP masks and/or prompt n-grams) are checked by the NTP logits in the next
                      pass; greedy output equals ``ntp`` token for token.
    """

    mode: Mode = "confadapt"
    """Decoding rule, see above."""
    threshold: float = 0.9
    """ConfAdapt confidence threshold tau in [0, 1] (a top-1 probability; at 1.0 almost nothing but the NTP token is
    accepted)."""
    k_max: int | Literal["auto"] = 8
    """Tokens proposed per pass (1 NTP + k_max-1 masks), or "auto" to pick k from the measured cost curve."""
    max_new_tokens: int = 256
    """Hard cap on generated tokens (an accepted block is truncated to fit)."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples (verified mode then uses lossless speculative sampling)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; only used when temperature > 0."""
    stop: tuple[str, ...] = ()
    """Stop strings; the text is cut before the first one (they may span block boundaries)."""
    max_time: float | None = None
    """Seconds after which decoding stops with finish_reason "timeout" and the partial text."""
    seed: int | None = None
    """Seed of the sampling generator (reproducible sampling)."""
    drafts: tuple[DraftName, ...] = ("mtp", "ngram", "grammar")
    """Draft sources for verified mode: "mtp" (mask predictions), "ngram" (prompt lookup), "grammar" (under a
    constraint, the forced text's last token, which jump-forward leaves to the model)."""
    ngram_max: int = 3
    """Longest n-gram suffix to match for prompt-lookup drafts."""
    ngram_draft_len: int = 10
    """Tokens proposed by one prompt-lookup match."""
    stop_token_ids: tuple[int, ...] = field(default=())
    """Extra token ids that end generation (the tokenizer's EOS always does)."""
    prefix_cache: bool = True
    """Reuse (and keep) prompt keys and values across generations through the engine's prefix cache; output is the
    same either way (False: prefill the whole prompt, as benchmarks of decoding speed do)."""
    cost_aware: bool = True
    """Verified mode: plan drafts and masks from the measured cost curve (False: verify the best-scoring draft
    whole and append k_max - 1 masks every pass, the same on every machine)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.drafts, (list, str)):
            object.__setattr__(self, "drafts", (self.drafts,) if isinstance(self.drafts, str) else tuple(self.drafts))
        _validate(self)

    def replace(self, **changes: object) -> DecodeConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]


def _fail(field_name: str, value: object, allowed: str) -> ConfigError:
    return ConfigError(f"DecodeConfig.{field_name}={value!r} is invalid: {allowed}.")


def _validate(cfg: DecodeConfig) -> None:
    if cfg.mode not in MODES:
        raise _fail("mode", cfg.mode, f"use one of {', '.join(MODES)}")
    if not _is_number(cfg.threshold) or not 0 <= cfg.threshold <= 1:
        raise _fail("threshold", cfg.threshold, "use a number in [0, 1] (0.9 is the paper's default)")
    if cfg.k_max != "auto" and (
        isinstance(cfg.k_max, bool) or not isinstance(cfg.k_max, int) or not 1 <= cfg.k_max <= K_MAX_LIMIT
    ):
        raise _fail("k_max", cfg.k_max, f'use an int in [1, {K_MAX_LIMIT}] or "auto"')
    if isinstance(cfg.max_new_tokens, bool) or not isinstance(cfg.max_new_tokens, int) or cfg.max_new_tokens < 1:
        raise _fail("max_new_tokens", cfg.max_new_tokens, "use an int >= 1")
    if not _is_number(cfg.temperature) or cfg.temperature < 0:
        raise _fail("temperature", cfg.temperature, "use a number >= 0 (0 = greedy)")
    if not _is_number(cfg.top_p) or not 0 < cfg.top_p <= 1:
        raise _fail("top_p", cfg.top_p, "use a number in (0, 1]")
    if any(not isinstance(s, str) or s == "" for s in cfg.stop):
        raise _fail("stop", cfg.stop, "use non-empty strings")
    if cfg.max_time is not None and (not _is_number(cfg.max_time) or cfg.max_time <= 0):
        raise _fail("max_time", cfg.max_time, "use a number of seconds > 0, or None for no deadline")
    if cfg.seed is not None and (isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int)):
        raise _fail("seed", cfg.seed, "use an int or None")
    unknown = [d for d in cfg.drafts if d not in DRAFT_SOURCES]
    if unknown or not cfg.drafts:
        raise _fail("drafts", cfg.drafts, f"use a non-empty tuple of {', '.join(DRAFT_SOURCES)}")
    if not isinstance(cfg.ngram_max, int) or cfg.ngram_max < 1:
        raise _fail("ngram_max", cfg.ngram_max, "use an int >= 1")
    if not isinstance(cfg.ngram_draft_len, int) or cfg.ngram_draft_len < 1:
        raise _fail("ngram_draft_len", cfg.ngram_draft_len, "use an int >= 1")
    if not isinstance(cfg.prefix_cache, bool):
        raise _fail("prefix_cache", cfg.prefix_cache, "use True or False")
    if not isinstance(cfg.cost_aware, bool):
        raise _fail("cost_aware", cfg.cost_aware, "use True or False")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))
