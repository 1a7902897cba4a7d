"""Export-time validation: how closely each reduced-precision variant agrees with fp32.

The figures go into the variant's manifest entry (``"agreement"``), so an export says what its
fp16, int8 and bf16 graphs cost in accuracy on the model actually exported, not only on the
random model the docs measured. Each text runs alone (batch 1, no padding) through the fp32
graph, then through each variant's own runtime, one session open at a time. The figures are
this machine's: bf16 on a CPU without native bf16 runs in fp32 on OpenVINO, so there they only
reflect its fp16-stored weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import corpus
from .main import GRAPH_PATHS, RUNTIMES

VALIDATION_TEXTS = 8


def _open(export_dir: Path, variant: str) -> Any:
    """A session over the variant's graph with bgeserve's runtime options (threads: auto)."""
    path = export_dir / GRAPH_PATHS[variant]
    if RUNTIMES.get(variant) == "openvino":
        from ..runtime.openvino import SharedModel

        return SharedModel(path, precision="bf16", threads=0, streams=1).session()
    from ..runtime.onnx import OnnxSession, SessionConfig

    return OnnxSession(path, SessionConfig())


def _outputs(export_dir: Path, variant: str,
             rows: Sequence[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Dense vectors [n, hidden] and per-token sparse weights (one array per text)."""
    session = _open(export_dir, variant)
    dense, sparse = [], []
    try:
        for ids in rows:
            out = session.run(ids[None, :], np.ones((1, len(ids)), np.int64),
                              outputs=["dense", "sparse_weights"])
            dense.append(np.asarray(out["dense"][0], dtype=np.float64))
            sparse.append(np.asarray(out["sparse_weights"][0], dtype=np.float64).reshape(-1))
    finally:
        session.close()
    return np.stack(dense), sparse


def compare(ref: tuple[np.ndarray, list[np.ndarray]],
            got: tuple[np.ndarray, list[np.ndarray]]) -> dict[str, float | int]:
    """Dense cosine (min, mean) and the largest per-token sparse weight difference."""
    a, b = ref[0], got[0]
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30)
    sparse = max(float(np.abs(x - y).max()) for x, y in zip(ref[1], got[1]))
    return {"dense_cos_min": round(float(cos.min()), 7),
            "dense_cos_mean": round(float(cos.mean()), 7),
            "sparse_max_abs": float(f"{sparse:.4g}"), "texts": len(a)}


def agreement(export_dir: Path, variants: Sequence[str], tokenizer: Path,
              n: int = VALIDATION_TEXTS, max_tokens: int = corpus.MAX_TOKENS,
              ) -> dict[str, dict[str, float | int]]:
    """{variant: figures} for each of ``variants`` against the export's fp32 graph."""
    rows = corpus.token_rows(tokenizer, corpus.VALIDATION_SEED, n, max_tokens=max_tokens)
    ref = _outputs(export_dir, "fp32", rows)
    return {v: compare(ref, _outputs(export_dir, v, rows)) for v in variants if v != "fp32"}
