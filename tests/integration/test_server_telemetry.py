"""The server records telemetry and keeps breaker state in Redis exactly as AgentMTPChat does (one StepEvent per
request through the service's policy controller), with the Redis URL never in a response or the log."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from agent_mtp.engine import MTPEngine
from agent_mtp.policy.breaker import RedisBreakerStore
from agent_mtp.server import ServerSettings, create_app
from agent_mtp.telemetry import Telemetry
from tests.fixtures.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.redis]

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_server_steps_reach_redis(
    redis_server: RedisServer,
    default_engine: MTPEngine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr("agent_mtp.service.shared_engine", lambda *a, **k: default_engine)
    caplog.set_level(logging.DEBUG)
    redis_server.add_user("server", "s3cret-pw")
    url = redis_server.url.replace("redis://", "redis://server:s3cret-pw@")
    settings = ServerSettings(model="default", policy="default", redis_url=SecretStr(url), breaker_store=SecretStr(url))
    app = create_app(settings)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    with TestClient(app) as client:
        controller = app.state.serving.service._controller("default")
        assert isinstance(controller.breakers.store, RedisBreakerStore)
        call = {"type": "function", "function": {"name": "get_weather"}}
        bodies = [
            {"model": "default", "messages": question, "tools": [TOOL], "tool_choice": call, "max_tokens": 48},
            {"model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16},
            {"model": "default", "messages": question, "max_tokens": 16, "stream": True},
        ]
        texts = [client.post("/v1/chat/completions", json=b).text for b in bodies]
    # the app's own Telemetry flushed when the app stopped
    report = Telemetry(redis_server.url, start=False).query("5m", flush=False)
    assert report.total.requests == 3
    assert report.select(step_type="tool_call").requests == 1
    assert all("s3cret-pw" not in t for t in texts) and "s3cret-pw" not in caplog.text
