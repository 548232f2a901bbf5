"""The peers: Hugging Face ``generate`` on the bare base model (greedy, any dtype, prompt lookup decoding).

What a user would run instead of agent-mtp. The engine's MTP adapter is detached while they run (its hooks would
otherwise add work to every forward), other dtypes use a cached copy of the bare model, forward passes are counted
with a hook on the model (prefill included, like the engine counts them) and TTFT is the end of the first pass.
Grammar-constrained prompts get the same constraint through a logits processor, so a constrained item is compared
with a constrained peer.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent_mtp.engine import MTPEngine
from agent_mtp.engine.constraints import TokenConstraint
from agent_mtp.engine.fast import blockq


@dataclass(frozen=True)
class HFOutput:
    token_ids: list[int]
    wall_s: float
    ttft_s: float
    forward_passes: int


@contextmanager
def bare_model(engine: Any) -> Iterator[Any]:
    """The engine's model with its MTP adapter detached for the duration (re-attached afterwards)."""
    adapter = engine.adapter
    if adapter is None or getattr(engine.model, "_agent_mtp_adapter", None) is None:
        yield engine.model
        return
    adapter.detach(engine.model)
    try:
        yield engine.model
    finally:
        adapter.attach(engine.model, engine.mask_token_id)


FAST_FP32 = "fast-fp32"
"""A bench runtime name: the fast runtime with the float32 GEMM for every pass (no block weights), to show the
block kernels' gain side by side."""
FAST_AVX2 = "fast-avx2"
"""A bench runtime name: the fast runtime with the block kernels in their AVX2 forms on a CPU with AVX-512 (the same
tokens; its own cost curve), to show the AVX-512 forms' gain side by side. Without AVX-512 it is the fast runtime."""


FAST_AVX512 = "fast-avx512"
"""A bench runtime name: the fast runtime with the block kernels in their AVX forms (AMX tiles and VNNI off) on a CPU
with AMX-INT8 or AVX-512 VNNI, to show the tile records' gain side by side. Without either it is the fast runtime."""
FAST_EXACT_MASKS = "fast-exact-masks"
"""A bench runtime name: the fast runtime with ``verified``'s mask rows computed exactly (``draft_masks="exact"``;
its own cost curve), to show what the 8-bit draft masks gain side by side (the same tokens)."""
FAST_INT16 = "fast-int16"
"""A bench runtime name: the fast runtime with real rows on the 16-bit grid (``row_grid="int16"``; its own cost
curve), to show that grid's gain and how often its output still equals HF ``generate`` side by side."""
FAST_AMX = "fast-amx"
"""A bench runtime name: the fast runtime with every block pass on the AMX tiles, on a CPU that also has AVX-512
VNNI (where short passes otherwise take VNNI: :data:`agent_mtp.engine.fast.blockq.AMX_ROWS_ENV`; the same tokens,
its own cost curve), to show that choice's gain side by side. Elsewhere it is the fast runtime."""
SIBLINGS = (FAST_AVX2, FAST_AVX512, FAST_AMX)
"""Runtimes that are the fast runtime with other kernels: sibling engines of their own (own cost curves)."""


def kernels_for(runtime: str | None) -> contextlib.AbstractContextManager[object]:
    """What a variant on ``runtime`` runs inside: the AVX kernels (tiles and VNNI off) for :data:`FAST_AVX512`, and in
    their AVX2 forms for :data:`FAST_AVX2`; the tiles for every pass for :data:`FAST_AMX`; else the process's
    choice."""
    stack = contextlib.ExitStack()
    if runtime == FAST_AMX and blockq.kernels_available():
        stack.enter_context(blockq.tiles_from(blockq.TILES_EVERY_PASS))
    elif runtime in SIBLINGS and blockq.kernels_available():
        stack.enter_context(blockq.avx_kernels())
        if runtime == FAST_AVX2:
            stack.enter_context(blockq.avx512(False))
    return stack


class BaselineModels:
    """What the variants run on: bare models per dtype (the engine's own with its adapter detached for its dtype, a
    cached copy for any other), sibling engines per runtime, and the llama.cpp peer (loaded on first use)."""

    def __init__(self, engine: Any, *, gguf: str | Path | None = None) -> None:
        self.main = engine
        self.gguf = gguf
        self._copies: dict[torch.dtype, Any] = {}
        self._engines: dict[str, Any] = {engine.runtime: engine}
        self._llama_cpp: Any = None

    def engine(self, runtime: str | None) -> Any:
        """The engine on ``runtime`` (None: the main engine), sharing the main engine's model and adapter."""
        if runtime is None:
            return self.main
        if runtime not in self._engines:
            if runtime == FAST_FP32:
                self._engines[runtime] = self.main.with_runtime("fast", block_weights=False)
            elif runtime == FAST_EXACT_MASKS:
                self._engines[runtime] = self.main.with_runtime("fast", draft_masks="exact")
            elif runtime == FAST_INT16:
                self._engines[runtime] = self.main.with_runtime("fast", row_grid="int16")
            elif runtime in SIBLINGS:  # a sibling of its own: a fast-runtime main engine would return itself
                self._engines[runtime] = MTPEngine(self.main.loaded, adapter=self.main.adapter, runtime="fast")
            else:
                self._engines[runtime] = self.main.with_runtime(runtime)
        return self._engines[runtime]

    def cost_curves(self) -> dict[str, list[list[float]]]:
        """The cost curve each runtime's planner used (those measured or loaded so far: one real token and exact
        masks), and where its planner priced passes on the live curve, that curve's real-token and draft-mask
        points as the run left them (engine/cost.py ``PassTimes``)."""
        curves: dict[str, list[list[float]]] = {}
        for runtime, e in self._engines.items():
            if e._cost_curve is None:
                continue
            curves[runtime] = [list(p) for p in e._cost_curve.points]
            if e.cost_curve_source != "live":
                continue
            live = e.pass_times.calibrated(e._cost_curve)
            if live is not e._cost_curve:
                # rows priced apart (real tokens, draft masks), or every row alike on ``points`` (no record paths)
                apart = (("real tokens", live.real), ("draft masks", live.draft))
                kinds = apart if live.draft is not None else (("rows", live.points),)
                for name, points in kinds:
                    if points is not None:
                        curves[f"{runtime} live, {name}"] = [list(p) for p in points]
        return curves

    def llama_cpp(self) -> Any:
        if self._llama_cpp is None:
            from agent_mtp.bench.llamacpp import LlamaCppPeer, gguf_for

            self._llama_cpp = LlamaCppPeer(gguf_for(self.main.model_id, self.gguf))
        return self._llama_cpp

    @contextmanager
    def use(self, dtype: torch.dtype | None) -> Iterator[Any]:
        if dtype is None or dtype == self.main.model.dtype:
            with bare_model(self.main) as model:
                yield model
            return
        if dtype not in self._copies:
            with bare_model(self.main) as model:
                self._copies[dtype] = copy.deepcopy(model).to(dtype).eval()
        yield self._copies[dtype]


class ConstraintLogitsProcessor:
    """A :class:`TokenConstraint` as an HF logits processor. Stateless towards HF: before each call the constraint
    is synchronised with the tokens generated so far (rolling back what assisted decoding rejected)."""

    def __init__(self, constraint: TokenConstraint, prompt_len: int) -> None:
        self.constraint = constraint
        self.prompt_len = prompt_len
        self.accepted: list[int] = []

    def sync(self, generated: list[int]) -> None:
        common = 0
        for a, b in zip(generated, self.accepted, strict=False):
            if a != b:
                break
            common += 1
        self.constraint.rollback(len(self.accepted) - common)
        del self.accepted[common:]
        for token in generated[common:]:
            if not self.constraint.accept(token):
                break
            self.accepted.append(token)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.sync(input_ids[0, self.prompt_len :].tolist())
        allowed = self.constraint.allowed_mask(scores.shape[-1]).to(scores.device)  # [V]
        return scores.masked_fill(~allowed, float("-inf"))


class _PassCounter:
    """Counts top-level forward calls and notes when the first one ended."""

    def __init__(self, model: Any) -> None:
        self.calls = 0
        self.first_end: float | None = None
        self._handle = model.register_forward_hook(self._after)

    def _after(self, module: Any, args: Any, output: Any) -> None:
        self.calls += 1
        if self.first_end is None:
            self.first_end = time.perf_counter()

    def remove(self) -> None:
        self._handle.remove()


def hf_generate(
    engine: Any,
    model: Any,
    ids: list[int],
    max_new_tokens: int,
    *,
    prompt_lookup: int | None = None,
    constraint: TokenConstraint | None = None,
) -> HFOutput:
    """Greedy ``model.generate`` (with ``prompt_lookup_num_tokens`` when given) on ``ids``; EOS ends it."""
    from transformers import LogitsProcessorList

    eos = sorted(engine.eos_token_ids)
    kwargs: dict[str, Any] = {}
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    if constraint is not None:
        kwargs["logits_processor"] = LogitsProcessorList([ConstraintLogitsProcessor(constraint, len(ids))])
    counter = _PassCounter(model)
    try:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids], device=model.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
                suppress_tokens=[engine.mask_token_id],
                **kwargs,
            )
        wall = time.perf_counter() - start
    finally:
        counter.remove()
    tokens = out[0, len(ids) :].tolist()  # ends with the EOS token when the model stopped, like the engine's ids
    ttft = (counter.first_end - start) if counter.first_end is not None else float("nan")
    return HFOutput(tokens, wall, ttft, counter.calls)
