"""Feeding tokens to the model: with a KV cache (production) or recomputing from scratch (the reference)."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Runner(Protocol):
    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        """Append ``tokens`` to the sequence and return the logits of the last ``keep`` of them [keep, V] (fp32)."""
        ...

    def drop(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` positions (mask tokens, rejected drafts)."""
        ...

    @property
    def length(self) -> int: ...


class CachedRunner:
    """One forward per pass over the new tokens only; rejected positions are cropped from the DynamicCache."""

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @torch.no_grad()
    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)  # [1, n]
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=keep)
        self._length += len(tokens)
        return out.logits[0].float()  # [keep, V]

    def drop(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.cache.crop(-num_tokens)
            self._length -= num_tokens


class ReferenceRunner:
    """Recomputes the whole sequence every pass without any cache: slow, obviously correct."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    @torch.no_grad()
    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        self.tokens += tokens
        ids = torch.tensor([self.tokens], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep)
        return out.logits[0].float()

    def drop(self, num_tokens: int) -> None:
        if num_tokens > 0:
            del self.tokens[-num_tokens:]
