"""Issue 16 against a real redis-server with an ACL user: with only AGENT_MTP_REDIS_URL set, a chat model's steps
reach Redis; a wrong password in breaker_store never fails a call; the passwords appear in no surface."""

from __future__ import annotations

import json
import logging

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.load import dumps
from typer.testing import CliRunner

from agent_mtp import AgentMTPChat
from agent_mtp.errors import TelemetryError
from agent_mtp.telemetry import Telemetry, TelemetryConfig, process_telemetry, query_stats, redis_store
from tests.fixtures.redis_server import RedisServer
from tests.unit.test_chat_model_helpers import shared_tiny_engine

pytestmark = pytest.mark.redis

PASSWORD = "Env-S3cret-Pw"
WRONG = "Wr0ng-Br3aker-Pw"


class _Capture(BaseCallbackHandler):
    def __init__(self) -> None:
        self.seen: list[object] = []

    def on_chat_model_start(self, serialized: object, messages: object, **kwargs: object) -> None:
        self.seen.append({"serialized": serialized, **kwargs})


@pytest.mark.usefixtures("fresh_process_telemetry")
def test_env_only_redis_records_every_step_and_no_password_shows(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = redis_server.add_user("alice", PASSWORD)
    wrong = redis_server.url_for("alice", WRONG)
    monkeypatch.setenv("AGENT_MTP_REDIS_URL", url)
    monkeypatch.setenv("AGENT_MTP_TELEMETRY_NAMESPACE", "envtest")
    llm = AgentMTPChat(model=shared_tiny_engine(), policy="default", breaker_store=wrong, max_tokens=4)
    capture = _Capture()
    for question in ("Hello", "Name a colour.", "Count to two."):
        llm.invoke(question, config={"callbacks": [capture]})
    telemetry = process_telemetry()
    assert telemetry is not None and telemetry.flush()
    report = query_stats(redis_store(url, namespace="envtest"), window="1m")
    assert report.total.requests == 3 and report.writers == 1

    texts = [repr(llm), str(llm), repr(llm.model_dump()), dumps(llm), repr(telemetry), str(telemetry.stats())]
    texts += [json.dumps(seen, default=repr) for seen in capture.seen]
    with pytest.raises(TelemetryError) as info:
        Telemetry(wrong, config=TelemetryConfig(namespace="envtest"), start=False).query("1m")
    texts.append(str(info.value))
    assert "AuthenticationError" in str(info.value) and "alice:***@" in str(info.value)

    import typer

    from agent_mtp.telemetry.cli import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    ok = CliRunner().invoke(app, ["stats", "--json", "--namespace", "envtest"])  # the URL from the environment
    bad = CliRunner().invoke(app, ["stats", "--redis-url", wrong])
    assert ok.exit_code == 0 and json.loads(ok.output)["total"]["requests"] == 3
    assert bad.exit_code == 1 and "alice:***@" in bad.output
    assert "breaker store: Redis unreachable (AuthenticationError" in caplog.text  # the call still answered
    texts += [ok.output, bad.output, caplog.text]
    for text in texts:
        assert PASSWORD not in text and WRONG not in text
