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


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content or ():
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind in ("image", "image_url", "audio", "input_audio", "file", "video", "document"):
            raise MTPInvalidRequestError(f"AgentMTPChat is text-only; the message has a {kind!r} content block.")
        # tool_use / tool_call / reasoning blocks: the tool calls are rendered from message.tool_calls
    return "\n".join(p for p in parts if p)
