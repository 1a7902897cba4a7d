"""Tests for bgeserve.heads: sparse weights, normalisation and the numpy heads, against plain
reference computations (loops over tokens, as FlagEmbedding's code reads)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bgeserve.engine.heads import (
    ChunkOutputs,
    HiddenHeads,
    colbert_rows,
    l2_normalize,
    sparse_vector,
)

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)


def reference_sparse(ids, weights) -> dict[int, float]:
    """FlagEmbedding's ``_process_token_weights``: skip specials and weights ≤ 0, keep the max."""
    out: dict[int, float] = {}
    for token, w in zip(ids, weights):
        token, w = int(token), float(w)
        if token in (0, 1, 2, 3) or w <= 0:
            continue
        if w > out.get(token, 0.0):
            out[token] = w
    return out


# ------------------------------------------------------------------------- sparse_vector
def test_sparse_vector_by_hand():
    """Specials and non-positive weights go; a repeated id keeps its largest weight."""
    ids = np.array([0, 7, 5, 7, 3, 9, 1, 2, 5], dtype=np.int64)
    w = np.array([9, 0.2, 0.5, 0.8, 9, 0.0, 9, 9, -1], dtype=np.float32)
    idx, val = sparse_vector(ids, w)
    assert idx.tolist() == [5, 7]
    np.testing.assert_array_equal(val, np.array([0.5, 0.8], np.float32))
    assert idx.dtype == np.int64 and val.dtype == np.float32


@pytest.mark.parametrize("ids, weights", [
    ([], []),
    ([0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0]),
    ([5, 6], [0.0, -0.5]),
])
def test_sparse_vector_with_nothing_left_is_empty_and_typed(ids, weights):
    """No surviving token gives empty int64 ids and float32 weights."""
    idx, val = sparse_vector(np.array(ids, np.int64), np.array(weights, np.float32))
    assert idx.shape == (0,) and idx.dtype == np.int64
    assert val.shape == (0,) and val.dtype == np.float32


def test_sparse_vector_drops_nan_weights():
    """A NaN weight is not > 0, so it is dropped rather than poisoning the max."""
    idx, val = sparse_vector(np.array([5, 5, 6]), np.array([np.nan, 0.5, np.nan], np.float32))
    assert idx.tolist() == [5] and val.tolist() == [0.5]


def test_sparse_vector_casts_weights_to_float32():
    """float16 or float64 weights come back float32; int32 ids come back int64."""
    idx, val = sparse_vector(np.array([5, 6], np.int32), np.array([0.25, 0.5], np.float64))
    assert idx.dtype == np.int64 and val.dtype == np.float32
    idx, val = sparse_vector(np.array([5], np.int64), np.array([0.25], np.float16))
    assert val.dtype == np.float32 and val.tolist() == [0.25]


@PROPERTY
@given(st.lists(st.tuples(st.integers(0, 12), st.floats(-1.0, 1.0, width=32)), max_size=40))
def test_sparse_vector_matches_the_reference(pairs):
    """For any ids and weights: ids ascending and unique, each with the reference max weight."""
    ids = np.array([p[0] for p in pairs], dtype=np.int64)
    w = np.array([p[1] for p in pairs], dtype=np.float32)
    idx, val = sparse_vector(ids, w)
    ref = reference_sparse(ids, w)
    assert idx.tolist() == sorted(ref)
    np.testing.assert_array_equal(val, np.array([ref[k] for k in sorted(ref)], np.float32))
    assert np.all(np.diff(idx) > 0) and np.all(val > 0)


# -------------------------------------------------------------------------- l2_normalize
def test_l2_normalize_gives_unit_rows_in_float32():
    """Every non-zero row gets unit length; the result is float32."""
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float64) * 100
    y = l2_normalize(x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), 1.0, atol=1e-6)
    np.testing.assert_allclose(y, x / np.linalg.norm(x, axis=-1, keepdims=True), atol=1e-6)


def test_l2_normalize_leaves_zero_rows_zero():
    """A zero row stays zero (no NaN), as torch's normalize with eps does."""
    x = np.array([[0.0, 0.0, 0.0], [3.0, 0.0, 4.0]], np.float32)
    y = l2_normalize(x)
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[0], [0, 0, 0])
    np.testing.assert_allclose(y[1], [0.6, 0.0, 0.8], atol=1e-7)


def test_l2_normalize_works_on_the_last_axis_of_any_rank():
    """(B, L, H) arrays are normalised along H."""
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(np.linalg.norm(l2_normalize(x), axis=-1), 1.0, atol=1e-6)


# --------------------------------------------------------------------------- HiddenHeads
def heads(hidden: int = 6, out: int = 5, seed: int = 0) -> HiddenHeads:
    rng = np.random.default_rng(seed)
    return HiddenHeads(rng.standard_normal(hidden).astype(np.float32), 0.1,
                       rng.standard_normal((out, hidden)).astype(np.float32),
                       rng.standard_normal(out).astype(np.float32))


def test_sparse_head_is_relu_of_a_linear_map_per_position():
    """sparse(h)[b, t] = max(0, h[b, t]·w + bias), position by position."""
    h = heads()
    hidden = np.random.default_rng(2).standard_normal((3, 4, 6)).astype(np.float32)
    got = h.sparse(hidden)
    assert got.shape == (3, 4) and got.dtype == np.float32
    for b in range(3):
        for t in range(4):
            want = max(0.0, float(np.dot(hidden[b, t], h.sparse_weight)) + h.sparse_bias)
            assert got[b, t] == pytest.approx(want, abs=1e-5)
    assert np.any(got == 0) and np.any(got > 0)


def test_colbert_head_matches_a_per_token_reference():
    """colbert(h, mask)[b, t-1] = normalise(W·h[b, t] + bias) for real t ≥ 1, zero for padding."""
    h = heads()
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((2, 5, 6)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int64)
    got = h.colbert(hidden, mask)
    assert got.shape == (2, 4, 5) and got.dtype == np.float32
    for b in range(2):
        for t in range(1, 5):
            if mask[b, t]:
                v = h.colbert_weight @ hidden[b, t] + h.colbert_bias
                np.testing.assert_allclose(got[b, t - 1], v / np.linalg.norm(v), atol=1e-5)
            else:
                np.testing.assert_array_equal(got[b, t - 1], 0.0)


def test_colbert_head_does_not_modify_its_inputs():
    """The hidden states and mask passed in are left untouched."""
    h = heads()
    hidden = np.random.default_rng(4).standard_normal((1, 3, 6)).astype(np.float32)
    mask = np.array([[1, 1, 0]], np.int64)
    before = hidden.copy(), mask.copy()
    h.colbert(hidden, mask)
    np.testing.assert_array_equal(hidden, before[0])
    np.testing.assert_array_equal(mask, before[1])


def test_colbert_head_accepts_float16_hidden_states():
    """fp16 graphs' hidden states give float32 vectors close to the fp32 result."""
    h = heads()
    hidden = np.random.default_rng(5).standard_normal((1, 4, 6)).astype(np.float32)
    mask = np.ones((1, 4), np.int64)
    got = h.colbert(hidden.astype(np.float16), mask)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, h.colbert(hidden, mask), atol=5e-3)


# ---------------------------------------------------------------------------- colbert_rows
def test_colbert_rows_keeps_n_tokens_minus_one_rows():
    """One row per token after <s> (</s> kept, padding dropped), as contiguous float32."""
    vectors = np.arange(5 * 3, dtype=np.float64).reshape(5, 3)  # a text padded to L = 6
    rows = colbert_rows(vectors, 4)
    assert rows.shape == (3, 3) and rows.dtype == np.float32 and rows.flags.c_contiguous
    np.testing.assert_array_equal(rows, vectors[:3])
    chunk = np.ones((2, 6, 3), np.float32)  # already float32 and contiguous: still a copy
    assert not np.shares_memory(colbert_rows(chunk[1], 4), chunk)


@pytest.mark.parametrize("n_tokens", [0, 1])
def test_colbert_rows_of_a_text_without_content_is_empty(n_tokens):
    """Fewer than two tokens leave no rows (never a negative slice)."""
    assert colbert_rows(np.ones((4, 3), np.float32), n_tokens).shape == (0, 3)


def test_chunk_outputs_holds_whatever_heads_were_asked_for():
    """Heads not computed are None."""
    out = ChunkOutputs(np.zeros((1, 4), np.float32), None, None)
    assert out.sparse_weights is None and out.colbert is None
