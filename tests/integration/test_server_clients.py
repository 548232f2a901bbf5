"""Real clients, unchanged, against `agent-mtp serve` on the default model (uvicorn on a free port): the official
openai client, langchain-openai's ChatOpenAI (plain, streaming, bind_tools, structured output) and the LangGraph
agent example."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from agent_mtp.engine import MTPEngine
from agent_mtp.server import ServerSettings, create_app
from agent_mtp.service import Service
from tests.fixtures.uvicorn_server import ThreadedServer, serving

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def server(default_engine: MTPEngine) -> Iterator[ThreadedServer]:
    service = Service(default_engine, concurrency="batched")
    settings = ServerSettings(model="default", policy="default", request_timeout_s=120)
    with serving(create_app(settings, service=service)) as running:
        yield running
    service.close()


def _chat(server: ThreadedServer, **kw: Any) -> Any:
    return langchain_openai.ChatOpenAI(
        base_url=server.base_url, api_key="unused", model="default", temperature=0, max_retries=0, **kw
    )


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return json.dumps({"city": city, "celsius": 18, "sky": "sunny"})


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)


def test_openai_client_plain_and_streaming(server: ThreadedServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["default"]
    messages = [{"role": "user", "content": "Name three primary colours."}]
    done = client.chat.completions.create(model="default", messages=messages, max_tokens=32)
    assert done.choices[0].message.content and done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.prompt_tokens > 0 and done.usage.completion_tokens > 0
    extension = done.model_extra["agent_mtp"]
    assert extension["stats"]["forward_passes"] >= 1 and extension["policy"]["step_type"]
    stream = client.chat.completions.create(
        model="default", messages=messages, max_tokens=32, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content  # the default policy's final answers are greedy ConfAdapt
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the second identical prompt hit the cache


def test_chat_openai_invoke_and_stream(server: ThreadedServer) -> None:
    llm = _chat(server, max_tokens=24)
    message = llm.invoke("Say hello in French.")
    assert isinstance(message.content, str) and message.content
    assert message.usage_metadata["output_tokens"] > 0
    streamed = "".join(str(chunk.content) for chunk in _chat(server, max_tokens=24).stream("Say hello in French."))
    assert streamed == message.content


@pytest.mark.parametrize("streaming", [False, True])
def test_chat_openai_tool_calls_parse(server: ThreadedServer, streaming: bool) -> None:
    llm = _chat(server, max_tokens=64, streaming=streaming).bind_tools([get_weather], tool_choice="get_weather")
    for city in ("Paris", "Oslo", "Tokyo"):
        message = llm.invoke(f"What is the weather in {city}?")
        assert not message.invalid_tool_calls
        assert [c["name"] for c in message.tool_calls] == ["get_weather"]
        assert isinstance(message.tool_calls[0]["args"].get("city"), str)


def test_chat_openai_structured_output(server: ThreadedServer) -> None:
    llm = _chat(server, max_tokens=64).with_structured_output(Person)
    person = llm.invoke("Alice is 31 years old. Extract the person.")
    assert isinstance(person, Person) and person.name


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_served_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_langgraph_agent_example_against_the_server(server: ThreadedServer, capsys: pytest.CaptureFixture[str]) -> None:
    example = load_example("langgraph_agent")
    state = example.run("What is the weather in Paris, in Fahrenheit?", max_tokens=96, base_url=server.base_url)
    tools_called = [m.name for m in state["messages"] if isinstance(m, ToolMessage)]
    assert tools_called == ["get_weather", "convert_temperature"]
    assert isinstance(state["structured_response"], example.WeatherAnswer)
    assert "model -> get_weather(" in capsys.readouterr().out
