"""Hybrid search in Milvus Lite (dense + sparse, fused with RRF) on vectors from bgeserve.

    pip install pymilvus milvus-lite httpx
    BGESERVE_URL=http://localhost:8081 python examples/milvus_hybrid.py

``sparse_format: dict`` gives ``{"<token id>": weight}``, what a ``SPARSE_FLOAT_VECTOR``
field takes (and what pymilvus's ``BGEM3EmbeddingFunction`` returns). **Milvus refuses an
empty sparse vector** ("sparse vector must contain at least one nonzero float32 weight"),
which an empty or very short text, or ``sparse_min_weight``, can produce. ``sparse_empty:
omit`` leaves those texts out of the answer (the others keep their ``index``), so a batch
never fails on one of them; this example indexes the rest and reports what it skipped.
A path ending in ``.db`` runs Milvus Lite in-process; ``MilvusClient("http://host:19530")``
is the same code against a server.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import httpx
from pymilvus import AnnSearchRequest, DataType, MilvusClient, RRFRanker

URL = os.environ.get("BGESERVE_URL", "http://localhost:8081")
COLLECTION = "docs"


def embed_both(texts: list[str], url: str = URL) -> list[dict[str, Any]]:
    """Dense and ``{id: weight}`` sparse vectors; texts with an empty sparse vector left out."""
    headers = {"Authorization": f"Bearer {os.environ['BGE_M3_API_KEY']}"} if os.environ.get(
        "BGE_M3_API_KEY") else {}
    body = {"input": texts, "sparse_format": "dict", "sparse_empty": "omit"}
    r = httpx.post(f"{url}/v1/embeddings:both", json=body, headers=headers, timeout=120)
    r.raise_for_status()
    return r.json()["data"]  # type: ignore[no-any-return]


def build(docs: list[str], db_path: str, url: str = URL) -> tuple[MilvusClient, list[int]]:
    """A Milvus Lite collection of ``docs``; returns it and the indices of skipped docs."""
    items = embed_both(docs, url)
    client = MilvusClient(db_path)
    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("text", DataType.VARCHAR, max_length=4096)
    schema.add_field("dense", DataType.FLOAT_VECTOR, dim=len(items[0]["embedding"]))
    schema.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
    index = client.prepare_index_params()
    index.add_index(field_name="dense", index_type="AUTOINDEX", metric_type="IP")
    index.add_index(field_name="sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="IP")
    client.create_collection(COLLECTION, schema=schema, index_params=index)
    client.insert(COLLECTION, [
        {"id": item["index"], "text": docs[item["index"]], "dense": item["embedding"],
         "sparse": item["sparse_values"]} for item in items])
    kept = {item["index"] for item in items}
    return client, [i for i in range(len(docs)) if i not in kept]


def search(client: MilvusClient, query: str, url: str = URL, limit: int = 3
           ) -> list[dict[str, Any]]:
    """Dense (inner product of unit vectors: cosine) and sparse hits fused by RRF."""
    (item,) = embed_both([query], url) or [None]
    if item is None:  # the query has no sparse weight: dense alone
        raise ValueError(f"{query!r} has an empty sparse vector; search the dense field only")
    requests = [
        AnnSearchRequest(data=[item["embedding"]], anns_field="dense",
                         param={"metric_type": "IP"}, limit=20),
        AnnSearchRequest(data=[item["sparse_values"]], anns_field="sparse",
                         param={"metric_type": "IP"}, limit=20),
    ]
    (hits,) = client.hybrid_search(COLLECTION, requests, ranker=RRFRanker(60), limit=limit,
                                   output_fields=["text"])
    return list(hits)


DOCS = [
    "BGE M3 is an embedding model supporting dense, sparse and multi-vector retrieval.",
    "BM25 is a bag-of-words ranking function used by search engines.",
    "Milvus stores dense and sparse vectors side by side.",
    "",  # no token at all: an empty sparse vector, which Milvus would refuse
]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        client, skipped = build(DOCS, os.path.join(tmp, "milvus_demo.db"))
        print("skipped (empty sparse vector):", skipped)
        for hit in search(client, "What is BGE M3?"):
            print(f"{hit['distance']:.4f}  {hit['entity']['text']}")
        client.close()


if __name__ == "__main__":
    main()
