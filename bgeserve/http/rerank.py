"""The rerank routes: ``/v1/rerank`` and ``/v2/rerank`` (Jina's and Cohere's shape, what
LangChain's and LlamaIndex's rerankers send) and ``/rerank`` (text-embeddings-inference's).

Thin, like every handler: read → parse (``rerank_schemas``) → ``service.rerank`` → render
(``rerank_render``). ``/rerank`` is one of ``app.tei_routes``: every error on it, the guards'
included, is answered in TEI's shape by ``errors.ErrorStyle`` (``{"error", "error_type"}``,
TEI's statuses).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from bgeserve.errors import BgeServeError
from bgeserve.http.errors import renamed_param
from bgeserve.http.handlers import (
    parse_body,
    read_json_body,
    unless_disconnected,
)
from bgeserve.http.rerank_render import render_rerank, render_tei_rerank
from bgeserve.http.rerank_schemas import (
    RerankRequest,
    parse_rerank_request,
    parse_tei_rerank_request,
)


async def rerank(request: Request) -> Response:
    """``POST /v1/rerank``, ``POST /v2/rerank``: sorted ``results`` with ``relevance_score``."""
    state = request.state
    raw = await read_json_body(request)
    ids = (*state.model_ids, *state.service.rerank_model_ids())
    parsed = await parse_body(request, raw, parse_rerank_request, state.settings, ids)
    result = await unless_disconnected(request, state.service.rerank(
        parsed.query, parsed.documents, parsed.options, request_id=state.request_id))
    return Response(render_rerank(parsed, result, state.request_id),
                    media_type="application/json")


async def tei_rerank(request: Request) -> Response:
    """``POST /rerank``: TEI's ``[{index, score, text?}]``; its errors take TEI's shape on the
    way out (``/rerank`` is one of ``app.tei_routes``: ``errors.ErrorStyle``)."""
    raw = await read_json_body(request)
    parsed = await parse_body(request, raw, parse_tei_rerank_request, request.state.settings)
    return await tei_rerank_parsed(request, parsed)


async def tei_rerank_parsed(request: Request, parsed: RerankRequest) -> Response:
    """``tei_rerank`` of a body already parsed (``POST /``'s)."""
    state = request.state
    try:
        result = await unless_disconnected(request, state.service.rerank(
            parsed.query, parsed.documents, parsed.options, request_id=state.request_id))
    except BgeServeError as exc:
        renamed = renamed_param(exc, "documents", "texts")  # TEI's field
        if renamed is None:
            raise
        raise renamed from exc
    return Response(render_tei_rerank(parsed, result), media_type="application/json")


