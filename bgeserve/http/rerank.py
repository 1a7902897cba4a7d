"""The rerank routes: ``/v1/rerank`` and ``/v2/rerank`` (Jina's and Cohere's shape, what
LangChain's and LlamaIndex's rerankers send) and ``/rerank`` (text-embeddings-inference's).

Thin, like every handler: read → parse (``rerank_schemas``) → ``service.rerank`` → render
(``rerank_render``). ``/rerank`` answers its errors in TEI's shape (``{"error", "error_type"}``,
TEI's statuses); errors raised before the handler runs (auth, body limit, unknown route) keep
the one envelope.
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from bgeserve.errors import (
    BgeServeError,
    EngineFailed,
    InvalidInput,
    ModelUnavailable,
    NotReady,
    Overloaded,
    TooLarge,
)
from bgeserve.http.errors import error_response, json_error
from bgeserve.http.handlers import (
    OFFLOAD_BODY_BYTES,
    _maybe_offload,
    read_json_body,
    unless_disconnected,
)
from bgeserve.http.rerank_render import render_rerank, render_tei_rerank
from bgeserve.http.rerank_schemas import parse_rerank_request, parse_tei_rerank_request

# TEI's statuses and error types (text-embeddings-inference router/src/http/server.rs):
# validation 422, an empty input 400 "Empty", overload 429, a backend failure 424, not ready 503.
TEI_ERRORS: dict[type[BgeServeError], tuple[int, str]] = {
    InvalidInput: (422, "Validation"), TooLarge: (413, "Validation"),
    Overloaded: (429, "Overloaded"), EngineFailed: (424, "Backend"),
    NotReady: (503, "Unhealthy"), ModelUnavailable: (503, "Unhealthy"),
}
TEI_CODES = {"empty_input": (400, "Empty"), "invalid_json": (400, "Validation")}


async def rerank(request: Request) -> Response:
    """``POST /v1/rerank``, ``POST /v2/rerank``: sorted ``results`` with ``relevance_score``."""
    state = request.state
    raw = await read_json_body(request)
    ids = (*state.model_ids, *state.service.rerank_model_ids())
    parsed = await _maybe_offload(len(raw) > OFFLOAD_BODY_BYTES, parse_rerank_request, raw,
                                  state.settings, ids)
    result = await unless_disconnected(request, state.service.rerank(
        parsed.query, parsed.documents, parsed.options, request_id=state.request_id))
    return Response(render_rerank(parsed, result, state.request_id),
                    media_type="application/json")


async def tei_rerank(request: Request) -> Response:
    """``POST /rerank``: TEI's ``[{index, score, text?}]``, its errors in TEI's shape."""
    state = request.state
    try:
        raw = await read_json_body(request)
        parsed = await _maybe_offload(len(raw) > OFFLOAD_BODY_BYTES, parse_tei_rerank_request,
                                      raw, state.settings)
        result = await unless_disconnected(request, state.service.rerank(
            parsed.query, parsed.documents, parsed.options, request_id=state.request_id))
    except BgeServeError as exc:  # translated to TEI's shape here, the status table's way
        return tei_error(exc, state.request_id)
    return Response(render_tei_rerank(parsed, result), media_type="application/json")


def tei_error(exc: BgeServeError, request_id: str | None) -> Response:
    """``exc`` as TEI answers it: the envelope's message (internals hidden, logged as every
    error is) in ``{"error", "error_type"}`` with TEI's status; Retry-After kept."""
    base = error_response(exc, request_id)
    message = orjson.loads(base.body)["error"]["message"]
    status, kind = TEI_CODES.get(exc.code) or next(
        (TEI_ERRORS[c] for c in type(exc).__mro__ if c in TEI_ERRORS),
        (base.status_code, "Backend" if base.status_code >= 500 else "Validation"))
    headers = {k: v for k, v in base.headers.items() if k.lower() == "retry-after"}
    return json_error(status, {"error": message, "error_type": kind}, headers)
