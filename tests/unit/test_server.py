"""The OpenAI-compatible server on a tiny random model: wire format, tools, structured output, errors, auth,
pressure (429, deadlines, disconnects, shutdown). Real HTTP where it matters (uvicorn on a free port)."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.fast import FastModel
from agent_mtp.server import ServerSettings, create_app
from agent_mtp.server.errors import validation_error
from agent_mtp.service import Service
from tests.fixtures.uvicorn_server import serving
from tests.tiny import tiny_engine

KEY = "sk-test-very-secret-123"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def engine() -> MTPEngine:
    engine = tiny_engine(adapter=True, max_positions=1024)
    engine.set_cost_curve(CostCurve(((1, 1.0), (8, 1.5), (32, 3.0))))
    return engine


def _settings(**kw: Any) -> ServerSettings:
    base: dict[str, Any] = {"model": "tiny", "policy": "none", "mode": "verified", "request_timeout_s": 60}
    return ServerSettings(**{**base, **kw})


@pytest.fixture()
def client(engine: MTPEngine) -> Iterator[TestClient]:
    service = Service(engine, concurrency="batched")
    with TestClient(create_app(_settings(), service=service)) as c:
        yield c
    service.close()


def _body(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16, **kw}


def _events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ------------------------------------------------------------------------------------------------ basics
def test_health_and_models(client: TestClient) -> None:
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["active"] == 0
    assert (health["runtime"], health["kv_cache"], health["row_grid"]) == ("fast", "fp32", "int24")
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert health["batching"] == {"passes": 0, "mean_batch": 0.0, "rows": 0, "mean_rows": 0.0}
    client.post("/v1/chat/completions", json=_body())
    batching = client.get("/health").json()["batching"]
    assert batching["passes"] > 0 and batching["rows"] >= batching["passes"]
    assert batching["mean_rows"] == round(batching["rows"] / batching["passes"], 3)


def test_completion_has_openai_shape_usage_and_mtp_stats(client: TestClient, engine: MTPEngine) -> None:
    body = client.post("/v1/chat/completions", json=_body()).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["agent_mtp"]["stats"]["mode"] == "verified"
    assert body["agent_mtp"]["stats"]["new_tokens"] == usage["completion_tokens"]
    expected = engine.generate(
        [{"role": "user", "content": "Say something."}], DecodeConfig(mode="ntp", max_new_tokens=16)
    )
    assert choice["message"]["content"] == expected.text.strip() or choice["message"]["content"] == expected.text
    again = client.post("/v1/chat/completions", json=_body()).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prefix cache
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]


def test_stream_is_openai_chunks_and_equals_the_completion(client: TestClient) -> None:
    whole = client.post("/v1/chat/completions", json=_body(max_tokens=24)).json()
    opts = {"include_usage": True}
    with client.stream(
        "POST", "/v1/chat/completions", json=_body(max_tokens=24, stream=True, stream_options=opts)
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    last = next(c for c in reversed(chunks) if c["choices"])
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert "stats" in last["agent_mtp"]
    assert (
        chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    )


def test_named_tool_choice_gives_a_parsed_tool_call(client: TestClient) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = _body(tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=48)
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    if message["finish_reason"] == "tool_calls":
        call = message["message"]["tool_calls"][0]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [e for e in _events(r) if e != "[DONE]"]
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
    if message["finish_reason"] == "tool_calls":
        assert calls and calls[0]["function"]["name"] == "get_weather" and calls[0]["index"] == 0


def test_history_with_tool_calls_and_results_is_accepted(client: TestClient) -> None:
    messages = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "4 C, rain"},
    ]
    r = client.post("/v1/chat/completions", json=_body(messages=messages, tools=[WEATHER_TOOL], tool_choice="none"))
    assert r.status_code == 200, r.text


def test_response_format_json_schema_gives_json(client: TestClient) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    body = client.post("/v1/chat/completions", json=_body(response_format=fmt, max_tokens=60)).json()
    if body["choices"][0]["finish_reason"] == "stop":
        assert "answer" in json.loads(body["choices"][0]["message"]["content"], strict=False)


def test_per_request_policy_override(client: TestClient) -> None:
    body = client.post("/v1/chat/completions", json=_body(agent_mtp={"mode": "ntp"})).json()
    assert body["agent_mtp"]["stats"]["mode"] == "ntp" and body["agent_mtp"]["policy"] is None
    body = client.post("/v1/chat/completions", json=_body(agent_mtp={"policy": "exact"})).json()
    assert body["agent_mtp"]["policy_name"] == "exact" and body["agent_mtp"]["policy"]["mode"] == "verified"


# ------------------------------------------------------------------------------------------------ bad requests
@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"n": 2}, "n"),
        ({"temperature": 5}, "temperature"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
        ({"colour": "blue"}, "colour"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"agent_mtp": {"policy": "/etc/passwd"}}, "agent_mtp.policy"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_requests_get_400_naming_the_field(client: TestClient, change: dict[str, Any], param: str) -> None:
    r = client.post("/v1/chat/completions", json={**_body(), **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        error["type"] == "invalid_request_error"
        and error["param"] == param
        and param.split(".")[-1] in error["message"]
    )


def test_unknown_model_is_404_and_malformed_json_is_400(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**_body(), "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_validation_error_names_nested_fields() -> None:
    error = validation_error([{"loc": ("body", "messages", 0, "content", "str"), "msg": "bad", "type": "x"}])
    assert error.param == "messages.0.content"


# ------------------------------------------------------------------------------------------------ auth
def test_api_key_is_required_and_never_logged(engine: MTPEngine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    settings = _settings(api_key=SecretStr(KEY))
    assert KEY not in repr(settings) and KEY not in str(settings.model_dump())
    with TestClient(create_app(settings, service=Service(engine))) as c:
        assert c.get("/health").status_code == 200  # health stays open for probes
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = c.post("/v1/chat/completions", json=_body(), headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
    assert KEY not in caplog.text


# ------------------------------------------------------------------------------------------------ pressure
@pytest.fixture()
def slow_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward pass takes >= 100 ms (so a request is still decoding when the test acts)."""
    original = FastModel.forward_batch

    def slow(self: FastModel, items: Any) -> Any:
        time.sleep(0.1)
        return original(self, items)

    monkeypatch.setattr(FastModel, "forward_batch", slow)


def test_full_queue_gets_429_with_retry_after(engine: MTPEngine, slow_passes: None) -> None:
    service = Service(engine, concurrency="batched")
    app = create_app(_settings(max_active=1, max_queue=1), service=service)
    with serving(app) as server:
        url = f"{server.base_url}/chat/completions"
        results: list[int] = []
        body = _body(max_tokens=40, agent_mtp={"mode": "ntp"})
        threads = [
            threading.Thread(target=lambda: results.append(httpx.post(url, json=body, timeout=60).status_code))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        _wait(lambda: httpx.get(server.base_url.replace("/v1", "/health")).json()["queued"] == 1)
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        for t in threads:
            t.join()
        assert results == [200, 200]
    service.close()


def test_deadline_returns_partial_text_with_a_finish_reason(client: TestClient, slow_passes: None) -> None:
    body = client.post(
        "/v1/chat/completions", json=_body(max_tokens=200, agent_mtp={"mode": "ntp", "timeout": 0.3})
    ).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["agent_mtp"]["finish_reason"] == "timeout"
    assert 0 < body["usage"]["completion_tokens"] < 200
    assert body["agent_mtp"]["stats"]["new_tokens"] == body["usage"]["completion_tokens"]


def test_client_disconnect_mid_stream_frees_the_slot_at_once(engine: MTPEngine, slow_passes: None) -> None:
    service = Service(engine, concurrency="batched")
    with serving(create_app(_settings(max_active=1, max_queue=0), service=service)) as server:
        health = server.base_url.replace("/v1", "/health")
        body = _body(max_tokens=200, stream=True, agent_mtp={"mode": "ntp"})
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{server.base_url}/chat/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            assert httpx.get(health).json()["active"] == 1
        # the connection is closed: the slot and the batch seat are free long before 200 passes x 100 ms
        _wait(lambda: httpx.get(health).json()["active"] == 0, timeout=10)
        assert service.decoder.scheduler is not None
        _wait(lambda: service.decoder.scheduler.stats().active == 0, timeout=10)
        ok = httpx.post(f"{server.base_url}/chat/completions", json=_body(max_tokens=4), timeout=60)
        assert ok.status_code == 200  # the only slot is usable again
    service.close()


def test_graceful_shutdown_finishes_in_flight_streams(engine: MTPEngine, slow_passes: None) -> None:
    service = Service(engine, concurrency="batched")
    server_ctx = serving(create_app(_settings(), service=service), grace_s=30)
    server = server_ctx.__enter__()
    events: list[Any] = []

    def consume() -> None:
        body = _body(max_tokens=20, stream=True, agent_mtp={"mode": "ntp"})
        with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=60) as r:
            events.extend(_events(r))

    reader = threading.Thread(target=consume)
    reader.start()
    _wait(lambda: httpx.get(server.base_url.replace("/v1", "/health")).json()["active"] == 1)
    server.server.should_exit = True  # what SIGTERM does
    reader.join(60)
    server_ctx.__exit__(None, None, None)
    assert events and events[-1] == "[DONE]"
    assert any(e != "[DONE]" and e["choices"] and e["choices"][0]["finish_reason"] for e in events)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url.replace("/v1", "/health"))
    service.close()


def test_concurrent_requests_equal_sequential(engine: MTPEngine) -> None:
    bodies = [_body(messages=[{"role": "user", "content": f"Item {i}"}], max_tokens=12 + i) for i in range(4)]
    service = Service(engine, concurrency="batched")
    with serving(create_app(_settings(), service=service)) as server:
        url = f"{server.base_url}/chat/completions"
        alone = [httpx.post(url, json=b, timeout=60).json()["choices"][0]["message"]["content"] for b in bodies]
        got: dict[int, str] = {}

        def run(i: int) -> None:
            got[i] = httpx.post(url, json=bodies[i], timeout=60).json()["choices"][0]["message"]["content"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    service.close()
    assert [got[i] for i in range(4)] == alone


def test_openai_client_against_the_server(engine: MTPEngine) -> None:
    openai = pytest.importorskip("openai")
    service = Service(engine, concurrency="batched")
    with serving(create_app(_settings(), service=service)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        done = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        assert done.usage.completion_tokens >= 1
        assert done.model_extra["agent_mtp"]["stats"]["mode"] == "verified"
        parts = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        assert text == done.choices[0].message.content
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3)
    service.close()


def _wait(predicate: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_serve_and_loadtest_commands_are_registered() -> None:
    from typer.testing import CliRunner

    from agent_mtp.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["serve", "--help"]).exit_code == 0
    assert runner.invoke(app, ["loadtest", "--help"]).exit_code == 0
    bad = runner.invoke(app, ["serve", "--max-active", "0"])
    assert bad.exit_code != 0 and "max_active" in bad.output


async def test_a_stream_never_read_frees_its_slot(engine: MTPEngine) -> None:
    """A client gone before the first byte: the response is dropped unread and its slot comes back."""
    import gc

    from agent_mtp.server.protocol import ChatCompletionRequest
    from agent_mtp.server.serving import ChatServing

    serving = ChatServing(Service(engine), _settings(max_active=1, max_queue=0))
    events = await serving.stream(ChatCompletionRequest.model_validate(_body(stream=True)))
    assert serving.admission.active == 1
    del events
    gc.collect()
    assert serving.admission.active == 0
    async with serving.admission.slot():  # the only slot is free again
        assert serving.admission.active == 1


async def test_deltas_that_arrive_together_go_out_in_one_write_their_text_as_one_chunk(
    engine: MTPEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of deltas (a greedy run's tokens, a busy loop's backlog) is one SSE write whose text is one chunk,
    then the last chunk; the same deltas one at a time give the same text in more chunks."""
    from agent_mtp.server.protocol import ChatCompletionRequest
    from agent_mtp.server.serving import ChatServing

    serving = ChatServing(Service(engine), _settings(mode="ntp"))
    body = ChatCompletionRequest.model_validate(_body(max_tokens=12, stream=True))

    async def sent(bursts: Any) -> list[str]:
        monkeypatch.setattr(serving.service, "astream_bursts", bursts)
        return [event async for event in await serving.stream(body)]

    deltas = list(serving.service.stream(serving.to_service_request(body, timeout=60)))
    assert len([d for d in deltas if d.content]) > 2 and deltas[-1].result is not None

    async def together(request: Any) -> Any:
        yield list(deltas)

    async def apart(request: Any) -> Any:
        for delta in deltas:
            yield [delta]

    async def quiet_first(request: Any) -> Any:  # a burst of deltas with nothing to send sends nothing
        yield [dataclasses.replace(deltas[0], content="", tool_call_chunks=[], result=None)]
        yield list(deltas)

    one, many = await sent(together), await sent(apart)
    quiet = await sent(quiet_first)
    assert len(quiet) == 3 and all(quiet)  # no empty write for the quiet burst
    assert len(one) == 3 and one[-1] == "data: [DONE]\n\n"  # the role chunk, the burst, [DONE]
    burst = [json.loads(e[len("data: ") :]) for e in one[1].split("\n\n") if e]
    assert len(burst) == 2  # the text in one chunk, then the last chunk
    text = "".join(d.content for d in deltas)
    assert burst[0]["choices"][0]["delta"]["content"] == text and burst[1]["choices"][0]["finish_reason"]
    chunks = [json.loads(e[len("data: ") :]) for w in many[1:-1] for e in w.split("\n\n") if e]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text and len(chunks) > 2


async def test_bursts_keep_every_item_in_order_and_raise_after_them() -> None:
    """``_iterate_in_thread(bursts=True)``: however the items group, they come in order, each once, and an error
    the iterator raised after them comes after the last burst."""
    import threading as th

    from agent_mtp.service import _iterate_in_thread

    def items() -> Iterator[int]:
        yield from range(50)
        raise ValueError("after 50")

    seen: list[int] = []
    with pytest.raises(ValueError, match="after 50"):
        async for burst in _iterate_in_thread(items(), th.Event(), bursts=True):
            assert isinstance(burst, list) and burst
            seen.extend(burst)
    assert seen == list(range(50))
    done = [b async for b in _iterate_in_thread(iter(range(7)), th.Event(), bursts=True)]
    assert [x for b in done for x in b] == list(range(7))
