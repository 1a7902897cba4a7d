"""``bgeserve.bulk.coverage``: the rows finished shards hold (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from bgeserve.bulk.coverage import Coverage, OverlappingShards, spans_of


def test_spans_of_compresses_runs():
    """Consecutive row numbers become one [start, stop) span, in any input order."""
    assert spans_of([5, 0, 1, 2, 9, 8]) == [[0, 3], [5, 6], [8, 10]]
    assert spans_of(np.array([], dtype=np.int64)) == []


def test_covered_marks_exactly_the_rows_of_the_spans():
    """A row is covered iff a span of its own source holds it."""
    c = Coverage()
    c.add("a", [[0, 3], [10, 12]], "s1")
    c.add("a", [[3, 5]], "s2")
    c.add("b", [[0, 1]], "s3")
    rows = np.arange(14)
    assert c.covered("a", rows).tolist() == [r < 5 or 10 <= r < 12 for r in rows]
    assert c.covered("b", rows).tolist() == [r == 0 for r in rows]
    assert not c.covered("c", rows).any()
    assert c.rows("a") == 7 and c.rows() == 8


def test_two_shards_holding_one_row_are_refused():
    """Overlapping spans name both shards: never resolved by guessing."""
    c = Coverage()
    c.add("a", [[0, 10]], "first.parquet")
    c.add("a", [[9, 12]], "second.parquet")
    with pytest.raises(OverlappingShards, match="first.parquet and second.parquet"):
        c.verify()
