"""Gated MTP adapters: LoRA deltas that act only at mask positions, plus a trained mask embedding.

    y = W x                      at real-token positions (bit-exact base model)
    y = W x + (alpha/r) B A x    at mask positions

The gate is derived from the input ids (``input_ids == mask_token_id``) by a forward pre-hook on the model, so
every forward (engine, HF ``generate``, training) gets it right without extra arguments. The mask embedding lives
outside the (tied) embedding matrix and is substituted by a hook on the embedding layer, so the lm_head never
changes either.

On disk (the format the trainer writes)::

    adapter_dir/
      adapter_config.json   format, version, base model + fingerprint, mask token, rank, alpha, target modules,
                            layers, k_max trained, training summary
      adapter.safetensors   "mask_embedding" [hidden] and "lora.<module path>.A" [r, in] / ".B" [out, r]
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from agent_mtp.errors import AdapterError

ADAPTER_FORMAT = "agent-mtp-gated-lora"
ADAPTER_VERSION = 1
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter.safetensors"
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterConfig:
    base_model: str
    mask_token: str
    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = LLAMA_TARGETS
    layers: tuple[int, ...] | None = None
    """Decoder layer indices that carry LoRA (None = all)."""
    k_max_trained: int = 8
    base_fingerprint: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    format: str = ADAPTER_FORMAT
    version: int = ADAPTER_VERSION

    def to_json(self) -> str:
        data = asdict(self)
        data["target_modules"] = list(self.target_modules)
        data["layers"] = list(self.layers) if self.layers is not None else None
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str) -> AdapterConfig:
        if data.get("format") != ADAPTER_FORMAT:
            raise AdapterError(f"{source}: format={data.get('format')!r}, expected {ADAPTER_FORMAT!r}.")
        if data.get("version") != ADAPTER_VERSION:
            raise AdapterError(f"{source}: version={data.get('version')!r}; this agent-mtp reads {ADAPTER_VERSION}.")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise AdapterError(f"{source}: unknown keys {unknown}; expected only {sorted(known)}.")
        try:
            data = dict(data)
            data["target_modules"] = tuple(data.get("target_modules", LLAMA_TARGETS))
            if data.get("layers") is not None:
                data["layers"] = tuple(int(i) for i in data["layers"])
            cfg = cls(**data)
        except TypeError as e:
            raise AdapterError(f"{source}: {e}") from e
        if cfg.rank < 1 or cfg.alpha <= 0:
            raise AdapterError(f"{source}: rank={cfg.rank}, alpha={cfg.alpha}; both must be positive.")
        return cfg


class GateState:
    """Which positions of the current forward are mask positions (shared by all LoRA layers of one model)."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None  # bool [B, S]
        self.override: torch.Tensor | None = None

    def current(self) -> torch.Tensor | None:
        return self.override if self.override is not None else self.mask


class GatedLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a LoRA delta applied only where the gate is on."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, gate: GateState) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = alpha / rank
        self.gate = gate
        self.enabled = True
        weight = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=weight.dtype, device=weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=weight.dtype, device=weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        gate = self.gate.current()
        if not self.enabled or gate is None or not bool(gate.any()):
            return y
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)  # fp32 master weights may drive a bf16 model
        if bool(gate.all()):  # a pass of mask slots only (training's student pass): no gather/scatter
            return y + (x @ a.T) @ b.T * self.scale
        rows = x[gate]  # [M, in]: only mask positions
        delta = (rows @ a.T) @ b.T * self.scale  # [M, out]
        return y.index_put((gate,), y[gate] + delta)


class MTPAdapter(nn.Module):
    """The trainable part of an MTP model: gated LoRA layers and the mask embedding, attached with hooks."""

    def __init__(self, config: AdapterConfig, mask_embedding: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.mask_embedding = nn.Parameter(mask_embedding.clone())
        self.lora = nn.ModuleDict()
        self.gate = GateState()
        self.mask_token_id: int = -1
        self._handles: list[Any] = []

    # -- attaching -------------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, mask_token_id: int) -> None:
        """Wrap target linears of ``model`` and install the gate/embedding hooks (idempotent per model)."""
        if getattr(model, "_agent_mtp_adapter", None) is not None:
            raise AdapterError("This model already has an MTP adapter attached; detach it first.")
        self.mask_token_id = mask_token_id
        targets = list(_target_linears(model, self.config))
        if not targets:
            msg = f"No modules named {list(self.config.target_modules)} found in {type(model).__name__}."
            raise AdapterError(msg + " Set target_modules to the linear layer names of this architecture.")
        for path, parent, attr, linear in targets:
            key = path.replace(".", "__")
            if key not in self.lora:
                self.lora[key] = GatedLoRALinear(linear, self.config.rank, self.config.alpha, self.gate)
            setattr(parent, attr, self.lora[key])
        self._handles.append(model.register_forward_pre_hook(self._set_gate, with_kwargs=True))
        embed = model.get_input_embeddings()  # type: ignore[operator]
        self._handles.append(embed.register_forward_hook(self._substitute_mask_embedding))
        model._agent_mtp_adapter = self  # type: ignore[assignment]
        self.to(device=embed.weight.device)

    def detach(self, model: nn.Module) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for path, parent, attr, _ in _target_linears(model, self.config, wrapped=True):
            setattr(parent, attr, self.lora[path.replace(".", "__")].base)
        model._agent_mtp_adapter = None  # type: ignore[assignment]

    def _set_gate(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.gate.mask = (ids == self.mask_token_id) if isinstance(ids, torch.Tensor) else None

    def _substitute_mask_embedding(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        ids = args[0]
        is_mask = ids == self.mask_token_id
        if not bool(is_mask.any()):
            return out
        return torch.where(is_mask.unsqueeze(-1), self.mask_embedding.to(out.dtype), out)

    @contextmanager
    def gate_override(self, mask: torch.Tensor | None) -> Iterator[None]:
        """Force the gate (e.g. for ``inputs_embeds`` forwards in training)."""
        previous = self.gate.override
        self.gate.override = mask
        try:
            yield
        finally:
            self.gate.override = previous

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the exact base model (the teacher): LoRA off. The mask embedding stays (only masks use it)."""
        layers = list(self.lora.values())
        states = [layer.enabled for layer in layers]
        for layer in layers:
            layer.enabled = False  # type: ignore[assignment]
        try:
            yield
        finally:
            for layer, state in zip(layers, states, strict=True):
                layer.enabled = state  # type: ignore[assignment]

    def layers(self) -> dict[str, GatedLoRALinear]:
        """The gated LoRA layers by key (module path with "." replaced by "__")."""
        return {key: cast(GatedLoRALinear, layer) for key, layer in self.lora.items()}

    def layer_indices(self) -> dict[str, int | None]:
        """The decoder layer index of each gated LoRA layer, by key (None for modules outside numbered layers)."""
        return {key: _layer_index(key.replace("__", ".")) for key in self.lora}

    def set_trainable_layers(self, layers: Collection[int] | None) -> None:
        """Let gradients reach only the LoRA layers of these decoder layers (None: all). The others keep their
        values; with the mask embedding frozen too, the backward pass stops at the lowest trainable layer."""
        for key, index in self.layer_indices().items():
            on = layers is None or index in layers
            self.lora[key].lora_A.requires_grad_(on)
            self.lora[key].lora_B.requires_grad_(on)

    def trainable_parameters(self) -> list[nn.Parameter]:
        params: list[nn.Parameter] = [self.mask_embedding]
        for layer in self.layers().values():
            params += [layer.lora_A, layer.lora_B]
        return params

    # -- saving / loading ----------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {"mask_embedding": self.mask_embedding.detach().float().contiguous()}
        for key, layer in self.layers().items():
            path = key.replace("__", ".")
            tensors[f"lora.{path}.A"] = layer.lora_A.detach().float().contiguous()
            tensors[f"lora.{path}.B"] = layer.lora_B.detach().float().contiguous()
        return tensors

    def save(self, directory: str | Path, *, training: dict[str, Any] | None = None) -> Path:
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        config = self.config
        if training is not None:
            config = AdapterConfig(**{**asdict(config), "training": training})
            self.config = config
        save_file(self.state_tensors(), str(out / WEIGHTS_FILE), metadata={"format": ADAPTER_FORMAT})
        (out / CONFIG_FILE).write_text(config.to_json() + "\n")
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor], *, source: str) -> None:
        expected = set(self.state_tensors())
        missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        if missing or unexpected:
            msg = (
                f"{source}: tensors do not match the adapter config "
                f"(missing {missing[:4]}, unexpected {unexpected[:4]})."
            )
            raise AdapterError(msg + " The adapter was made for another base model or target_modules.")
        with torch.no_grad():
            _copy_checked(self.mask_embedding, tensors["mask_embedding"], "mask_embedding", source)
            for key, layer in self.layers().items():
                path = key.replace("__", ".")
                _copy_checked(layer.lora_A, tensors[f"lora.{path}.A"], f"lora.{path}.A", source)
                _copy_checked(layer.lora_B, tensors[f"lora.{path}.B"], f"lora.{path}.B", source)


def _copy_checked(param: torch.Tensor, value: torch.Tensor, name: str, source: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        msg = f"{source}: {name} has shape {tuple(value.shape)}, the model needs {tuple(param.shape)}."
        raise AdapterError(msg + " The adapter was made for another base model.")
    if not torch.isfinite(value).all():
        raise AdapterError(f"{source}: {name} contains NaN or inf; the adapter file is corrupt.")
    param.copy_(value.to(param.dtype))


def _target_linears(
    model: nn.Module, config: AdapterConfig, *, wrapped: bool = False
) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    wanted = set(config.target_modules)
    layers = set(config.layers) if config.layers is not None else None
    for path, module in list(model.named_modules()):
        for attr, child in list(module.named_children()):
            is_target = isinstance(child, GatedLoRALinear) if wrapped else isinstance(child, nn.Linear)
            if attr not in wanted or not is_target:
                continue
            full = f"{path}.{attr}" if path else attr
            if layers is not None and _layer_index(full) not in layers:
                continue
            yield full, module, attr, child.base if isinstance(child, GatedLoRALinear) else child  # type: ignore[misc]


def _layer_index(path: str) -> int | None:
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Cheap identity of a base model: architecture sizes plus a checksum of a slice of the embedding."""
    config = model.config  # type: ignore[attr-defined]
    weight = model.get_input_embeddings().weight  # type: ignore[operator]
    sample = weight[: min(64, weight.shape[0]), : min(64, weight.shape[1])].detach().double()
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "embedding_checksum": round(float(sample.abs().sum()), 3),
    }


def new_adapter(
    model: nn.Module,
    *,
    base_model: str,
    mask_token: str,
    mask_token_id: int,
    rank: int = 16,
    alpha: float | None = None,
    target_modules: Sequence[str] = LLAMA_TARGETS,
    layers: Sequence[int] | None = None,
    k_max_trained: int = 8,
) -> MTPAdapter:
    """A fresh (identity-at-start) adapter attached to ``model``; the mask embedding starts from its vocab row."""
    config = AdapterConfig(
        base_model=base_model,
        mask_token=mask_token,
        rank=rank,
        alpha=float(alpha if alpha is not None else 2 * rank),
        target_modules=tuple(target_modules),
        layers=tuple(layers) if layers is not None else None,
        k_max_trained=k_max_trained,
        base_fingerprint=model_fingerprint(model),
    )
    row = model.get_input_embeddings().weight[mask_token_id].detach().float()  # type: ignore[operator]
    adapter = MTPAdapter(config, row)
    adapter.attach(model, mask_token_id)
    return adapter


def read_adapter_config(directory: str | Path) -> AdapterConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(
            f"{directory}: no {CONFIG_FILE}; an MTP adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}."
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path}: not valid JSON ({e}); the adapter file is corrupt.") from e
    if not isinstance(data, dict):
        raise AdapterError(f"{path}: expected a JSON object.")
    return AdapterConfig.from_dict(data, source=str(path))


def load_adapter(model: nn.Module, directory: str | Path, *, mask_token_id: int, check_base: bool = True) -> MTPAdapter:
    """Read an adapter directory, check it belongs to ``model``, and attach it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_adapter_config(directory)
    if check_base and config.base_fingerprint:
        actual = model_fingerprint(model)
        mismatched = {
            k: (v, actual.get(k))
            for k, v in config.base_fingerprint.items()
            if k != "embedding_checksum" and actual.get(k) != v
        }
        checksum = config.base_fingerprint.get("embedding_checksum")
        if checksum is not None and not math.isclose(checksum, actual["embedding_checksum"], rel_tol=1e-3):
            mismatched["embedding_checksum"] = (checksum, actual["embedding_checksum"])
        if mismatched:
            msg = (
                f"{directory}: adapter was trained for base model {config.base_model!r}; "
                f"this model differs in {mismatched}."
            )
            raise AdapterError(msg + " Load the matching base model, or pass check_base=False if you are sure.")
    weights = Path(directory) / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{directory}: missing {WEIGHTS_FILE}.")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"{weights}: cannot read ({e}); the adapter file is corrupt.") from e
    if "mask_embedding" not in tensors:
        raise AdapterError(f"{weights}: no 'mask_embedding' tensor; the adapter file is corrupt.")
    adapter = MTPAdapter(config, tensors["mask_embedding"].float())
    adapter.attach(model, mask_token_id)
    try:
        adapter.load_tensors(tensors, source=str(weights))
    except AdapterError:
        adapter.detach(model)
        raise
    return adapter
