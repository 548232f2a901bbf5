"""A prefix KV cache across generations: a radix tree over token ids, bounded by a memory budget (LRU eviction).

Agents send the whole conversation again at every step. After a generation the keys and values of every token the
runner holds (prompt and output) are kept; a new request finds the longest cached prefix of its token ids and
prefills only the rest. With the gated MTP adapter, real-token keys and values are the base model's own in every
decode mode, so one cache serves ``ntp``, ``verified``, ``confadapt`` and ``static`` alike.

The tree is the one SGLang's RadixAttention popularised: each edge holds a run of tokens and their KV, a lookup walks
edges while tokens match (splitting nothing), an insert splits an edge where a new sequence diverges and adds a leaf
for the rest. Payloads are runtime-specific tensors [layers, 2, kv_heads, tokens, head_dim] (a runner exports and
loads them), so one cache belongs to one engine and runtime, and is cleared whenever the model's weights change.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

SEQ_DIM = 3
"""The token axis of a payload [layers, 2, kv_heads, tokens, head_dim]."""


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    kv: torch.Tensor | None  # [L, 2, kvh, len(tokens), d]; None at the root
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: float = 0.0

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a request: ``length`` tokens whose KV is ``segments`` concatenated in order."""

    length: int
    segments: tuple[torch.Tensor, ...]


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    """Lookups that reused at least one token."""
    lookup_tokens: int = 0
    reused_tokens: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.reused_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class PrefixCache:
    """Longest-prefix reuse of KV across generations, at most ``budget_bytes`` of payload. Thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes}; use a size >= 0 (0 turns the cache off).")
        self.budget_bytes = budget_bytes
        self.stats = PrefixCacheStats()
        self._root = _Node((), None, None)
        self._bytes = 0
        self._owner: Hashable = None
        self._token_bytes = 0
        """Payload bytes per token, learnt from the first export (caps what one insert may add)."""
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Payload bytes held now (never above the budget)."""
        return self._bytes

    def bind(self, owner: Hashable) -> None:
        """Clear the cache unless it was filled for ``owner`` (the model's weight signature)."""
        with self._lock:
            if owner != self._owner:
                self._root = _Node((), None, None)
                self._bytes = 0
                self._owner = owner

    def clear(self) -> None:
        with self._lock:
            self._root = _Node((), None, None)
            self._bytes = 0

    def match(self, ids: Sequence[int], *, limit: int | None = None) -> PrefixMatch:
        """The longest cached prefix of ``ids`` (at most ``limit`` tokens)."""
        limit = len(ids) if limit is None else min(limit, len(ids))
        with self._lock:
            now = time.monotonic()
            node, pos, segments = self._root, 0, []
            while pos < limit:
                child = node.children.get(ids[pos])
                if child is None:
                    break
                n = _common_length(child.tokens, ids, pos, limit)
                child.last_used = now
                assert child.kv is not None
                segments.append(child.kv if n == len(child.tokens) else child.kv.narrow(SEQ_DIM, 0, n))
                pos += n
                if n < len(child.tokens):
                    break
                node = child
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(ids)
            self.stats.reused_tokens += pos
            self.stats.hits += int(pos > 0)
            return PrefixMatch(pos, tuple(segments))

    def insert(self, ids: Sequence[int], export: Callable[[int, int], torch.Tensor]) -> None:
        """Keep the KV of ``ids``; ``export(start, end)`` returns the payload of positions [start, end) (called only
        for the part not cached yet)."""
        if self.budget_bytes == 0 or not ids:
            return
        with self._lock:
            now = time.monotonic()
            node, pos = self._root, 0
            while pos < len(ids):
                child = node.children.get(ids[pos])
                if child is None:
                    break
                n = _common_length(child.tokens, ids, pos, len(ids))
                child.last_used = now
                if n < len(child.tokens):
                    child = self._split(child, n)
                pos += n
                node = child
            end = len(ids)
            if self._token_bytes:
                end = min(end, pos + self.budget_bytes // self._token_bytes)
            if pos < end:
                kv = export(pos, end).contiguous()
                self._token_bytes = kv.numel() * kv.element_size() // (end - pos)
                leaf = _Node(tuple(ids[pos:end]), kv, node, last_used=now)
                node.children[ids[pos]] = leaf
                self._bytes += leaf.nbytes
                self.stats.inserted_tokens += len(leaf.tokens)
            self._evict()

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node (which keeps the first n)."""
        assert child.kv is not None and child.parent is not None
        upper = _Node(child.tokens[:n], child.kv.narrow(SEQ_DIM, 0, n).clone(), child.parent, last_used=child.last_used)
        child.parent.children[child.tokens[0]] = upper
        lower_kv = child.kv.narrow(SEQ_DIM, n, len(child.tokens) - n).clone()
        child.tokens, child.kv, child.parent = child.tokens[n:], lower_kv, upper
        upper.children[child.tokens[0]] = child
        return upper

    def _evict(self) -> None:
        """Drop least-recently-used leaves until the payload fits the budget."""
        while self._bytes > self.budget_bytes:
            leaves = [n for n in _nodes(self._root) if not n.children and n is not self._root]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_used)
            assert victim.parent is not None
            del victim.parent.children[victim.tokens[0]]
            self._bytes -= victim.nbytes
            self.stats.evicted_tokens += len(victim.tokens)


def _common_length(edge: tuple[int, ...], ids: Sequence[int], start: int, limit: int) -> int:
    n, top = 0, min(len(edge), limit - start)
    while n < top and edge[n] == ids[start + n]:
        n += 1
    return n


def _nodes(root: _Node) -> list[_Node]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out
