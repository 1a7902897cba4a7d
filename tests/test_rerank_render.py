"""Tests for bgeserve.http.rerank_render: rerank results as Jina / Cohere and TEI bodies."""

from __future__ import annotations

import numpy as np
import orjson

from bgeserve.http.rerank_render import render_rerank, render_tei_rerank
from bgeserve.http.rerank_schemas import RerankRequest
from bgeserve.results import RerankOptions, RerankResult


def result() -> RerankResult:
    return RerankResult(np.array([0.2, 0.9, 0.2, 0.5]), np.array([False, True, False, False]),
                        np.array([1, 3, 1, 1]), 42, "bge-reranker-v2-m3")


def test_render_sorts_cuts_and_flags() -> None:
    """Jina / Cohere: sorted by score (ties by index), cut to top_n, documents only when
    asked, truncated and windowed documents flagged, usage counts the tokens scored."""
    request = RerankRequest("q", ["a", "b", "c", "d"], RerankOptions(), top_n=3,
                            return_documents=True)
    body = orjson.loads(render_rerank(request, result(), "req-1"))
    assert [r["index"] for r in body["results"]] == [1, 3, 0]
    assert body["results"][0] == {"index": 1, "relevance_score": 0.9, "document": {"text": "b"},
                                  "truncated": True, "windows": 3}
    assert body["results"][1] == {"index": 3, "relevance_score": 0.5, "document": {"text": "d"}}
    assert body["usage"] == {"total_tokens": 42} and body["model"] == "bge-reranker-v2-m3"
    assert body["id"] == "req-1"
    plain = orjson.loads(render_rerank(RerankRequest("q", list("abcd"), RerankOptions()),
                                       result()))
    assert [r["index"] for r in plain["results"]] == [1, 3, 0, 2]
    assert "document" not in plain["results"][0]


def test_cohere_document_objects_are_echoed_whole() -> None:
    """Cohere v1: a document sent as an object comes back with every field it was sent with
    ("all other fields will be preserved"); a string document as ``{"text"}``."""
    sent = {"text": "b", "title": "T", "id": 7}
    request = RerankRequest("q", ["a", "b", "c", "d"], RerankOptions(), return_documents=True,
                            objects=[None, sent, None, None])
    body = orjson.loads(render_rerank(request, result()))
    assert body["results"][0]["document"] == sent
    assert body["results"][1]["document"] == {"text": "d"}


def test_render_tei() -> None:
    """TEI: a bare array of {index, score, text?}, sorted, every text."""
    request = RerankRequest("q", list("abcd"), RerankOptions(), return_documents=True)
    body = orjson.loads(render_tei_rerank(request, result()))
    assert [(r["index"], r["text"]) for r in body] == [(1, "b"), (3, "d"), (0, "a"), (2, "c")]
    assert body[2] == {"index": 0, "score": 0.2, "text": "a"}
