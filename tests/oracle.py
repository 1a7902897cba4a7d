"""Compare bgeserve's outputs with FlagEmbedding's (the reference) within stated tolerances."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from bgeserve.results import Embeddings


@dataclass(frozen=True)
class Tolerance:
    """Per-variant agreement required with FlagEmbedding fp32."""

    dense_cos: float
    sparse_abs: float
    sparse_ids_exact: bool
    colbert_cos: float


# SPEC §2: fp32 must match to float noise. fp16/int8 change the numbers; their bounds are
# documented in docs/variants.md and are checked here, so a regression cannot hide.
FP32 = Tolerance(dense_cos=0.99999, sparse_abs=1e-4, sparse_ids_exact=True, colbert_cos=0.9999)
FP16 = Tolerance(dense_cos=0.999, sparse_abs=5e-3, sparse_ids_exact=False, colbert_cos=0.999)
INT8 = Tolerance(dense_cos=0.99, sparse_abs=0.1, sparse_ids_exact=False, colbert_cos=0.98)
# bf16 on OpenVINO (fp16-stored weights, bf16 compute): measured on the tiny model dense 0.99996,
# sparse 0.019, ColBERT 0.99986; on the full-size model dense 0.99997 (docs/benchmarks.md).
BF16 = Tolerance(dense_cos=0.999, sparse_abs=0.05, sparse_ids_exact=False, colbert_cos=0.999)


@contextmanager
def every_core() -> Iterator[None]:
    """torch on every CPU this process may use, for one oracle call: conftest keeps torch at
    one thread so that it never competes with the servers the tests start, but an oracle
    call runs alone (2 threads: 1.8x on 2 cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# FlagEmbedding pads each batch to its longest text: batches of 4 beside an 8,192-token text
# ran four 8,192-token passes for one text's worth of outputs (5.4x the time of one text per
# batch on the tiny model, outputs equal within 3e-6). One text (pair) per batch is also the
# reference with no padding at all.
def reference(flag_model, texts: list[str], max_length: int = 8192) -> dict:
    """FlagEmbedding outputs for ``texts`` (max_length passed: its default truncates at 512)."""
    with every_core():
        return flag_model.encode(texts, batch_size=1, max_length=max_length, return_dense=True,
                                 return_sparse=True, return_colbert_vecs=True)


def rerank_reference(flag_reranker, pairs: list[list[str]], max_length: int = 8192,
                     normalize: bool = False) -> np.ndarray:
    """FlagReranker's scores for ``pairs``: raw logits, or through its sigmoid."""
    with every_core():
        return np.asarray(flag_reranker.compute_score(pairs, max_length=max_length,
                                                      batch_size=1, normalize=normalize))


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30)


def assert_matches(ours: Embeddings, ref: dict, tol: Tolerance) -> None:
    """Every output of every text agrees with the reference within ``tol``."""
    n = len(ref["dense_vecs"])
    assert len(ours) == n
    cos = _cos(ours.dense, ref["dense_vecs"])
    assert cos.min() >= tol.dense_cos, f"dense cos min {cos.min():.7f} at {int(cos.argmin())}"
    for i in range(n):
        idx, val = ours.sparse[i]
        assert np.all(np.diff(idx) > 0), f"text {i}: sparse ids not ascending and unique"
        want = {int(k): float(v) for k, v in ref["lexical_weights"][i].items()}
        got = dict(zip(idx.tolist(), val.tolist()))
        if tol.sparse_ids_exact:
            assert set(got) == set(want), f"text {i}: sparse ids differ"
        # Near-zero weights may flip across relu in reduced precision: compare on the union.
        for k in set(got) | set(want):
            assert abs(got.get(k, 0.0) - want.get(k, 0.0)) <= tol.sparse_abs, (
                f"text {i}, id {k}: {got.get(k)} vs {want.get(k)}")
        ref_cb = np.asarray(ref["colbert_vecs"][i])
        assert ours.colbert[i].shape == ref_cb.shape, f"text {i}: colbert shape"
        if len(ref_cb):
            c = _cos(ours.colbert[i], ref_cb)
            assert c.min() >= tol.colbert_cos, f"text {i}: colbert cos {c.min():.6f}"


def dense_rows(body: dict[str, Any]) -> np.ndarray:
    """The dense vectors of an embeddings response, whether float lists or base64."""
    rows = []
    for item in body["data"]:
        v = item["embedding"]
        if isinstance(v, str):
            v = np.frombuffer(base64.b64decode(v), dtype="<f4")
        rows.append(np.asarray(v, dtype=np.float32))
    return np.stack(rows)
