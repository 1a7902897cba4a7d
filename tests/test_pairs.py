"""Tests for bgeserve.engine.pairs: FlagReranker's pair ids, windows over long documents."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bgeserve.engine.pairs import (
    PairConfig,
    build_pairs,
    content_ids,
    pair_ids,
    window_starts,
)


def ids(n: int, start: int = 10) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def test_a_pair_that_fits_is_flagrerankers_ids() -> None:
    """A pair within max_length is one row ``[0] + q + [2, 2] + d + [2]``, not flagged."""
    plan = build_pairs(ids(3), [ids(4, 100)], PairConfig(max_length=64))
    assert [r.tolist() for r in plan.rows] == [[0, 10, 11, 12, 2, 2, 100, 101, 102, 103, 2]]
    assert plan.windows.tolist() == [1] and plan.truncated.tolist() == [False]
    assert plan.tokens == 11 and plan.query_tokens == 3 and not plan.query_truncated


def test_empty_query_and_empty_document_keep_every_special() -> None:
    """An empty document still gives ``[0] + q + [2, 2, 2]``, an empty query ``[0, 2, 2] + d
    + [2]`` (FlagReranker's ids for both; an HF pair call would drop the empty side)."""
    plan = build_pairs(ids(2), [ids(0)], PairConfig(max_length=16))
    assert plan.rows[0].tolist() == [0, 10, 11, 2, 2, 2]
    plan = build_pairs(ids(0), [ids(2, 50)], PairConfig(max_length=16))
    assert plan.rows[0].tolist() == [0, 2, 2, 50, 51, 2]


def test_query_is_cut_to_three_quarters_of_max_length() -> None:
    """FlagReranker's query cap, ``max_length * 3 // 4`` tokens, flagged on the plan."""
    plan = build_pairs(ids(100), [ids(5, 500)], PairConfig(max_length=64), "truncate")
    assert plan.query_tokens == 48 and plan.query_truncated
    assert plan.rows[0][1:49].tolist() == ids(48).tolist()
    assert len(plan.rows[0]) == 48 + 4 + 5


def test_an_explicit_query_cap_still_leaves_a_document_token() -> None:
    """``query_max`` past the room is clipped so every window holds a document token."""
    config = PairConfig(max_length=16, query_max=100)
    assert config.query_limit == 11
    plan = build_pairs(ids(30), [ids(3, 500)], config)
    assert all(len(r) == 16 for r in plan.rows) and plan.windows.tolist() == [3]


def test_truncate_keeps_flagrerankers_cut_and_flags_it() -> None:
    """``truncate``: the document is cut to ``max_length - len(q) - 4`` tokens (FlagReranker's
    only_second truncation), one row, flagged."""
    plan = build_pairs(ids(6), [ids(100, 200), ids(2, 900)], PairConfig(max_length=32),
                       "truncate")
    assert plan.windows.tolist() == [1, 1] and plan.truncated.tolist() == [True, False]
    assert plan.rows[0].tolist() == pair_ids(ids(6), ids(22, 200)).tolist()
    assert len(plan.rows[0]) == 32


def test_windows_cover_a_long_document_and_end_at_its_end() -> None:
    """``max``: full windows of ``W`` tokens from 0 by ``W - overlap``, the last ending at the
    document's end; window 0 is the truncated row; nothing is flagged."""
    config = PairConfig(max_length=32)  # W = 32 - 6 - 4 = 22, overlap 5, stride 17
    plan = build_pairs(ids(6), [ids(100, 200)], config)
    starts = [0, 17, 34, 51, 68, 78]
    assert plan.windows.tolist() == [len(starts)] and not plan.truncated.any()
    for row, start in zip(plan.rows, starts, strict=True):
        assert row.tolist() == pair_ids(ids(6), ids(22, 200 + start)).tolist()
    assert plan.rows[0].tolist() == build_pairs(ids(6), [ids(100, 200)], config,
                                                "truncate").rows[0].tolist()


def test_max_windows_caps_a_document_and_flags_it() -> None:
    """Past ``max_windows`` the rest of the document is not scored, and says so."""
    plan = build_pairs(ids(6), [ids(100, 200), ids(10, 900)],
                       PairConfig(max_length=32, max_windows=2))
    assert plan.windows.tolist() == [2, 1] and plan.truncated.tolist() == [True, False]
    assert plan.owner.tolist() == [0, 0, 1]


def test_reduce_keeps_each_documents_best_window() -> None:
    """Scores come back per document: the maximum over its rows, in document order."""
    plan = build_pairs(ids(6), [ids(100, 200), ids(2, 900), ids(40, 300)],
                       PairConfig(max_length=32))
    rows = len(plan.rows)
    scores = np.arange(rows, dtype=np.float64)[::-1] - 3.0  # decreasing: each doc's first
    got = plan.reduce(scores)
    firsts = np.r_[0, np.cumsum(plan.windows)[:-1]]
    assert got.tolist() == scores[firsts].tolist()
    with pytest.raises(ValueError, match="scores for"):
        plan.reduce(scores[:-1])


def test_content_ids_drop_one_special_at_each_end() -> None:
    """``<s>`` and ``</s>`` added by the tokenizer go; a literal ``</s>`` inside stays."""
    assert content_ids(np.array([0, 5, 2, 6, 2])).tolist() == [5, 2, 6]
    assert content_ids(np.array([0, 2])).tolist() == []


def test_config_refuses_nonsense() -> None:
    """Lengths too short for the specials, and negative knobs, are refused with a message."""
    for bad in ({"max_length": 5}, {"query_max": -1}, {"overlap": -1}, {"max_windows": 0}):
        with pytest.raises(ValueError):
            PairConfig(**bad)
    with pytest.raises(ValueError, match="long_documents"):
        build_pairs(ids(1), [ids(1)], PairConfig(max_length=16), "split")


@given(length=st.integers(0, 400), width=st.integers(1, 60), overlap=st.integers(0, 80))
def test_window_starts_cover_every_token_with_full_windows(length, width, overlap) -> None:
    """Every document token lies in a window; every window but a short document's is full;
    starts increase; the last window ends at the end; neighbours overlap by at least
    ``min(overlap, width - 1)`` tokens."""
    starts = window_starts(length, width, overlap)
    assert starts[0] == 0 and starts == sorted(set(starts))
    covered = np.zeros(length, dtype=bool)
    for s in starts:
        covered[s:s + width] = True
        assert s + width <= max(length, width)
    assert covered.all()
    if length > width:
        assert starts[-1] == length - width
        shared = min(overlap, width - 1)
        assert all(b - a <= width - shared for a, b in itertools.pairwise(starts))


def test_truncate_left_keeps_the_documents_end() -> None:
    """``truncation_direction`` left (TEI's): the one window is the document's last tokens."""
    plan = build_pairs(ids(6), [ids(100, 200)], PairConfig(max_length=32), "truncate", "left")
    assert plan.rows[0].tolist() == pair_ids(ids(6), ids(22, 278)).tolist()
    assert plan.truncated.tolist() == [True]


def test_document_windows_for_single_texts() -> None:
    """The same window policy serves bge-m3's own windows (no query): first / last / all."""
    from bgeserve.engine.pairs import document_windows

    assert document_windows(10, 4, 1) == ([0, 3, 6], False)
    assert document_windows(10, 4, 1, "truncate") == ([0], True)
    assert document_windows(10, 4, 1, "truncate", "left") == ([6], True)
    assert document_windows(3, 4, 1, "truncate", "left") == ([0], False)
    assert document_windows(10, 4, 1, max_windows=2) == ([0, 3], True)
