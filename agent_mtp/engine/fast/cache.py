"""A preallocated KV cache written by position and rolled back by length (no cache objects per step)."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of one sequence: ``layers[i]`` is [2, kv_heads, capacity, head_dim] (0 = keys, 1 = values), a
    view of one tensor :attr:`storage` [layers, 2, kv_heads, capacity, head_dim] that holds them all.

    Writing appends at ``length``; ``truncate`` is an index change, not a copy. The capacity doubles (one copy) when
    a write would overflow it, up to ``max_length``. Positions of every layer are copied in and out in one operation
    (:meth:`write`, :meth:`read`): a prefix restored from the prefix cache took one copy per layer before, each a trip
    through the interpreter beside 8 batched sequences' Python threads, on the compute thread the batch's passes wait
    for (8 clients in one process: 2.2-2.6 ms a restore's copy before, 1.9-2.1 ms in one)."""

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
        self.storage = self._empty(self.capacity)
        self.layers = list(self.storage.unbind(0))
        self.length = 0

    def _empty(self, capacity: int) -> torch.Tensor:
        return torch.empty(self.num_layers, 2, self.kv_heads, capacity, self.head_dim, dtype=self.dtype)

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
        grown = self._empty(capacity)
        grown[:, :, :, : self.length] = self.storage[:, :, :, : self.length]
        self.storage, self.layers, self.capacity = grown, list(grown.unbind(0)), capacity

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"Cannot truncate a cache of {self.length} positions to {length}.")
        self.length = length

    def read(self, start: int, end: int) -> torch.Tensor:
        """Keys and values of positions [start, end) of every layer: [layers, 2, kv_heads, end - start, head_dim]
        (a copy)."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"Cannot read positions [{start}, {end}) of a cache of {self.length}.")
        return self.storage[:, :, :, start:end].clone()

    def write(self, segment: torch.Tensor) -> None:
        """Append ``segment`` [layers, 2, kv_heads, n, head_dim] (a :meth:`read` of a cache of this shape)."""
        expected = (self.num_layers, 2, self.kv_heads, self.head_dim)
        got = (segment.shape[0], segment.shape[1], segment.shape[2], segment.shape[4]) if segment.dim() == 5 else None
        if got != expected:
            raise ValueError(
                f"A KV segment of shape {tuple(segment.shape)} does not fit this cache; it needs "
                f"[{self.num_layers}, 2, {self.kv_heads}, n, {self.head_dim}]."
            )
        n = segment.shape[3]
        self.reserve(n)
        self.storage[:, :, :, self.length : self.length + n] = segment
        self.length += n

    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
