"""Tests for bgeserve.engine.m3score: bge-m3's dense / sparse / ColBERT / hybrid scores."""

from __future__ import annotations

import numpy as np
import pytest

from bgeserve.engine.m3score import (
    DEFAULT_WEIGHTS,
    M3Scores,
    canonical_mode,
    check_weights,
    colbert_scores,
    m3_scores,
    needs,
    sparse_scores,
)
from bgeserve.results import Embeddings


def unit(rows) -> np.ndarray:
    a = np.asarray(rows, dtype=np.float32)
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def embeddings(dense, sparse, colbert) -> Embeddings:
    n = len(dense)
    return Embeddings(np.asarray(dense, np.float32), sparse, colbert,
                      np.full(n, 3, dtype=np.int64), np.zeros(n, dtype=bool))


def sp(pairs: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    keys = sorted(pairs)
    return np.array(keys, dtype=np.int64), np.array([pairs[k] for k in keys], dtype=np.float32)


def test_each_mode_is_flagembeddings_formula() -> None:
    """dense = q·d; sparse = Σ over shared ids of w_q·w_d; colbert = mean over query vectors
    of the best dot product; the combinations are weighted sums over the weights' sum."""
    q = embeddings(unit([[1, 0]]), [sp({5: 0.5, 7: 2.0})], [unit([[1, 0], [0, 1]])])
    d = embeddings(unit([[1, 1], [0, 1]]),
                   [sp({5: 1.0, 9: 3.0}), sp({7: 0.25, 8: 1.0})],
                   [unit([[1, 1], [1, 0]]), unit([[-1, 0]])])
    s = m3_scores(q, d)
    np.testing.assert_allclose(s.dense, [2 ** -0.5, 0.0], atol=1e-7)
    np.testing.assert_allclose(s.sparse, [0.5, 0.5])
    np.testing.assert_allclose(s.colbert, [(1 + 2 ** -0.5) / 2, (-1 + 0) / 2], atol=1e-7)
    w = (0.4, 0.2, 0.4)
    np.testing.assert_allclose(s.combined("sparse+dense", w),
                               (0.2 * s.sparse + 0.4 * s.dense) / 0.6)
    np.testing.assert_allclose(s.combined("hybrid", w),
                               (0.4 * s.colbert + 0.2 * s.sparse + 0.4 * s.dense) / 1.0)
    np.testing.assert_array_equal(s.combined("colbert+sparse+dense", w), s.combined("hybrid", w))
    for mode in ("dense", "sparse", "colbert"):
        np.testing.assert_array_equal(s.combined(mode, (9, 9, 9)), getattr(s, mode))


def test_colbert_takes_the_maximum_over_real_tokens_only() -> None:
    """Where every document vector has a negative dot product with a query vector, its best
    is that negative number: FlagEmbedding's batch_size=1 score. (In a padded batch FlagEmbedding
    lets the padding's zero vectors win with 0; that batch-dependent score is not reproduced.)"""
    q = unit([[1, 0]])
    doc = unit([[-1, 0.2], [-1, -0.5]])
    got = colbert_scores(q, [doc])
    assert got[0] == pytest.approx(float(doc[:, 0].max()), abs=1e-7)
    assert got[0] < 0


def test_sparse_without_shared_ids_is_zero() -> None:
    """Texts sharing no token score 0 (including an empty sparse vector)."""
    empty = (np.zeros(0, np.int64), np.zeros(0, np.float32))
    assert sparse_scores(sp({1: 1.0}), [sp({2: 1.0}), empty]).tolist() == [0.0, 0.0]


def test_huge_weights_count_by_their_ratios() -> None:
    """Only the weights' ratios count: past 1 they are scaled so the largest is 1, so weights
    near the float maximum (schema-valid) give the same finite scores as their ratios, where
    the weighted sum overflowed (an HTTP answer's score was null)."""
    scores = M3Scores(np.array([0.5, 0.1]), np.array([6.25, 0.0]), np.array([0.75, 0.2]))
    huge = scores.combined("hybrid", (4e16, 6e307, 2e16))
    assert np.isfinite(huge).all()
    np.testing.assert_allclose(huge, scores.combined("hybrid", (4e16 / 6e307, 1, 2e16 / 6e307)))
    assert check_weights((0.4, 0.2, 0.4), "hybrid") == (0.4, 0.2, 0.4)  # within 1: as given
    assert check_weights((2, 1, 4), "hybrid") == (0.5, 0.25, 1.0)
    # Tiny weights are scaled up too: their products underflowed, and weights [5e-324, 0, 0]
    # scored every document 1.0 rather than its dense score.
    tiny = scores.combined("hybrid", (5e-324, 0, 0))
    np.testing.assert_array_equal(tiny, scores.dense)
    np.testing.assert_allclose(scores.combined("hybrid", (2e-310, 1e-310, 4e-310)),
                               scores.combined("hybrid", (0.5, 0.25, 1.0)), rtol=1e-15)


def test_modes_weights_and_needs_are_checked() -> None:
    """Unknown modes and bad weights raise with the accepted values; each mode says which
    outputs it needs, and refuses scores that were not computed."""
    assert canonical_mode("hybrid") == "colbert+sparse+dense"
    with pytest.raises(ValueError, match="expected one of"):
        canonical_mode("bm25")
    for bad in ((1, 1), (1, -1, 1), (float("nan"), 1, 1)):
        with pytest.raises(ValueError, match="three numbers"):
            check_weights(bad, "hybrid")
    with pytest.raises(ValueError, match="dense and sparse weights, which is 0"):
        check_weights((0, 0, 1), "sparse+dense")
    assert check_weights((0, 0, 1), "colbert") == (0.0, 0.0, 1.0)
    assert needs("dense") == (True, False, False) and needs("hybrid") == (True, True, True)
    assert needs("sparse+dense") == (True, True, False)
    with pytest.raises(ValueError, match="needs the colbert"):
        M3Scores(np.zeros(1), np.zeros(1), None).combined("hybrid", DEFAULT_WEIGHTS)


# ------------------------------------------------------------------------------- the oracle
@pytest.fixture(scope="module")
def pairs() -> list[list[str]]:
    """Queries against documents of 1 to ~2,500 tokens, an empty one and a repeated word."""
    from bgeserve.testing.randmodel import random_texts

    queries = random_texts(41, 3, 2, 12)
    docs = random_texts(42, 8, 1, 80) + ["", "the the the", " ".join(random_texts(43, 60, 30, 40))]
    return [[q, d] for q in queries for d in docs]


@pytest.fixture(scope="module")
def ours(tiny_export, pairs, tmp_path_factory) -> dict[str, M3Scores]:
    """bgeserve's scores from the tiny export (fp32): each query embedded once."""
    from bgeserve.engine import Engine

    out = {}
    with Engine(tiny_export, "fp32", cache_dir=tmp_path_factory.mktemp("cache"),
                offline=True) as engine:
        for query in dict.fromkeys(q for q, _ in pairs):
            docs = [d for q, d in pairs if q == query]
            q = engine.embed(query, dense=True, sparse=True, colbert=True)
            d = engine.embed(docs, dense=True, sparse=True, colbert=True)
            out[query] = m3_scores(q, d)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("weights", [None, [0.4, 0.2, 0.4], [1.0, 0.0, 3.0]],
                         ids=["default", "card", "skewed"])
def test_every_mode_matches_bgem3flagmodel(flag_model, pairs, ours, weights) -> None:
    """All five of compute_score's keys agree within 1e-4 (batch_size=1: the unpadded
    ColBERT semantics; 8192-token limits, as FlagEmbedding's default would cut at 512)."""
    ref = flag_model.compute_score(pairs, batch_size=1, max_query_length=8192,
                                   max_passage_length=8192, weights_for_different_modes=weights)
    w = weights or [1.0, 1.0, 1.0]  # FlagEmbedding's default: equal weights
    for mode in ("dense", "sparse", "colbert", "sparse+dense", "colbert+sparse+dense"):
        got = np.concatenate([ours[q].combined(mode, w) for q in dict.fromkeys(p[0] for p in pairs)])
        np.testing.assert_allclose(got, ref[mode], atol=1e-4, rtol=0, err_msg=mode)
        assert np.argsort(-got).tolist() == np.argsort(-np.asarray(ref[mode])).tolist(), mode
