"""The app factory: routes, authentication, the worker threads and the service's lifetime.

app = create_app(ServerSettings(policy="default"))            # loads the model at startup
app = create_app(settings, service=Service(engine, concurrency="batched"))   # tests: an engine you built
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from agent_mtp.server.errors import ServerError, install_handlers
from agent_mtp.server.protocol import ChatCompletionRequest, ModelCard, ModelList
from agent_mtp.server.serving import ChatServing
from agent_mtp.server.settings import ServerSettings
from agent_mtp.service import Service

log = logging.getLogger("agent_mtp.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_service(settings: ServerSettings) -> Service:
    """Load the engine and the telemetry sink the way AgentMTPChat does (shared engine, Redis telemetry)."""
    from agent_mtp.service import shared_engine
    from agent_mtp.telemetry import Telemetry

    if settings.threads is not None:
        import torch

        from agent_mtp.engine.threads import set_compute_threads

        torch.set_num_threads(settings.threads)
        set_compute_threads(settings.threads)  # the passes run on the engine's compute thread
    engine = shared_engine(settings.model, adapter=settings.adapter, dtype=settings.dtype)
    if settings.runtime != "auto" or settings.kv_cache is not None or settings.row_grid is not None:
        engine = engine.with_runtime(settings.runtime, kv_cache=settings.kv_cache, row_grid=settings.row_grid)
    # None: the process-wide telemetry of $AGENT_MTP_REDIS_URL (else nothing recorded), as for AgentMTPChat
    recorder = Telemetry(settings.redis_url.get_secret_value()) if settings.redis_url is not None else None
    breaker = settings.breaker_store.get_secret_value() if settings.breaker_store is not None else None
    return Service(engine, recorder=recorder, breaker_store=breaker, concurrency=settings.concurrency)


@asynccontextmanager
async def serving_lifetime(settings: ServerSettings, service: Service | None = None) -> AsyncIterator[ChatServing]:
    """The serving core of one process for the duration of the block: the service (the model loads here unless
    ``service`` is given), one worker thread per decoding request, and the cleanup on exit. Used by the app's
    lifespan and by each Ray replica (``agent_mtp.server.ray_app.MTPReplica``)."""
    own = service is None
    svc = service if service is not None else await asyncio.to_thread(build_service, settings)
    # one worker thread per decoding request (the default pool has min(32, cpus + 4) threads)
    pool = ThreadPoolExecutor(settings.max_active + 4, thread_name_prefix="agent-mtp-serve")
    asyncio.get_running_loop().set_default_executor(pool)
    log.info("Serving %s on %s runtime (%s)", settings.model_name, svc.engine.runtime, settings.concurrency)
    try:
        yield ChatServing(svc, settings)
    finally:
        if own:
            svc.close()
            if settings.redis_url is not None:  # this app's own Telemetry (the process-wide one closes at exit)
                close = getattr(svc.recorder, "close", None)
                if close is not None:
                    close()
        pool.shutdown(wait=False, cancel_futures=True)


def api_key_check(settings: ServerSettings) -> Callable[[Request], None]:
    """The dependency that refuses a /v1 request without ``Authorization: Bearer <api_key>`` (when one is set)."""

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        expected = settings.api_key.get_secret_value()
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected.encode()):
            msg = "Missing or incorrect API key; send 'Authorization: Bearer <key>' with the server's api_key."
            raise ServerError(401, msg, code="invalid_api_key")

    return authorize


def health_body(serving: ChatServing, settings: ServerSettings) -> dict[str, Any]:
    """What /health says of a serving process: its model (and the runtime, KV cache precision and real rows' grid
    it runs with, so a load test's report says what it measured), admission and batching counters."""
    admission = serving.admission
    engine = serving.service.engine
    body: dict[str, Any] = {
        "status": "ok",
        "model": settings.model_name,
        "runtime": engine.runtime,
        "kv_cache": engine.kv_cache,
        "row_grid": engine.row_grid,
        "active": admission.active,
        "queued": admission.waiting,
    }
    scheduler = getattr(serving.service.decoder, "scheduler", None)
    if scheduler is not None:
        stats = scheduler.stats()
        body["batching"] = {
            "passes": stats.passes,
            "mean_batch": round(stats.mean_batch, 3),
            "rows": stats.rows,
            "mean_rows": round(stats.rows / stats.passes, 3) if stats.passes else 0.0,
        }
    return body


def create_app(settings: ServerSettings | None = None, *, service: Service | None = None) -> FastAPI:
    """The ASGI app of one deployment. Without ``service`` the model loads at startup (``build_service``)."""
    settings = settings or ServerSettings()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with serving_lifetime(settings, service) as current:
            state["serving"] = app.state.serving = current
            state["started"] = int(time.time())
            try:
                yield
            finally:
                state.pop("serving", None)

    app = FastAPI(title="agent-mtp", version="0.1.0", lifespan=lifespan)
    install_handlers(app)
    authorize = api_key_check(settings)

    def serving() -> ChatServing:
        current = state.get("serving")
        if current is None:
            raise ServerError(503, "The server is starting or shutting down; retry shortly.", type="server_error")
        return current  # type: ignore[no-any-return]

    @app.get("/health")
    async def health() -> JSONResponse:
        current = state.get("serving")
        if current is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse(health_body(current, settings))

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_name, created=state.get("started", 0))])

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], response_model=None)
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        current = serving()
        if body.stream:
            events = await current.stream(body)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        completion = await current.complete(body)
        return JSONResponse(completion.model_dump(exclude_none=True))

    return app
