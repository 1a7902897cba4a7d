"""Test and benchmark helpers: deterministic random-weight models with bge-m3's layout
(and bge-reranker-v2-m3's).

Importing this package is cheap: names load on first use (which also keeps
``python -m bgeserve.testing.randmodel`` free of runpy's double-import warning), and torch,
transformers and tokenizers load only when a builder runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["SIZES", "build_random_model", "build_random_reranker", "cached_random_model",
           "cached_random_reranker", "random_texts"]
_RERANKER = ("build_random_reranker", "cached_random_reranker")

if TYPE_CHECKING:
    from bgeserve.testing.randmodel import (
        SIZES,
        build_random_model,
        cached_random_model,
        random_texts,
    )
    from bgeserve.testing.randreranker import build_random_reranker, cached_random_reranker


def __getattr__(name: str) -> Any:
    if name in _RERANKER:
        from bgeserve.testing import randreranker

        return getattr(randreranker, name)
    if name in __all__:
        from bgeserve.testing import randmodel

        return getattr(randmodel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
