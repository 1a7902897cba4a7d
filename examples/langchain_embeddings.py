"""bgeserve from LangChain's ``OpenAIEmbeddings``.

    pip install langchain-openai
    BGESERVE_URL=http://localhost:8081 python examples/langchain_embeddings.py

``check_embedding_ctx_length=False`` is required. By default LangChain tokenizes every text
with tiktoken (OpenAI's ``cl100k_base``) and sends those token ids, which bge-m3 would read as
ids of its own vocabulary: wrong vectors, silently. bgeserve refuses token ids with a 400 that
says so (unless BGE_M3_ACCEPT_TOKEN_IDS=1); with the flag off, LangChain sends the texts.
"""

from __future__ import annotations

import os

from langchain_openai import OpenAIEmbeddings

URL = os.environ.get("BGESERVE_URL", "http://localhost:8081")


def embeddings(url: str = URL) -> OpenAIEmbeddings:
    """LangChain embeddings served by bgeserve."""
    return OpenAIEmbeddings(
        model="bge-m3",
        base_url=f"{url}/v1",
        api_key=os.environ.get("BGE_M3_API_KEY", "unused"),  # type: ignore[arg-type]
        check_embedding_ctx_length=False,  # send texts, not tiktoken ids
    )


def main() -> None:
    emb = embeddings()
    docs = emb.embed_documents(["What is BGE M3?", "Definition of BM25"])
    query = emb.embed_query("what is bge-m3")
    print(f"{len(docs)} documents, {len(query)}-dimensional vectors")


if __name__ == "__main__":
    main()
