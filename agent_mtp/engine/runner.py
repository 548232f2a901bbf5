"""Feeding tokens to the model: with a KV cache (production) or recomputing from scratch (the reference)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch

from agent_mtp.engine.threads import compute


class Runner(Protocol):
    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        """Append ``tokens`` to the sequence and return the logits of the last ``keep`` of them [keep, V] (fp32)."""
        ...

    def drop(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` positions (mask tokens, rejected drafts)."""
        ...

    @property
    def length(self) -> int: ...


@runtime_checkable
class GreedyRunRunner(Runner, Protocol):
    """A runner that can chain plain greedy one-token passes without returning to the decode loop between them: the
    fast runner (the passes in one call to the compute thread) and its batched form (inside a scheduler's batches,
    engine/batching.py)."""

    def greedy_steps(
        self, first: int, steps: int, stop_ids: frozenset[int], until: Callable[[int], bool] | None = None
    ) -> tuple[list[int], list[float]]:
        """Feed ``first``, then each pass's greedy token (the argmax, mask token left out), for up to ``steps``
        one-token passes, ending early after a token in ``stop_ids`` or one for which ``until`` (called with each
        new token, in order, on the thread that runs the passes) returns True. Returns the greedy tokens (the last
        one not fed: it is the decode loop's next pending token) and the ``time.perf_counter()`` at which each pass
        ended."""
        ...


@runtime_checkable
class PrefixRunner(Runner, Protocol):
    """A runner whose cache can be copied out and started from a cached prefix (for the prefix cache)."""

    tokens: list[int]
    """The token ids whose keys and values the runner holds, in order."""

    def export(self, start: int, end: int) -> torch.Tensor:
        """Keys and values of positions [start, end): [layers, 2, kv_heads, end - start, head_dim] (a copy)."""
        ...

    def load(self, tokens: list[int], segments: Sequence[torch.Tensor]) -> None:
        """Start an empty runner from ``segments`` (payloads of :meth:`export`, in order) holding ``tokens``."""
        ...


class CachedRunner:
    """One forward per pass over the new tokens only; rejected positions are cropped from the DynamicCache."""

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        return compute().run(self._forward, tokens, keep)

    @torch.no_grad()
    def _forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)  # [1, n]
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=keep)
        self.tokens += tokens
        return out.logits[0].float()  # [keep, V]

    def drop(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.cache.crop(-num_tokens)
            del self.tokens[-num_tokens:]

    def export(self, start: int, end: int) -> torch.Tensor:
        return compute().run(self._export, start, end)

    def _export(self, start: int, end: int) -> torch.Tensor:
        layers = [
            (cast(Any, layer).keys[0, :, start:end], cast(Any, layer).values[0, :, start:end])
            for layer in self.cache.layers
        ]
        return torch.stack([torch.stack(kv) for kv in layers])  # [L, 2, kvh, n, d]

    def load(self, tokens: list[int], segments: Sequence[torch.Tensor]) -> None:
        compute().run(self._load, tokens, segments)

    @torch.no_grad()
    def _load(self, tokens: list[int], segments: Sequence[torch.Tensor]) -> None:
        if self.tokens:
            raise ValueError("load() needs an empty runner.")
        kv = torch.cat(list(segments), dim=3).to(self.model.device)  # [L, 2, kvh, n, d]
        if kv.shape[3] != len(tokens):
            raise ValueError(f"Cached segments hold {kv.shape[3]} positions for {len(tokens)} tokens.")
        for i, layer_kv in enumerate(kv):
            self.cache.update(layer_kv[0][None].contiguous(), layer_kv[1][None].contiguous(), i)
        self.tokens = list(tokens)


class ReferenceRunner:
    """Recomputes the whole sequence every pass without any cache: slow, obviously correct."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        self.tokens += tokens
        return compute().run(self._forward, keep)

    @torch.no_grad()
    def _forward(self, keep: int) -> torch.Tensor:
        ids = torch.tensor([self.tokens], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep)
        return out.logits[0].float()

    def drop(self, num_tokens: int) -> None:
        if num_tokens > 0:
            del self.tokens[-num_tokens:]
