"""Structured output on the real default model, every method (no xfail): the grammar makes the output parse."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from agent_mtp import AgentMTPChat

pytestmark = pytest.mark.integration


class Joke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_pydantic_structured_output_parses(method):
    llm = AgentMTPChat(max_tokens=64).with_structured_output(Joke, method=method)
    assert isinstance(llm.invoke("Tell me a joke about cats."), Joke)


def test_bounded_fields_always_finish_and_stream_whole():
    llm = AgentMTPChat(max_tokens=64).with_structured_output(City, include_raw=True)
    out = llm.invoke("Which city is the Eiffel Tower in?")
    assert isinstance(out["parsed"], City)
    assert out["raw"].response_metadata["finish_reason"] == "tool_calls"
    chunks = list(AgentMTPChat(max_tokens=64).with_structured_output(City).stream("Where is Big Ben?"))
    assert chunks and all(isinstance(c, City) for c in chunks)
