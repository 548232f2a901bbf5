"""Shared pieces of the command line (options, consoles, engine loading)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

console = Console(stderr=True)
out = Console()

ModelOpt = Annotated[str, typer.Option(help='"default", a hub id or a local directory.')]
AdapterOpt = Annotated[str | None, typer.Option(help='MTP adapter dir, "none", or omit for the shipped one.')]
DtypeOpt = Annotated[str, typer.Option(help="float32 or bfloat16.")]
RuntimeOpt = Annotated[
    str, typer.Option(help='What runs the forward passes: "auto" (fast where it can), "fast" or "hf" (transformers).')
]
ThreadsOpt = Annotated[int | None, typer.Option(help="torch threads (default: torch's choice).")]


def set_threads(threads: int | None) -> None:
    """torch threads for this command: here and on the thread that runs the engine's passes."""
    import torch

    from agent_mtp.engine.threads import set_compute_threads

    if threads:
        torch.set_num_threads(threads)
        set_compute_threads(threads)


def threads_in_use() -> int:
    from agent_mtp.engine.threads import compute_threads

    return compute_threads()


def load_engine(model: str, adapter: str | None, dtype: str, runtime: str = "auto") -> Any:
    """Load an engine for a CLI command: the shipped adapter unless ``adapter`` is a dir or "none"."""
    from transformers.utils import logging as hf_logging

    from agent_mtp.engine import MTPEngine

    hf_logging.disable_progress_bar()
    chosen = "auto" if adapter is None else (None if adapter == "none" else adapter)
    with console.status(f"Loading {model} ..."):
        return MTPEngine.from_pretrained(model, adapter=chosen, dtype=dtype, runtime=runtime)  # type: ignore[arg-type]
