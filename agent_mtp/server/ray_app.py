"""The two deployments of `agent-mtp serve --ray`: a router that is the HTTP ingress, and the model replicas.

    client ─► Ray Serve proxy ─► Router (FastAPI, no model, 0 CPUs) ─► DeploymentHandle ─► MTPReplica x N

Each :class:`MTPReplica` runs the serving core of one process (:func:`agent_mtp.server.app.serving_lifetime`: the
model loaded once, continuous batching, admission) and answers handle calls with a :class:`Reply` (status, OpenAI
body, headers) or, for a stream, a :class:`Reply` then the SSE events. The :class:`Router` owns the HTTP side: the
OpenAI routes, request validation, the API key, and the one thing Ray Serve's proxy cannot do, a clear error when a
replica dies under a request. The proxy answers that with a bare ``500 Internal Server Error``; the router sees the
actor's death on the handle (:func:`replica_lost`) and answers 503 + ``Retry-After`` + an OpenAI error body with code
``replica_unavailable`` (:func:`agent_mtp.server.errors.replica_unavailable`), or, once a stream is under way, that
body as one SSE error event, then the end of the stream. Requests not yet handed to a replica go to the live ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from agent_mtp.server.app import SSE_HEADERS, api_key_check, health_body, serving_lifetime
from agent_mtp.server.errors import ServerError, from_exception, install_handlers, replica_unavailable, sse_error
from agent_mtp.server.protocol import ChatCompletionRequest, ModelCard, ModelList
from agent_mtp.server.settings import ServerSettings

ENV_REPLICA = "AGENT_MTP_TELEMETRY_REPLICA"
REPLICA_HEADER = "x-agent-mtp-replica"
"""Response header naming the replica that answered (operators, the fault and breaker tests)."""


@dataclass(frozen=True)
class Reply:
    """A replica's answer to the router: HTTP status, JSON body and headers (the replica id among them)."""

    status: int
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


# ------------------------------------------------------------------------------------------------- the replica
class MTPReplica:
    """One model replica: its telemetry replica id, its torch threads, the serving core (model loaded at start).

    Ray calls ``check_health`` every ``health_check_period_s`` and replaces a replica whose check raises or that
    stops answering; ``__del__`` on a graceful shutdown, after in-flight requests had their grace period."""

    async def __init__(self, settings: ServerSettings) -> None:  # type: ignore[misc]  # Ray awaits async constructors
        from ray import serve

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        os.environ[ENV_REPLICA] = self.replica_id  # read by Telemetry's config when the service is built
        self.settings = settings
        self._headers = {REPLICA_HEADER: self.replica_id}
        self._lifetime = AsyncExitStack()
        self.serving = await self._lifetime.enter_async_context(serving_lifetime(settings))

    async def __del__(self) -> None:
        lifetime = getattr(self, "_lifetime", None)  # absent when the constructor failed early
        if lifetime is not None:
            await lifetime.aclose()

    async def complete(self, body: ChatCompletionRequest) -> Reply:
        try:
            completion = await self.serving.complete(body)
        except Exception as e:
            return self._error(e)
        return Reply(200, completion.model_dump(exclude_none=True), self._headers)

    async def stream(self, body: ChatCompletionRequest) -> AsyncIterator[Reply | str]:
        """A :class:`Reply` first (200: the events follow; else the error, before any event), then SSE events."""
        try:
            events = await self.serving.stream(body)
        except Exception as e:
            yield self._error(e)
            return
        yield Reply(200, {}, self._headers)
        async for event in events:
            yield event

    async def health(self) -> Reply:
        return Reply(200, {**health_body(self.serving, self.settings), "replica": self.replica_id}, self._headers)

    async def whoami(self) -> Reply:
        return Reply(200, {"replica": self.replica_id, "pid": os.getpid()}, self._headers)

    def check_health(self) -> None:
        scheduler = getattr(self.serving.service.decoder, "scheduler", None)
        thread = getattr(scheduler, "_thread", None)
        if thread is not None and not thread.is_alive():
            msg = f"replica {self.replica_id}: the batching scheduler thread died"
            raise RuntimeError(msg)

    def _error(self, error: Exception) -> Reply:
        mapped = from_exception(error)
        return Reply(mapped.status, mapped.body(), {**mapped.headers, **self._headers})


# -------------------------------------------------------------------------------------------------- the router
def replica_lost(error: BaseException) -> bool:
    """True when a handle call failed because its replica died or cannot be reached (not because of the request):
    ``RayActorError`` (``ActorDiedError``, ``ActorUnavailableError``), Serve's ``ReplicaUnavailableError``, or a
    task error caused by one of them."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    lost = (RayActorError, ReplicaUnavailableError)
    return isinstance(error, lost) or isinstance(getattr(error, "cause", None), lost)


async def _forward(call: Awaitable[Any]) -> Any:
    """Await a handle call; a lost replica becomes the retryable 503, anything else the usual mapping."""
    try:
        return await call
    except Exception as e:
        raise (replica_unavailable() if replica_lost(e) else from_exception(e)) from e


async def _relay(events: Any) -> AsyncIterator[str]:
    """The replica's SSE events; if it dies mid-stream, one error event, then the end (no ``[DONE]``). A client
    that leaves cancels the replica's stream (its slot is freed and the decode stops at its next pass)."""
    done = False
    try:
        async for event in events:
            yield event
        done = True
    except Exception as e:
        done = True
        yield sse_error(replica_unavailable() if replica_lost(e) else from_exception(e))
    finally:
        if not done:
            events.cancel()


def create_router_app(settings: ServerSettings, replicas: Any) -> FastAPI:
    """The router's ASGI app: the server's routes, answered by ``replicas`` (a ``DeploymentHandle`` of
    :class:`MTPReplica`, or anything with the same ``.method.remote()`` calls)."""
    app = FastAPI(title="agent-mtp", version="0.1.0")
    install_handlers(app)
    authorize = api_key_check(settings)
    started = int(time.time())

    @app.get("/health")
    async def health() -> JSONResponse:
        """A replica's /health (which one answered is in ``replica``); 503 while none can answer."""
        reply: Reply = await _forward(replicas.health.remote())
        return reply.response()

    @app.get("/replica")
    async def replica() -> JSONResponse:
        """Which replica answered (id, process id): for operators and the fault tests."""
        reply: Reply = await _forward(replicas.whoami.remote())
        return reply.response()

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_name, created=started)])

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], response_model=None)
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        if not body.stream:
            reply: Reply = await _forward(replicas.complete.remote(body))
            return reply.response()
        events = replicas.options(stream=True).stream.remote(body)
        first = await _forward(events.__anext__())
        if not isinstance(first, Reply):  # a replica always opens with its Reply
            events.cancel()
            raise ServerError(500, "Internal server error; see the server log.", type="server_error")
        if first.status != 200:
            return first.response()
        return StreamingResponse(
            _relay(events), media_type="text/event-stream", headers={**SSE_HEADERS, **first.headers}
        )

    return app


class Router:
    """The ingress deployment (wrapped with ``serve.ingress()`` by ``build_application``): holds the handle of the
    replicas and builds :func:`create_router_app` in its own process. No model, no CPUs reserved."""

    def __init__(self, settings: ServerSettings, replicas: Any) -> None:
        self.settings = settings
        self.replicas = replicas

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_router_app(self.settings, self.replicas)
