"""A caller's job and its pieces: one text each, queued, run in some chunk, written back in place.

A ``Job`` is one call's tokenized texts and the future its answer goes to; a ``Piece`` is one
of its texts as the queue sees it. Results are written into the job's slots by input index, so
the order chunks run in never shows; the future resolves once, with the whole result or the
first error.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import numpy as np

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
    served: int = 0  # the queue's turn when a chunk last took its texts (0: never)
    solo: bool = False  # runs in chunks of its own, never packed with another job's texts

    def __post_init__(self) -> None:
        n = len(self.ids)
        self.remaining = n
        self.sparse = [None] * n if self.options.sparse else None
        self.colbert = [None] * n if self.options.colbert else None

    def result(self) -> Embeddings:
        return Embeddings(self.dense, self.sparse, self.colbert,
                          np.fromiter((len(x) for x in self.ids), np.int64, len(self.ids)),
                          self.truncated)

    def write(self, index: int, out: ChunkOutputs, row: int) -> None:
        """Store text ``index``'s results from row ``row`` of a chunk's outputs (the caller
        counts it done)."""
        n = len(self.ids[index])
        # The chunk ran every output some job in it asked for, so this job's are there.
        if self.options.dense:
            assert out.dense is not None
            if self.dense is None:
                self.dense = np.empty((len(self.ids), out.dense.shape[1]), dtype=np.float32)
            self.dense[index] = out.dense[row]
        if self.sparse is not None:
            assert out.sparse_weights is not None
            self.sparse[index] = sparse_vector(self.ids[index], out.sparse_weights[row, :n])
        if self.colbert is not None:
            assert out.colbert is not None
            self.colbert[index] = colbert_rows(out.colbert[row], n)


@dataclass(eq=False)
class Piece:
    """One text of a job, as the queue holds it."""

    job: Job
    index: int
    length: int
    arrived: float


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
