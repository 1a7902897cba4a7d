"""Which kind of model a directory holds: bge-m3 (an embedding model) or a cross-encoder reranker.

A Hugging Face checkpoint says so in ``config.json``'s ``architectures``
(``XLMRobertaForSequenceClassification`` for bge-reranker-v2-m3, ``XLMRobertaModel`` for bge-m3);
a bgeserve export in its ``manifest.json`` (``kind``; exports made before rerankers existed
have none and are embeddings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EMBEDDING = "embedding"
RERANKER = "reranker"
KINDS = (EMBEDDING, RERANKER)


def config_kind(config: dict[str, Any]) -> str:
    """``reranker`` for a sequence-classification config, else ``embedding``. Without
    ``architectures``, one label says a reranker (a base model's config has transformers'
    two by default): it was taken for an embedding model, refused for missing bge-m3's heads
    (QA)."""
    architectures = config.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return RERANKER
    if not architectures and num_labels(config) == 1:
        return RERANKER
    return EMBEDDING


def num_labels(config: dict[str, Any]) -> int:
    """Logits per input of a classification config (``id2label``'s size; 1 for a reranker)."""
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    return int(config.get("num_labels", 2))  # transformers' default when nothing is given


def directory_kind(path: Path) -> str | None:
    """The kind of model in ``path`` (an export or a checkpoint); None when neither file says."""
    path = Path(path)
    for name in ("manifest.json", "config.json"):
        try:
            data = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        if name == "manifest.json":
            kind = data.get("kind", EMBEDDING)
            return kind if kind in KINDS else None
        return config_kind(data)
    return None
