"""The fast runtime behind the engine's ``Runner`` protocol."""

from __future__ import annotations

import torch

from agent_mtp.engine.fast.cache import KVCache
from agent_mtp.engine.fast.model import FastModel


class FastRunner:
    """One sequence on a :class:`FastModel`: forward appends to a preallocated cache, drop rolls it back by length."""

    def __init__(self, model: FastModel, cache: KVCache | None = None) -> None:
        self.model = model
        self.cache = cache if cache is not None else model.new_cache()

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        return self.model.forward(tokens, self.cache, keep)  # [keep, V]

    def drop(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.cache.truncate(self.cache.length - num_tokens)
