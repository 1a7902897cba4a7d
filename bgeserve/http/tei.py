"""Handlers for text-embeddings-inference's routes, on the same service as the OpenAI ones.

Request and response shapes are TEI's (``docs/openapi.json`` of huggingface/text-embeddings-
inference); errors on these paths are TEI's ``{"error", "error_type"}`` with TEI's statuses
(``errors.ErrorStyle`` picks them by path, from ``app.tei_routes``). Every handler is
read → parse → service call → render, like ``handlers.embed_endpoint``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from bgeserve.errors import BgeServeError
from bgeserve.http import rerank
from bgeserve.http.handlers import (
    OFFLOAD_ITEMS,
    _maybe_offload,
    health,
    parse_body,
    read_json_body,
    refuse_when_full,
    streams,
    unless_disconnected,
)
from bgeserve.http.render import (
    TOKEN_BYTES,
    json_pieces,
    numbers_bytes,
    select_sparse,
    token_pieces,
)
from bgeserve.http.rerank_schemas import RerankRequest
from bgeserve.http.schemas import check_dimensions
from bgeserve.http.tei_schemas import (
    TeiEmbedRequest,
    as_similarity,
    parse_decode,
    parse_embed,
    parse_root,
    parse_similarity,
    parse_tokenize,
)
from bgeserve.results import Embeddings, EmbedOptions, ModelInfo

_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def _json(content: Any) -> Response:
    return Response(orjson.dumps(content, option=_NUMPY), media_type="application/json")


async def _parse(request: Request, parse: Any, **kwargs: Any) -> Any:
    raw = await read_json_body(request)
    return await parse_body(request, raw, functools.partial(parse, **kwargs),
                            request.state.settings)


async def _embed(request: Request, parsed: TeiEmbedRequest, options: EmbedOptions) -> Embeddings:
    """Embed ``parsed.inputs``; left truncation cuts the texts' ids first, then embeds them."""
    service, state = request.state.service, request.state
    # Cut inside the service's deadline (it waits for a tokenizing slot).
    return await unless_disconnected(request, service.embed(
        parsed.inputs, options, request_id=state.request_id,
        left=parsed.left and parsed.truncate))


def _dense_rows(result: Embeddings) -> np.ndarray:
    assert result.dense is not None
    return np.ascontiguousarray(result.dense, dtype=np.float32)


async def embed(request: Request) -> Response:
    """``POST /embed``: ``[[f32]]``, one L2-normalised dense vector per input."""
    parsed = await _parse(request, parse_embed, dense=True)
    return await _dense_response(request, parsed)


async def _dense_response(request: Request, parsed: TeiEmbedRequest) -> Response:
    check_dimensions(parsed.dimensions, request.state.service.dense_width())
    result = await _embed(request, parsed, EmbedOptions(truncate=parsed.truncate))
    rows = _dense_rows(result)
    if streams(request, rows.nbytes):
        return _streamed(rows)
    body = await _maybe_offload(len(result) > OFFLOAD_ITEMS, orjson.dumps, rows, None, _NUMPY)
    return Response(body, media_type="application/json")


def _streamed(arrays: Iterable[np.ndarray]) -> Response:
    """``[a, b, ...]`` of float32 arrays, rendered as it is sent (``render.STREAM_BYTES``)."""
    items = (orjson.dumps(np.ascontiguousarray(a, dtype=np.float32), option=_NUMPY)
             for a in arrays)
    return StreamingResponse(json_pieces(b"[", items, b"]"), media_type="application/json")


def _sparse_items(result: Embeddings, parsed: TeiEmbedRequest) -> Iterator[bytes]:
    """Each text's ``[{index, value}]``, rendered when asked for: the dicts of one text at a
    time (all of them at once took ~150 bytes an entry: QA, an OOM kill)."""
    assert result.sparse is not None
    for indices, values in result.sparse:
        ids, weights = select_sparse(indices, values, parsed.sparse_top_k,
                                     parsed.sparse_min_weight)
        yield orjson.dumps([{"index": i, "value": w} for i, w in zip(ids.tolist(), weights,
                                                                       strict=True)],
                           option=_NUMPY)


async def embed_sparse(request: Request) -> Response:
    """``POST /embed_sparse``: ``[[{index, value}]]``, bge-m3's lexical weights per token id,
    ids ascending and unique, zeros left out (an input can have none)."""
    parsed = await _parse(request, parse_embed, sparse=True)
    options = EmbedOptions(dense=False, sparse=True, truncate=parsed.truncate)
    result = await _embed(request, parsed, options)
    pieces = json_pieces(b"[", _sparse_items(result, parsed), b"]")
    if streams(request, numbers_bytes(result, ("sparse",))):
        return StreamingResponse(pieces, media_type="application/json")
    body = await _maybe_offload(len(result) > OFFLOAD_ITEMS, b"".join, pieces)
    return Response(body, media_type="application/json")


async def embed_all(request: Request) -> Response:
    """``POST /embed_all``: ``[[[f32]]]``, bge-m3's ColBERT vectors (one per token after
    ``<s>``, each L2-normalised)."""
    parsed = await _parse(request, parse_embed)
    options = EmbedOptions(dense=False, colbert=True, truncate=parsed.truncate)
    result = await _embed(request, parsed, options)
    assert result.colbert is not None
    if streams(request, numbers_bytes(result, ("colbert",))):
        return _streamed(result.colbert)
    matrices = [np.ascontiguousarray(m, dtype=np.float32) for m in result.colbert]
    body = await _maybe_offload(True, orjson.dumps, matrices, None, _NUMPY)
    return Response(body, media_type="application/json")


async def similarity(request: Request) -> Response:
    """``POST /similarity``: ``[f32]``, the cosine of each sentence with the source sentence."""
    parsed = await _parse(request, parse_similarity)
    return _json(await _similarities(request, parsed))


async def _similarities(request: Request, parsed: TeiEmbedRequest) -> np.ndarray:
    try:
        embedded = await _embed(request, parsed, EmbedOptions(truncate=parsed.truncate))
    except BgeServeError as exc:  # a text too long, over the budget: named as the body does
        raise as_similarity(exc) from exc
    rows = _dense_rows(embedded)
    # Unit vectors: the dot is the cosine, clipped to [-1, 1] where float32 rounding passes
    # it (an identical sentence gave 1.0000002).
    return np.ascontiguousarray(np.clip(rows[1:] @ rows[0], -1.0, 1.0))


async def root(request: Request) -> Response:
    """``POST /`` (and SageMaker's ``/invocations``): TEI's route for its model type, here
    for the body's: ``/embed``; ``/similarity`` for a body whose ``inputs`` has a
    ``source_sentence`` (what ``huggingface_hub.InferenceClient(base_url=...)`` sends for
    either task); ``/rerank`` for a ``query`` and ``texts`` (a reranker deployment's).
    ``GET /`` is TEI's health check, ``/health``."""
    if request.method != "POST":
        return await health(request)
    kind, parsed = await _parse(request, parse_root)
    if kind == "rerank":
        assert isinstance(parsed, RerankRequest)
        return await rerank.tei_rerank_parsed(request, parsed)
    assert isinstance(parsed, TeiEmbedRequest)
    if kind == "similarity":
        return _json(await _similarities(request, parsed))
    return await _dense_response(request, parsed)


async def tokenize(request: Request) -> Response:
    """``POST /tokenize``: ``[[{id, text, special, start, stop}]]``, UTF-8 byte offsets.
    Refused from the headers when the queue is full, as the embedding routes are: it waits
    for the same tokenizing slots, and under a flood it waited out the deadline for a 504
    (QA: 39-49 of 80, and embedding requests behind them 504s), never a 429."""
    refuse_when_full(request)
    parsed = await _parse(request, parse_tokenize)
    tokens = await unless_disconnected(request, request.state.service.tokenize(
        parsed.inputs, parsed.add_special_tokens))
    count = sum(len(t) for t in tokens)
    pieces = token_pieces(tokens)
    if streams(request, count * TOKEN_BYTES):  # QA: 12 slow readers of 16 MB answers
        return StreamingResponse(pieces, media_type="application/json")
    body = await _maybe_offload(count > OFFLOAD_ITEMS, b"".join, pieces)
    return Response(body, media_type="application/json")


async def decode(request: Request) -> Response:
    """``POST /decode``: ``[str]``, one text per id sequence (refused as /tokenize is)."""
    refuse_when_full(request)
    parsed = await _parse(request, parse_decode)
    return _json(await unless_disconnected(request, request.state.service.decode(
        parsed.ids, parsed.skip_special_tokens)))


# TEI's ``model_type`` of a sequence-classification model with one logit (bge-reranker-v2-m3).
RERANKER_TYPE = {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}


async def info(request: Request) -> Response:
    """``GET /info``: TEI's ``Info`` for the served model."""
    service = request.state.service
    return _info(service.info(), service.model_name, {"embedding": {"pooling": "cls"}})


async def reranker_info(request: Request) -> Response:
    """``GET /reranker/info``: ``/info`` as a TEI server of a reranker answers it, for what
    ``/rerank`` scores with. A TEI client that checks the model's type before it reranks
    (Dify's TEI provider: "not a rerank model" for an embedding one) is given
    ``http://HOST:PORT/reranker`` as its server; the same client's embeddings keep the root,
    whose ``/info`` says embedding. One TEI server serves one model; bgeserve serves both."""
    service = request.state.service
    ids = service.rerank_model_ids()
    return _info(service.reranker_info(), ids[0] if ids else service.model_name,
                 RERANKER_TYPE)


def _info(facts: ModelInfo, served: str, model_type: dict[str, Any]) -> Response:
    return _json({
        "model_id": facts.model_id,
        "model_sha": facts.model_sha,
        "model_dtype": facts.dtype,
        "served_model_name": served,
        "model_type": model_type,
        "max_concurrent_requests": facts.max_concurrent_requests,
        "max_input_length": facts.max_input_length,
        "max_batch_tokens": facts.max_batch_tokens,
        "max_batch_requests": facts.max_batch_requests,
        "max_client_batch_size": facts.max_client_batch_size,
        "auto_truncate": facts.auto_truncate,
        "tokenization_workers": facts.tokenization_workers,
        "version": facts.version,
        "sha": None,
        "docker_label": None,
    })
