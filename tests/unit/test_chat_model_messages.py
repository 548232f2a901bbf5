"""Message rendering: the chat template where it accepts the sequence, a normalised sequence where it refuses,
``role: content`` lines without a template; tool calls and results in the history; token counting."""

from __future__ import annotations

import pytest
from langchain_core.messages import (
    AIMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from agent_mtp import AgentMTPChat
from agent_mtp.langchain import MTPInvalidRequestError
from agent_mtp.langchain.messages import render_prompt
from tests.unit.test_chat_model_helpers import real_tokenizer, shared_tiny_engine

STRICT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{% endif %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return real_tokenizer()


def rendered(tokenizer, messages, **kwargs) -> str:
    return tokenizer.decode(render_prompt(tokenizer, messages, **kwargs))


def tool_history() -> list:
    return [
        SystemMessage("You are terse."),
        SystemMessage("Use tools."),
        HumanMessage("What is 1 + 2?"),
        HumanMessage("Quickly."),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "abc", "type": "tool_call"}]),
        ToolMessage("3", tool_call_id="abc", name="add"),
    ]


def test_two_system_two_human_and_a_tool_message_last(tokenizer):
    text = rendered(tokenizer, tool_history())
    assert text.count("<|im_start|>system") == 2
    assert text.count("<|im_start|>user") == 2
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
        in text
    )
    assert "<|im_start|>tool\n3<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "SmolLM" not in text  # the template's default system prompt is only for conversations without one


def test_system_block_joins_the_first_system_message(tokenizer):
    text = rendered(tokenizer, [HumanMessage("hi")], system_block="TOOLS HERE")
    assert text.startswith("<|im_start|>system\nTOOLS HERE<|im_end|>")
    text = rendered(tokenizer, [SystemMessage("Be kind."), HumanMessage("hi")], system_block="TOOLS HERE")
    assert text.startswith("<|im_start|>system\nBe kind.\n\nTOOLS HERE<|im_end|>")


def test_a_template_that_refuses_gets_the_normalised_sequence(tokenizer):
    tokenizer.chat_template = STRICT_TEMPLATE
    try:
        text = rendered(tokenizer, tool_history())
    finally:
        tokenizer.chat_template = real_tokenizer().chat_template
    assert text.count("<|im_start|>system") == 1
    assert "You are terse.\n\nUse tools." in text
    assert "<|im_start|>user\nWhat is 1 + 2?\n\nQuickly.<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_without_a_template_messages_become_role_lines(tokenizer):
    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        text = rendered(tokenizer, [SystemMessage("s"), HumanMessage("h1"), HumanMessage("h2")])
    finally:
        tokenizer.chat_template = saved
    assert text == "system: s\nuser: h1\n\nh2\nassistant:"


def test_content_blocks_error_status_and_chat_roles(tokenizer):
    messages = [
        HumanMessage([{"type": "text", "text": "part one"}, "part two"]),
        AIMessage(
            [{"type": "text", "text": "some text"}, {"type": "tool_use", "id": "x", "name": "add", "input": {}}],
            tool_calls=[{"name": "add", "args": {}, "id": "x", "type": "tool_call"}],
        ),
        ToolMessage("missing b", tool_call_id="x", status="error"),
        ChatMessage("from a human", role="human"),
        HumanMessage("named", name="alice"),
    ]
    text = rendered(tokenizer, messages)
    assert "part one\npart two" in text
    assert 'some text\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>' in text
    assert "<|im_start|>tool\nError: missing b" in text
    assert "<|im_start|>user\nfrom a human" in text


def test_images_and_empty_conversations_are_refused(tokenizer):
    image = HumanMessage([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    with pytest.raises(MTPInvalidRequestError, match="text-only"):
        render_prompt(tokenizer, [image])
    with pytest.raises(MTPInvalidRequestError, match="no messages"):
        render_prompt(tokenizer, [])


def test_token_counts_use_the_local_tokenizer():
    engine = shared_tiny_engine()
    llm = AgentMTPChat(model=engine)
    text = "Tokenizers differ: SmolLM2 is not GPT-2."
    assert llm.get_num_tokens(text) == len(engine.tokenizer.encode(text))
    messages = [SystemMessage("s"), HumanMessage("What is the weather?")]
    assert llm.get_num_tokens_from_messages(messages) == len(render_prompt(engine.tokenizer, messages))

    def get_weather(city: str) -> str:
        """Weather for a city."""
        return "sunny"

    with_tools = llm.get_num_tokens_from_messages(messages, tools=[get_weather])
    assert with_tools > llm.get_num_tokens_from_messages(messages)


def test_token_counting_without_loading_the_model():
    llm = AgentMTPChat()  # "default": only the tokenizer is loaded for counting
    assert llm.get_num_tokens("hello world") == 2
    assert llm._engine_instance is None
