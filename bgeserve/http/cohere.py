"""Cohere's embed routes: ``POST /v1/embed`` and ``POST /v2/embed`` (the Cohere SDK's
``Client.embed`` / ``ClientV2.embed``; LangChain's ``CohereEmbeddings`` posts to v1),
answered with bge-m3's dense vectors.

Read → parse (``cohere_schemas``) → ``service.embed`` → render, like every handler. Errors are
the OpenAI shape with ``detail`` (``errors.DETAIL_STYLE``), as on Cohere's rerank route.
``binary`` / ``ubinary`` are the sign bits packed 8 to a byte, first dimension in the high bit,
as Cohere and sentence-transformers' ``quantize_embeddings`` give them (``binary`` is the
``ubinary`` byte less 128).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from bgeserve.errors import BgeServeError
from bgeserve.http.cohere_schemas import CohereEmbedRequest, parse_cohere_embed
from bgeserve.http.errors import renamed_param
from bgeserve.http.handlers import (
    OFFLOAD_ITEMS,
    _maybe_offload,
    parse_body,
    read_json_body,
    refuse_when_full,
    unless_disconnected,
)
from bgeserve.http.render import encode_array
from bgeserve.http.schemas import check_dimensions
from bgeserve.results import Embeddings, EmbedOptions


def typed(dense: np.ndarray, kind: str) -> Any:
    """One ``embedding_types`` entry of float32 ``dense`` (n, width)."""
    if kind == "float":
        return dense
    if kind == "base64":  # each vector's little-endian float32 bytes
        return [encode_array(row, "base64") for row in dense]
    bits = np.packbits(dense > 0, axis=1)
    return bits if kind == "ubinary" else (bits.astype(np.int16) - 128).astype(np.int8)


def render_cohere_embed(parsed: CohereEmbedRequest, result: Embeddings, request_id: str,
                        version: int) -> bytes:
    """Cohere's answer: v1 without ``embedding_types`` a bare list of float vectors
    (``embeddings_floats``), else an object by type (``embeddings_by_type``, v2's only shape,
    ``float`` when none is asked for)."""
    assert result.dense is not None
    dense = np.ascontiguousarray(result.dense, dtype=np.float32)
    if version == 1 and parsed.types is None:
        embeddings: Any = dense
        response_type = "embeddings_floats"
    else:
        embeddings = {kind: typed(dense, kind) for kind in parsed.types or ("float",)}
        response_type = "embeddings_by_type"
    meta = {"api_version": {"version": str(version)},
            "billed_units": {"input_tokens": result.prompt_tokens}}
    body = {"id": request_id, "embeddings": embeddings, "texts": parsed.texts, "meta": meta,
            "response_type": response_type}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


# The engine's advice for a text over the length, in Cohere's parameter.
COHERE_WORDS = {"send truncate=true": 'send truncate "END" (or "START")'}


async def _embed(request: Request, version: int) -> Response:
    state = request.state
    refuse_when_full(request)
    raw = await read_json_body(request)
    parsed = await parse_body(request, raw, parse_cohere_embed, state.settings, state.model_ids)
    check_dimensions(parsed.dimensions, state.service.dense_width(), "output_dimension")
    try:
        result = await unless_disconnected(request, state.service.embed(
            parsed.texts, EmbedOptions(truncate=parsed.truncate), request_id=state.request_id,
            left=parsed.left))
    except BgeServeError as exc:  # the engine's input[i] is this body's texts[i]
        renamed = renamed_param(exc, "input", "texts", COHERE_WORDS)
        if renamed is None:
            raise
        raise renamed from exc
    body = await _maybe_offload(len(result) > OFFLOAD_ITEMS, render_cohere_embed, parsed,
                                result, state.request_id, version)
    return Response(body, media_type="application/json")


async def embed_v1(request: Request) -> Response:
    """``POST /v1/embed``: Cohere's v1 embed."""
    return await _embed(request, 1)


async def embed_v2(request: Request) -> Response:
    """``POST /v2/embed``: Cohere's v2 embed (always by type)."""
    return await _embed(request, 2)
