"""The Ray fleet's router (agent_mtp.server.ray_app) against a fake deployment handle, no Ray cluster: a replica that
dies under a request gives a retryable 503 with Retry-After and an OpenAI error body, or mid-stream one SSE error
event and the end of the stream; the openai client retries the 503 by itself and names the code of a stream's error;
errors that are not a replica's death keep their own mapping; the API key is checked in the router.

Skipped (with the reason) when Ray is not installed: the router recognises Ray's own exception types."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from agent_mtp.server.ray_app import REPLICA_HEADER, Reply, create_router_app
from agent_mtp.server.settings import ServerSettings

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'agent-mtp[ray]')")
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import ReplicaUnavailableError

HEADERS = {REPLICA_HEADER: "r1"}
CHUNK = 'data: {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}'
CHUNK += "\n\n"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "tiny",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.remote = fn


class _Events:
    """Like a DeploymentResponseGenerator: items, then an error or the end; ``cancel`` is recorded."""

    def __init__(self, items: list[Any], error: BaseException | None) -> None:
        self.items = list(items)
        self.error = error
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class FakeReplicas:
    """A handle whose calls fail with ``errors`` (one per call, then succeed) and whose streams are ``streams``."""

    def __init__(self, *, errors: list[BaseException] | None = None, streams: list[_Events] | None = None) -> None:
        self.errors = list(errors or [])
        self.streams = list(streams or [])
        self.calls = 0

    def options(self, *, stream: bool) -> FakeReplicas:
        return self

    def _reply(self, reply: Reply) -> Callable[..., Awaitable[Reply]]:
        async def call(*_: Any) -> Reply:
            self.calls += 1
            if self.errors:
                raise self.errors.pop(0)
            return reply

        return call

    @property
    def complete(self) -> _Method:
        return _Method(self._reply(Reply(200, COMPLETION, HEADERS)))

    @property
    def health(self) -> _Method:
        return _Method(self._reply(Reply(200, {"status": "ok", "replica": "r1"}, HEADERS)))

    @property
    def whoami(self) -> _Method:
        return _Method(self._reply(Reply(200, {"replica": "r1", "pid": 1}, HEADERS)))

    @property
    def stream(self) -> _Method:
        return _Method(lambda *_: self.streams.pop(0))


def _client(replicas: FakeReplicas, **settings: Any) -> TestClient:
    return TestClient(create_router_app(ServerSettings(model="tiny", **settings), replicas))


def _events(response: httpx.Response) -> list[Any]:
    data = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def _assert_replica_unavailable(error: dict[str, Any]) -> None:
    assert error["type"] == "server_error" and error["code"] == "replica_unavailable"
    assert "died" in error["message"] and "may be retried" in error["message"]


@pytest.mark.parametrize("lost", [ActorDiedError(), ReplicaUnavailableError("r1")], ids=["died", "unavailable"])
def test_a_replica_lost_under_a_request_is_a_retryable_503(lost: BaseException) -> None:
    with _client(FakeReplicas(errors=[lost])) as client:
        reply = client.post("/v1/chat/completions", json=BODY)
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    _assert_replica_unavailable(reply.json()["error"])


def test_a_stream_whose_replica_dies_ends_with_one_error_event_and_no_done() -> None:
    events = _Events([Reply(200, {}, HEADERS), CHUNK], ActorDiedError())
    with (
        _client(FakeReplicas(streams=[events])) as client,
        client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as reply,
    ):
        assert reply.status_code == 200 and reply.headers[REPLICA_HEADER] == "r1"
        got = _events(reply)
    assert got[0]["choices"][0]["delta"]["content"] == "Hi"
    assert len(got) == 2 and "[DONE]" not in got
    _assert_replica_unavailable(got[1]["error"])


def test_a_stream_whose_replica_dies_before_its_first_event_is_a_503() -> None:
    with _client(FakeReplicas(streams=[_Events([], ActorDiedError())])) as client:
        reply = client.post("/v1/chat/completions", json={**BODY, "stream": True})
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    _assert_replica_unavailable(reply.json()["error"])


def test_replica_errors_and_other_failures_keep_their_own_status() -> None:
    refused = Reply(429, {"error": {"message": "full", "type": "rate_limit_error", "param": None, "code": "x"}})
    streams = [_Events([refused], None), _Events([Reply(200, {}, HEADERS)], RuntimeError("bug"))]
    with _client(FakeReplicas(errors=[RuntimeError("bug")], streams=streams)) as client:
        crashed = client.post("/v1/chat/completions", json=BODY)
        full = client.post("/v1/chat/completions", json={**BODY, "stream": True})
        with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as reply:
            failed = _events(reply)
    assert crashed.status_code == 500 and crashed.json()["error"]["code"] is None  # not called retryable
    assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
    assert failed[-1]["error"]["type"] == "server_error" and failed[-1]["error"]["code"] is None


def test_routes_key_and_replica_visibility() -> None:
    with _client(FakeReplicas(), api_key=SecretStr("k")) as client:
        assert client.get("/health").json()["replica"] == "r1"  # no key needed for probes
        assert client.get("/replica").json() == {"replica": "r1", "pid": 1}
        assert client.post("/v1/chat/completions", json=BODY).status_code == 401
        auth = {"Authorization": "Bearer k"}
        assert [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]] == ["tiny"]
        done = client.post("/v1/chat/completions", json=BODY, headers=auth)
        assert done.status_code == 200 and done.headers[REPLICA_HEADER] == "r1"
        bad = client.post("/v1/chat/completions", json={**BODY, "messages": [{"role": "x"}]}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("messages.0")


def test_the_openai_client_retries_the_503_and_names_a_stream_error() -> None:
    openai = pytest.importorskip("openai")
    replicas = FakeReplicas(
        errors=[ActorDiedError()], streams=[_Events([Reply(200, {}, HEADERS), CHUNK], ActorDiedError())]
    )
    with _client(replicas) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=1, http_client=http)
        done = client.chat.completions.create(model="tiny", messages=BODY["messages"], max_tokens=4)
        assert done.choices[0].message.content == "Hi" and replicas.calls == 2  # the 503, then the retry
        stream = client.chat.completions.create(model="tiny", messages=BODY["messages"], max_tokens=4, stream=True)
        with pytest.raises(openai.APIError) as caught:
            for _ in stream:
                pass
    assert caught.value.code == "replica_unavailable"
