"""The dashboard's ASGI app: one page, its JSON, ``/metrics`` and the vendored chart library, all read-only.

    app = create_dashboard_app(DashboardSettings(redis_url="redis://..."))     # agent-mtp dashboard runs this
    server_app.mount("/dashboard", create_dashboard_app(settings))             # or under another FastAPI app

Routes (relative to where the app is mounted): ``/`` the page, ``/api/config``, ``/api/stats?window=5m``,
``/metrics`` (Prometheus text format), ``/static/...`` (uPlot, the page's script and style). With a token every
route but ``/static`` needs ``Authorization: Bearer <token>``; a browser opens ``/?token=<token>`` once and gets
an HttpOnly cookie instead (the token leaves the address bar by a redirect).
"""

from __future__ import annotations

import json
import secrets
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from agent_mtp.errors import TelemetryError
from agent_mtp.telemetry.config import WINDOWS, parse_window
from agent_mtp.telemetry.queries import redis_store
from agent_mtp.telemetry.web.data import Fleet, dashboard_view
from agent_mtp.telemetry.web.metrics import metrics_registry, render_metrics
from agent_mtp.telemetry.web.settings import DashboardSettings

COOKIE = "agent_mtp_dashboard"
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    # Nothing but this app's own files may load: the page works offline and cannot leak to a third party.
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def static_dir() -> Path:
    """The page and the vendored uPlot inside the installed package."""
    return Path(str(resources.files("agent_mtp.telemetry.web") / "static"))


def build_fleets(settings: DashboardSettings) -> list[Fleet]:
    """One read-side store per fleet (the URL's password stays inside the client)."""
    url = settings.redis_url.get_secret_value()
    return [
        Fleet(
            source.label,
            source.namespace,
            redis_store(url, namespace=source.namespace, socket_timeout_s=settings.socket_timeout_s),
        )
        for source in settings.sources
    ]


def _authorizer(settings: DashboardSettings) -> Any:
    expected = settings.token.get_secret_value().encode() if settings.token is not None else None

    def authorize(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        given = value.strip() if scheme.lower() == "bearer" else request.cookies.get(COOKIE, "")
        if not given or not secrets.compare_digest(given.encode(), expected):
            raise HTTPException(
                status_code=401,
                detail="missing or wrong dashboard token: send 'Authorization: Bearer <token>' or open /?token=<token>",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return authorize


def create_dashboard_app(settings: DashboardSettings, *, fleets: list[Fleet] | None = None) -> FastAPI:
    """The dashboard as a FastAPI app that can run alone or be mounted (e.g. at ``/dashboard``) in another app.

    ``fleets`` replaces the stores built from ``settings`` (tests, or a caller that already has clients)."""
    fleets = fleets if fleets is not None else build_fleets(settings)
    registry = metrics_registry(fleets)
    authorize = _authorizer(settings)
    guarded = [Depends(authorize)]
    app = FastAPI(title="agent-mtp dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=static_dir()), name="static")
    page_template = (static_dir() / "index.html").read_text(encoding="utf-8")
    config = {
        "fleets": [{"label": f.label, "namespace": f.namespace, "target": f.store.target} for f in fleets],
        "windows": list(WINDOWS),
        "refresh_s": settings.refresh_s,
    }

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page(request: Request, token: Annotated[str | None, Query()] = None) -> Response:
        if token is not None and settings.token is not None:
            if not secrets.compare_digest(token.encode(), settings.token.get_secret_value().encode()):
                raise HTTPException(status_code=401, detail="wrong dashboard token")
            response = RedirectResponse(str(request.url.remove_query_params("token")), status_code=303)
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path=_root(request) or "/")
            return response
        authorize(request)
        base = _root(request) + "/"
        html = page_template.replace("__BASE__", base).replace("__CONFIG__", json.dumps(config).replace("<", "\\u003c"))
        return HTMLResponse(html, headers=PAGE_HEADERS)

    @app.get("/api/config", dependencies=guarded)
    def api_config() -> dict[str, Any]:
        return config

    @app.get("/api/stats", dependencies=guarded)
    def api_stats(window: str = "5m") -> JSONResponse:
        try:
            window_s = parse_window(window)
        except TelemetryError as e:
            raise HTTPException(status_code=400, detail=str(e)) from None
        view = dashboard_view(fleets, window_s=window_s, points=settings.points)
        failed = all("error" in fleet for fleet in view["fleets"])
        return JSONResponse(view, status_code=503 if failed else 200, headers={"Cache-Control": "no-store"})

    @app.get("/metrics", dependencies=guarded, include_in_schema=False)
    def metrics() -> Response:
        return Response(render_metrics(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _root(request: Request) -> str:
    """Where the app is mounted (``""`` when it runs alone, ``/dashboard`` under a server)."""
    return str(request.scope.get("root_path", "")).rstrip("/")
