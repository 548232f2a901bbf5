"""LangChain messages -> the ``{"role", "content"}`` dicts the service renders (with the engine's one renderer)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from agent_mtp.engine.prompt import render_messages
from agent_mtp.langchain.errors import MTPInvalidRequestError
from agent_mtp.service import with_system_block
from agent_mtp.tools import render_tool_call

_ROLE_NAMES = {"human": "user", "ai": "assistant", "function": "tool"}


def render_prompt(tokenizer: Any, messages: Sequence[BaseMessage], *, system_block: str | None = None) -> list[int]:
    """Token ids of ``messages`` (plus an optional system block, e.g. the tools) ready for generation, as
    :func:`agent_mtp.engine.prompt.render_messages` renders them."""
    dicts = with_system_block(message_dicts(messages), system_block)
    if not dicts:
        raise MTPInvalidRequestError("There are no messages to answer; pass at least one message.")
    return render_messages(tokenizer, dicts)


def message_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    return [message_dict(m) for m in messages]


def message_dict(message: BaseMessage) -> dict[str, Any]:
    text = _text_of(message.content)
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": text}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": text}
    if isinstance(message, AIMessage):
        calls = [render_tool_call(c["name"], c["args"]) for c in message.tool_calls]
        return {"role": "assistant", "content": "\n".join(p for p in [text, *calls] if p)}
    if isinstance(message, ToolMessage):
        if message.status == "error" and not text.lower().startswith("error"):
            text = f"Error: {text}"
        return {"role": "tool", "content": text}
    if isinstance(message, FunctionMessage):
        return {"role": "tool", "content": text}
    if isinstance(message, ChatMessage):
        return {"role": _ROLE_NAMES.get(message.role, message.role), "content": text}
    raise MTPInvalidRequestError(f"Unsupported message type {type(message).__name__}.")


_TEXT_BLOCKS = frozenset({"text", "input_text", "output_text", "text-plain"})
_MEDIA_BLOCKS = frozenset({"image", "image_url", "audio", "input_audio", "file", "video", "document"})
_SKIPPED_BLOCKS = frozenset(
    {
        "tool_use", "tool_call", "tool_call_chunk", "invalid_tool_call",  # rendered from message.tool_calls
        "reasoning", "thinking", "redacted_thinking",  # a model's own reasoning is not fed back
        "server_tool_call", "server_tool_call_chunk", "server_tool_result",  # another provider's server tools
    }
)  # fmt: skip
"""Content block types left out of the prompt on purpose (documented in docs/langchain.md)."""


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content or ():
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _TEXT_BLOCKS:
            parts.append(str(block.get("text", "")))
        elif kind in _MEDIA_BLOCKS:
            raise MTPInvalidRequestError(f"AgentMTPChat is text-only; the message has a {kind!r} content block.")
        elif kind not in _SKIPPED_BLOCKS:
            msg = (
                f"Unknown content block {_short(block)}: AgentMTPChat reads text blocks ({{'type': 'text', "
                f"'text': ...}}) and leaves out {', '.join(sorted(_SKIPPED_BLOCKS))}; send the content as text."
            )
            raise MTPInvalidRequestError(msg)
    return "\n".join(p for p in parts if p)


def _short(block: Any, limit: int = 80) -> str:
    text = repr(block)
    return text if len(text) <= limit else text[: limit - 3] + "..."
