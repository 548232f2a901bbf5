"""The one prompt renderer: a conversation -> the token ids the model reads before it answers.

Every user renders through here (the engine, the LangChain chat model, training-data generation, the bench, the
server), so an adapter sees in serving exactly the token ids it was trained on:

    ids = render_messages(tokenizer, [{"role": "system", "content": "..."}, {"role": "user", "content": "hi"}])

The chat template renders the messages as they are; if it refuses them (e.g. "roles must alternate"), a
normalised sequence (one leading system message, tool results as user turns in ``<tool_response>`` tags,
consecutive same-role messages merged) is tried; without a template, or if that fails too, ``role: content``
lines ending with ``assistant:``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("agent_mtp.engine")

Message = Mapping[str, Any]
"""``{"role": ..., "content": ...}`` (other keys are passed to the chat template as they are)."""


def render_messages(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of ``messages`` followed by the assistant's turn header (the generation prompt)."""
    dicts = [dict(m) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        for attempt in (dicts, normalised_messages(dicts)):
            ids = _apply_template(tokenizer, attempt)
            if ids is not None:
                return ids
    text = "\n".join(f"{d['role']}: {d['content']}" for d in normalised_messages(dicts)) + "\nassistant:"
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]


def normalised_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    """One leading system message, tool results as user turns, consecutive same-role messages merged."""
    system = "\n\n".join(str(m["content"]) for m in messages if m["role"] == "system" and m["content"])
    out: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for m in messages:
        if m["role"] == "system":
            continue
        role, content = str(m["role"]), str(m["content"])
        if role not in ("user", "assistant"):
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if out and out[-1]["role"] == role:
            out[-1] = {"role": role, "content": f"{out[-1]['content']}\n\n{content}"}
        else:
            out.append({"role": role, "content": content})
    return out


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a turn: the generation config's, the model config's and the tokenizer's EOS, in that
    order (the first is the one to pad with)."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(int(v) for v in value)
    return tuple(dict.fromkeys(ids))


def _apply_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int] | None:
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as e:  # jinja raises its own TemplateError (e.g. "roles must alternate")
        log.debug("chat template refused the messages (%s); trying the normalised form", e)
        return None
    if isinstance(ids, Mapping) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
