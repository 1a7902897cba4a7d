"""Request ids: accepted or generated, echoed on every response, carried by every log line.

``RequestContext`` is the outermost of our middleware: it settles the id before anything can
fail, stores it in ``scope["state"]["request_id"]`` and in a context variable, adds the
``X-Request-ID`` header to every response that passes through it, and writes one access-log
line per request; ``bgeserve.logs`` stamps the id on every log record.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bgeserve.logs import request_id_var
from bgeserve.timings import Timings, measuring

log = logging.getLogger("bgeserve.http")

_HEADER = b"x-request-id"
# Set in ``scope["state"]`` by the HTTP protocol (headlimits.py) when the connection is lost with
# the request's answer started and not all written: uvicorn drops what the app sends after
# that without a word, so the app may finish its answer thinking it was sent.
ANSWER_CUT = "answer_cut"
# Set in ``scope["state"]`` by the HTTP protocol (stalls.py): ``hold_until_taken(answer,
# give_back)`` says how many bytes of an answer just handed over its client has not taken
# (0: none to speak of), and gives them back through ``give_back(n)`` as it takes them or the
# connection ends. Absent under another protocol: nothing is held.
HOLD_UNTIL_TAKEN = "hold_until_taken"
# Set in ``scope["state"]`` by the allowance of bodies in progress (guards.InflightLimit):
# ``charge(n)`` counts ``n`` bytes more for the request until its answer is taken (what
# decoding its body adds, jsoncost.py); it raises ``TooLarge`` where they could never fit,
# ``Overloaded`` where other requests hold the room.
CHARGE_BODY = "charge_body"
_PREFLIGHT = b"access-control-request-method"
_VALID_ID = re.compile(r"[\x20-\x7e]{1,128}")
MAX_LOGGED_PATH = 256  # characters of a request's path in its access line
# The health checks, bgeserve's and TEI's (its `GET /`; its `POST /` embeds): a GET of one
# needs no key (app.py). With the scrapes, they are logged at debug and not counted in flight
# (an autoscaler reads that gauge).
PROBE_PATHS = frozenset({"/health", "/health/deep", "/", "/ping"})
_QUIET_PATHS = PROBE_PATHS | {"/metrics"}


def _quiet(scope: Scope) -> bool:
    return scope["path"] in _QUIET_PATHS and scope["method"] in ("GET", "HEAD")


def sanitize_request_id(raw: bytes | None) -> str:
    """The caller's id when it is 1–128 printable ASCII characters, else a fresh uuid4 hex."""
    if raw is not None:
        text = raw.decode("latin-1").strip()
        if _VALID_ID.fullmatch(text):
            return text
    return uuid.uuid4().hex


def request_id_of(scope: Scope) -> str | None:
    """The id ``RequestContext`` settled for this request (None before it ran)."""
    return scope.get("state", {}).get("request_id")


class RequestContext:
    """ASGI middleware: request id in, request id out, one access-log line."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        # The app's routes, to label a request a guard answered before routing (a 413 from
        # Content-Length, a 401, a 429) by the route it was for, as a routed one is.
        self.routes = tuple(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope["headers"] if k == _HEADER), None)
        rid = sanitize_request_id(raw)
        scope.setdefault("state", {})["request_id"] = rid
        request_id_var.set(rid)
        status = 500  # what the log says if the app raises before starting a response
        complete = False  # the answer's last byte went out
        started = time.perf_counter()
        spent = Timings()

        async def send_with_id(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.body":
                complete = not message.get("more_body", False)
            elif message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k != _HEADER]
                headers.append((_HEADER, rid.encode("latin-1")))
                if spent.calls and status < 400:  # the model ran for it: where the time went
                    compute = getattr(scope["state"].get("service"), "compute_type", "cpu")
                    headers += spent.headers(time.perf_counter() - started, compute)
                message = {**message, "headers": headers}
            await send(message)

        quiet = _quiet(scope)
        metrics = _metrics(scope) if not quiet else None
        if metrics is not None:
            metrics.in_flight.inc()
        returned = False
        try:
            with measuring(spent):
                await self.app(scope, receive, send_with_id)
            returned = True
        finally:
            if metrics is not None:
                metrics.in_flight.dec()
            seconds = time.perf_counter() - started
            state = scope.get("state", {})
            route = _route(scope, self.routes)
            error, param = state.get("error"), state.get("error_param")
            if status < 400 and (not complete or state.get(ANSWER_CUT)):
                # Started but never finished: a streamed answer its client left mid-way (or
                # stopped reading, stalls.py) is not one it got; one the app broke off by
                # raising, uvicorn cuts short.
                status, error = (499, "client_disconnected") if returned else (500, error)
            # A 5xx is the server's failure: above info, so that a warning filter keeps it; a
            # probe's 503 (loading, draining) is its answer, every few seconds: debug.
            level = (logging.DEBUG if quiet else
                     logging.WARNING if status >= 500 else logging.INFO)
            path = logged_path(scope["path"])
            log.log(
                level,
                "%s %s %d %.1fms%s",
                scope["method"],
                path,
                status,
                seconds * 1000,
                f" {error}" + (f" ({param})" if param else "") if error else "",
                extra={"request_id": rid, "method": scope["method"], "route": route,
                       "status": status, "path": path,
                       # The peer, or behind a proxy uvicorn trusts (FORWARDED_ALLOW_IPS,
                       # 127.0.0.1 by default) the X-Forwarded-For client it named.
                       "client": _client(scope),
                       "ms": round(seconds * 1000, 1), "error": error, "param": param,
                       **_spent(spent)},
            )
            _observe(scope, status, seconds, route)


def _client(scope: Scope) -> str | None:
    """The access line's client, cut as the path is: behind a proxy uvicorn trusts it is the
    X-Forwarded-For the proxy passed on, which a client may have written (QA: 100 KB)."""
    client = (scope.get("client") or (None,))[0]
    return None if client is None else logged_path(client, 64)


def logged_path(path: str, keep: int = MAX_LOGGED_PATH) -> str:
    """``path`` as the access line shows it: cut to ``keep`` characters (default
    ``MAX_LOGGED_PATH``), saying how many more there were. A request
    target may be 64 KiB (the head's limit), and the line holds the path twice: one client,
    without a key, could write 128 KiB lines, which Docker's json-file driver and most log
    shippers split at 16 KiB into pieces that no longer parse (QA)."""
    if len(path) <= keep:
        return path
    return f"{path[:keep]}...(+{len(path) - keep} chars)"


def _spent(spent: Timings) -> dict[str, float | int]:
    """The access line's model figures (none where the model did not run)."""
    if not spent.calls:
        return {}
    return {"tokens": spent.tokens, "tokenization_ms": round(spent.tokenization_s * 1000, 1),
            "queue_ms": round(spent.queue_s * 1000, 1),
            "inference_ms": round(spent.inference_s * 1000, 1)}


def _metrics(scope: Scope):
    """The service's metrics (None when the service keeps none)."""
    return _registry(scope.get("state", {}))


def _registry(state: Mapping[str, Any]):
    """The metrics of the service in ``state`` (a request's, or the app's: the same service)."""
    return getattr(state.get("service"), "metrics_registry", None)


def count_refused(app_state: Mapping[str, Any], status: int) -> None:
    """Count in ``/metrics`` a request the HTTP protocol refused before any app saw it
    (headlimits.py: a head too large or too slow, bytes that are not HTTP), under the route
    ``unmatched``: it has no access line either, only the protocol's warning."""
    metrics = _registry(app_state)
    if metrics is not None:
        metrics.count_http("unmatched", status)


def _route(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The route template a request was for: its matched route's, or for one answered before
    routing (a guard's 413, 401, 429) the route its path names; ``unmatched`` for none. Never
    the raw path: unknown paths must not grow the label set. A browser's CORS preflight
    (answered by the CORS middleware, for any route) is ``preflight``: counted under its
    route, each was one more 200 of /v1/embeddings, say, in its latency too."""
    if scope["method"] == "OPTIONS" and any(k == _PREFLIGHT for k, _ in scope["headers"]):
        return "preflight"
    route = scope.get("route")
    if route is None:
        route = next((r for r in routes if r.matches(scope)[0] is not Match.NONE), None)
    return getattr(route, "path", None) or "unmatched"


def _observe(scope: Scope, status: int, seconds: float, route: str) -> None:
    """Count the request in the service's metrics (when the service keeps any)."""
    metrics = _metrics(scope)
    if metrics is None:
        return
    metrics.observe_http(route, status, seconds)
