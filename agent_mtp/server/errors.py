"""Every error a request can meet -> an HTTP status and the OpenAI error body, in one place.

{"error": {"message": "...", "type": "invalid_request_error", "param": "messages.0.role", "code": null}}
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_mtp.errors import (
    AgentMTPError,
    ConfigError,
    DeadlineExceededError,
    GrammarError,
    ModelLoadError,
    PolicyError,
    PromptError,
    PromptTooLongError,
    QualityError,
)
from agent_mtp.server.protocol import ErrorDetail, ErrorResponse

log = logging.getLogger("agent_mtp.server")


class ServerError(Exception):
    """An error with its HTTP status and OpenAI error fields (raised by the serving layer)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()


def overloaded(retry_after_s: int, active: int, queued: int) -> ServerError:
    msg = (
        f"The server is at capacity ({active} requests decoding, {queued} queued); retry after {retry_after_s} s "
        "(the Retry-After header), or raise max_active / max_queue on the server."
    )
    return ServerError(
        429, msg, type="rate_limit_error", code="server_overloaded", headers={"Retry-After": str(retry_after_s)}
    )


def replica_unavailable(retry_after_s: int = 1) -> ServerError:
    """A Ray replica died (or could not be reached) under the request: retryable, the other replicas serve."""
    msg = (
        "The replica serving this request died before it finished (Ray is replacing it); the request was not "
        f"completed and may be retried: the other replicas keep serving. Retry after {retry_after_s} s "
        "(the Retry-After header)."
    )
    return ServerError(
        503, msg, type="server_error", code="replica_unavailable", headers={"Retry-After": str(retry_after_s)}
    )


def sse_error(error: ServerError) -> str:
    """The error as one server-sent event (what a stream that has started sends before it ends)."""
    return f"data: {json.dumps(error.body())}\n\n"


def from_exception(error: BaseException) -> ServerError:
    """Map a service / engine error to its ServerError (unknown errors become a 500 without internals)."""
    if isinstance(error, ServerError):
        return error
    if isinstance(error, PromptTooLongError):
        return ServerError(400, str(error), param="messages", code="context_length_exceeded")
    if isinstance(error, PolicyError):
        return ServerError(400, str(error), param="agent_mtp.policy", code="invalid_policy")
    if isinstance(error, GrammarError):
        return ServerError(400, str(error), param="response_format", code="invalid_schema")
    if isinstance(error, (PromptError, ConfigError)):
        return ServerError(400, str(error), code="invalid_request")
    if isinstance(error, DeadlineExceededError):
        return ServerError(504, str(error), type="timeout_error", code="deadline_exceeded")
    if isinstance(error, QualityError):
        return ServerError(500, str(error), type="server_error", code="quality_check_failed")
    if isinstance(error, ModelLoadError):
        return ServerError(503, str(error), type="server_error", code="model_unavailable")
    if isinstance(error, AgentMTPError):
        return ServerError(500, str(error), type="server_error")
    log.exception("Unexpected error while serving a request", exc_info=error)
    return ServerError(500, "Internal server error; see the server log.", type="server_error")


def validation_error(errors: Sequence[Any]) -> ServerError:
    """The first pydantic validation error, naming the field (``messages.0.role``)."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # drop the union-branch labels pydantic adds (``str``, ``list[ContentPart]``, ``function-after[...]``)
    param = ".".join(p for p in loc if not any(c in p for c in "[]()") and p not in ("str", "int", "float", "bool"))
    kind = first.get("type", "")
    what = "is not a field of this request" if kind == "extra_forbidden" else first.get("msg", "is invalid")
    given = f" (got {first['input']!r})" if "input" in first and kind != "missing" else ""
    extra = f" and {len(errors) - 1} more problem(s)" if len(errors) > 1 else ""
    msg = f"{param or 'body'}: {what}{given}{extra}."
    if kind == "extra_forbidden":
        msg += " Remove it (agent-mtp options go in the 'agent_mtp' field)."
    return ServerError(400, msg[:2000], param=param or None, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Every error leaves the server as an OpenAI error body."""

    async def on_server_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServerError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return await on_server_error(_, validation_error(exc.errors()))

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        error = ServerError(exc.status_code, str(exc.detail), type="invalid_request_error")
        return await on_server_error(_, error)

    async def on_other(_: Request, exc: Exception) -> JSONResponse:
        return await on_server_error(_, from_exception(exc))

    app.add_exception_handler(ServerError, on_server_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(AgentMTPError, on_other)
