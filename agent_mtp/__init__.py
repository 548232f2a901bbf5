"""agent-mtp: multi-token prediction for LangChain agents on local models.

Public names are imported lazily, so ``import agent_mtp.telemetry`` (or the CLI's light commands) does not pay for
torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from agent_mtp.engine import DecodeConfig, GenerationResult, MTPEngine
    from agent_mtp.langchain import AgentMTPChat

__all__ = ["AgentMTPChat", "DecodeConfig", "GenerationResult", "MTPEngine", "__version__"]

_LAZY = {
    "AgentMTPChat": "agent_mtp.langchain",
    "DecodeConfig": "agent_mtp.engine",
    "GenerationResult": "agent_mtp.engine",
    "MTPEngine": "agent_mtp.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agent_mtp' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
