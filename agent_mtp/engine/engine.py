"""MTPEngine: a Hugging Face causal LM that decodes several tokens per forward pass."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch

from agent_mtp.engine.adapter import MTPAdapter, load_adapter
from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.constraints import TokenConstraint
from agent_mtp.engine.cost import (
    CURVE_POINTS,
    CostCurve,
    PassTimes,
    load_or_measure,
    measure_cost_curve,
    store_curve,
)
from agent_mtp.engine.decode import DecodeSetup, decode
from agent_mtp.engine.fast import FastModel, FastRunner, blockq, unsupported_reason
from agent_mtp.engine.fast.choices import machine_key
from agent_mtp.engine.fast.model import SourceSignature
from agent_mtp.engine.fast.roofline import Roofline, measure_roofline
from agent_mtp.engine.fast.weights import BLOCKS_EVERY_PASS
from agent_mtp.engine.loading import DEFAULT_MODEL_ALIASES, LoadedModel, cache_root, load_model, prefix_cache_mb
from agent_mtp.engine.planner import Planner, needs_cost_curve
from agent_mtp.engine.prefix_cache import PrefixCache
from agent_mtp.engine.prompt import eos_token_ids, render_messages
from agent_mtp.engine.results import GenerationResult, StreamChunk
from agent_mtp.engine.runner import CachedRunner, PrefixRunner, ReferenceRunner, Runner
from agent_mtp.engine.text import TextTracker
from agent_mtp.engine.threads import compute, compute_threads
from agent_mtp.errors import AdapterError, ConfigError, EmptyPromptError, PromptError, PromptTooLongError

log = logging.getLogger("agent_mtp.engine")

Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]
SHIPPED_ADAPTERS = Path(__file__).resolve().parent.parent / "adapters"
DEFAULT_ADAPTER_DIR = SHIPPED_ADAPTERS / "smollm2-135m-instruct"
COST_CURVE_ROUNDS = 9
"""Interleaved timing rounds of the cost curve (the fastest of each size is kept): with 5, one lucky one-token
sample made the curve of an idle 2-core machine 1.35x at 2 tokens where 9 rounds measure 1.10x."""
COST_CURVE_PREFIX = 256
"""Cached context the cost curve's passes attend to (less on a model whose context window is smaller)."""
Runtime = Literal["auto", "fast", "hf"]
RUNTIMES: tuple[str, ...] = ("auto", "fast", "hf")
DraftMasks = Literal["int8", "exact"]
DRAFT_MASKS: tuple[str, ...] = ("int8", "exact")
DRAFT_MASKS_ENV = "AGENT_MTP_DRAFT_MASKS"
"""How ``verified``'s mask rows (only drafts) are computed where the fast runtime's record paths serve a pass:
``int8`` (default; their inputs on an 8-bit grid per block, ~1/3 of an exact row's multiply work) or ``exact``."""
KVCache = Literal["fp32", "fp16"]
KV_CACHES: tuple[str, ...] = ("fp32", "fp16")
KV_CACHE_ENV = "AGENT_MTP_KV_CACHE"
"""What the fast runtime's KV caches hold: ``fp32`` (default; greedy output equals HF ``generate``) or ``fp16`` (half
the bytes each pass reads from its caches: batched passes over long contexts are bound by them; keys and values are
rounded to float16, so output may differ from the float32 model's at near-ties)."""
RowGrid = Literal["int24", "int16"]
ROW_GRIDS: tuple[str, ...] = ("int24", "int16")
ROW_GRID_ENV = "AGENT_MTP_ROW_GRID"
"""The grid on which the fast runtime's record paths (AMX, VNNI) put a real row's inputs, per block of 32 weights:
``int24`` (default; float32-accurate, greedy output equals HF ``generate``) or ``int16`` (2^-15 of the block's
largest input: outputs ~1e-5 of their scale off, so output may differ from the float32 model's at near-ties; on
VNNI a real row then costs 16 integer products a block instead of 24, which passes of many rows -- batches of
sequences, verified's checked drafts -- are bound by). No effect on the AVX kernels (float32 throughout)."""
CostCurveSource = Literal["live", "stored"]
COST_CURVE_SOURCES: tuple[str, ...] = ("live", "stored")
COST_CURVE_ENV = "AGENT_MTP_COST_CURVE"
"""Which cost curve the planner of a sequence decoding alone reads: ``live`` (default; the stored curve with the
points this process has timed in its own decode passes in their place, :class:`~agent_mtp.engine.cost.PassTimes`)
or ``stored`` (the curve measured once per machine, as it is on disk)."""
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class MachineCosts:
    """What :meth:`MTPEngine.measure_machine` measured and stored."""

    curve: CostCurve
    curve_path: Path
    kernels: str
    """The weight path passes take (the fast runtime's kernel tag, or the runtime's name)."""
    kernel_choices: Mapping[str, Any]
    """The fast runtime's stored kernel choices (engine/fast/choices.py); empty where none are timed."""
    choices_path: Path | None
    measured: tuple[str, ...]
    """The kernel choices this process measured (the others were read from ``choices_path``)."""
    roofline: Roofline | None = None
    """The fast runtime's passes beside the same passes at this machine's memory and float32 GEMM rates
    (engine/fast/roofline.py); None on the Hugging Face runtime."""


class MTPEngine:
    """Multi-token prediction on a local causal LM.

    >>> engine = MTPEngine.from_pretrained("default")
    >>> r = engine.generate("List three colours.", DecodeConfig(mode="verified", max_new_tokens=64))
    >>> r.text, r.finish_reason, r.stats.tokens_per_forward

    ``MTPEngine(loaded, adapter=...)`` wraps a model that is already loaded (a
    :class:`~agent_mtp.engine.loading.LoadedModel`: model, tokenizer, model id, mask token and its id).

    ``runtime`` picks what runs the forward passes: ``"fast"`` is the package's own CPU forward
    (:mod:`agent_mtp.engine.fast`: weights pre-packed once, a preallocated KV cache, logits only for the rows the
    decoder reads) for Llama/Qwen2/Qwen3 models in float32 on the CPU; ``"hf"`` is the Hugging Face forward (any
    causal LM, any device: the reference); ``"auto"`` (default) takes ``"fast"`` where it can run and ``"hf"``
    elsewhere. :attr:`runtime` says which one runs.

    A prefix cache (:attr:`prefix_cache`) keeps the keys and values of every generation's prompt and output; a
    request that starts with a cached prefix (an agent's next step re-sends the conversation) prefills only the
    rest. ``prefix_cache_mb`` bounds it (default ``$AGENT_MTP_PREFIX_CACHE_MB`` or 512; 0 turns it off); output is
    the same with and without it; ``DecodeConfig(prefix_cache=False)`` bypasses it for one request.

    Thread-safe: generations on one engine are serialised by a lock (results equal sequential calls).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        adapter: MTPAdapter | None = None,
        cost_curve: CostCurve | None = None,
        runtime: Runtime = "auto",
        prefix_cache_mb: float | None = None,
        block_weights: bool = True,
        draft_masks: DraftMasks | None = None,
        kv_cache: KVCache | None = None,
        row_grid: RowGrid | None = None,
        cost_curve_source: CostCurveSource | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_id = loaded.model_id
        self.mask_token = loaded.mask_token
        self.mask_token_id = loaded.mask_token_id
        self.adapter = adapter
        self._cost_curve = cost_curve
        self._lock = threading.RLock()
        self.eos_token_ids = frozenset(eos_token_ids(self.model, self.tokenizer))
        self.runtime: str = _resolve_runtime(runtime, self.model)
        """The runtime that runs forward passes: "fast" or "hf" (``runtime="auto"`` resolved)."""
        self.block_weights = block_weights
        """Fast runtime: short passes read weights that are exactly GGUF quantization blocks (the default model's)
        as blocks (:mod:`agent_mtp.engine.fast.blockq`); False keeps the float32 GEMM for every pass."""
        self.draft_masks: DraftMasks = draft_masks_setting(draft_masks)
        """``verified``'s mask rows on the fast runtime's record paths: "int8" (an 8-bit input grid; they are only
        drafts, which real rows check, so output is the same) or "exact"; ``$AGENT_MTP_DRAFT_MASKS`` by default."""
        self.kv_cache: KVCache = kv_cache_setting(kv_cache, self.runtime)
        """What the fast runtime's KV caches hold: "fp32" (exact) or "fp16" (half the bytes a pass reads from them;
        see :data:`KV_CACHE_ENV`); ``$AGENT_MTP_KV_CACHE`` by default. Always "fp32" on the HF runtime."""
        self.row_grid: RowGrid = row_grid_setting(row_grid, self.runtime)
        """The fast runtime's grid for real rows on its record paths: "int24" (exact) or "int16" (fewer products a
        row; see :data:`ROW_GRID_ENV`); ``$AGENT_MTP_ROW_GRID`` by default. Always "int24" on the HF runtime."""
        self.cost_curve_source: CostCurveSource = cost_curve_source_setting(cost_curve_source)
        """What the planner of a sequence decoding alone prices passes with: "live" (the stored curve corrected by
        this engine's own pass times, :attr:`pass_times`) or "stored"; ``$AGENT_MTP_COST_CURVE`` by default."""
        self.pass_times = PassTimes()
        """How long this engine's decode passes of one sequence took, by kind (recorded by the decode loop)."""
        self._fast: FastModel | None = None
        self._signature = SourceSignature(self.model)
        """The model's weight signature: the fast model and the prefix cache are reused while it holds."""
        budget = prefix_cache_mb_setting(prefix_cache_mb)
        self.prefix_cache = PrefixCache(int(budget * 2**20))
        """Keys and values of earlier generations, reused by requests that share a prefix with them."""

    # -- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str = "default",
        *,
        adapter: str | Path | Literal["auto"] | None = "auto",
        mask_token: str | None = None,
        dtype: str | torch.dtype = "float32",
        revision: str | None = None,
        local_files_only: bool | None = None,
        check_adapter_base: bool = True,
        runtime: Runtime = "auto",
        prefix_cache_mb: float | None = None,
        kv_cache: KVCache | None = None,
        row_grid: RowGrid | None = None,
        cost_curve_source: CostCurveSource | None = None,
    ) -> MTPEngine:
        """Load ``"default"`` (the embedded SmolLM2-135M-Instruct + its shipped MTP adapter), a hub id, or a local
        directory. ``adapter``: "auto" (the shipped adapter for the default model, or ``<dir>/mtp_adapter`` beside a
        local model), a directory, or None for the bare model with an untrained mask token. ``runtime``: "auto",
        "fast" or "hf"; ``prefix_cache_mb``: the prefix cache's budget (see the class docstring); ``kv_cache``:
        "fp32" or "fp16" (:data:`KV_CACHE_ENV`); ``row_grid``: "int24" or "int16" (:data:`ROW_GRID_ENV`);
        ``cost_curve_source``: "live" or "stored" (:data:`COST_CURVE_ENV`)."""
        torch_dtype = _dtype(dtype)
        loaded = compute().run(  # torch work of loading runs where the passes will (engine/threads.py)
            load_model,
            name_or_path,
            dtype=torch_dtype,
            mask_token=mask_token,
            revision=revision,
            local_files_only=local_files_only,
        )
        adapter_dir = _adapter_dir(name_or_path, adapter)
        mtp_adapter = None
        if adapter_dir is not None:
            mtp_adapter = compute().run(
                load_adapter,
                loaded.model,
                adapter_dir,
                mask_token_id=loaded.mask_token_id,
                check_base=check_adapter_base,
            )
            if mtp_adapter.config.mask_token != loaded.mask_token:
                msg = (
                    f"{adapter_dir}: adapter uses mask token {mtp_adapter.config.mask_token!r}, "
                    f"model has {loaded.mask_token!r}."
                )
                raise AdapterError(msg + f" Pass mask_token={mtp_adapter.config.mask_token!r}.")
        return cls(
            loaded,
            adapter=mtp_adapter,
            runtime=runtime,
            prefix_cache_mb=prefix_cache_mb,
            kv_cache=kv_cache,
            row_grid=row_grid,
            cost_curve_source=cost_curve_source,
        )

    # -- prompts ------------------------------------------------------------------------------------------------
    @property
    def context_window(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: token ids pass through; a string becomes one user message and a list of
        {"role", "content"} dicts a conversation, both rendered by :func:`~agent_mtp.engine.prompt.render_messages`."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise EmptyPromptError("The prompt is empty; pass some text, messages or token ids.")
            return self._render([{"role": "user", "content": prompt}])
        items = list(prompt)
        if not items:
            raise EmptyPromptError("The prompt is empty; pass some text, messages or token ids.")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return self._check_ids([int(cast(int, t)) for t in items])
        if all(isinstance(m, Mapping) for m in items):
            return self._render(items)  # type: ignore[arg-type]
        raise PromptError(
            "A prompt is a string, a list of {'role': ..., 'content': ...} messages, or a list of token ids; "
            f"got a list of {sorted({type(x).__name__ for x in items})}."
        )

    def _render(self, messages: list[Mapping[str, Any]]) -> list[int]:
        for i, m in enumerate(messages):
            if "role" not in m or "content" not in m:
                raise PromptError(f"Message {i} needs 'role' and 'content' keys; got {sorted(m)}.")
        return self._check_ids(render_messages(self.tokenizer, messages))

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise EmptyPromptError("The prompt encodes to zero tokens.")
        vocab = self.model.get_input_embeddings().weight.shape[0]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"Token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
        if self.mask_token_id in ids:
            raise PromptError(f"The prompt contains the mask token {self.mask_token!r}; it is reserved for MTP.")
        if len(ids) >= self.context_window:
            msg = (
                f"The prompt has {len(ids)} tokens but the model's context window is {self.context_window}; "
                "shorten the prompt (drop old messages or tool results)."
            )
            raise PromptTooLongError(msg, prompt_tokens=len(ids), context_window=self.context_window)
        return ids

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode_tokens(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False))

    # -- generation -----------------------------------------------------------------------------------------
    def stream(
        self,
        prompt: Prompt,
        config: DecodeConfig | None = None,
        *,
        constraint: TokenConstraint | None = None,
        runner: Runner | None = None,
        _reference: bool = False,
    ) -> Generator[StreamChunk, None, None]:
        """Yield one chunk per forward pass; the last chunk has ``finish_reason`` and ``stats``.

        ``runner``: an empty runner to decode on instead of a new one of this engine's runtime, for callers that
        own the model's concurrency (a batch scheduler whose runners share passes). Generations are then not
        serialised by the engine's lock; the prefix cache is still read and kept (it is thread-safe)."""
        started = time.perf_counter()
        cfg = config or DecodeConfig()
        ids = self.encode_prompt(prompt)
        cfg = self._fit_to_context(cfg, len(ids))
        curve = self.cost_curve if needs_cost_curve(cfg) else None
        setup = DecodeSetup(
            self.mask_token_id,
            self.eos_token_ids,
            Planner.for_config(cfg, curve),
            self.draft_masks == "int8",
            # (a reference run's passes are the HF forward's, not this runtime's)
            self.pass_times if self.cost_curve_source == "live" and not _reference else None,
        )
        if runner is not None:
            if runner.length:
                raise ValueError(f"stream(runner=...) needs an empty runner; this one holds {runner.length} tokens.")
            yield from self._decode(runner, ids, cfg, setup, constraint, started)
            return
        with self._lock:
            own: Runner = ReferenceRunner(self.model) if _reference else self.new_runner()
            yield from self._decode(own, ids, cfg, setup, constraint, started)

    def _decode(
        self,
        runner: Runner,
        ids: list[int],
        cfg: DecodeConfig,
        setup: DecodeSetup,
        constraint: TokenConstraint | None,
        started: float,
    ) -> Generator[StreamChunk, None, None]:
        reuse = cfg.prefix_cache and self.prefix_cache.budget_bytes > 0 and isinstance(runner, PrefixRunner)
        if reuse:  # the cache's copies run where the passes do (engine/threads.py)
            compute().run(self._restore_prefix, cast(PrefixRunner, runner), ids)
        tracker = TextTracker(self.tokenizer, cfg.stop)
        finished = False
        try:
            yield from decode(runner, ids, cfg, setup, tracker, constraint=constraint, started_at=started)
            finished = True
        except GeneratorExit:  # the caller stopped reading between passes: the cache is consistent
            finished = True
            raise
        finally:
            if reuse and finished:
                compute().run(self._keep_prefix, cast(PrefixRunner, runner))

    def _restore_prefix(self, runner: PrefixRunner, ids: list[int]) -> None:
        """Load the longest cached prefix of ``ids`` (all but the last token: its logits start decoding)."""
        self.prefix_cache.bind(self._signature())
        match = self.prefix_cache.match(ids, limit=len(ids) - 1)
        if match.length:
            runner.load(ids[: match.length], match.segments)

    def _keep_prefix(self, runner: PrefixRunner) -> None:
        tokens = runner.tokens
        if self.mask_token_id in tokens:  # never: every pass drops its masks; kept as a guard
            tokens = tokens[: tokens.index(self.mask_token_id)]
        self.prefix_cache.insert(tokens, runner.export)

    def generate(
        self,
        prompt: Prompt,
        config: DecodeConfig | None = None,
        *,
        constraint: TokenConstraint | None = None,
        runner: Runner | None = None,
        _reference: bool = False,
    ) -> GenerationResult:
        """Decode to the end and return text, token ids, finish reason and stats."""
        text: list[str] = []
        ids: list[int] = []
        last: StreamChunk | None = None
        for chunk in self.stream(prompt, config, constraint=constraint, runner=runner, _reference=_reference):
            text.append(chunk.text)
            ids += chunk.token_ids
            last = chunk
        assert last is not None and last.stats is not None and last.finish_reason is not None
        return GenerationResult("".join(text), ids, last.finish_reason, last.stats)

    def with_runtime(
        self,
        runtime: Runtime,
        *,
        block_weights: bool | None = None,
        draft_masks: DraftMasks | None = None,
        kv_cache: KVCache | None = None,
        row_grid: RowGrid | None = None,
    ) -> MTPEngine:
        """This engine if it already runs on ``runtime`` (with ``block_weights``, ``draft_masks``, ``kv_cache`` and
        ``row_grid``, None: this engine's), else a sibling over the same model, tokenizer and adapter (for
        side-by-side comparisons; it has its own lock and cost curve). An HF sibling keeps the model's own (float32)
        cache and rows."""
        blocks = self.block_weights if block_weights is None else block_weights
        masks = self.draft_masks if draft_masks is None else draft_masks
        kv = self.kv_cache if kv_cache is None else kv_cache
        grid = self.row_grid if row_grid is None else row_grid
        target = _resolve_runtime(runtime, self.model)
        if target == "hf" and kv_cache is None:
            kv = "fp32"
        if target == "hf" and row_grid is None:
            grid = "int24"
        current = (self.runtime, self.block_weights, self.draft_masks, self.kv_cache, self.row_grid)
        if (target, blocks, masks, kv, grid) == current:
            return self
        return MTPEngine(
            self.loaded,
            adapter=self.adapter,
            runtime=runtime,
            block_weights=blocks,
            draft_masks=masks,
            kv_cache=kv,
            row_grid=grid,
            cost_curve_source=self.cost_curve_source,
        )

    def prepare_runtime(self) -> None:
        """Prepare the fast runtime's model now instead of on the first generation: its weights laid out once
        (quantization blocks, their kernels' layouts, pre-packed float32 copies where long passes read them; ~0.8 s
        for the default model on a 2-core Zen 5, which the first request paid in its time to first token). Nothing
        to do on the Hugging Face runtime. Every front end's engine is prepared so (``service.shared_engine``)."""
        if self.runtime != "hf":
            self._fast_model()

    def new_runner(self) -> Runner:
        """A runner for one sequence on this engine's runtime (the fast model is prepared on first use, and again
        whenever a weight it copied has changed in place, e.g. by training)."""
        if self.runtime == "hf":
            return CachedRunner(self.model)
        return FastRunner(self._fast_model())

    def _fast_model(self) -> FastModel:
        """The fast runtime's model, prepared on first use and again when a weight it copied changed in place."""
        with self._lock:
            if self._fast is None or self._fast.signature != self._signature():
                log.info("Preparing the fast runtime for %s", self.model_id)
                self._fast = compute().run(
                    FastModel.from_hf,
                    self.model,
                    mask_token_id=self.mask_token_id,
                    blocks=self.block_weights,
                    kv_dtype=torch.float16 if self.kv_cache == "fp16" else torch.float32,
                    grid_bits=16 if self.row_grid == "int16" else 24,
                )
            return self._fast

    def _fit_to_context(self, cfg: DecodeConfig, prompt_len: int) -> DecodeConfig:
        k = 64 if cfg.k_max == "auto" else int(cfg.k_max)
        room = self.context_window - prompt_len - k - (cfg.ngram_draft_len if cfg.mode == "verified" else 0)
        if room < 1:
            msg = (
                f"The prompt has {prompt_len} tokens; with room for k_max={cfg.k_max} proposals it exceeds the "
                f"context window of {self.context_window}. Shorten the prompt or lower k_max."
            )
            raise PromptTooLongError(msg, prompt_tokens=prompt_len, context_window=self.context_window)
        return cfg.replace(max_new_tokens=room) if cfg.max_new_tokens > room else cfg

    # -- scoring (the exact NTP path) -----------------------------------------------------------------------
    @torch.no_grad()
    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int]) -> list[float]:
        """Log-probabilities of ``continuation_ids`` under the base model (teacher forcing, one pass)."""
        if not continuation_ids:
            return []
        ids = self._check_ids([*prompt_ids, *continuation_ids][:-1])
        with self._lock:
            return compute().run(self._score, ids, list(continuation_ids))

    @torch.no_grad()
    def _score(self, ids: list[int], continuation_ids: list[int]) -> list[float]:
        tensor = torch.tensor([ids], device=self.model.device)
        logits = self.model(input_ids=tensor, logits_to_keep=len(continuation_ids)).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        target = torch.tensor(continuation_ids, device=logp.device)
        return logp.gather(-1, target[:, None]).squeeze(-1).tolist()  # type: ignore[no-any-return]

    # -- cost-aware k -----------------------------------------------------------------------------------------
    @property
    def cost_curve(self) -> CostCurve:
        """Relative cost of an n-token forward on this machine, measured once and cached on disk."""
        if self._cost_curve is None:
            with self._lock:
                self._cost_curve = load_or_measure(self._cost_curve_path(), self.measure_cost_curve)
        return self._cost_curve

    def set_cost_curve(self, curve: CostCurve) -> None:
        self._cost_curve = curve

    def measure_machine(self) -> MachineCosts:
        """Measure this engine's forward cost curve now, use it, and store it where later engines on this machine
        read it (OSError where the cache folder cannot be written); with it the fast runtime's kernel choices as this
        process settled them (measured afresh where ``$AGENT_MTP_KERNEL_CHOICES=measure`` was set before the runtime
        was prepared, as ``agent-mtp measure-machine`` does), and on the fast runtime its passes beside the same passes
        at the machine's rates (:class:`~agent_mtp.engine.fast.roofline.Roofline`, not stored). Run it on an idle
        machine."""
        curve = self.measure_cost_curve()
        path = self._cost_curve_path()
        store_curve(path, curve)
        self.set_cost_curve(curve)
        fast = self._fast_model() if self.runtime == "fast" else None
        stored = fast.stored_choices if fast is not None else None
        roofline = None
        if fast is not None:
            with self._lock:
                roofline = compute().run(measure_roofline, fast, context=self._curve_prefix_length())
        return MachineCosts(
            curve=curve,
            curve_path=path,
            kernels=blockq.kernel_tag() if self.runtime == "fast" and self.block_weights else self.runtime,
            kernel_choices=dict(stored.values) if stored is not None else {},
            choices_path=stored.path if stored is not None else None,
            measured=tuple(stored.measured) if stored is not None else (),
            roofline=roofline,
        )

    def _cost_curve_path(self) -> Path:
        device = str(self.model.device).replace(":", "")
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.model_id)
        dtype = str(self.model.dtype).replace("torch.", "")
        rows = self._fast_model().block_rows if self.runtime != "hf" and self.block_weights else None
        # read after preparing the model, which settles the kernels' form (and the crossover) for the process
        kernels = "" if self.runtime == "hf" else f"-{blockq.kernel_tag() if self.block_weights else 'fp32'}"
        if rows is not None:
            kernels += "-rall" if rows >= BLOCKS_EVERY_PASS else f"-r{rows}"  # the crossover the model settled on
        if self.runtime != "hf" and self.draft_masks == "exact":
            kernels += "-exactmasks"  # its mask_share is 1
        if self.runtime != "hf" and self.kv_cache == "fp16":
            kernels += "-kv16"
        if self.runtime != "hf" and self.row_grid == "int16":
            kernels += "-grid16"
        # c2: curves with the real-token and draft-mask passes measured apart (older files lack them); the machine (its
        # CPU and the kernels' build) keeps a curve from being read on another CPU that shares the cache folder
        build = blockq.build_key() if self.runtime != "hf" and self.block_weights else ""
        accelerator = torch.cuda.get_device_name(self.model.device) if self.model.device.type == "cuda" else ""
        machine = machine_key(f"{build}|{accelerator}")
        name = f"{slug}-{device}-{dtype}-{self.runtime}{kernels}-t{compute_threads()}-m{machine}-c2.json"
        return cache_root() / "cost_curves" / name

    def _curve_prefix_length(self) -> int:
        """Cached positions the cost curve's passes (and the roofline's) run on: COST_CURVE_PREFIX where the longest
        pass still fits the context window (small models fit too)."""
        return max(min(COST_CURVE_PREFIX, self.context_window - max(CURVE_POINTS)), 1)

    def measure_cost_curve(self) -> CostCurve:
        """Time decode-shaped passes of 1..32 tokens (one real token, then masks, every row's logits read) on a
        cached 256-token prefix on this engine's runtime now, and return the curve (relative to one token); where
        the fast runtime's record paths (AMX, VNNI) serve the passes, the same passes with draft-only masks
        (:attr:`CostCurve.draft`, :attr:`CostCurve.mask_share`) and passes of n real tokens (:attr:`CostCurve.real`)
        too. :attr:`cost_curve` measures once per machine and caches it on disk; call this to measure afresh (then
        :meth:`set_cost_curve`)."""
        log.info("Measuring the forward cost curve of %s", self.model_id)
        high = min(1000, self.mask_token_id)
        length = self._curve_prefix_length()
        prefix = [int(t) for t in torch.randint(3, high, (length,), generator=torch.Generator().manual_seed(0))]
        with self._lock:
            runner = self.new_runner()
            runner.forward(prefix, 1)

            def forward_n(n: int) -> None:
                runner.forward([prefix[-1]] + [self.mask_token_id] * (n - 1), n)
                runner.drop(n)

            draft_masks_n = None
            if self.draft_masks == "int8" and isinstance(runner, FastRunner) and blockq.records_active():

                def draft_masks_n(n: int) -> None:
                    runner.coarse_masks = True
                    try:
                        forward_n(n)
                    finally:
                        runner.coarse_masks = False

            def real_n(n: int) -> None:  # a verified pass's pending token and draft: n real tokens, no masks
                if isinstance(runner, FastRunner):
                    runner.argmax_only = True  # greedy rows, as verified's (the output head may screen them)
                runner.forward([prefix[i % len(prefix)] for i in range(n)], n)
                runner.drop(n)

            # where masks are not draft-only every row costs alike: the one curve prices them all
            return measure_cost_curve(
                forward_n,
                repeats=COST_CURVE_ROUNDS,
                draft_masks_n=draft_masks_n,
                real_n=real_n if draft_masks_n is not None else None,
            )


def _choice(name: str, value: str | None, env: str, choices: tuple[str, ...], default: str, hint: str) -> str:
    """``value``, else ``$env``, else ``default``; a :class:`ConfigError` naming the source and ``hint`` otherwise."""
    source = name if value is not None else env
    raw = value if value is not None else (os.environ.get(env, "").strip().lower() or default)
    if raw not in choices:
        raise ConfigError(f"{source}={raw!r} is not {hint}.")
    return raw


def _fast_runtime_choice(
    name: str, value: str | None, env: str, choices: tuple[str, ...], runtime: str, hint: str, hf_reason: str
) -> str:
    """:func:`_choice` of a fast-runtime setting whose first choice is the default and the only one the HF runtime
    has: another one asked for explicitly on the HF runtime is refused (``hf_reason`` says why); the environment's
    leaves an HF engine at the default (a process may hold both runtimes: the bench's HF peer)."""
    default = choices[0]
    raw = _choice(name, value, env, choices, default, hint)
    if raw != default and runtime == "hf":
        if value is not None:
            raise ConfigError(f"{name}={raw!r} needs the fast runtime; {hf_reason}.")
        return default
    return raw


def kv_cache_setting(value: str | None, runtime: str) -> KVCache:
    """``value``, else ``$AGENT_MTP_KV_CACHE``, else "fp32"; a clear error for anything else, and for an explicit
    "fp16" on the HF runtime (whose cache is the model's own). The environment's "fp16" leaves an HF engine at
    "fp32"."""
    hint = "a KV cache precision; use 'fp32' (the default: exact) or 'fp16' (half the bytes per pass, output may "
    hint += "differ at near-ties)"
    reason = "the HF runtime keeps the model's own cache"
    return cast(KVCache, _fast_runtime_choice("kv_cache", value, KV_CACHE_ENV, KV_CACHES, runtime, hint, reason))


def row_grid_setting(value: str | None, runtime: str) -> RowGrid:
    """``value``, else ``$AGENT_MTP_ROW_GRID``, else "int24"; a clear error for anything else, and for an explicit
    "int16" on the HF runtime (which computes every row in float32). The environment's "int16" leaves an HF engine
    at "int24"."""
    hint = "a grid for real rows; use 'int24' (the default: float32-accurate) or 'int16' (fewer products per row on "
    hint += "VNNI, output may differ at near-ties)"
    reason = "the HF runtime computes rows in float32"
    return cast(RowGrid, _fast_runtime_choice("row_grid", value, ROW_GRID_ENV, ROW_GRIDS, runtime, hint, reason))


def draft_masks_setting(value: str | None) -> DraftMasks:
    """``value``, else ``$AGENT_MTP_DRAFT_MASKS``, else "int8"; a clear error for anything else."""
    hint = "a way to compute verified's mask rows; use 'int8' (the default: drafts on an 8-bit grid, same output) or "
    hint += "'exact'"
    return cast(DraftMasks, _choice("draft_masks", value, DRAFT_MASKS_ENV, DRAFT_MASKS, "int8", hint))


def cost_curve_source_setting(value: str | None) -> CostCurveSource:
    """``value``, else ``$AGENT_MTP_COST_CURVE``, else "live"; a clear error for anything else."""
    hint = "a cost curve source; use 'live' (the default: the stored curve corrected by this process's own passes) "
    hint += "or 'stored'"
    return cast(CostCurveSource, _choice("cost_curve_source", value, COST_CURVE_ENV, COST_CURVE_SOURCES, "live", hint))


def prefix_cache_mb_setting(value: float | None) -> float:
    """The prefix cache budget in MB: ``value``, else the environment's (see :func:`loading.prefix_cache_mb`)."""
    if value is None:
        return prefix_cache_mb()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ConfigError(f"prefix_cache_mb={value!r} is invalid; use a number of megabytes >= 0 (0: off).")
    return float(value)


def _resolve_runtime(runtime: str, model: Any) -> str:
    if runtime not in RUNTIMES:
        raise ConfigError(f"runtime={runtime!r} is not supported; use one of {', '.join(RUNTIMES)}.")
    if runtime == "hf":
        return "hf"
    reason = unsupported_reason(model)
    if reason is None:
        return "fast"
    if runtime == "fast":
        raise ConfigError(f"runtime='fast' cannot run this model: {reason}. Use runtime='hf' (or 'auto').")
    log.info("Using the Hugging Face runtime: the fast runtime cannot run %s", reason)
    return "hf"


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    return DTYPES[dtype]


def _adapter_dir(name_or_path: str, adapter: str | Path | None) -> Path | None:
    if adapter is None:
        return None
    if adapter != "auto":
        path = Path(adapter)
        if not path.is_dir():
            raise AdapterError(f"adapter={str(adapter)!r} is not a directory; pass an adapter directory or None.")
        return path
    if name_or_path.lower() in DEFAULT_MODEL_ALIASES:
        return DEFAULT_ADAPTER_DIR if (DEFAULT_ADAPTER_DIR / "adapter_config.json").is_file() else None
    beside = Path(name_or_path) / "mtp_adapter"
    return beside if (beside / "adapter_config.json").is_file() else None
