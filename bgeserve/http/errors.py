"""The one table from exception class to HTTP status, the error bodies, and the handlers.

Every error response, the framework's own included, has one of two shapes, chosen by the
request's path (``ErrorStyle``): the OpenAI shape ``{"error": {"message", "type", "code",
"param"}}`` everywhere, and TEI's ``{"error": str, "error_type": str}`` on the routes that speak
text-embeddings-inference's API (``/embed``, ``/tokenize``, ...), with TEI's statuses
(``TEI_ERRORS``). On the Jina / Cohere rerank routes the OpenAI shape also carries the message
as ``detail`` (``DETAIL_STYLE``). Errors are translated where they enter: the service raises ``BgeServeError``
subclasses, request parsing raises ``InvalidInput`` / ``TooLarge``, middleware raises the
HTTP-only classes below, and Starlette's ``HTTPException`` (unknown route, wrong method) is
translated by ``on_http_exception``. Everything that answers an error calls ``respond``.
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
from starlette.types import ASGIApp, Receive, Scope, Send

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

# TEI's statuses and error types (text-embeddings-inference router/src/http/server.rs and
# docs/openapi.json, commit 0d124dc): validation and tokenizer errors are 422, an empty input
# 400, a backend failure 424, overload 429, unhealthy 503. Looked up along the MRO like
# ERROR_STATUS; a class missing here keeps its ERROR_STATUS status, typed Validation (4xx) or
# Backend (5xx), since TEI's ErrorType has no other members.
TEI_ERRORS: dict[type[BgeServeError], tuple[int, str]] = {
    InvalidInput: (422, "Validation"),
    TooLarge: (413, "Validation"),
    Overloaded: (429, "Overloaded"),
    EngineFailed: (424, "Backend"),
    NotReady: (503, "Unhealthy"),
    ModelUnavailable: (503, "Unhealthy"),
}
# Codes TEI answers otherwise than their class: an empty input is TEI's own 400 "Empty", a
# body that is no JSON is 400 (axum's JSON extractor), and a text over the sequence length with
# truncation off is its tokenizer's validation error, 422 (TEI's 413 is a batch too large).
TEI_CODES: dict[str, tuple[int, str]] = {
    "empty_input": (400, "Empty"),
    "too_many_tokens": (422, "Validation"),
    "invalid_json": (400, "Validation"),
    "bad_request": (400, "Validation"),
}
TEI_STYLE = "tei"
# The engine names the texts as the OpenAI and Cohere-style bodies do; TEI's bodies call them
# ``inputs`` (embed, tokenize, predict) and ``texts`` (rerank).
_TEI_FIELDS = {"input": "inputs", "documents": "texts"}
OPENAI_STYLE = "openai"
# The OpenAI shape plus ``"detail": message``: LlamaIndex's JinaRerank reads FastAPI's
# ``detail`` from any answer without ``results`` (a KeyError that hid the message otherwise).
DETAIL_STYLE = "openai+detail"

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


def tei_status(exc: BgeServeError) -> tuple[int, str]:
    """TEI's status and ``error_type`` for ``exc`` (``TEI_CODES``, then ``TEI_ERRORS``)."""
    if exc.code in TEI_CODES:
        return TEI_CODES[exc.code]
    for cls in type(exc).__mro__:
        if cls in TEI_ERRORS:
            return TEI_ERRORS[cls]
    status = status_for(exc)
    return status, "Backend" if status >= 500 else "Validation"


def _tei_names(message: str, param: str | None) -> str:
    """``message`` with the engine's name for the field at fault (``input[3]``,
    ``documents[2]``) spelled as TEI's request names it (``inputs[3]``, ``texts[2]``)."""
    for ours, theirs in _TEI_FIELDS.items():
        if param and param.startswith(ours + "["):
            return message.replace(param, theirs + param[len(ours):])
    return message


def tei_body(message: str, error_type: str) -> dict[str, Any]:
    """TEI's error body (``ErrorResponse`` in TEI's docs/openapi.json)."""
    return {"error": message, "error_type": error_type}


def envelope(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """The error body: ``type`` is ``invalid_request_error`` for 4xx, ``server_error`` for 5xx."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def openai_body(style: str, status: int, message: str, code: str,
                param: str | None = None) -> dict[str, Any]:
    """The OpenAI-shape body in ``style`` (``DETAIL_STYLE`` adds ``detail``)."""
    body = envelope(status, message, code, param)
    if style == DETAIL_STYLE:
        body["detail"] = message
    return body


def json_error(
    status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> Response:
    """An error response with an orjson-encoded envelope."""
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def error_response(exc: BgeServeError, request_id: str | None = None,
                   style: str = OPENAI_STYLE, *, access_logged: bool = False) -> Response:
    """Translate a ``BgeServeError`` through the table into an error response of ``style``.

    ``access_logged``: the request's access-log line names the error (``respond``), so a 4xx
    needs no line of its own (a flood of refusals then logs one line per request, not two)."""
    status = status_for(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, Overloaded | NotReady) and exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, DeadlineExceeded):
        # The openai client (and LangChain's, LlamaIndex's on top) retries every 5xx twice
        # unless told not to: a request that used up its deadline would run three times,
        # adding its whole cost to the load that made it late. A 429 / 503 stay retryable.
        headers["x-should-retry"] = "false"
    message = exc.message
    if status >= 500:
        level = logging.ERROR if status == 500 else logging.WARNING
        if access_logged and isinstance(exc, NotReady | DeadlineExceeded):
            # A 503 (loading, stopping) or a 504 is the client's answer, and the request's
            # access line says it at warning with its code: a second warning each (QA) was
            # a client polling through a first start's minutes, or every request of a
            # backlog, logged twice.
            level = logging.DEBUG
        log.log(level, "%s: %s", type(exc).__name__, exc.message, extra={"request_id": request_id})
        if status == 500 or isinstance(exc, ModelUnavailable):
            message = _GENERIC_MESSAGE.format(rid=request_id)
    else:
        log.log(logging.DEBUG if access_logged else logging.INFO, "rejected: %s%s", exc.code,
                f" ({exc.param})" if exc.param else "", extra={"request_id": request_id})
    if style == TEI_STYLE:
        tei, error_type = tei_status(exc)
        return json_error(tei, tei_body(_tei_names(message, exc.param), error_type), headers)
    return json_error(status, openai_body(style, status, message, exc.code, exc.param), headers)


def style_of(scope: Scope) -> str:
    """The error style ``ErrorStyle`` chose for this request (OpenAI's before it ran)."""
    return scope.get("state", {}).get("error_style", OPENAI_STYLE)


def respond(exc: BgeServeError, scope: Scope) -> Response:
    """The error response for ``exc`` in the style and with the request id of ``scope``;
    its code and parameter go on the request's access-log line (``RequestContext``)."""
    state = scope.setdefault("state", {})
    state["error"] = exc.code
    state["error_param"] = exc.param
    return error_response(exc, request_id_of(scope), style_of(scope),
                          access_logged="request_id" in state)


def renamed_param(exc: BgeServeError, field: str, name: str,
                  words: Mapping[str, str] | None = None) -> BgeServeError | None:
    """A copy of ``exc`` naming ``name[i]`` where it names ``field[i]`` (the engine's names
    for a route whose body calls its items otherwise), and with each of ``words`` (the
    engine's advice in bgeserve's parameters) put in the route's own; None when it names no
    such item."""
    param = exc.param
    if param is None or not param.startswith(f"{field}["):
        return None
    renamed = name + param[len(field):]
    message = exc.message.replace(param, renamed)
    for said, meant in (words or {}).items():
        message = message.replace(said, meant)
    return type(exc)(message, param=renamed, code=exc.code)


class ErrorStyle:
    """ASGI middleware: errors on ``tei_paths`` get TEI's shape and statuses, those on
    ``detail_paths`` the OpenAI shape with ``detail``.

    Decided from the path before anything can fail (the auth, body and in-flight guards answer
    before routing), and kept in ``scope["state"]["error_style"]`` for ``respond``.
    """

    def __init__(self, app: ASGIApp, *, tei_paths: frozenset[str],
                 detail_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.tei_paths = tei_paths
        self.detail_paths = detail_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            style = (TEI_STYLE if path in self.tei_paths
                     else DETAIL_STYLE if path in self.detail_paths else OPENAI_STYLE)
            scope.setdefault("state", {})["error_style"] = style
        await self.app(scope, receive, send)


async def on_bgeserve_error(request: Request, exc: Exception) -> Response:
    """Handler for every ``BgeServeError`` that reaches the router."""
    assert isinstance(exc, BgeServeError)
    return respond(exc, request.scope)


async def on_http_exception(request: Request, exc: Exception) -> Response:
    """Translate Starlette's ``HTTPException`` (404, 405, …) into the error body."""
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    message = exc.detail
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}; use {allowed}"
    style = style_of(request.scope)
    if style == TEI_STYLE:
        if exc.status_code == 404:
            message += " (TEI's routes that bgeserve serves: docs/tei.md)"
        return json_error(exc.status_code, tei_body(message, "Validation"), exc.headers)
    if exc.status_code == 404:
        # A path no route serves is most often a client's URL built wrong (a base URL with a
        # trailing slash or a route appended twice); clients that read only a string `detail`,
        # `error` or `message` (Hugging Face's JS client) said "an HTTP error occurred" without it.
        style = DETAIL_STYLE
    return json_error(exc.status_code, openai_body(style, exc.status_code, message, code),
                      exc.headers)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    """The outer 500: generic message, request id echoed; Starlette re-raises so it is logged."""
    rid = request_id_of(request.scope)
    log.error("unexpected %s", type(exc).__name__, extra={"request_id": rid})
    message = _GENERIC_MESSAGE.format(rid=rid)
    body = (tei_body(message, "Backend") if style_of(request.scope) == TEI_STYLE
            else openai_body(style_of(request.scope), 500, message, "internal_error"))
    return json_error(500, body, {REQUEST_ID_HEADER: rid} if rid else None)


EXCEPTION_HANDLERS = {
    BgeServeError: on_bgeserve_error,
    HTTPException: on_http_exception,
    Exception: on_unexpected,
}
