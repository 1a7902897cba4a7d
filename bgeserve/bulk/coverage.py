"""Which rows of which sources finished shards already hold: spans of row numbers per source.

Each shard records the spans it accounts for (its written rows and its bad rows) in its own
Parquet footer, so the record and the rows become visible in one rename: there is no progress
file that could say more, or less, than the shards on disk.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from bgeserve.errors import BgeServeError

Spans = list[list[int]]  # [[start, stop), ...], ascending, disjoint


class OverlappingShards(BgeServeError):
    """Two shards claim the same row: a bug (or files copied in by hand); never resolved by
    guessing which one is right."""


def spans_of(rows: Iterable[int]) -> Spans:
    """Runs of consecutive row numbers, e.g. [0, 1, 2, 5] → [[0, 3], [5, 6]]."""
    r = np.unique(np.asarray(list(rows) if not isinstance(rows, np.ndarray) else rows,
                             dtype=np.int64))
    if r.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(r) != 1) + 1
    starts = np.concatenate(([r[0]], r[breaks]))
    stops = np.concatenate((r[breaks - 1] + 1, [r[-1] + 1]))
    return [[int(a), int(b)] for a, b in zip(starts, stops, strict=True)]


class Coverage:
    """Row spans per source, with the shard that holds each (to name both of an overlap)."""

    def __init__(self) -> None:
        self._spans: dict[str, list[tuple[int, int, str]]] = {}
        self._index: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def add(self, source: str, spans: Spans, shard: str) -> None:
        """Record that ``shard`` holds ``spans`` of ``source`` (``verify`` checks overlaps)."""
        self._spans.setdefault(source, []).extend((a, b, shard) for a, b in spans)
        self._index.pop(source, None)

    def verify(self) -> None:
        """OverlappingShards if two shards hold one row; builds the lookup index."""
        for source in list(self._spans):
            self._build(source)

    def _build(self, source: str) -> tuple[np.ndarray, np.ndarray]:
        if source not in self._index:
            spans = self._spans[source] = sorted(self._spans[source])
            for (_, b0, s0), (a1, _, s1) in itertools.pairwise(spans):
                if a1 < b0:
                    raise OverlappingShards(
                        f"shards {s0} and {s1} both hold rows of {source} from row {a1}: "
                        "remove the one that should not be there (or start again in a new "
                        "--output)")
            self._index[source] = (np.array([a for a, _, _ in spans], dtype=np.int64),
                                   np.array([b for _, b, _ in spans], dtype=np.int64))
        return self._index[source]

    def covered(self, source: str, rows: np.ndarray) -> np.ndarray:
        """A boolean mask: which of ``rows`` (row numbers of ``source``) are held already."""
        if source not in self._spans:
            return np.zeros(len(rows), dtype=bool)
        starts, stops = self._build(source)
        if starts.size == 0:
            return np.zeros(len(rows), dtype=bool)
        at = np.searchsorted(starts, rows, side="right") - 1
        return (at >= 0) & (rows < stops[np.maximum(at, 0)])

    def only(self, source: str) -> Coverage:
        """The spans of one source alone (what a Ray read task of that file needs)."""
        part = Coverage()
        part._spans[source] = list(self._spans.get(source, []))
        return part

    def rows(self, source: str | None = None) -> int:
        """Rows held (of one source, or of all)."""
        sources = [source] if source is not None else list(self._spans)
        return sum(b - a for s in sources for a, b, _ in self._spans.get(s, []))

    def sources(self) -> list[str]:
        return list(self._spans)
