"""bgeserve from the official OpenAI Python client: change the base URL, nothing else.

    pip install openai
    BGESERVE_URL=http://localhost:8081 python examples/openai_client.py

The client asks for base64 by default and decodes it itself; ``encoding_format="float"``
gets plain lists; an explicit ``encoding_format="base64"`` hands back the base64 text of the
little-endian float32 bytes, decoded here. The vectors are the same every way.
"""

from __future__ import annotations

import base64
import os
import struct

from openai import OpenAI

URL = os.environ.get("BGESERVE_URL", "http://localhost:8081")


def client(url: str = URL) -> OpenAI:
    """An OpenAI client pointed at bgeserve (the key matters only with BGE_M3_API_KEY)."""
    return OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("BGE_M3_API_KEY", "unused"))


def embed(texts: list[str], url: str = URL, encoding_format: str | None = None
          ) -> list[list[float]]:
    """Dense vectors, one per text, in order."""
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    response = client(url).embeddings.create(model="bge-m3", input=texts, **extra)
    return [_floats(item.embedding) for item in response.data]


def _floats(embedding: list[float] | str) -> list[float]:
    if isinstance(embedding, list):
        return embedding
    raw = base64.b64decode(embedding)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def main() -> None:
    texts = ["What is BGE M3?", "Definition of BM25"]
    for fmt in (None, "float", "base64"):
        vectors = embed(texts, encoding_format=fmt)
        print(f"{fmt or 'default (base64, decoded by the client)'}: {len(vectors)} vectors of {len(vectors[0])} floats")
    print("model:", client().models.retrieve("bge-m3").id)


if __name__ == "__main__":
    main()
