"""agent-mtp: multi-token prediction for LangChain agents on local models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_mtp.engine import DecodeConfig, GenerationResult, MTPEngine

__version__ = "0.1.0"

if TYPE_CHECKING:
    from agent_mtp.chat_model import AgentMTPChat

__all__ = ["AgentMTPChat", "DecodeConfig", "GenerationResult", "MTPEngine", "__version__"]


def __getattr__(name: str) -> Any:
    # LangChain is imported only when the chat model is used.
    if name == "AgentMTPChat":
        from agent_mtp.chat_model import AgentMTPChat

        return AgentMTPChat
    raise AttributeError(f"module 'agent_mtp' has no attribute {name!r}")
