"""A Llama-family decoder forward for the CPU, a handful of ops per layer, checked against the HF forward.

Per layer (n new tokens, ``x`` [n, hidden])::

    h = rms_norm(x);  qkv = W_qkv h  (+ adapter delta at mask rows)          # one packed GEMM  [n, q + 2 kv]
    (q, k) *= rope[positions]                                             # one complex multiply, in place
    cache[:, :, start:end] = (k, v);  x += W_o attend(q, cache[:end])         # one copy, 3 ops of attention
    h = rms_norm(x);  x += W_down (silu(gate) * up)  where gate|up = W_gu h   # two packed GEMMs

and logits are computed only for the last ``keep`` rows (the rows the decoder reads).
"""

from __future__ import annotations

import ctypes
import logging
import math
import statistics
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from agent_mtp.engine.fast import blockq
from agent_mtp.engine.fast.cache import KVCache
from agent_mtp.engine.fast.choices import StoredChoices, row_pair, rows_or_never, whole_number
from agent_mtp.engine.fast.weights import (
    BLOCKS_EVERY_PASS,
    CROSSOVER_BYTES,
    WEIGHT_DTYPES,
    MaskRuns,
    PackedLinear,
    Projection,
    flat_runs,
    measure_avx512,
    measure_block_rows,
    measure_buffered_rows,
    measure_tile_rows,
    rope_pair_order,
    stack_low_rank,
)

log = logging.getLogger("agent_mtp.engine.fast")

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
SDPA_FROM_ROWS = 32
"""Where the C++ attention kernel is unavailable: passes of at least this many new tokens (prefill) use SDPA,
shorter ones three small batched GEMMs. With the kernel, every pass attends in it (prefills included: on Zen 3 a
32-token prefill took 59.6 ms through SDPA and the Python layer loop, 46-50 in the fused pass; 300 tokens 459-481
against 405-436; 2,000 tokens 4.0 against 3.8 s)."""
KV_DTYPES = (torch.float32, torch.float16)
"""What a :class:`KVCache` may hold (see :attr:`FastModel.kv_dtype`)."""


SCREEN_ROWS = 6
"""Passes with at least this many greedy rows screen them in the output head (:attr:`BatchItem.argmax_only`) where
the machine's measurement says screening pays (:func:`measure_screen_rows`), and on models too small to time. The
screen pays where the head's exact rows are bound by their integer products rather than by reading the head from
memory: on a 2-core Zen 4, 8 / 16 exact rows of the head alone (read cold) took 2.1-2.7 / 4.7-5.4 ms and screened
1.6-2.0 / 2.8-3.2 ms; in 8 clients' batched passes, screened and exact interleaved at random, passes with 6 / 7 / 8
greedy rows took 0.97-0.99x / 0.94-0.97x / 0.97x the time screened, those with 3-5 0.94-1.07x (docs/benchmarks.md).
On a 2-core Zen 5, which issues four times the integer products a cycle, the screen lost: whole 8 / 16-row passes
took 1.07-1.30x / 1.11-1.28x the time screened."""

SCREEN_CANDIDATES = ((8, SCREEN_ROWS), (16, 12))
"""(greedy rows a timed pass has, the threshold chosen where screening wins there), smallest first
(:func:`measure_screen_rows`): screening wins at 8 rows -> 6 (as measured on Zen 4), only at 16 -> 12, at neither ->
0 (never)."""


@dataclass(frozen=True)
class ScreenStats:
    """Output-head passes that screened greedy rows, the rows screened and the record streams (16 logits each)
    recomputed exactly for them."""

    passes: int
    rows: int
    streams: int


@dataclass(frozen=True)
class BatchItem:
    """One sequence's share of a batched pass: new tokens, its own KV cache, and how many logits rows it reads."""

    tokens: Sequence[int]
    cache: KVCache
    keep: int
    coarse_masks: bool = False
    """Whether this sequence's mask rows are only drafts (``verified``: real rows check every one), so that block
    passes on the record paths may compute them on an 8-bit input grid (one integer product per weight instead of
    three). Exact mask rows (ConfAdapt, static: their tokens are committed) otherwise."""
    argmax_only: bool = False
    """Whether the caller reads this sequence's kept real rows only for their argmax (greedy decoding without a
    constraint): in a pass with at least :attr:`FastModel.screen_rows` such rows the output head screens them on the
    8-bit grid and recomputes exactly only the logits that could be the argmax
    (:meth:`~agent_mtp.engine.fast.weights.PackedLinear.screened`). Each such row's argmax is the exact head's; its
    other logits are lower approximations."""


@dataclass(frozen=True)
class _Segment:
    row_start: int
    row_end: int
    start: int
    """Cache position of the segment's first new token."""
    cache: KVCache
    rope: torch.Tensor
    bias: torch.Tensor | None


def unsupported_reason(model: Any) -> str | None:
    """Why the fast runtime cannot run ``model`` (None when it can)."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no config"
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type={model_type!r} (the fast runtime knows {sorted(SUPPORTED_MODEL_TYPES)})"
    params = next(model.parameters())
    if params.device.type != "cpu":
        return f"the model is on {params.device} (the fast runtime is for the CPU)"
    if params.dtype not in WEIGHT_DTYPES:
        return f"dtype={params.dtype} (the fast runtime reads float32 or bfloat16 weights)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act!r} (only silu)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) in {"dynamic", "longrope"}:
        return f"rope_type={rope.get('rope_type', rope.get('type'))!r} (position-dependent scaling is not supported)"
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        return "sliding-window attention is not supported"
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1 is not supported"
    head_dim = _head_dim(config)
    if head_dim % 2:
        return f"head_dim={head_dim} is odd"
    return None


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Projection
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection
    inter: int
    """Intermediate size: gate_up gives [gate | up], each ``inter`` wide."""


LoRAFactors = tuple[torch.Tensor, torch.Tensor, float]


def _linear_parts(module: Any) -> tuple[torch.Tensor, torch.Tensor | None, LoRAFactors | None]:
    """(weight, bias, LoRA factors or None) of a plain or gated-LoRA linear."""
    base = getattr(module, "base", module)
    lora = None
    if base is not module and getattr(module, "enabled", True):
        lora = (module.lora_A, module.lora_B, float(module.scale))
    bias = base.bias.detach() if base.bias is not None else None
    return base.weight.detach(), bias, lora


def _cat_bias(biases: Sequence[torch.Tensor | None], sizes: Sequence[int]) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(s) for b, s in zip(biases, sizes, strict=True)])


def _stored_choices(linears: Sequence[PackedLinear]) -> AbstractContextManager[StoredChoices]:
    """This machine's stored kernel choices for weights of these shapes, passed on this thread's pool, locked and
    saved around the block (:meth:`StoredChoices.settling`)."""
    from agent_mtp.engine.loading import cache_root

    shapes = [
        (
            linear.in_features,
            linear.out_features,
            linear.blocks.kind if linear.blocks is not None else str(linear.dtype),
        )
        for linear in linears
    ]
    return StoredChoices.settling(
        cache_root(), build=blockq.build_key(), shapes=shapes, threads=torch.get_num_threads()
    )


def _settle_choices(stored: StoredChoices, linears: Sequence[PackedLinear], rows: int | None) -> int | None:
    """Settle the process's kernel choices from ``stored`` (timing those it lacks) and return the crossover (``rows``
    where the environment pinned it)."""
    if not blockq.tiles_active():  # the kernel form first: the crossover is measured on it
        blockq.settle_avx512(lambda: stored.get("avx512", lambda: measure_avx512(linears), int, blockq.Wide))
        blockq.settle_buffered_rows(
            lambda: stored.get("buffered_rows", lambda: measure_buffered_rows(linears), int, whole_number)
        )
    else:  # which passes the tiles serve and which VNNI (the same bits)
        blockq.settle_tile_rows(
            lambda: stored.get(
                "tile_rows",
                lambda: measure_tile_rows(linears),
                lambda t: [t.exact, t.drafted],
                lambda v: blockq.TileRows(*row_pair(v)),
            )
        )
    if rows is None:
        rows = stored.get("block_rows", lambda: measure_block_rows(linears), int, whole_number)
        reach = "every pass" if rows >= BLOCKS_EVERY_PASS else f"passes of up to {rows} rows"
        log.info("Block weights serve %s here (as measured against the float32 GEMM)", reach)
    return rows


def source_signature(model: Any) -> tuple[int, ...]:
    """Changes whenever a weight the fast model copied is modified in place, or an adapter is (de)attached or
    switched: a prepared model is reused only while this stays equal."""
    return _signature(getattr(model, "_agent_mtp_adapter", None), *_watched(model))


class SourceSignature:
    """:func:`source_signature` of one model, without walking its module tree on every call (a walk of the default
    model's ~400 modules took ~2 ms; engines ask twice per request, on the compute thread): the parameters are
    listed again only when the attached adapter changes (attaching or detaching one swaps modules); their versions
    are read on every call. Replacing a module or parameter of the model by other means is not seen."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._adapter: Any = None
        self._lists: tuple[list[Any], list[Any], list[Any]] | None = None

    def __call__(self) -> tuple[int, ...]:
        adapter = getattr(self.model, "_agent_mtp_adapter", None)
        if self._lists is None or adapter is not self._adapter:  # ``is``: the held reference keeps its id unique
            self._adapter, self._lists = adapter, _watched(self.model)
        return _signature(adapter, *self._lists)


def _watched(model: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """The model's parameters, its adapter's parameters and LoRA layers (empty without an adapter)."""
    adapter = getattr(model, "_agent_mtp_adapter", None)
    if adapter is None:
        return list(model.parameters()), [], []
    return list(model.parameters()), list(adapter.parameters()), list(adapter.lora.values())


def _signature(adapter: Any, params: list[Any], adapter_params: list[Any], loras: list[Any]) -> tuple[int, ...]:
    versions = [p._version for p in params] + [p._version for p in adapter_params]
    versions += [int(getattr(layer, "enabled", True)) for layer in loras]
    return (id(adapter), *versions)


class FastModel:
    """A prepared copy of a Llama/Qwen2/Qwen3 model (plus its gated MTP adapter) for the CPU.

    Build once per process with :meth:`from_hf`; :meth:`forward` appends tokens to a :class:`KVCache` and returns
    the logits of the last ``keep`` rows. Thread-safe for concurrent forwards on different caches.

    Weights keep the model's dtype: float32 (exact against the HF forward up to kernel rounding) or bfloat16 (half
    the bytes per pass; GEMM inputs are rounded to bfloat16, everything else -- residual stream, norms, RoPE,
    attention, KV cache, logits -- stays float32, so it is closer to the float32 model than HF's all-bfloat16
    forward, but not equal to either)."""

    def __init__(
        self,
        model: Any,
        *,
        mask_token_id: int | None,
        prepack: bool = True,
        blocks: bool = True,
        kv_dtype: torch.dtype = torch.float32,
        grid_bits: int = 24,
    ) -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={kv_dtype} is not a KV cache dtype here; use torch.float32 or torch.float16.")
        if grid_bits not in blockq.GRID_BITS:
            raise ValueError(f"grid_bits={grid_bits!r} is not a grid here; use 24 (float32-accurate) or 16.")
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"The fast runtime cannot run this model: {reason}.")
        config = model.config
        self.signature = source_signature(model)
        self.num_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = _head_dim(config)
        self.groups = self.num_heads // self.kv_heads
        self.q_dim = self.num_heads * self.head_dim
        self.kv_dim = self.kv_heads * self.head_dim
        self.eps = float(config.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.max_length = int(getattr(config, "max_position_embeddings", 2048))
        self.grid_bits = grid_bits
        """Bits of the grid block passes on the record paths (AMX, VNNI) put exact rows on: 24 (float32-accurate)
        or 16 (fewer integer products per row on VNNI; outputs ~1e-5 of their scale off): :data:`blockq.GRID_BITS`."""
        self.kv_dtype = kv_dtype
        """What the KV caches hold: float32 (exact), or float16 (half the bytes every pass reads from its caches;
        attention still computes in float32 on the converted values)."""
        self.mask_token_id = mask_token_id
        decoder = model.model
        self.embed = decoder.embed_tokens.weight.detach()
        adapter = getattr(model, "_agent_mtp_adapter", None)
        self.mask_embedding = adapter.mask_embedding.detach().float() if adapter is not None else None
        order_q = rope_pair_order(self.num_heads, self.head_dim)
        order_k = rope_pair_order(self.kv_heads, self.head_dim)
        self.layers = [self._prepare_layer(layer, order_q, order_k, prepack, blocks) for layer in decoder.layers]
        self.final_norm = decoder.norm.weight.detach().float()
        self.lm_head = PackedLinear(model.get_output_embeddings().weight.detach(), prepack=prepack, blocks=blocks)
        fused = _fused_weights(self.layers)
        self._fused = None if fused is None else torch.classes.agent_mtp_blockq.LayerStack(fused)
        """The decoder weights handed to ``decode_layers`` once (a pass passes this one object)."""
        self.screen_rows = SCREEN_ROWS if blockq.screen_enabled() else 0
        """Passes with at least this many greedy rows (:attr:`BatchItem.argmax_only`) screen them in the output head
        (0: never; ``AGENT_MTP_SCREEN_HEAD=0``): measured once per machine for models past the CPU caches
        (:meth:`_settle_screen_rows`), else :data:`SCREEN_ROWS`."""
        self.screen_stats = ScreenStats(0, 0, 0)
        """What the head's screening has done so far (for benchmarks and tests; counted by the thread that runs the
        passes, one at a time)."""
        self.block_rows = self._settle_block_rows()
        """Passes of up to this many rows read the quantization blocks (0: none are kept), longer ones the float32
        GEMM: pinned by ``AGENT_MTP_BLOCK_ROWS``, else measured here for models past the CPU caches."""
        self._attend_kernel = self.head_dim % 8 == 0 and blockq.enabled() and blockq.kernels_available()
        """Whether short passes attend with the C++ kernel (RoPE, cache write and attention of every sequence in one
        call per layer) instead of ATen's bmm / softmax / bmm per sequence."""
        self._silu_kernel = all(layer.inter % 8 == 0 for layer in self.layers) and self._attend_kernel
        """Whether the Python layer loop takes the MLP activation from the C++ ``silu_mul`` (as the fused pass does)
        instead of ATen's silu and mul_."""
        self._rotary = decoder.rotary_emb
        self._rope = torch.empty(0, 1, self.head_dim // 2, dtype=torch.complex64)
        self._rope_lock = threading.Lock()
        self.screen_rows = self._settle_screen_rows()

    @classmethod
    def from_hf(
        cls,
        model: Any,
        *,
        mask_token_id: int | None,
        prepack: bool = True,
        blocks: bool = True,
        kv_dtype: torch.dtype = torch.float32,
        grid_bits: int = 24,
    ) -> FastModel:
        """``blocks``: also keep weights that are exactly GGUF quantization blocks as blocks, for short passes
        (:mod:`agent_mtp.engine.fast.blockq`); False keeps only the float32 GEMM. ``kv_dtype``, ``grid_bits``: see
        :attr:`kv_dtype`, :attr:`grid_bits`."""
        with torch.no_grad():
            return cls(
                model,
                mask_token_id=mask_token_id,
                prepack=prepack,
                blocks=blocks,
                kv_dtype=kv_dtype,
                grid_bits=grid_bits,
            )

    def _linears(self) -> list[PackedLinear]:
        projections = [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return [p.linear for p in projections] + [self.lm_head]

    def _settle_block_rows(self) -> int:
        linears = self._linears()
        self.stored_choices: StoredChoices | None = None
        """This machine's stored kernel choices (None where the model is too small to time, or has no blocks)."""
        if all(linear.blocks is None for linear in linears):
            return 0
        rows = blockq.pinned_rows()
        large = sum(linear.nbytes() for linear in linears) >= CROSSOVER_BYTES
        if large:  # measured once per machine (choices.py): each is timed only where the machine has none stored
            with _stored_choices(linears) as stored:
                self.stored_choices = stored
                rows = _settle_choices(stored, linears, rows)
        rows = blockq.MAX_ROWS if rows is None else rows
        for linear in linears:
            linear.block_rows = rows
        if rows >= BLOCKS_EVERY_PASS:  # no pass reads the float32 copies: release them (~0.5 GB, default model)
            released = sum(linear.release_dense() for linear in linears)
            _return_freed_memory()
            log.info("Released %.0f MB of float32 weights that no pass reads", released / 2**20)
        else:  # longer passes read them: packed now, not in the first such pass (a request's prefill)
            for linear in linears:
                linear.pack()
        return rows

    def _settle_screen_rows(self) -> int:
        """:attr:`screen_rows` on this machine: the stored choice (:mod:`.choices`), else :func:`measure_screen_rows`
        (stored for the next process); :data:`SCREEN_ROWS` where the model is too small to time (no stored choices)
        and where the head cannot screen; 0 where ``AGENT_MTP_SCREEN_HEAD=0``. Each input grid has its own choice
        (the 16-bit grid's exact rows take fewer products)."""
        if self.screen_rows <= 0 or self.stored_choices is None or not self.lm_head.screens(SCREEN_CANDIDATES[0][0]):
            return self.screen_rows
        name = "screen_rows" if self.grid_bits == 24 else f"screen_rows_int{self.grid_bits}"
        with _stored_choices(self._linears()) as stored:
            rows = stored.get(name, lambda: measure_screen_rows(self), int, rows_or_never)
        self.stored_choices = stored  # what the file holds now, this choice included
        return rows

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(
            len(self.layers),
            self.kv_heads,
            self.head_dim,
            max_length=self.max_length,
            capacity=capacity,
            dtype=self.kv_dtype,
        )

    # -- preparation ----------------------------------------------------------------------------------------
    def _prepare_layer(
        self, layer: Any, order_q: torch.Tensor, order_k: torch.Tensor, prepack: bool, blocks: bool
    ) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        (wq, bq, lq), (wk, bk, lk), (wv, bv, lv) = (_linear_parts(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        wq, wk = wq[order_q], wk[order_k]
        bq = bq[order_q] if bq is not None else None
        bk = bk[order_k] if bk is not None else None
        lq = (lq[0], lq[1][order_q], lq[2]) if lq is not None else None
        lk = (lk[0], lk[1][order_k], lk[2]) if lk is not None else None
        sizes = (self.q_dim, self.kv_dim, self.kv_dim)
        wo, bo, lo = _linear_parts(attn.o_proj)
        (wg, bg, lg), (wu, bu, lu) = (_linear_parts(m) for m in (mlp.gate_proj, mlp.up_proj))
        wd, bd, ld = _linear_parts(mlp.down_proj)
        inter = int(wg.shape[0])
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        half_order = rope_pair_order(1, self.head_dim)
        return _Layer(
            input_norm=layer.input_layernorm.weight.detach().float(),
            qkv=Projection(
                torch.cat([wq, wk, wv]),
                _cat_bias((bq, bk, bv), sizes),
                stack_low_rank((lq, lk, lv), sizes),
                prepack=prepack,
                blocks=blocks,
            ),
            q_norm=q_norm.weight.detach()[half_order].float() if q_norm is not None else None,
            k_norm=k_norm.weight.detach()[half_order].float() if k_norm is not None else None,
            o=Projection(wo, bo, stack_low_rank((lo,), (int(wo.shape[0]),)), prepack=prepack, blocks=blocks),
            post_norm=layer.post_attention_layernorm.weight.detach().float(),
            gate_up=Projection(
                torch.cat([wg, wu]),
                _cat_bias((bg, bu), (inter, inter)),
                stack_low_rank((lg, lu), (inter, inter)),
                prepack=prepack,
                blocks=blocks,
            ),
            down=Projection(wd, bd, stack_low_rank((ld,), (int(wd.shape[0]),)), prepack=prepack, blocks=blocks),
            inter=inter,
        )

    def _rope_rows(self, start: int, end: int) -> torch.Tensor:
        """RoPE as unit complex numbers (times HF's attention scaling) for positions [start, end): [n, 1, d/2]."""
        if end > self._rope.shape[0]:
            with self._rope_lock:
                if end > self._rope.shape[0]:
                    size = min(max(end, 2 * self._rope.shape[0], 512), max(self.max_length, end))
                    probe = torch.zeros(1, dtype=torch.float32)
                    cos, sin = self._rotary(probe, torch.arange(size)[None])  # [1, size, d] each, halves repeated
                    half = self.head_dim // 2
                    self._rope = torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())[:, None, :]
        return self._rope[start:end]

    # -- the forward -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        tokens: Sequence[int],
        cache: KVCache,
        keep: int,
        *,
        coarse_masks: bool = False,
        argmax_only: bool = False,
    ) -> torch.Tensor:
        """Append ``tokens`` at ``cache.length``; return fp32 logits of the last ``keep`` of them [keep, V].
        ``coarse_masks``, ``argmax_only``: see :class:`BatchItem`."""
        return self.forward_batch([BatchItem(tokens, cache, keep, coarse_masks, argmax_only)])[0]

    @torch.no_grad()
    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """One pass over several sequences (continuous batching): every GEMM runs once over all their new rows,
        attention runs per sequence against its own cache. Returns each item's logits [keep, V], in order."""
        if not items:
            return []
        by_kernel = self._attend_kernel
        segments = self._segments(items, biases=not by_kernel)
        tokens = [t for item in items for t in item.tokens]
        x = F.embedding(torch.tensor(tokens, dtype=torch.long), self.embed).float()  # [N, H]
        rows = _mask_runs(tokens, self.mask_token_id)
        coarse = _coarse_runs(rows, segments, items)
        if self.mask_embedding is not None:
            for run in rows:
                x[run] = self.mask_embedding
        rope = segments[0].rope if len(segments) == 1 else torch.cat([seg.rope for seg in segments])  # [N, 1, d/2]
        if by_kernel and self._fused is not None and len(tokens) <= self.block_rows:
            self._fused_layers(x, segments, rope, rows, coarse)
        else:
            for i, layer in enumerate(self.layers):
                self._layer(layer, i, x, segments, rope, rows, coarse, by_kernel)
        for item in items:
            item.cache.length += len(item.tokens)
        kept = [x[seg.row_end - item.keep : seg.row_end] for seg, item in zip(segments, items, strict=True)]
        h = kept[0] if len(kept) == 1 else torch.cat(kept)
        # the final norm inside the head's call (one op less; the kernels normalise as the layers' norms do)
        head_coarse = flat_runs(_kept_runs(coarse, segments, items)) if coarse else []
        screen = self._screened_rows(items, segments, rows, h.shape[0])
        norm = (self.final_norm, self.eps)
        if screen:
            logits, streams = self.lm_head.screened(h, screen, norm, head_coarse, grid_bits=self.grid_bits)
            done = self.screen_stats
            self.screen_stats = ScreenStats(done.passes + 1, done.rows + _count(screen), done.streams + streams)
        else:
            logits = self.lm_head(h, norm=norm, coarse=head_coarse, grid_bits=self.grid_bits)
        return list(logits.split([item.keep for item in items])) if len(items) > 1 else [logits]

    def _screened_rows(
        self, items: Sequence[BatchItem], segments: Sequence[_Segment], masks: MaskRuns, kept: int
    ) -> list[int]:
        """The head's rows to screen (flattened [start, stop) runs): the kept real rows of the ``argmax_only``
        items, where the pass has at least :attr:`screen_rows` of them and the head can screen; else none. Mask
        rows are never screened: the decode loop reads their confidences (draft-only ones are on the 8-bit grid
        anyway, exact ones stay exact)."""
        if self.screen_rows <= 0 or sum(item.keep for item in items if item.argmax_only) < self.screen_rows:
            return []  # (most passes: asked before the head's switches, which are op calls)
        greedy = [item.argmax_only for item in items for _ in range(item.keep)]
        for run in _kept_runs(masks, segments, items):
            greedy[run] = [False] * (run.stop - run.start)
        if sum(greedy) < self.screen_rows or not self.lm_head.screens(kept):
            return []
        return flat_runs(_runs(greedy))

    def greedy_tokens(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax of ``logits`` [n, V] (the first of equal maxima, as ``torch.argmax``), the mask token
        left out as the decode loop leaves it out (it is never a prediction); ``logits`` are not changed.

        Runners call it on the compute thread right after the pass: the rows were just written there and are still
        in that core's cache, while the decode thread, on the other core after a pass that streamed ~100 MB of
        weights through the caches, read a 49k-logit row in ~80-120 us instead of ~6 (measured, default model)."""
        rows = logits.detach().numpy()
        top = [int(i) for i in rows.argmax(-1)]
        mask = self.mask_token_id
        for r, token in enumerate(top):
            if token == mask:  # rare (an untrained mask token): the row without it
                row = rows[r].copy()
                row[mask] = float("-inf")
                top[r] = int(row.argmax())
        return top

    def _segments(self, items: Sequence[BatchItem], *, biases: bool) -> list[_Segment]:
        segments: list[_Segment] = []
        row = 0
        for item in items:
            n = len(item.tokens)
            if n < 1 or not 1 <= item.keep <= n:
                raise ValueError(f"A batch item needs >= 1 token and 1 <= keep <= tokens; got {n} and {item.keep}.")
            if any(item.cache is other.cache for other in items[: len(segments)]):
                raise ValueError("Two batch items share one KV cache; each sequence needs its own.")
            item.cache.reserve(n)
            start = item.cache.length
            bias = self._attention_bias(n, start) if biases and 1 < n < SDPA_FROM_ROWS else None
            segments.append(_Segment(row, row + n, start, item.cache, self._rope_rows(start, start + n), bias))
            row += n
        return segments

    def _layer(
        self,
        layer: _Layer,
        index: int,
        x: torch.Tensor,
        segments: list[_Segment],
        rope: torch.Tensor,
        rows: MaskRuns,
        coarse: MaskRuns,
        by_kernel: bool,
    ) -> None:
        n = x.shape[0]
        bits = self.grid_bits
        qkv = layer.qkv(x, rows, norm=(layer.input_norm, self.eps), coarse=coarse, grid_bits=bits)  # of rms_norm(x)
        if layer.q_norm is not None and layer.k_norm is not None:
            self._qk_norm(qkv, layer.q_norm, layer.k_norm)
        if by_kernel:  # RoPE, cache writes and attention of every segment: one C++ call
            attended = torch.ops.agent_mtp_blockq.attend(
                qkv,
                rope,
                [seg.cache.layers[index] for seg in segments],
                [seg.start for seg in segments],
                [seg.row_end - seg.row_start for seg in segments],
                self.num_heads,
                self.kv_heads,
                self.head_dim,
                self.scale,
            )
        else:
            qk = qkv[:, : self.q_dim + self.kv_dim].view(n, self.num_heads + self.kv_heads, self.head_dim // 2, 2)
            torch.view_as_complex(qk).mul_(rope)
            parts = [self._attend_segment(qkv, seg, index) for seg in segments]
            attended = parts[0] if len(parts) == 1 else torch.cat(parts)  # [N, q]
        layer.o.add_into(x, attended, rows, coarse, grid_bits=bits)
        gate_up = layer.gate_up(x, rows, norm=(layer.post_norm, self.eps), coarse=coarse, grid_bits=bits)  # [N, 2 I]
        if self._silu_kernel:  # the fused pass's op, so both give the same bits
            act = torch.ops.agent_mtp_blockq.silu_mul(gate_up, layer.inter)
        else:
            act = F.silu(gate_up[:, : layer.inter])
            act.mul_(gate_up[:, layer.inter :])
        layer.down.add_into(x, act, rows, coarse, grid_bits=bits)

    def _fused_layers(
        self, x: torch.Tensor, segments: Sequence[_Segment], rope: torch.Tensor, rows: MaskRuns, coarse: MaskRuns
    ) -> None:
        """All layers of a short block pass (one sequence or a batch) in one C++ call (the same ops as
        :meth:`_layer`)."""
        assert self._fused is not None
        torch.ops.agent_mtp_blockq.decode_layers(
            x,
            self._fused,
            [seg.cache.layers[i] for i in range(len(self.layers)) for seg in segments],  # layer-major
            rope,
            [seg.start for seg in segments],
            [seg.row_end - seg.row_start for seg in segments],
            flat_runs(rows),
            self.num_heads,
            self.kv_heads,
            self.head_dim,
            self.layers[0].inter,
            self.eps,
            self.scale,
            flat_runs(coarse),
            self.grid_bits,
        )

    def _attend_segment(self, qkv: torch.Tensor, seg: _Segment, index: int) -> torch.Tensor:
        """Write one sequence's new keys/values into its cache, attend its queries to its cache: [n, q]."""
        n, end = seg.row_end - seg.row_start, seg.start + seg.row_end - seg.row_start
        kv = seg.cache.layers[index]
        rows = qkv[seg.row_start : seg.row_end]
        kv[:, :, seg.start : end] = rows[:, self.q_dim :].view(n, 2, self.kv_heads, self.head_dim).permute(1, 2, 0, 3)
        cached = kv[:, :, :end]
        if cached.dtype != torch.float32:  # a float16 cache: the values it holds, attended in float32 (as the kernel)
            cached = cached.float()
        return self._attend(rows[:, : self.q_dim], cached, seg.start, seg.bias)

    def _qk_norm(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor) -> None:
        n, d = qkv.shape[0], self.head_dim
        q = qkv[:, : self.q_dim].view(n, self.num_heads, d)
        k = qkv[:, self.q_dim : self.q_dim + self.kv_dim].view(n, self.kv_heads, d)
        q.copy_(F.rms_norm(q, (d,), q_norm, self.eps))
        k.copy_(F.rms_norm(k, (d,), k_norm, self.eps))

    def _attention_bias(self, n: int, start: int) -> torch.Tensor:
        """Additive causal bias [groups * n, start + n] for a short multi-token pass (rows ordered group-major)."""
        keys = torch.arange(start + n)
        queries = start + torch.arange(n)
        bias = torch.zeros(n, start + n).masked_fill_(keys[None, :] > queries[:, None], float("-inf"))
        return bias.repeat(self.groups, 1)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, start: int, bias: torch.Tensor | None) -> torch.Tensor:
        """q [n, heads * d] against the cached keys/values kv [2, kv_heads, end, d] -> [n, heads * d]."""
        n, d, g = q.shape[0], self.head_dim, self.groups
        if n >= SDPA_FROM_ROWS:
            return self._attend_sdpa(q, kv, start)
        if n == 1:
            qg = q.view(self.kv_heads, g, d)  # [kvh, g, d]
        else:
            qg = q.view(n, self.kv_heads, g, d).permute(1, 2, 0, 3).reshape(self.kv_heads, g * n, d)
        keys, values = kv[0], kv[1]  # [kvh, end, d]
        if bias is None:
            scores = torch.bmm(qg, keys.transpose(1, 2)).mul_(self.scale)  # [kvh, g n, end]
        else:
            scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, values)  # [kvh, g n, d]
        if n == 1:
            return out.view(1, self.q_dim)
        return out.view(self.kv_heads, g, n, d).permute(2, 0, 1, 3).reshape(n, self.q_dim)

    def _attend_sdpa(self, q: torch.Tensor, kv: torch.Tensor, start: int) -> torch.Tensor:
        n, d = q.shape[0], self.head_dim
        q4 = q.view(n, self.num_heads, d).transpose(0, 1)[None]  # [1, h, n, d]
        keys, values = kv[0][None], kv[1][None]  # [1, kvh, end, d]
        if start == 0:
            out = F.scaled_dot_product_attention(q4, keys, values, is_causal=True, enable_gqa=True)
        else:
            allowed = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]  # [n, end]
            out = F.scaled_dot_product_attention(q4, keys, values, attn_mask=allowed, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(n, self.q_dim)


def measure_screen_rows(model: FastModel, *, rounds: int = 9, context: int = 24) -> int:
    """From how many greedy rows a pass screens them in the output head on this machine (:attr:`FastModel.
    screen_rows`; 0: never): whole batched passes of one greedy row per sequence (as a server's greedy runs feed
    them), screened and exact alternately, ``rounds`` of each at every size of :data:`SCREEN_CANDIDATES`, the medians
    compared. The sequences hold ``context`` positions of fixed token ids and are fed their own greedy tokens, so the
    head sees the logits of real hidden states (how many outputs the screen recomputes depends on them); each pass is
    rolled back. Run it on the thread that will run the passes (its OpenMP pool is the one that is timed)."""
    sizes = [rows for rows, _ in SCREEN_CANDIDATES]
    vocab = int(model.embed.shape[0])
    caches = [model.new_cache(context + 1) for _ in range(max(sizes))]
    fed: list[int] = []
    for s, cache in enumerate(caches):  # ids spread over the vocabulary, the same on every machine
        ids = [(17 + 7919 * (s * context + i)) % vocab for i in range(context)]
        fed.append(model.greedy_tokens(model.forward(ids, cache, 1))[0])
    before, stats = model.screen_rows, model.screen_stats

    def timed(rows: int, screen: bool) -> float:
        model.screen_rows = 1 if screen else 0
        items = [BatchItem([fed[s]], caches[s], 1, argmax_only=True) for s in range(rows)]
        start = time.perf_counter()
        for logits in model.forward_batch(items):
            model.greedy_tokens(logits)
        elapsed = time.perf_counter() - start
        for cache in caches[:rows]:
            cache.truncate(context)
        return elapsed

    chosen = 0
    try:
        for rows, threshold in SCREEN_CANDIDATES:
            timed(rows, True)  # warm-up of this size: first-touch pages of the grids and buffers
            timed(rows, False)
            screened: list[float] = []
            exact: list[float] = []
            for _ in range(rounds):
                screened.append(timed(rows, True))
                exact.append(timed(rows, False))
            on_screen, on_exact = statistics.median(screened), statistics.median(exact)
            log.debug("screen: %d greedy rows, screened %.2f ms, exact %.2f ms", rows, 1e3 * on_screen, 1e3 * on_exact)
            if on_screen < on_exact:
                chosen = threshold
                break
    finally:
        model.screen_rows, model.screen_stats = before, stats
    log.info(
        "The output head screens greedy rows here from %s",
        f"{chosen} rows a pass" if chosen else "no pass size (its exact rows were as fast)",
    )
    return chosen


def _return_freed_memory() -> None:
    """Hand freed heap pages back to the operating system where the C library is glibc: it keeps them otherwise
    (default model on Zen 3: resident memory 2.00 GB with the float32 copies, 1.75 GB after releasing them, 1.38 GB
    after this)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _fused_weights(layers: Sequence[_Layer]) -> list[torch.Tensor] | None:
    """The 38 tensors per layer ``decode_layers`` reads (kernels/blockq.cpp), or None where a layer is not plain
    Q4_1 blocks (no bias, no q/k norm, nothing padded or computed apart): those passes run :meth:`FastModel._layer`."""
    fused: list[torch.Tensor] = []
    none = torch.empty(0)
    for layer in layers:
        if layer.q_norm is not None or layer.k_norm is not None or layer.inter != layers[0].inter:
            return None
        fused.append(layer.input_norm)
        for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if proj is layer.gate_up:
                fused.append(layer.post_norm)
            blocks = proj.linear.blocks
            if blocks is None or blocks.kind != "q4_1" or not blocks.accumulates or proj.linear.bias is not None:
                return None
            assert blocks.minimum is not None
            extra = proj.linear.extra_rows
            fused += [blocks.qs, blocks.scale, blocks.minimum, extra if extra is not None else none]
            fused.append(proj.b_t if proj.b_t is not None else none)
            fused.append(blocks.lanes if blocks.lanes is not None else none)
        for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
            tiles = proj.linear.blocks.tiles if proj.linear.blocks is not None else None
            fused.append(tiles if tiles is not None else none)
        for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
            fused.append(proj.b_draft if proj.b_draft is not None else none)
            fused.append(proj.b_spans if proj.b_spans is not None else none)
    return fused


def _coarse_runs(rows: MaskRuns, segments: Sequence[_Segment], items: Sequence[BatchItem]) -> list[slice]:
    """The mask runs of the sequences whose mask rows are only drafts (:attr:`BatchItem.coarse_masks`)."""
    if not rows or not any(item.coarse_masks for item in items):
        return []
    pairs = zip(segments, items, strict=True)
    return [run for seg, item in pairs if item.coarse_masks for run in _clipped(rows, seg.row_start, seg.row_end)]


def _count(runs: Sequence[int]) -> int:
    """Rows in flattened [start, stop) runs."""
    return sum(runs[i + 1] - runs[i] for i in range(0, len(runs), 2))


def _kept_runs(runs: MaskRuns, segments: Sequence[_Segment], items: Sequence[BatchItem]) -> list[slice]:
    """``runs`` (rows of the pass) as rows of the head's input: each sequence's last ``keep`` rows, in order."""
    out: list[slice] = []
    offset = 0
    for seg, item in zip(segments, items, strict=True):
        first = seg.row_end - item.keep
        shift = offset - first
        out += [slice(r.start + shift, r.stop + shift) for r in _clipped(runs, first, seg.row_end)]
        offset += item.keep
    return out


def _clipped(runs: MaskRuns, start: int, stop: int) -> list[slice]:
    """The parts of ``runs`` inside rows [start, stop)."""
    parts = [slice(max(r.start, start), min(r.stop, stop)) for r in runs]
    return [p for p in parts if p.start < p.stop]


def _mask_runs(tokens: Sequence[int], mask_token_id: int | None) -> list[slice]:
    """Rows holding the mask token, as runs of consecutive rows (the decode loop's tail; one per sequence in a
    batch)."""
    if mask_token_id is None:
        return []
    return _runs([token == mask_token_id for token in tokens])


def _runs(flags: Sequence[bool]) -> list[slice]:
    """The rows whose flag is set, as runs of consecutive rows."""
    runs: list[slice] = []
    for i, flag in enumerate(flags):
        if not flag:
            continue
        if runs and runs[-1].stop == i:
            runs[-1] = slice(runs[-1].start, i + 1)
        else:
            runs.append(slice(i, i + 1))
    return runs
