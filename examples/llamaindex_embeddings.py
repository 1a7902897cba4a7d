"""bgeserve from LlamaIndex's ``OpenAILikeEmbedding``.

    pip install llama-index-embeddings-openai-like
    BGESERVE_URL=http://localhost:8081 python examples/llamaindex_embeddings.py

LlamaIndex sends the texts themselves (no tiktoken ids), ten per request by default
(``embed_batch_size``), and replaces newlines with spaces before sending.
"""

from __future__ import annotations

import os

from llama_index.embeddings.openai_like import OpenAILikeEmbedding

URL = os.environ.get("BGESERVE_URL", "http://localhost:8081")


def embeddings(url: str = URL) -> OpenAILikeEmbedding:
    """LlamaIndex embeddings served by bgeserve."""
    return OpenAILikeEmbedding(
        model_name="bge-m3",
        api_base=f"{url}/v1",
        api_key=os.environ.get("BGE_M3_API_KEY", "unused"),
        embed_batch_size=64,
    )


def main() -> None:
    emb = embeddings()
    docs = emb.get_text_embedding_batch(["What is BGE M3?", "Definition of BM25"])
    query = emb.get_query_embedding("what is bge-m3")
    print(f"{len(docs)} documents, {len(query)}-dimensional vectors")


if __name__ == "__main__":
    main()
