"""bgeserve from a text-embeddings-inference client: ``huggingface_hub.InferenceClient``.

    pip install huggingface_hub
    BGESERVE_URL=http://localhost:8081 python examples/tei_client.py

Given a URL, ``InferenceClient`` POSTs to that URL itself (it appends no route): the bare
server URL reaches ``POST /`` (bgeserve answers it as TEI does for an embedding model: like
``/embed``, or ``/similarity`` for a similarity body); ``{url}/embed`` names the route.
"""

from __future__ import annotations

import os

import numpy as np
from huggingface_hub import InferenceClient

URL = os.environ.get("BGESERVE_URL", "http://localhost:8081")


def client(url: str = URL, route: str = "") -> InferenceClient:
    """A TEI client for bgeserve (``route``: "" for ``POST /``, or "/embed")."""
    return InferenceClient(base_url=f"{url}{route}", api_key=os.environ.get("BGE_M3_API_KEY"))


def embed(texts: str | list[str], url: str = URL, route: str = "/embed") -> np.ndarray:
    """float32 (n, width): one dense vector per text (TEI always answers a list of them)."""
    return client(url, route).feature_extraction(texts)


def similarity(source: str, sentences: list[str], url: str = URL) -> list[float]:
    """Cosine of each sentence with ``source`` (TEI's ``/similarity``, through ``POST /``)."""
    return client(url).sentence_similarity(source, sentences)


def main() -> None:
    vectors = embed(["What is BGE M3?", "Definition of BM25"])
    print("feature_extraction:", vectors.shape, vectors.dtype)
    print("similarity:", similarity("what is bge-m3", ["BGE M3 is an embedding model", "BM25"]))


if __name__ == "__main__":
    main()
