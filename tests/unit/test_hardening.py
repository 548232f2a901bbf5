"""Issue 16, one test per hole: secrets never shown, Redis URLs checked up front by one parser, out-of-range
settings refused everywhere alike, every user-caused error in the tree, no input dropped without a word, Redis
from the environment alone."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.exceptions import ModelInvalidRequestError
from langchain_core.load import dumpd, dumps
from langchain_core.messages import HumanMessage
from pydantic import ValidationError
from typer.testing import CliRunner

from agent_mtp import AgentMTPChat
from agent_mtp.engine import DecodeConfig
from agent_mtp.errors import (
    AgentMTPError,
    ConfigError,
    EmptyPromptError,
    PolicyError,
    RedisURLError,
    TelemetryError,
)
from agent_mtp.events import MemoryRecorder
from agent_mtp.langchain import MTPInvalidRequestError, MTPPolicyError
from agent_mtp.policy import load_policy
from agent_mtp.policy.breaker import RedisBreakerStore
from agent_mtp.redis_url import validate_redis_url
from agent_mtp.service import Limits, Request, Service, default_recorder, shared_service
from agent_mtp.telemetry import Telemetry, TelemetryConfig, process_telemetry
from tests.fixtures.redis_server import free_port
from tests.unit.test_chat_model_helpers import shared_tiny_engine

SECRET = "TopSecretQ"
BAD_URLS = ["http://x", "garbage", "", "redis://127.0.0.1:notaport/0", "redis://:@", "redis://127.0.0.1:99999/0"]


@pytest.fixture(scope="module")
def engine():
    return shared_tiny_engine()


def chat(engine: Any, **kwargs: Any) -> AgentMTPChat:
    settings: dict[str, Any] = {"model": engine, "max_tokens": 4, "mode": "ntp", "recorder": MemoryRecorder()}
    settings.update(kwargs)
    return AgentMTPChat(**settings)


# -- 1. no secret in any repr, dump, trace or log ------------------------------------------------------------------
class _Capture(BaseCallbackHandler):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.seen.append({"serialized": serialized, **kwargs})

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.seen.append(response)


@pytest.mark.usefixtures("fresh_process_telemetry")
def test_no_secret_in_any_surface_of_a_chat_model_with_secrets_in_every_url(engine, monkeypatch, caplog):
    """breaker_store, the recorder's URL and AGENT_MTP_REDIS_URL all carry the secret (on a closed port, so every
    Redis call fails and logs): it appears in no repr, str, dump, callback payload, DEBUG log or error message."""
    closed = free_port()
    url = f"redis://alice:{SECRET}@127.0.0.1:{closed}/0"
    monkeypatch.setenv("AGENT_MTP_REDIS_URL", f"redis://bob:{SECRET}@127.0.0.1:{closed}/1")
    caplog.set_level(logging.DEBUG)
    telemetry = Telemetry(url, config=TelemetryConfig(socket_timeout_s=0.2), start=False)
    surfaces: list[str] = []
    for llm in (
        chat(engine, breaker_store=url, recorder=telemetry, mode=None, policy="default"),
        chat(engine, breaker_store=url, recorder=None),  # the process-wide telemetry from the environment
    ):
        capture = _Capture()
        llm.invoke("Hi", config={"callbacks": [capture]})
        list(llm.stream("Hi", config={"callbacks": [capture]}))
        surfaces += [repr(llm), str(llm), repr(llm.model_dump()), json.dumps(llm.model_dump(), default=str)]
        surfaces += [dumps(llm), json.dumps(dumpd(llm)), repr(llm._identifying_params)]
        surfaces += [json.dumps(seen, default=repr) for seen in capture.seen]
    telemetry.flush(timeout_s=1)
    surfaces += [repr(telemetry), repr(telemetry.stats()), repr(process_telemetry())]
    for bad in (f"redis://alice:{SECRET}@", f"redis://alice:{SECRET}@127.0.0.1:notaport/0", f"http://a:{SECRET}@x"):
        with pytest.raises(AgentMTPError) as info:
            chat(engine, breaker_store=bad)
        surfaces.append(str(info.value))
    with pytest.raises(MTPInvalidRequestError) as info:  # any bad setting: the message never echoes the URL
        chat(engine, breaker_store=url, temperature=-1.0)
    surfaces.append(str(info.value))
    with pytest.raises(TelemetryError) as info:
        telemetry.query("1m")
    surfaces.append(str(info.value))
    surfaces += [record.getMessage() for record in caplog.records]
    assert any("alice:***@" in s for s in surfaces)  # the URLs are shown, redacted
    leaks = [s for s in surfaces if SECRET in s]
    assert not leaks, leaks[0]
    telemetry.close(timeout_s=0.5)


def test_stats_command_output_never_shows_the_password():
    import typer

    from agent_mtp.telemetry.cli import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a group, so "stats" is a subcommand as in agent-mtp
    url = f"redis://alice:{SECRET}@127.0.0.1:{free_port()}/0"
    for args in (["stats", "--redis-url", url], ["stats", "--redis-url", url, "--json"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, result.output
        assert "alice:***@" in result.output and SECRET not in result.output


# -- 2. one URL parser and validation for the breaker and telemetry ---------------------------------------------------
@pytest.mark.parametrize("url", BAD_URLS)
def test_bad_redis_urls_are_refused_at_construction_everywhere(engine, url):
    with pytest.raises(RedisURLError, match="breaker_store"):
        RedisBreakerStore(url)
    with pytest.raises(MTPInvalidRequestError, match="breaker_store"):
        chat(engine, breaker_store=url)
    with pytest.raises(TelemetryError):
        Telemetry(url, start=False)
    with pytest.raises(RedisURLError):
        validate_redis_url(url)


def test_good_redis_urls_pass():
    for url in ("redis://127.0.0.1:6379/0", "rediss://u:p@host:6380", "unix:///tmp/redis.sock", "redis://h"):
        assert validate_redis_url(url) == url


# -- 3. one validation of out-of-range settings -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "value"), [("k_max", 0), ("threshold", 1.5), ("threshold", -0.1), ("max_tokens", 0), ("timeout", 0)]
)
def test_out_of_range_settings_are_refused_by_the_chat_model_and_the_policy_schema(engine, setting, value):
    with pytest.raises(MTPInvalidRequestError, match=f"{setting}={value!r}"):
        chat(engine, mode="static", **{setting: value})
    field = {"max_tokens": "max_new_tokens", "timeout": "max_time_s"}.get(setting, setting)
    with pytest.raises(PolicyError, match=field):
        load_policy({"version": 1, "defaults": {field: value}})


def test_out_of_range_settings_per_call_are_refused(engine):
    llm = chat(engine, mode="static", k_max=4)
    for kwargs in ({"max_tokens": 0}, {"k_max": 0}, {"threshold": 1.5}, {"timeout": 0}):
        with pytest.raises(MTPInvalidRequestError, match=next(iter(kwargs))):
            llm.invoke("Hi", **kwargs)
    with pytest.raises(ConfigError, match="max_tokens=0"):
        Limits(max_tokens=0)
    with pytest.raises(ConfigError):
        DecodeConfig(k_max=0)


# -- 4. every user-caused error in the tree (and LangChain's class in the chat model) ---------------------------------
def test_construction_errors_are_agent_mtp_errors_of_langchain_classes(engine, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefaults:\n  mode: fast\n")
    for kwargs, kind in (
        ({"policy": str(bad), "mode": None}, MTPPolicyError),
        ({"policy": "no/such.yaml", "mode": None}, MTPPolicyError),
        ({"mode": "fast"}, MTPInvalidRequestError),
        ({"temperature": "hot"}, MTPInvalidRequestError),
    ):
        with pytest.raises(kind) as info:
            chat(engine, **kwargs)
        assert isinstance(info.value, AgentMTPError) and isinstance(info.value, ModelInvalidRequestError)
        assert not isinstance(info.value, ValidationError)
    with pytest.raises(PolicyError, match="mode"):
        chat(engine, policy=str(bad), mode=None)


def test_bind_tools_with_bad_parameters_is_an_invalid_request(engine):
    bad = {"type": "function", "function": {"name": "f", "description": "", "parameters": "a string"}}
    with pytest.raises(MTPInvalidRequestError, match="parameters"):
        chat(engine).bind_tools([bad])


def test_telemetry_query_against_a_refusing_redis_raises_telemetry_error():
    telemetry = Telemetry(f"redis://127.0.0.1:{free_port()}/0", config=TelemetryConfig(socket_timeout_s=0.2))
    with pytest.raises(TelemetryError, match="cannot read telemetry"):
        telemetry.query("1m", flush=False)
    telemetry.close(timeout_s=0.2)


# -- 5. no input dropped without a word -------------------------------------------------------------------------------
def test_unknown_content_block_is_refused(engine):
    with pytest.raises(MTPInvalidRequestError, match="'foo'"):
        chat(engine).invoke([HumanMessage(content=[{"type": "text", "text": "hi"}, {"type": "foo"}])])
    reply = chat(engine).invoke([HumanMessage(content=[{"type": "text", "text": "hi"}, {"type": "reasoning"}])])
    assert reply.usage_metadata is not None  # documented: reasoning blocks are left out, the text is read


def test_empty_conversation_is_refused(engine):
    with pytest.raises(MTPInvalidRequestError, match="empty"):
        chat(engine).invoke("")
    with pytest.raises(EmptyPromptError):
        Service(engine, recorder=MemoryRecorder()).generate(
            Request(messages=({"role": "user", "content": "  "},), policy=None)
        )


def test_forced_tool_choice_without_tools_is_refused(engine):
    for choice in ("any", "required", True):
        with pytest.raises(MTPInvalidRequestError, match="no tools are bound"):
            chat(engine).bind_tools([], tool_choice=choice)
    chat(engine).bind_tools([], tool_choice="auto")  # nothing to choose from: allowed, as LangGraph does


def test_tool_names_with_spaces_are_refused(engine):
    tool = {"name": "get weather now", "description": "d", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(MTPInvalidRequestError, match="'get_weather_now'"):
        chat(engine).bind_tools([tool])


# -- 7. Redis from the environment alone ------------------------------------------------------------------------------
@pytest.mark.usefixtures("fresh_process_telemetry")
def test_a_chat_model_without_recorder_uses_the_process_telemetry(engine, monkeypatch):
    monkeypatch.delenv("AGENT_MTP_REDIS_URL", raising=False)
    assert default_recorder() is None
    monkeypatch.setenv("AGENT_MTP_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    telemetry = process_telemetry()
    assert isinstance(telemetry, Telemetry) and telemetry is process_telemetry()  # one per process
    llm = chat(engine, recorder=None)
    llm.invoke("Hi")
    service = shared_service(engine)
    assert service.recorder is telemetry and telemetry.stats().recorded_events >= 1
    monkeypatch.setenv("AGENT_MTP_REDIS_URL", "http://not-redis")
    with pytest.raises(MTPInvalidRequestError, match=r"redis_url='http://not-redis'"):
        chat(engine, recorder=None)
