"""The real-token pass of gated-adapter training, computed once per record and read back on every later draw.

With a gated adapter a training sequence's real tokens run the exact base model whatever the adapter has learnt
(the gate is off outside mask slots), and a document's real tokens see only their own document, from position 0. So a
record's keys and values in every layer, and the teacher's greedy next token after each of its tokens, are fixed for
the whole run. :class:`RealPassStore` computes them the first time a record is drawn; every later step that draws it
(a run draws each record several times) reads them back instead of running the base model over its tokens again. A
step's cache is the concatenation of its documents' entries, each cut to the tokens the step uses (a document cut
short is a prefix of its record, and causal attention makes its entries a prefix of the record's).

Entries are kept in memory up to a byte budget (least recently used dropped first) and, given a directory, on disk as
well, where later and resumed runs find them. Files are named by a hash of the record's tokens, inside a folder named
by the model's fingerprint and dtype, so a different base model, dtype or record never reads them. Only the hard
teacher uses the store (the soft teacher needs full logits, which are not kept).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent_mtp.engine.adapter import MTPAdapter, model_fingerprint
from agent_mtp.errors import TrainingError
from agent_mtp.training.head_loss import argmax_without_mask
from agent_mtp.training.packing import PackedSequence


@dataclass(frozen=True)
class RecordPass:
    """One record's real-token pass."""

    keys: torch.Tensor
    """[layers, kv_heads, n, head_dim] keys of every layer (after the rotary embedding), in the model's dtype."""
    values: torch.Tensor
    """[layers, kv_heads, n, head_dim]."""
    argmax: torch.Tensor
    """[n] the teacher's greedy next token after each token (the mask token never wins)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.argmax))


@dataclass
class StoreStats:
    hits: int = 0
    """Documents read from memory."""
    disk_reads: int = 0
    """Documents read from disk."""
    computed: int = 0
    """Documents whose record had to be run."""
    memory_bytes: int = 0
    """Bytes of the entries held in memory now."""
    disk_bytes: int = 0
    """Bytes this store has written to its directory."""
    evicted: int = 0

    def as_dict(self) -> dict[str, Any]:
        drawn = self.hits + self.disk_reads + self.computed
        return {
            "drawn": drawn,
            "reused": round((self.hits + self.disk_reads) / max(1, drawn), 4),
            "computed": self.computed,
            "memory_gb": round(self.memory_bytes / 2**30, 3),
            "disk_written_gb": round(self.disk_bytes / 2**30, 3),
        }


@dataclass
class RealPassStore:
    """Per-record real-token passes of ``model`` (the model that runs the training steps).

    ``adapter``: the gated adapter attached to ``model``, switched off while records are run (the real tokens never
    open the gate anyway; this makes the base model explicit). ``directory``: where entries persist (None: memory
    only). ``memory_bytes``: the in-memory budget.
    """

    model: Any = field(repr=False)
    mask_token_id: int
    adapter: MTPAdapter | None = field(default=None, repr=False)
    directory: Path | None = None
    memory_bytes: int = field(default_factory=lambda: default_memory_budget())
    stats: StoreStats = field(default_factory=StoreStats)
    _memory: OrderedDict[str, RecordPass] = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        if self.memory_bytes < 0:
            raise TrainingError(f"memory_bytes={self.memory_bytes}: give a budget of 0 or more bytes.")
        if self.directory is not None:
            self.directory = Path(self.directory) / _model_key(self.model)
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise TrainingError(f"real-pass cache: cannot create {self.directory} ({e}); pass another dir.") from e
            info = self.directory / "model.json"
            if not info.exists():
                info.write_text(json.dumps(_model_description(self.model), indent=2) + "\n")

    # -- a step's real pass -----------------------------------------------------------------------------------------
    def real_pass(self, seq: PackedSequence) -> tuple[Any, torch.Tensor]:
        """(DynamicCache of ``seq``'s real tokens, [L] teacher argmax after each real token) for a sequence packed
        with its sources (``pack_documents(..., sources=...)``)."""
        if not seq.sources:
            raise TrainingError("real-pass cache: the packed sequence has no sources; pack it with sources=records.")
        keys = [_record_key(s) for s in seq.sources]
        entries = self._entries(keys, seq.sources)
        device = model_device(self.model)
        parts = [(entries[k], n) for k, n in zip(keys, seq.lengths, strict=True)]
        layer_keys = torch.cat([e.keys[:, :, :n] for e, n in parts], dim=2).to(device)
        layer_values = torch.cat([e.values[:, :, :n] for e, n in parts], dim=2).to(device)
        argmax = torch.cat([e.argmax[:n] for e, n in parts]).to(device)
        return _dynamic_cache(layer_keys, layer_values), argmax

    def _entries(self, keys: list[str], sources: Sequence[Sequence[int]]) -> dict[str, RecordPass]:
        found: dict[str, RecordPass] = {}
        missing: dict[str, Sequence[int]] = {}
        for key, source in zip(keys, sources, strict=True):
            if key in found or key in missing:
                continue
            entry = self._from_memory(key)
            if entry is None:
                entry = self._from_disk(key)
            if entry is None:
                missing[key] = source
            else:
                found[key] = entry
        for key, entry in self._compute(missing).items():
            found[key] = entry
            self._to_disk(key, entry)
            self._remember(key, entry)
        return found

    # -- tiers ------------------------------------------------------------------------------------------------------
    def _from_memory(self, key: str) -> RecordPass | None:
        entry = self._memory.get(key)
        if entry is not None:
            self._memory.move_to_end(key)
            self.stats.hits += 1
        return entry

    def _from_disk(self, key: str) -> RecordPass | None:
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            blob = torch.load(path, weights_only=True)
            entry = RecordPass(blob["keys"], blob["values"], blob["argmax"])
        except Exception:  # a torn or foreign file: recompute it (and overwrite it)
            return None
        self.stats.disk_reads += 1
        self._remember(key, entry)
        return entry

    def _remember(self, key: str, entry: RecordPass) -> None:
        if entry.nbytes > self.memory_bytes:
            return
        self._memory[key] = entry
        self.stats.memory_bytes += entry.nbytes
        while self.stats.memory_bytes > self.memory_bytes:
            _, old = self._memory.popitem(last=False)
            self.stats.memory_bytes -= old.nbytes
            self.stats.evicted += 1

    def _to_disk(self, key: str, entry: RecordPass) -> None:
        path = self._path(key)
        if path is None:
            return
        path.parent.mkdir(exist_ok=True)
        staging = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"keys": entry.keys, "values": entry.values, "argmax": entry.argmax}, staging)
        staging.replace(path)  # atomic: a reader sees the old file or the whole new one
        self.stats.disk_bytes += path.stat().st_size

    def _path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / key[:2] / f"{key}.pt"

    # -- computing --------------------------------------------------------------------------------------------------
    def _compute(self, missing: dict[str, Sequence[int]]) -> dict[str, RecordPass]:
        return {key: self._run(tokens) for key, tokens in missing.items()}

    def _run(self, tokens: Sequence[int]) -> RecordPass:
        """Run the base model over one record, alone: its entry is then a function of the record only (not of the
        records that happened to be computed with it), so a resumed run reads back the very same bits."""
        from contextlib import nullcontext

        ids = torch.tensor([list(tokens)], dtype=torch.long, device=model_device(self.model))
        base = self.adapter.disabled() if self.adapter is not None else nullcontext()
        with torch.no_grad(), base:
            out = self.model(input_ids=ids, use_cache=True)
        layers = out.cache.layers
        self.stats.computed += 1
        return RecordPass(
            torch.stack([layer.keys[0] for layer in layers]).cpu(),  # [layers, kv_heads, n, head_dim]
            torch.stack([layer.values[0] for layer in layers]).cpu(),
            argmax_without_mask(out.logits[0], self.mask_token_id).cpu(),
        )


def default_memory_budget() -> int:
    """A quarter of the machine's physical memory, at most 8 GiB (2 GiB where the size cannot be read)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2 * 2**30
    return min(8 * 2**30, physical // 4)


def _dynamic_cache(keys: torch.Tensor, values: torch.Tensor) -> Any:
    """A transformers DynamicCache holding [layers, kv_heads, L, head_dim] keys/values (batch of one)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in zip(keys, values, strict=True)])


def _record_key(tokens: Sequence[int]) -> str:
    data = torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


def _model_description(model: Any) -> dict[str, Any]:
    weight = next(model.parameters())
    described = dict(model_fingerprint(model))
    described["dtype"] = str(weight.dtype).removeprefix("torch.")
    described["name_or_path"] = str(getattr(model.config, "name_or_path", ""))
    described["num_key_value_heads"] = getattr(model.config, "num_key_value_heads", None)
    return described


def _model_key(model: Any) -> str:
    """Folder name for ``model``'s entries: base model identity and dtype (entries of another model never match)."""
    text = json.dumps(_model_description(model), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_device(model: Any) -> torch.device:
    """The device of ``model``'s (first) parameters."""
    return next(model.parameters()).device
