"""A caller's job and its pieces: one text each, queued, run in some chunk, written back in place.

A ``Job`` is one call's tokenized texts and the future its answer goes to; a ``Piece`` is one
of its texts as the queue sees it. Results are written into the job's slots by input index, so
the order chunks run in never shows; the future resolves once, with the whole result or the
first error. With an embedding cache (``Job.reuse``), texts found in it are filled in before the
job is queued, a text repeated within the job is computed once (its repeats get copies of the
results), and what is computed is stored for the next caller.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import numpy as np

from bgeserve.engine.cache import EmbeddingCache, Entry
from bgeserve.engine.heads import ChunkOutputs, colbert_rows, sparse_vector
from bgeserve.results import Embeddings, EmbedOptions


@dataclass(eq=False)
class Job:
    """One caller's texts (already tokenized) and the future its answer goes to."""

    ids: list[np.ndarray]
    truncated: np.ndarray
    options: EmbedOptions
    deadline: float | None = None
    request_id: str = ""
    future: Future = field(default_factory=Future)
    dense: np.ndarray | None = None
    sparse: list | None = None
    colbert: list | None = None
    remaining: int = 0
    done: bool = False
    submitted: float = 0.0
    started: float = 0.0  # monotonic seconds when a chunk first took its texts (0: never)
    room_wait: float = 0.0  # seconds it waited for room for its ColBERT output, before queued
    # The queue's turn a chunk last took its texts at; before the first, the turn it arrived
    # at less its lead (``queue.PendingQueue.add``; the queue ranks the next chunk's requests
    # by it).
    served: int = 0
    # The indices the queue must run (None: every text; ``reuse`` narrows it).
    todo: list[int] | None = None
    repeats: dict[int, list[int]] = field(default_factory=dict)  # index -> its later copies
    cache: EmbeddingCache | None = None  # where each computed text is stored
    solo: bool = False  # runs in chunks of its own, never packed with another job's texts

    def __post_init__(self) -> None:
        n = len(self.ids)
        self.remaining = n if self.todo is None else len(self.todo)
        self.sparse = [None] * n if self.options.sparse else None
        self.colbert = [None] * n if self.options.colbert else None

    def pending(self) -> list[int]:
        """The indices of the texts still to run."""
        return list(range(len(self.ids))) if self.todo is None else self.todo

    def result(self) -> Embeddings:
        return Embeddings(self.dense, self.sparse, self.colbert,
                          np.fromiter((len(x) for x in self.ids), np.int64, len(self.ids)),
                          self.truncated)

    def reuse(self, cache: EmbeddingCache | None) -> None:
        """Before queueing: answer the texts ``cache`` holds, fold the job's own repeats into
        their first occurrence (counted as the cache's ``repeats``), and store what is computed
        later in ``cache``. Without a cache, only the repeats are folded (a reranker's
        duplicate documents: their rows ran in other chunks and scored apart by ~1e-6, so a
        later copy could outrank its first)."""
        self.cache = cache
        first: dict[bytes, int] = {}  # ids -> the index that runs (or was cached) for them
        todo: list[int] = []
        for i, ids in enumerate(self.ids):
            key = ids.tobytes()
            seen = first.get(key)
            if seen is not None:
                self.repeats.setdefault(seen, []).append(i)
                continue
            first[key] = i
            entry = cache.get(ids, self.options) if cache is not None else None
            if entry is None:
                todo.append(i)
            else:
                self.fill(i, entry)
        running = set(todo)
        for seen, later in self.repeats.items():  # repeats of cached texts: copied now
            if seen not in running:
                for i in later:
                    self._copy(seen, i)
        self.repeats = {i: later for i, later in self.repeats.items() if i in running}
        self.todo = todo
        self.remaining = len(todo)
        if cache is not None:
            cache.count_repeats(len(self.ids) - len(first))

    def _dense_rows(self, width: int) -> np.ndarray:
        if self.dense is None:
            self.dense = np.empty((len(self.ids), width), dtype=np.float32)
        return self.dense

    def answer_from(self, index: int, entry: Entry) -> None:
        """Text ``index`` (and its repeats) answered by a cache entry after it was queued (the
        caller counts it done)."""
        self.fill(index, entry)
        for i in self.repeats.get(index, ()):
            self._copy(index, i)

    def fill(self, index: int, entry: Entry) -> None:
        """Store text ``index``'s results from a cache entry (copies: callers own theirs)."""
        if self.options.dense:
            assert entry.dense is not None
            self._dense_rows(entry.dense.shape[0])[index] = entry.dense
        if self.sparse is not None:
            assert entry.sparse is not None
            self.sparse[index] = (entry.sparse[0].copy(), entry.sparse[1].copy())
        if self.colbert is not None:
            assert entry.colbert is not None
            self.colbert[index] = entry.colbert.copy()

    def _copy(self, source: int, index: int) -> None:
        """Give text ``index`` (a repeat) the results of text ``source``."""
        if self.dense is not None and self.options.dense:
            self.dense[index] = self.dense[source]
        if self.sparse is not None:
            ids, weights = self.sparse[source]
            self.sparse[index] = (ids.copy(), weights.copy())
        if self.colbert is not None:
            self.colbert[index] = self.colbert[source].copy()

    def write(self, index: int, out: ChunkOutputs, row: int) -> None:
        """Store text ``index``'s results from row ``row`` of a chunk's outputs, and its
        repeats' (the caller counts it done)."""
        n = len(self.ids[index])
        # The chunk ran every output some job in it asked for, so this job's are there.
        dense = None
        if self.options.dense:
            assert out.dense is not None
            dense = self._dense_rows(out.dense.shape[1])[index]
            dense[:] = out.dense[row]
        if self.sparse is not None:
            assert out.sparse_weights is not None
            self.sparse[index] = sparse_vector(self.ids[index], out.sparse_weights[row, :n])
        if self.colbert is not None:
            assert out.colbert is not None
            self.colbert[index] = colbert_rows(out.colbert[row], n)
        for i in self.repeats.get(index, ()):
            self._copy(index, i)
        if self.cache is not None:
            self.cache.put(self.ids[index], dense=dense,
                           sparse=self.sparse[index] if self.sparse is not None else None,
                           colbert=self.colbert[index] if self.colbert is not None else None)


@dataclass(eq=False)
class Piece:
    """One text of a job, as the queue holds it."""

    job: Job
    index: int
    length: int
    arrived: float


@dataclass
class Folded:
    """A chunk as it runs once the cache had its say (``fold``): the pieces to run, the pieces
    repeating one of them (by row), and the pieces the cache now answers."""

    run: list[Piece]
    twins: dict[int, list[Piece]]
    cached: list[tuple[Piece, Entry]]


def fold(pieces: list[Piece]) -> Folded:
    """Just before a chunk runs, for pieces of jobs with a cache: a text cached since it was
    queued (its first copy ran in an earlier chunk) is answered from the cache, and a text
    that repeats another piece of this chunk (another request sent it too) runs once."""
    run: list[Piece] = []
    twins: dict[int, list[Piece]] = {}
    cached: list[tuple[Piece, Entry]] = []
    rows: dict[bytes, int] = {}
    for p in pieces:
        cache = p.job.cache
        if cache is None:
            run.append(p)
            continue
        ids = p.job.ids[p.index]
        entry = cache.get(ids, p.job.options, late=True)
        if entry is not None:
            cached.append((p, entry))
            continue
        key = ids.tobytes()
        row = rows.get(key)
        if row is None:
            rows[key] = len(run)
            run.append(p)
        else:
            twins.setdefault(row, []).append(p)
            cache.count_late_hits(1)
    return Folded(run, twins, cached)


def answer(future: Future, result: Embeddings | None = None,
           error: BaseException | None = None) -> None:
    """Resolve a job's future, unless its caller cancelled it meanwhile (asyncio's wrap_future
    cancels it when the awaiting task is cancelled): that must not raise in a worker, where it
    would skip the answers of the other jobs in the chunk."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
