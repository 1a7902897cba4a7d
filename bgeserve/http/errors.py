"""The one table from exception class to HTTP status, the error envelope, and the handlers.

Every error response, the framework's own included, has the OpenAI shape
``{"error": {"message", "type", "code", "param"}}``. Errors are translated where they enter:
the service raises ``BgeServeError`` subclasses, request parsing raises ``InvalidInput`` /
``TooLarge``, middleware raises the HTTP-only classes below, and Starlette's ``HTTPException``
(unknown route, wrong method) is translated by ``on_http_exception``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from bgeserve.errors import (
    BgeServeError,
    DeadlineExceeded,
    EngineFailed,
    InvalidInput,
    ModelUnavailable,
    NotReady,
    Overloaded,
    TooLarge,
)
from bgeserve.http.context import request_id_of

log = logging.getLogger("bgeserve.http")

REQUEST_ID_HEADER = "X-Request-ID"


class Unauthorized(BgeServeError):
    """The ``Authorization: Bearer`` key is missing or matches no configured key."""

    code = "invalid_api_key"


class ModelNotFound(BgeServeError):
    """The request names a model this server does not serve."""

    code = "model_not_found"


class UnsupportedMediaType(BgeServeError):
    """The request body is not declared as UTF-8 JSON."""

    code = "unsupported_media_type"


class BodyTimeout(BgeServeError):
    """The client stopped sending its body (a stalled or slowloris client)."""

    code = "request_timeout"


class ClientGone(BgeServeError):
    """The client closed the connection before its answer: its queued texts were dropped.

    Nobody reads the response; the status (nginx's 499, "client closed request") is for the
    access log and the request metrics.
    """

    code = "client_disconnected"


# The one table. Looked up along the MRO, so OutOfMemory (an EngineFailed) is a 500 and any
# other BgeServeError (e.g. ConfigError) falls through to 500.
ERROR_STATUS: dict[type[BgeServeError], int] = {
    InvalidInput: 400,
    Unauthorized: 401,
    ModelNotFound: 404,
    BodyTimeout: 408,
    TooLarge: 413,
    UnsupportedMediaType: 415,
    Overloaded: 429,
    EngineFailed: 500,
    NotReady: 503,
    ModelUnavailable: 503,
    DeadlineExceeded: 504,
    ClientGone: 499,
}

# 500s and a missing model may carry internals (paths, runtime errors) in their message: the
# caller gets a generic text and the request id; the details go to the log only.
_GENERIC_MESSAGE = "internal server error; see the server log for request id {rid}"

# Codes for Starlette's own HTTPExceptions, by status.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 400: "bad_request"}


def status_for(exc: BgeServeError) -> int:
    """The HTTP status for ``exc`` (500 for a class the table does not know)."""
    for cls in type(exc).__mro__:
        if cls in ERROR_STATUS:
            return ERROR_STATUS[cls]
    return 500


def envelope(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """The error body: ``type`` is ``invalid_request_error`` for 4xx, ``server_error`` for 5xx."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def json_error(
    status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> Response:
    """An error response with an orjson-encoded envelope."""
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def error_response(exc: BgeServeError, request_id: str | None = None) -> Response:
    """Translate a ``BgeServeError`` through the table into an enveloped response."""
    status = status_for(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    message = exc.message
    if status >= 500:
        level = logging.ERROR if status == 500 else logging.WARNING
        log.log(level, "%s: %s", type(exc).__name__, exc.message, extra={"request_id": request_id})
        if status == 500 or isinstance(exc, ModelUnavailable):
            message = _GENERIC_MESSAGE.format(rid=request_id)
    else:
        log.info("rejected: %s (%s)", exc.code, exc.param, extra={"request_id": request_id})
    return json_error(status, envelope(status, message, exc.code, exc.param), headers)


async def on_bgeserve_error(request: Request, exc: Exception) -> Response:
    """Handler for every ``BgeServeError`` that reaches the router."""
    assert isinstance(exc, BgeServeError)
    return error_response(exc, request_id_of(request.scope))


async def on_http_exception(request: Request, exc: Exception) -> Response:
    """Translate Starlette's ``HTTPException`` (404, 405, …) into the envelope."""
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    message = exc.detail
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}; use {allowed}"
    return json_error(exc.status_code, envelope(exc.status_code, message, code), exc.headers)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    """The outer 500: generic message, request id echoed; Starlette re-raises so it is logged."""
    rid = request_id_of(request.scope)
    log.error("unexpected %s", type(exc).__name__, extra={"request_id": rid})
    body = envelope(500, _GENERIC_MESSAGE.format(rid=rid), "internal_error")
    return json_error(500, body, {REQUEST_ID_HEADER: rid} if rid else None)


EXCEPTION_HANDLERS = {
    BgeServeError: on_bgeserve_error,
    HTTPException: on_http_exception,
    Exception: on_unexpected,
}
