"""The fast runtime behind the engine's ``Runner`` protocol."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from agent_mtp.engine.fast.cache import KVCache
from agent_mtp.engine.fast.model import FastModel
from agent_mtp.engine.threads import compute


class FastRunner:
    """One sequence on a :class:`FastModel`: forward appends to a preallocated cache, drop rolls it back by length."""

    def __init__(self, model: FastModel, cache: KVCache | None = None) -> None:
        self.model = model
        self.cache = cache if cache is not None else model.new_cache()
        self.tokens: list[int] = []
        """The token ids whose keys and values the cache holds, in order."""
        self.coarse_masks = False
        """Whether this sequence's mask rows are only drafts (set by the decode loop for ``verified``): see
        :attr:`agent_mtp.engine.fast.model.BatchItem.coarse_masks`."""
        self.argmax_only = False
        """Whether the decode loop reads this sequence's real rows only for their argmax (greedy, unconstrained
        ``ntp`` / ``verified``: it takes :attr:`greedy`), so that the output head may screen them (see
        :attr:`agent_mtp.engine.fast.model.BatchItem.argmax_only`)."""
        self.greedy: list[int] | None = None
        """Each kept row's argmax (mask token left out) of the last forward, computed with it on the compute thread
        (:meth:`FastModel.greedy_tokens`): the decode loop takes greedy tokens from here instead of reading the
        logits again."""

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        logits, self.greedy = compute().run(self._forward, tokens, keep)  # [keep, V]
        self.tokens += tokens
        return logits

    def _forward(self, tokens: list[int], keep: int) -> tuple[torch.Tensor, list[int]]:
        logits = self.model.forward(
            tokens, self.cache, keep, coarse_masks=self.coarse_masks, argmax_only=self.argmax_only
        )
        return logits, self.model.greedy_tokens(logits)

    def greedy_steps(
        self, first: int, steps: int, stop_ids: frozenset[int], until: Callable[[int], bool] | None = None
    ) -> tuple[list[int], list[float]]:
        """Up to ``steps`` one-token passes in one call to the compute thread, each fed the last one's greedy token
        (see :class:`agent_mtp.engine.runner.GreedyRunRunner`): no hand-over to the caller's thread and no decode
        step in Python between them."""
        if steps < 1:
            raise ValueError(f"steps={steps} is not a number of passes; use 1 or more.")
        return self._greedy_run(first, steps, stop_ids, until)

    def _greedy_run(
        self, first: int, steps: int, stop_ids: frozenset[int], until: Callable[[int], bool] | None
    ) -> tuple[list[int], list[float]]:
        """The run itself (:meth:`greedy_steps` checked its arguments); a batched runner makes it in the batches."""
        return compute().run(self._greedy_steps, first, steps, stop_ids, until)

    def _greedy_steps(
        self, first: int, steps: int, stop_ids: frozenset[int], until: Callable[[int], bool] | None
    ) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        ended: list[float] = []
        feed = first
        for _ in range(steps):
            logits = self.model.forward([feed], self.cache, 1, argmax_only=True)  # a run reads only its argmax
            self.tokens.append(feed)
            self.greedy = self.model.greedy_tokens(logits)
            tokens.append(self.greedy[-1])
            ended.append(time.perf_counter())
            if tokens[-1] in stop_ids or (until is not None and until(tokens[-1])):
                break
            feed = tokens[-1]
        return tokens, ended

    def drop(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.cache.truncate(self.cache.length - num_tokens)
            del self.tokens[-num_tokens:]

    def export(self, start: int, end: int) -> torch.Tensor:
        """Keys and values of positions [start, end): [layers, 2, kv_heads, end - start, head_dim] (a copy)."""
        return compute().run(self.cache.read, start, end)

    def load(self, tokens: list[int], segments: Sequence[torch.Tensor]) -> None:
        """Start from a cached prefix: ``segments`` (payloads of :meth:`export`, in order) hold ``tokens``' KV."""
        compute().run(self._load, tokens, segments)

    def _load(self, tokens: list[int], segments: Sequence[torch.Tensor]) -> None:
        if self.cache.length:
            raise ValueError("load() needs an empty runner.")
        held = sum(int(segment.shape[3]) for segment in segments)
        if held != len(tokens):
            raise ValueError(f"Cached segments hold {held} positions for {len(tokens)} tokens.")
        self.cache.reserve(held)
        for segment in segments:
            self.cache.write(segment)
        self.tokens = list(tokens)
