"""One prompt renderer: the same conversation gives the same token ids through every user (engine, chat model,
service, training-data generation, bench), so an adapter sees in serving exactly what it was trained on."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from agent_mtp import AgentMTPChat
from agent_mtp.bench.suites import BenchPrompt
from agent_mtp.engine.prompt import render_messages
from agent_mtp.langchain.messages import render_prompt
from agent_mtp.service import Request, prompt_ids
from agent_mtp.training import data as training_data
from tests.unit.test_chat_model_helpers import shared_tiny_engine

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one."},
]
LANGCHAIN = [
    SystemMessage("You are terse."),
    HumanMessage("Name a colour."),
    AIMessage("Blue."),
    HumanMessage("Another one."),
]


@pytest.fixture(scope="module")
def engine():
    return shared_tiny_engine()


def test_every_user_renders_the_same_token_ids(engine, monkeypatch, tmp_path) -> None:
    tok = engine.tokenizer
    assert tok.chat_template  # the default model's ChatML template
    expected = render_messages(tok, CONVERSATION)
    assert engine.encode_prompt(CONVERSATION) == expected
    assert render_prompt(tok, LANGCHAIN) == expected
    assert AgentMTPChat(model=engine).get_num_tokens_from_messages(LANGCHAIN) == len(expected)
    assert prompt_ids(tok, Request(messages=tuple(CONVERSATION))) == expected
    bench = BenchPrompt(id="p", suite="chat", messages=tuple(CONVERSATION), max_new_tokens=8)
    assert engine.encode_prompt(bench.prompt_messages()) == expected

    seen: list[list[int]] = []  # training-data generation encodes prompts through the same function
    monkeypatch.setattr(training_data, "_greedy_batch", lambda model, prompts, *a: seen.extend(prompts) or [[]])
    item = training_data.PromptItem("p", "test", "chat", CONVERSATION)
    training_data.generate_responses(engine.model, tok, [item], tmp_path, max_new_tokens=4, batch_size=1)
    assert seen == [expected]
