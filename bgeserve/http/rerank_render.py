"""Rerank response bodies: a ``RerankResult`` → Jina / Cohere JSON, or TEI's bare array.

Both sort by score, descending (ties: the lower index first), since the clients use results in
the server's order. A result carries ``"truncated": true`` (and, when windowed, ``"windows"``)
where part of its document was not scored / was scored in several windows; clients ignore
fields they do not know.
"""

from __future__ import annotations

from typing import Any

import orjson

from bgeserve.http.rerank_schemas import RerankRequest
from bgeserve.results import RerankResult


def _flags(item: dict[str, Any], result: RerankResult, i: int) -> dict[str, Any]:
    if result.truncated[i]:
        item["truncated"] = True
    if result.windows[i] > 1:
        item["windows"] = int(result.windows[i])
    return item


def render_rerank(request: RerankRequest, result: RerankResult, request_id: str = "") -> bytes:
    """``{id, model, results: [{index, relevance_score, document?}], usage, meta}``: Jina's
    shape (``usage.total_tokens``) and Cohere's (``id``, ``meta.billed_units``) at once."""
    results = []
    for i in result.ranking(request.top_n):
        item: dict[str, Any] = {"index": i, "relevance_score": float(result.scores[i])}
        if request.return_documents:
            sent = request.objects[i] if request.objects else None
            item["document"] = sent if sent is not None else {"text": request.documents[i]}
        results.append(_flags(item, result, i))
    body: dict[str, Any] = {"id": request_id, "model": result.model, "results": results,
            "usage": {"total_tokens": result.tokens},
            "meta": {"billed_units": {"search_units": 1}}}
    if result.query_truncated:
        body["query_truncated"] = True
    return orjson.dumps(body)


def render_tei_rerank(request: RerankRequest, result: RerankResult) -> bytes:
    """TEI's ``[{index, score, text?}]``, ``text`` only with ``return_text``."""
    items = []
    for i in result.ranking():
        item: dict[str, Any] = {"index": i, "score": float(result.scores[i])}
        if request.return_documents:
            item["text"] = request.documents[i]
        items.append(_flags(item, result, i))
    return orjson.dumps(items)
