"""Thin handlers: read → parse → one service call → render. Errors propagate to the table.

The lifespan puts ``service``, ``settings`` and ``model_ids`` in the request state. Parsing a
big body and rendering a big result are CPU work, so past a size they run on a worker thread
and the event loop keeps serving other requests.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio.to_thread
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from bgeserve.errors import InvalidInput
from bgeserve.http import contract, jsoncost, render
from bgeserve.http.context import CHARGE_BODY
from bgeserve.http.errors import ClientGone, ModelNotFound, UnsupportedMediaType
from bgeserve.http.render import embedding_parts, numbers_bytes, render_embeddings, render_json
from bgeserve.http.schemas import Endpoint, check_dimensions, parse_embed_request

T = TypeVar("T")

OFFLOAD_BODY_BYTES = 256 * 1024  # parse on a thread past this (~2 ms of orjson + checks)
OFFLOAD_ITEMS = 16  # render on a thread past this many items (16 x 1024 floats)
HEALTHY = frozenset({"ok", "warn", "idle"})


async def _maybe_offload(heavy: bool, fn: Callable[..., T], *args: Any) -> T:
    if heavy:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))
    return fn(*args)


async def parse_body(request: Request, raw: bytes, parse: Callable[..., T], *args: Any) -> T:
    """``parse(raw, *args)``; past ``OFFLOAD_BODY_BYTES`` on a thread, after what decoding the
    body adds was charged to the allowance of bodies in progress (jsoncost.py: 30 MiB of
    ``[{},...]`` decode to 690 MiB, and the threads decode several at once)."""
    if len(raw) <= OFFLOAD_BODY_BYTES:  # on the event loop: one at a time, <= ~9 MiB
        return parse(raw, *args)
    charge = request.scope.get("state", {}).get(CHARGE_BODY)
    if charge is not None:
        charge(await anyio.to_thread.run_sync(jsoncost.decoded_bytes, raw) - len(raw))
    return await anyio.to_thread.run_sync(functools.partial(parse, raw, *args))


async def read_json_body(request: Request) -> bytes:
    """The raw body, after checking it is declared as UTF-8 JSON (a missing type is allowed),
    not compressed. A header sent twice counts as its values joined (QA: the first one alone
    was read, and "identity" then "gzip" let a compressed body through)."""
    types = request.headers.getlist("content-type")
    # The same type twice is that type (case and spaces aside).
    declared = ", ".join(dict.fromkeys(t.strip().lower() for t in types)) if types else None
    if declared is not None:
        media, *params = (part.strip().lower() for part in declared.split(";"))
        charsets = [p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")]
        if media != "application/json" or any(c not in ("utf-8", "utf8") for c in charsets):
            raise UnsupportedMediaType(
                f"Content-Type {declared!r} is not supported; send application/json (UTF-8)"
            )
    coding = ", ".join(request.headers.getlist("content-encoding")).strip().lower()
    if any(c.strip() not in ("identity", "") for c in coding.split(",")):
        # Read as it is, a compressed body was a 400 about UTF-8 (gzip) or, where the bytes
        # happened to be JSON, silently taken as if it were not compressed.
        raise UnsupportedMediaType(
            f"Content-Encoding {coding!r} is not supported; send the body uncompressed")
    transfer = ", ".join(request.headers.getlist("transfer-encoding")).strip().lower()
    if [c.strip() for c in transfer.split(",") if c.strip()] not in ([], ["chunked"]):
        # The parser takes off the chunking alone: a gzip coding under it was read as the body.
        raise UnsupportedMediaType(
            f"Transfer-Encoding {transfer!r} is not supported; send the body uncompressed "
            "(chunked alone is)")
    try:
        return await request.body()
    except ClientDisconnect:
        raise ClientGone("client disconnected while sending the body") from None


async def _disconnected(request: Request) -> None:
    """Return once the client has closed the connection.

    Called after the whole body was read: the server's next message is then only ever
    ``http.disconnect`` (uvicorn sends it when the peer goes away, or once the response is
    complete).
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``, cancelling it if the client goes away first.

    Starlette does not cancel a handler whose client left, so without this an abandoned
    request would still have every text computed, delaying everyone queued behind it; the
    engine drops a cancelled job's queued texts.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled: so is its work
        _abandon(task)
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    _abandon(task)
    await asyncio.wait({task})  # the cancellation reaches the engine before we answer
    raise ClientGone("client disconnected before the answer; its texts were dropped")


def _abandon(task: asyncio.Future[Any]) -> None:
    """Cancel work nobody will await. It may still end in an error rather than cancelled (a
    job refused 429 as the cancellation arrived: ``wait_for`` then raises the job's error):
    that error is read here, so asyncio does not log it as never retrieved."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def streams(request: Request, vector_bytes: int) -> bool:
    """Whether an answer carrying ``vector_bytes`` of float32 vectors is sent as it is rendered
    (``render.STREAM_BYTES``; StreamingResponse renders each piece on a thread). Over HTTP/1.1
    only: such an answer has no Content-Length, and uvicorn frames it chunked whatever the
    client's version; an HTTP/1.0 client cannot read that, so it gets the answer whole."""
    return vector_bytes > render.STREAM_BYTES and request.scope.get("http_version") == "1.1"


def refuse_when_full(request: Request) -> None:
    """429 from the headers when no request can be admitted now, whatever its size: before
    the body is read (the lingering close then drops it, linger.py)."""
    refusal = request.state.service.refuse_now()
    if refusal is not None:
        raise refusal


def embed_endpoint(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    """A handler for one embedding route (dense, sparse or both)."""

    async def handle(request: Request) -> Response:
        state = request.state
        refuse_when_full(request)
        raw = await read_json_body(request)
        parsed = await parse_body(request, raw, parse_embed_request, endpoint, state.settings,
                                  state.model_ids)
        check_dimensions(parsed.dimensions, state.service.dense_width())
        result = await unless_disconnected(request, state.service.embed(
            parsed.inputs, parsed.options, request_id=state.request_id
        ))
        if streams(request, numbers_bytes(result, parsed.outputs)):
            return StreamingResponse(embedding_parts(
                endpoint, parsed, result, state.service.model_name, state.service.token_strings,
            ), media_type="application/json")
        body = await _maybe_offload(
            len(result) > OFFLOAD_ITEMS or "colbert" in parsed.outputs,
            render_embeddings, endpoint, parsed, result, state.service.model_name,
            state.service.token_strings,
        )
        return Response(body, media_type="application/json")

    return handle


def _model_entry(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "owned_by": "BAAI", "created": 0}


async def models(request: Request) -> Response:
    """``GET /v1/models``: bge-m3, every accepted alias, and the reranker when loaded."""
    names = (*request.state.model_ids, *request.state.service.rerank_model_ids())
    data = [_model_entry(name) for name in names]
    return Response(render_json({"object": "list", "data": data}), media_type="application/json")


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}`` (``client.models.retrieve``): any name ``/v1/models`` lists
    (the reranker's too), else 404."""
    name = request.path_params["model_id"]
    if not name:  # `/v1/models/`: an unknown route, as every trailing slash is
        raise HTTPException(404)
    names = (*request.state.model_ids, *request.state.service.rerank_model_ids())
    if name not in names:
        raise ModelNotFound(f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(names)}", param="model")
    return Response(render_json(_model_entry(name)), media_type="application/json")


async def health(request: Request) -> Response:
    """``GET /health``: 200 while the service can answer (ok/warn/idle), else 503."""
    report = request.state.service.health()
    status = 200 if report.get("status") in HEALTHY else 503
    return Response(render_json(report), status, media_type="application/json")


DEEP_TIMEOUT_RANGE = (1.0, 60.0)  # seconds a caller may give the canary (?timeout=)


async def deep_health(request: Request) -> Response:
    """``GET /health/deep``: the canary through queue, session and heads; 200 with timings,
    503 with the reason. ``?timeout=SECS`` (1-60) bounds it instead of the default 5 s."""
    raw = request.query_params.get("timeout")
    deadline = None
    if raw is not None:
        lo, hi = DEEP_TIMEOUT_RANGE
        try:
            deadline = float(raw)
        except ValueError:
            deadline = math.nan
        if not lo <= deadline <= hi:  # nan fails too
            raise InvalidInput(f"timeout must be a number of seconds in [{lo:g}, {hi:g}]",
                               param="timeout")
    status, body = await request.state.service.deep_health(deadline)
    return Response(render_json(body), status, media_type="application/json")


async def metrics(request: Request) -> Response:
    """``GET /metrics``: the Prometheus exposition from the service."""
    body, content_type = request.state.service.metrics()
    return Response(body, media_type=content_type)


async def openapi(request: Request) -> Response:
    """``GET /openapi.json``: the contract with this server's real bounds (503 while loading)."""
    state = request.state
    bounds = contract.bounds_of(state.service, state.settings, state.model_ids)
    return Response(contract.served(bounds), media_type="application/json")
