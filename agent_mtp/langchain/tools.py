"""LangChain tools, functions and schema classes -> OpenAI-format tools and response formats for the service."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool

from agent_mtp.langchain.errors import MTPInvalidRequestError


def as_openai_tool(tool: Any, *, strict: bool | None = None) -> dict[str, Any]:
    """An OpenAI-format tool from a LangChain tool, a function, a pydantic model, a TypedDict or a schema dict."""
    if isinstance(tool, Mapping) and tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
        return dict(tool)
    try:
        return convert_to_openai_tool(tool, strict=strict)
    except (ValueError, TypeError) as e:
        raise MTPInvalidRequestError(f"Cannot use {tool!r} as a tool: {e}") from e


def as_response_format(response_format: Any) -> Mapping[str, Any] | None:
    """An OpenAI-style ``response_format`` (or a bare JSON schema) from what LangChain callers pass: a dict or a
    schema class."""
    if response_format is None or isinstance(response_format, Mapping):
        return response_format
    if isinstance(response_format, type):
        return convert_to_json_schema(response_format)
    raise MTPInvalidRequestError(f"response_format={response_format!r} is not a dict or a schema class.")
