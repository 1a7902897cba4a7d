"""bgeserve: BAAI/bge-m3 dense, sparse and ColBERT embeddings from ONNX Runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "Reranker", "Settings", "__version__", "create_app"]

if TYPE_CHECKING:
    from bgeserve.config import Settings
    from bgeserve.engine import Engine
    from bgeserve.engine.reranker import Reranker
    from bgeserve.http.app import create_app


def __getattr__(name: str) -> Any:
    # Lazy: `import bgeserve` must stay cheap (the CLI's export path never loads the server stack).
    if name == "Engine":
        from bgeserve.engine import Engine

        return Engine
    if name == "Reranker":
        from bgeserve.engine.reranker import Reranker

        return Reranker
    if name == "Settings":
        from bgeserve.config import Settings

        return Settings
    if name == "create_app":
        from bgeserve.http.app import create_app

        return create_app
    raise AttributeError(name)
