"""The self-distillation loop: AdamW + warmup, clipping, bf16 option, checkpoints/resume, eval, JSONL log, plot.

out/
  checkpoint/       adapter files + trainer_state.pt (optimizer, step, best metric) -- resume from here
  adapter/          the final adapter (gated-lora) or model (full)
  best/             the adapter with the best held-out verified tokens/forward
  log.jsonl         one line per logged step and per evaluation
  curves.png        the curves at the end
"""

from __future__ import annotations

import copy
import json
import math
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

import torch

from agent_mtp.engine.adapter import LLAMA_TARGETS, MTPAdapter, load_adapter, new_adapter, read_adapter_config
from agent_mtp.engine.engine import MTPEngine
from agent_mtp.engine.loading import LoadedModel
from agent_mtp.errors import AdapterError, TrainingError
from agent_mtp.training.attention import use_slot_attention
from agent_mtp.training.data import Record, read_records
from agent_mtp.training.evaluate import EvalPrompt, eval_prompts, evaluate
from agent_mtp.training.objective import ObjectiveConfig, StepOutput, distill_full, distill_gated
from agent_mtp.training.packing import PackedSequence, Region, pack_documents
from agent_mtp.training.precision import low_precision_twin
from agent_mtp.training.real_cache import RealPassStore, default_memory_budget

STATE_FILE = "trainer_state.pt"
ADAPTER_LINK = "adapter_link.txt"
"""In a checkpoint without its own adapter weights: the folder (relative path) that holds them."""


@dataclass(frozen=True)
class TrainConfig:
    adapter: Literal["gated-lora", "full"] = "gated-lora"
    """Gated LoRA (+ mask embedding) or the paper's full fine-tune with a frozen teacher copy."""
    rank: int = 16
    model_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the frozen base weights in training steps (gated-lora): "bf16" runs a bf16 twin of the model with the
    adapter's fp32 parameters shared and an fp32 head for the targets (see ``training/precision.py``); evaluations
    always run the fp32 model."""
    target_modules: tuple[str, ...] = LLAMA_TARGETS
    layers: tuple[int, ...] | None = None
    """Decoder layers that carry LoRA (None = all); upper layers only shorten the backward pass."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    steps: int = 1000
    lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    regions: int = 64
    """MTP regions packed per training sequence."""
    seq_len: int = 384
    """Real tokens per packed sequence (documents are added until this is reached)."""
    agent_fraction: float = 0.8
    """Share of documents drawn from the agent-domain prompts (the rest: ShareGPT)."""
    freeze_embedding_after: int | None = None
    """Stop training the mask embedding after this step (then layers without LoRA need no backward)."""
    train_layers: tuple[int, ...] | None = None
    """LoRA layers the optimizer updates (None: all of the adapter's). The others keep their values (e.g. from
    ``--resume``); with the mask embedding frozen, the backward pass stops at the lowest trained layer."""
    real_pass_cache: bool = True
    """Gated LoRA + hard teacher: compute each record's real-token pass once and read it back on later draws
    (``training/real_cache.py``; the same targets and gradients)."""
    real_pass_memory_gb: float | None = None
    """In-memory budget of that cache (None: a quarter of the machine's memory, at most 8 GB); entries beyond it are
    read back from its directory, or recomputed."""
    eval_every: int = 100
    eval_prompts: int = 8
    eval_max_new_tokens: int = 48
    log_every: int = 10
    checkpoint_minutes: float = 5.0
    max_minutes: float | None = None
    seed: int = 0

    def validate(self) -> None:
        """Raise :class:`TrainingError` naming the bad value (and its ``agent-mtp distill`` option) and the fix."""
        k = self.objective.k_max
        if k < 2:
            msg = f"k_max={k} (--k-max {k}): MTP needs at least one mask; use 2 or more (8 is a good start)."
            raise TrainingError(msg)
        for owner, name in (
            (self, "adapter"),
            (self, "model_dtype"),
            (self.objective, "k_sampling"),
            (self.objective, "teacher"),
            (self.objective, "slots"),
        ):
            allowed = get_args(get_type_hints(type(owner))[name])
            value = getattr(owner, name)
            if value not in allowed:
                flag = f"--{name.replace('_', '-')} {value}"
                raise TrainingError(f"{name}={value!r} ({flag}): use one of {', '.join(allowed)}.")
        if self.model_dtype == "bf16" and self.adapter != "gated-lora":
            raise TrainingError("model_dtype='bf16' needs --adapter gated-lora (use --bf16 autocast for 'full').")
        if self.train_layers is not None and self.adapter != "gated-lora":
            raise TrainingError("train_layers needs --adapter gated-lora (the full fine-tune trains every weight).")
        if self.train_layers is not None and self.layers is not None and not set(self.train_layers) <= set(self.layers):
            extra = sorted(set(self.train_layers) - set(self.layers))
            raise TrainingError(f"train_layers has layers {extra} without LoRA; pick them from --layers {self.layers}.")
        if self.real_pass_memory_gb is not None and self.real_pass_memory_gb < 0:
            raise TrainingError(f"real_pass_memory_gb={self.real_pass_memory_gb}: give 0 or more GB.")
        if self.rank < 1 or self.steps < 1 or self.lr <= 0 or self.regions < 1:
            raise TrainingError(
                f"rank={self.rank}, steps={self.steps}, lr={self.lr}, regions={self.regions}: all must be positive."
            )


@dataclass
class TrainState:
    step: int = 0
    best_tpf: float = 0.0
    slots: int = 0
    train_seconds: float = 0.0


# -- batches ----------------------------------------------------------------------------------------------------------
def sample_sequence(records: Sequence[Record], step: int, cfg: TrainConfig) -> PackedSequence:
    """The packed sequence of a step: a pure function of (seed, step), so a resumed run sees the same batches."""
    rng = random.Random(f"{cfg.seed}-{step}")
    usable = [r for r in records if len(r.response_ids) >= 2]  # an anchor needs a response token after it
    if not usable:
        raise TrainingError("No training record has a response of 2+ tokens; rebuild the data with more tokens.")
    agent = [r for r in usable if r.source == "agent"]
    other = [r for r in usable if r.source != "agent"]
    docs: list[list[int]] = []
    sources: list[list[int]] = []
    spans: list[tuple[int, int]] = []  # eligible anchors per document, in packed indices
    total = 0
    while total < cfg.seq_len and len(docs) < 64:
        pool = agent if (agent and (not other or rng.random() < cfg.agent_fraction)) else other
        rec = rng.choice(pool)
        ids = rec.ids[: max(cfg.seq_len - total, len(rec.prompt_ids) + 2)]
        spans.append((total + len(rec.prompt_ids) - 1, total + len(ids) - 2))
        docs.append(ids)
        sources.append(rec.ids)
        total += len(ids)
    eligible = [a for lo, hi in spans for a in range(lo, hi + 1)]
    chosen = sorted(rng.sample(eligible, min(cfg.regions, len(eligible))))
    k_max = cfg.objective.k_max
    random_k = cfg.objective.k_sampling == "random"
    regions = [Region(a, rng.randint(1, k_max - 1) if random_k else k_max - 1) for a in chosen]
    return pack_documents(docs, regions, sources=sources)


# -- the trainer ----------------------------------------------------------------------------------------------------
class Trainer:
    """Owns the student (+ teacher for full fine-tune), optimizer, schedule, logging and checkpoints."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        config: TrainConfig,
        train: Sequence[Record],
        heldout: Sequence[Record],
        out_dir: str | Path,
        progress: bool = True,
        extra_eval: Sequence[EvalPrompt] = (),
        real_pass_dir: str | Path | None = None,
    ) -> None:
        """``loaded``: the base model, its tokenizer and mask token (:func:`~agent_mtp.engine.loading.load_model`).
        ``real_pass_dir``: where the real-pass cache keeps its entries across runs (None: memory only)."""
        config.validate()
        model, tokenizer = loaded.model, loaded.tokenizer
        model_id, mask_token, mask_token_id = loaded.model_id, loaded.mask_token, loaded.mask_token_id
        if not train:
            raise TrainingError("No training records (the data holds only held-out prompts?). Build more data.")
        self.model, self.tokenizer = model, tokenizer
        self.model_id, self.mask_token, self.mask_token_id = model_id, mask_token, mask_token_id
        self.cfg = config
        self.train_records = list(train)
        self.eval_set: list[EvalPrompt] = eval_prompts(heldout, config.eval_prompts) + list(extra_eval)
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self.state = TrainState()
        self.adapter: MTPAdapter | None = None
        self.teacher: Any = None
        self.step_model: Any = model
        """The model that runs training steps: ``model`` itself, or its bf16 twin (``model_dtype="bf16"``)."""
        self.step_adapter: MTPAdapter | None = None
        self.store: RealPassStore | None = None
        """Per-record real-token passes (gated LoRA with the hard teacher and ``real_pass_cache``)."""
        if config.adapter == "gated-lora":
            self.adapter = new_adapter(
                model,
                base_model=model_id,
                mask_token=mask_token,
                mask_token_id=mask_token_id,
                rank=config.rank,
                target_modules=config.target_modules,
                layers=config.layers,
                k_max_trained=config.objective.k_max,
            )
            self.adapter.set_trainable_layers(config.train_layers)
            self.params = self.adapter.trainable_parameters()
            self.step_adapter = self.adapter
            if config.model_dtype == "bf16":
                self.step_model, self.step_adapter = low_precision_twin(
                    model, self.adapter, mask_token_id=mask_token_id
                )
            use_slot_attention(self.step_model)  # plain SDPA outside the objective's slot passes
            if config.real_pass_cache and config.objective.teacher == "hard":
                self.store = RealPassStore(
                    self.step_model,
                    mask_token_id,
                    adapter=self.step_adapter,
                    directory=Path(real_pass_dir) if real_pass_dir is not None else None,
                    memory_bytes=(
                        default_memory_budget()
                        if config.real_pass_memory_gb is None
                        else int(config.real_pass_memory_gb * 2**30)
                    ),
                )
        else:
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
            model.requires_grad_(True)
            self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.engine = MTPEngine(loaded, adapter=self.adapter)

    # -- schedule / one step --------------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to 10% at ``steps``."""
        cfg = self.cfg
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    def train_step(self) -> StepOutput:
        step = self.state.step
        seq = sample_sequence(self.train_records, step, self.cfg)
        self._maybe_freeze_embedding(step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        if self.step_adapter is not None:
            out = distill_gated(
                self.step_model,
                self.step_adapter,
                seq,
                self.cfg.objective,
                mask_token_id=self.mask_token_id,
                store=self.store,
            )
        else:
            out = distill_full(self.model, self.teacher, seq, self.cfg.objective, mask_token_id=self.mask_token_id)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.state.step += 1
        self.state.slots += out.slots
        return out

    def _maybe_freeze_embedding(self, step: int) -> None:
        after = self.cfg.freeze_embedding_after
        if self.adapter is not None and after is not None and step >= after:
            self.adapter.mask_embedding.requires_grad_(False)

    # -- the loop ---------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to ``steps`` or ``max_minutes``; Ctrl-C saves a checkpoint. Returns the final eval metrics."""
        cfg = self.cfg
        deadline = time.monotonic() + 60 * cfg.max_minutes if cfg.max_minutes else None
        last_ckpt = time.monotonic()
        if self.state.step == 0 and self.eval_set:
            self._eval()
        bar = _progress_bar(cfg.steps, self.state.step, enabled=self.progress)
        window: list[StepOutput] = []
        window_start = time.monotonic()
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            while self.state.step < cfg.steps:
                if deadline is not None and time.monotonic() > deadline:
                    self._log({"event": "deadline", "step": self.state.step})
                    break
                t0 = time.monotonic()
                window.append(self.train_step())
                self.state.train_seconds += time.monotonic() - t0
                bar.update(1)
                if self.state.step % cfg.log_every == 0:
                    self._log_window(window, time.monotonic() - window_start, bar)
                    window, window_start = [], time.monotonic()
                if cfg.eval_every and self.state.step % cfg.eval_every == 0 and self.eval_set:
                    self._eval()
                    window, window_start = [], time.monotonic()  # slots/s counts training time only
                if time.monotonic() - last_ckpt > 60 * cfg.checkpoint_minutes:
                    self.save_checkpoint()
                    last_ckpt = time.monotonic()
        except KeyboardInterrupt:
            self._log({"event": "interrupted", "step": self.state.step})
            self.save_checkpoint()
            bar.close()
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        bar.close()
        self.save_checkpoint()
        metrics = self._eval() if self.eval_set else {}
        self.export(self.out / "adapter")
        self.plot()
        return metrics

    def _log_window(self, window: list[StepOutput], seconds: float, bar: Any) -> None:
        slots = sum(o.slots for o in window)
        counts = torch.stack([_pad(o.count, self.cfg.objective.k_max - 1) for o in window]).sum(0)
        agree = torch.stack([_pad(o.agree * o.count, self.cfg.objective.k_max - 1) for o in window]).sum(0)
        row: dict[str, Any] = {
            "event": "train",
            "step": self.state.step,
            "loss": round(sum(float(o.loss.detach()) for o in window) / len(window), 4),
            "lr": self.lr_at(self.state.step - 1),
            "slots_per_s": round(slots / max(seconds, 1e-9), 1),
            "agree_per_slot": [round(float(a), 4) for a in agree / counts.clamp(min=1)],
            "slots_total": self.state.slots,
        }
        if self.store is not None:
            row["real_pass_cache"] = self.store.stats.as_dict()
        self._log(row)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=row["loss"], slots_s=row["slots_per_s"], agree1=row["agree_per_slot"][0])

    def _eval(self) -> dict[str, Any]:
        t0 = time.monotonic()
        metrics = evaluate(
            self.engine, self.eval_set, k_max=self.cfg.objective.k_max, max_new_tokens=self.cfg.eval_max_new_tokens
        )
        self._log({"event": "eval", "step": self.state.step, "seconds": round(time.monotonic() - t0, 1), **metrics})
        tpf = float(metrics.get("tpf_verified", 0.0))
        if self.state.step > 0 and tpf > self.state.best_tpf:
            self.state.best_tpf = tpf
            self.export(self.out / "best")
        return metrics

    def _log(self, row: dict[str, Any]) -> None:
        row = {"time": round(time.time(), 1), **row}
        with open(self.out / "log.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if not self.progress:
            print(json.dumps(row), flush=True)

    # -- saving -----------------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        cfg = asdict(self.cfg)
        return {
            "steps": self.state.step,
            "supervised_slots": self.state.slots,
            "train_seconds": round(self.state.train_seconds, 1),
            "best_verified_tpf": self.state.best_tpf,
            "lr": cfg["lr"],
            "regions": cfg["regions"],
            "seq_len": cfg["seq_len"],
            "objective": cfg["objective"],
            "train_records": len(self.train_records),
        }

    def export(self, directory: Path) -> Path:
        if self.adapter is not None:
            return self.adapter.save(directory, training=self.summary())
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        (directory / "training.json").write_text(json.dumps(self.summary(), indent=2) + "\n")
        return directory

    def save_checkpoint(self, directory: Path | None = None) -> Path:
        """Adapter (or model) + optimizer state + step, written to a temp dir and swapped in."""
        target = directory or self.out / "checkpoint"
        staging = target.with_name(target.name + ".tmp")
        self.export(staging)
        torch.save(
            {"state": asdict(self.state), "optimizer": self.optimizer.state_dict(), "config": asdict(self.cfg)},
            staging / STATE_FILE,
        )
        _swap(staging, target)
        return target

    def resume(self, directory: str | Path) -> None:
        """Continue from a checkpoint written by :meth:`save_checkpoint` (same config expected)."""
        path = Path(directory)
        state_file = path / STATE_FILE
        if not state_file.is_file():
            raise TrainingError(f"{path}: no {STATE_FILE}; pass the 'checkpoint' folder of an earlier run to --resume.")
        blob: dict[str, Any] = torch.load(state_file, weights_only=False)
        if self.adapter is not None:
            path = checkpoint_adapter_dir(path)
            cfg = read_adapter_config(path)
            mine = self.adapter.config
            if (cfg.rank, cfg.target_modules, cfg.layers) != (mine.rank, mine.target_modules, mine.layers):
                msg = (
                    f"{path}: checkpoint has rank={cfg.rank}, layers={cfg.layers}; "
                    f"this run has rank={mine.rank}, layers={mine.layers}."
                )
                raise TrainingError(msg + " Resume with the same --rank/--layers/--target-modules.")
            from safetensors.torch import load_file

            try:
                self.adapter.load_tensors(load_file(str(path / "adapter.safetensors")), source=str(path))
            except AdapterError as e:
                raise TrainingError(str(e)) from e
        else:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(path, dtype=self.model.dtype)
            self.model.load_state_dict(loaded.state_dict())
        self.state = TrainState(**blob["state"])
        self._maybe_freeze_embedding(self.state.step)
        self.optimizer.load_state_dict(blob["optimizer"])

    def plot(self) -> Path | None:
        from agent_mtp.training.plot import plot_log

        return plot_log(self.out / "log.jsonl", self.out / "curves.png")


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(max(0, n - t.shape[0]))])[:n]


def _swap(staging: Path, target: Path) -> None:
    import shutil

    old = target.with_name(target.name + ".old")
    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _progress_bar(total: int, initial: int, *, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, desc="distill")


# -- wiring for the CLI ---------------------------------------------------------------------------------------------
def load_data(data_dir: str | Path) -> tuple[list[Record], list[Record]]:
    records = read_records(data_dir)
    train = [r for r in records if r.split == "train"]
    heldout = [r for r in records if r.split == "heldout"]
    return train, heldout


def checkpoint_adapter_dir(directory: str | Path) -> Path:
    """Where a checkpoint's adapter weights are: the checkpoint itself, or the folder its ``ADAPTER_LINK`` file
    names (relative to the checkpoint), so a checkpoint of a shipped adapter need not hold a second copy."""
    path = Path(directory)
    link = path / ADAPTER_LINK
    if (path / "adapter.safetensors").is_file() or not link.is_file():
        return path
    target = (path / link.read_text(encoding="utf-8").strip()).resolve()
    if not (target / "adapter.safetensors").is_file():
        raise TrainingError(f"{link} names {target}, which holds no adapter.safetensors; fix the link or the path.")
    return target


def check_resume_base(directory: str | Path, model: Any, mask_token_id: int) -> None:
    """Fail early when a checkpoint adapter belongs to another base model (loads and detaches it)."""
    try:
        adapter = load_adapter(model, checkpoint_adapter_dir(directory), mask_token_id=mask_token_id)
    except AdapterError as e:
        raise TrainingError(f"--resume {directory}: {e}") from e
    adapter.detach(model)


def with_objective(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    return replace(cfg, objective=replace(cfg.objective, **changes))
