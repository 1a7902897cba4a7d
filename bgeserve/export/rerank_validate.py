"""Export-time validation of a reranker: how closely each variant's scores and rankings agree
with fp32.

A reranker is judged by the order it puts documents in, so besides the logits' largest
difference this records, over ``QUERIES`` queries of ``DOCUMENTS`` documents each, the worst
Kendall tau between a variant's ranking and fp32's and the share of queries whose top document
is the same. Pairs run through fp32 alone (batch 1, no padding), then through the variant
alone and in padded batches as the server packs them; the figures are the worse of the two
passes (``validate.py`` does the same for embeddings).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bgeserve.export import corpus
from bgeserve.export.validate import BATCH, batches, open_session

QUERIES = 4
DOCUMENTS = 8  # per query: 2 of 3-8 tokens, the rest spread over 16..max_tokens


def validation_pairs(tokenizer: Path, max_tokens: int) -> list[np.ndarray]:
    """``QUERIES × DOCUMENTS`` pair rows, query-major (pair ``q * DOCUMENTS + d``)."""
    queries = corpus.token_rows(tokenizer, corpus.VALIDATION_SEED + 2, QUERIES, min_tokens=5,
                                max_tokens=26)
    docs = corpus.token_rows(tokenizer, corpus.VALIDATION_SEED, DOCUMENTS - 2,
                             max_tokens=max_tokens)
    docs += corpus.token_rows(tokenizer, corpus.VALIDATION_SEED + 1, 2, min_tokens=3,
                              max_tokens=8)
    return [corpus.pair_row(q, d, max_tokens) for q in queries for d in docs]


def scores(export_dir: Path, variant: str, rows: Sequence[np.ndarray],
           batch: int = 1) -> np.ndarray:
    """The ``score`` logit of each row (float64), the rows run ``batch`` at a time."""
    from bgeserve.engine.forward import pad_chunk

    session = open_session(export_dir, variant)
    out = np.zeros(len(rows))
    try:
        for group in batches(rows, batch):
            members = [rows[i] for i in group]
            ids, mask = pad_chunk(members, max(len(r) for r in members))
            got = np.asarray(session.run(ids, mask, outputs=["score"])["score"]).reshape(-1)
            out[group] = got.astype(np.float64)
    finally:
        session.close()
    return out


def kendall_tau(a: np.ndarray, b: np.ndarray) -> float:
    """Kendall's tau-a between two score vectors (1: the same order; ties count as 0)."""
    n = len(a)
    if n < 2:
        return 1.0
    da = np.sign(a[:, None] - a[None, :])
    db = np.sign(b[:, None] - b[None, :])
    upper = np.triu_indices(n, 1)
    return float((da[upper] * db[upper]).sum() / len(upper[0]))


def compare(ref: np.ndarray, got: np.ndarray) -> dict[str, float | int]:
    """Score and rank agreement of ``got`` with ``ref`` (both query-major, DOCUMENTS a query)."""
    diff = np.abs(ref - got)
    taus = [kendall_tau(r, g) for r, g in zip(ref.reshape(-1, DOCUMENTS),
                                              got.reshape(-1, DOCUMENTS), strict=True)]
    top = np.mean(ref.reshape(-1, DOCUMENTS).argmax(1) == got.reshape(-1, DOCUMENTS).argmax(1))
    return {"score_max_abs": float(f"{diff.max():.4g}"),
            "score_mean_abs": float(f"{diff.mean():.4g}"),
            "score_std": float(f"{ref.std():.4g}"),  # the scale the differences compare with
            "kendall_tau_min": round(min(taus), 4),
            "top1_agreement": round(float(top), 4),
            "pairs": len(ref)}


def worse(a: dict[str, float | int], b: dict[str, float | int]) -> dict[str, float | int]:
    """The figures of two passes over the same pairs, each at its worse value."""
    return {"score_max_abs": max(a["score_max_abs"], b["score_max_abs"]),
            "score_mean_abs": max(a["score_mean_abs"], b["score_mean_abs"]),
            "score_std": a["score_std"],
            "kendall_tau_min": min(a["kendall_tau_min"], b["kendall_tau_min"]),
            "top1_agreement": min(a["top1_agreement"], b["top1_agreement"]),
            "pairs": a["pairs"]}


def agreement(export_dir: Path, variants: Sequence[str], tokenizer: Path,
              max_tokens: int = corpus.MAX_TOKENS) -> dict[str, dict[str, float | int]]:
    """{variant: figures} for each of ``variants`` against the export's fp32 graph."""
    rows = validation_pairs(tokenizer, max_tokens)
    ref = scores(export_dir, "fp32", rows)
    return {v: worse(compare(ref, scores(export_dir, v, rows)),
                     compare(ref, scores(export_dir, v, rows, BATCH)))
            for v in variants if v != "fp32"}
