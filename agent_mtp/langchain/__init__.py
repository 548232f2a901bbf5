"""LangChain front end: :class:`AgentMTPChat`, a ``BaseChatModel`` over :mod:`agent_mtp.service`.

chat_models.py   the chat model (its class docstring is the manual)
messages.py      LangChain messages -> {"role", "content"} dicts (rendered by the engine's one renderer)
tools.py         LangChain tools / schema classes -> OpenAI-format tools and response formats
errors.py        agent-mtp errors -> LangChain's exception classes
"""

from __future__ import annotations

from agent_mtp.langchain.chat_models import AgentMTPChat
from agent_mtp.langchain.errors import (
    MTPContextOverflowError,
    MTPInvalidRequestError,
    MTPModelNotFoundError,
    MTPPolicyError,
    MTPTimeoutError,
)

__all__ = [
    "AgentMTPChat",
    "MTPContextOverflowError",
    "MTPInvalidRequestError",
    "MTPModelNotFoundError",
    "MTPPolicyError",
    "MTPTimeoutError",
]
