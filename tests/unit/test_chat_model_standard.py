"""LangChain's standard unit-test suite for AgentMTPChat (tiny random model with the default model's tokenizer)."""

from __future__ import annotations

from typing import Any

from langchain_tests.unit_tests import ChatModelUnitTests

from agent_mtp import AgentMTPChat
from tests.unit.test_chat_model_helpers import shared_tiny_engine


class TestAgentMTPChatStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[AgentMTPChat]:
        return AgentMTPChat

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": shared_tiny_engine()}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True


def test_all_is_pinned() -> None:
    import agent_mtp
    import agent_mtp.langchain

    assert "AgentMTPChat" in agent_mtp.__all__
    assert agent_mtp.AgentMTPChat is AgentMTPChat
    assert agent_mtp.langchain.__all__ == [
        "AgentMTPChat",
        "MTPContextOverflowError",
        "MTPInvalidRequestError",
        "MTPModelNotFoundError",
        "MTPPolicyError",
        "MTPTimeoutError",
    ]
