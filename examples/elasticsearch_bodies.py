"""Request bodies for Elasticsearch's ``sparse_vector`` field, from bgeserve's sparse output.

    pip install httpx
    BGESERVE_URL=http://localhost:8081 python examples/elasticsearch_bodies.py

Prints the index mapping, one document per text and a query, as JSON to send with any client
(``PUT /docs``, ``POST /docs/_doc``, ``POST /docs/_search``; needs Elasticsearch >= 8.15 for
the ``sparse_vector`` query, ``text_expansion`` before). ``sparse_format: tokens`` keys the
weights by token string (``{"▁hello": 0.21}``), weights > 0 as Elasticsearch requires.
Elasticsearch before 8.16 rejects feature names with a dot (``"."`` is a bge-m3 token):
there, pass ``keys="ids"`` for ``{"<token id>": weight}`` (``sparse_format: dict``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx

URL = os.environ.get("BGESERVE_URL", "http://localhost:8081")


def sparse(texts: list[str], url: str = URL, keys: str = "tokens") -> list[dict[str, float]]:
    """Per text, ``{feature: weight}`` keyed by token string (``keys="tokens"``) or id."""
    headers = {"Authorization": f"Bearer {os.environ['BGE_M3_API_KEY']}"} if os.environ.get(
        "BGE_M3_API_KEY") else {}
    body = {"input": texts, "sparse_format": "tokens" if keys == "tokens" else "dict"}
    r = httpx.post(f"{url}/v1/sparse-embeddings", json=body, headers=headers, timeout=120)
    r.raise_for_status()
    return [item["sparse_values"] for item in r.json()["data"]]


def mapping() -> dict[str, Any]:
    """``PUT /docs``: a text field and a ``sparse_vector`` field."""
    return {"mappings": {"properties": {"text": {"type": "text"},
                                        "sparse": {"type": "sparse_vector"}}}}


def documents(texts: list[str], url: str = URL, keys: str = "tokens") -> list[dict[str, Any]]:
    """``POST /docs/_doc`` bodies, one per text."""
    return [{"text": text, "sparse": weights}
            for text, weights in zip(texts, sparse(texts, url, keys), strict=True)]


def query(text: str, url: str = URL, keys: str = "tokens") -> dict[str, Any]:
    """``POST /docs/_search``: the dot product of the query's weights with each document's."""
    (weights,) = sparse([text], url, keys)
    return {"query": {"sparse_vector": {"field": "sparse", "query_vector": weights}}}


def main() -> None:
    texts = ["BGE M3 supports sparse retrieval.", "BM25 is a ranking function."]
    print(json.dumps({"mapping": mapping(), "documents": documents(texts),
                      "query": query("What is BGE M3?")}, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
