"""Hybrid search in Qdrant (dense + sparse, fused with RRF) on vectors from bgeserve.

    pip install qdrant-client httpx
    BGESERVE_URL=http://localhost:8081 python examples/qdrant_hybrid.py

One request to ``/v1/embeddings:both`` gives both vectors from one forward pass. bgeserve's
sparse output (``sparse_format: indices``, the default) is Qdrant's ``SparseVector`` as is:
token ids unique and ascending, weights > 0. Qdrant accepts an empty sparse vector (a text
whose every weight is 0), so every document is indexed. Runs Qdrant in local mode
(``QdrantClient(":memory:")``, no server); ``QdrantClient(url=...)`` is the same code.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
from qdrant_client import QdrantClient, models

URL = os.environ.get("BGESERVE_URL", "http://localhost:8081")
COLLECTION = "docs"


def embed_both(texts: list[str], url: str = URL) -> list[dict[str, Any]]:
    """Dense and sparse vectors per text (``data`` items, in input order)."""
    headers = {"Authorization": f"Bearer {os.environ['BGE_M3_API_KEY']}"} if os.environ.get(
        "BGE_M3_API_KEY") else {}
    r = httpx.post(f"{url}/v1/embeddings:both", json={"input": texts}, headers=headers,
                   timeout=120)
    r.raise_for_status()
    return r.json()["data"]  # type: ignore[no-any-return]


def sparse_vector(item: dict[str, Any]) -> models.SparseVector:
    return models.SparseVector(indices=item["sparse_values"]["indices"],
                               values=item["sparse_values"]["values"])


def build(docs: list[str], url: str = URL) -> QdrantClient:
    """An in-memory collection with a named dense and a named sparse vector per document."""
    items = embed_both(docs, url)
    client = QdrantClient(":memory:")
    client.create_collection(
        COLLECTION,
        vectors_config={"dense": models.VectorParams(size=len(items[0]["embedding"]),
                                                     distance=models.Distance.COSINE)},
        sparse_vectors_config={"sparse": models.SparseVectorParams()},
    )
    client.upsert(COLLECTION, points=[
        models.PointStruct(id=i, payload={"text": text},
                           vector={"dense": item["embedding"], "sparse": sparse_vector(item)})
        for i, (text, item) in enumerate(zip(docs, items, strict=True))])
    return client


def search(client: QdrantClient, query: str, url: str = URL, limit: int = 3
           ) -> list[models.ScoredPoint]:
    """Dense and sparse candidates fused by reciprocal rank (Qdrant's RRF)."""
    (item,) = embed_both([query], url)
    return client.query_points(
        COLLECTION,
        prefetch=[models.Prefetch(query=item["embedding"], using="dense", limit=20),
                  models.Prefetch(query=sparse_vector(item), using="sparse", limit=20)],
        query=models.FusionQuery(fusion=models.Fusion.RRF),
        limit=limit, with_payload=True).points


DOCS = [
    "BGE M3 is an embedding model supporting dense, sparse and multi-vector retrieval.",
    "BM25 is a bag-of-words ranking function used by search engines.",
    "Qdrant is a vector database with named dense and sparse vectors.",
    "Reciprocal rank fusion merges ranked lists by summing 1 / (k + rank).",
]


def main() -> None:
    client = build(DOCS)
    for hit in search(client, "What is BGE M3?"):
        print(f"{hit.score:.4f}  {hit.payload['text']}")  # type: ignore[index]


if __name__ == "__main__":
    main()
