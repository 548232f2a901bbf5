"""A preallocated KV cache written by position and rolled back by length (no cache objects per step)."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of one sequence: ``layers[i]`` is [2, kv_heads, capacity, head_dim] (0 = keys, 1 = values).

    Writing appends at ``length``; ``truncate`` is an index change, not a copy. The capacity doubles (one copy) when
    a write would overflow it, up to ``max_length``."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        max_length: int,
        capacity: int = 256,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.max_length = max_length
        self.dtype = dtype
        self.capacity = min(capacity, max_length)
        self.layers = [self._empty(self.capacity) for _ in range(num_layers)]
        self.length = 0

    def _empty(self, capacity: int) -> torch.Tensor:
        return torch.empty(2, self.kv_heads, capacity, self.head_dim, dtype=self.dtype)

    def reserve(self, new_tokens: int) -> None:
        """Make room for ``new_tokens`` more positions (grows by doubling)."""
        needed = self.length + new_tokens
        if needed > self.max_length:
            msg = f"KV cache overflow: {needed} positions requested, the model's context window is {self.max_length}."
            raise ValueError(msg)
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self.max_length)
        for i, old in enumerate(self.layers):
            grown = self._empty(capacity)
            grown[:, :, : self.length] = old[:, :, : self.length]
            self.layers[i] = grown
        self.capacity = capacity

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"Cannot truncate a cache of {self.length} positions to {length}.")
        self.length = length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
