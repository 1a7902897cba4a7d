"""The queue of texts waiting for a session: oldest first, across every caller.

Not thread-safe by itself: the scheduler holds its lock around every call. Pure bookkeeping
(no threads, no model), so its rules are testable on their own: the oldest text always goes in
the next chunk (nobody starves), packed with the waiting texts nearest to it in length.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator, Sequence

from .binpack import Chunk
from .jobs import Job, Piece

WINDOW = 1024  # pending texts considered per dispatch: bounds the packing work
Pack = Callable[[Sequence[int]], list[Chunk]]


class PendingQueue:
    """Pieces in arrival order, and how many tokens they hold."""

    def __init__(self) -> None:
        self._pieces: collections.deque[Piece] = collections.deque()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._pieces)

    def __iter__(self) -> Iterator[Piece]:
        return iter(self._pieces)

    def oldest_arrival(self) -> float:
        return self._pieces[0].arrived

    def add(self, job: Job, now: float) -> None:
        """Queue every text of ``job``."""
        for i, x in enumerate(job.ids):
            self._pieces.append(Piece(job, i, len(x), now))
            self.tokens += len(x)

    def purge(self, now: float, expire: Callable[[Job], None]) -> int:
        """Drop the pieces of finished jobs; a job past its deadline is handed to ``expire``
        first (which must mark it done). Returns how many pieces were dropped."""
        keep: collections.deque[Piece] = collections.deque()
        dropped = 0
        for p in self._pieces:
            job = p.job
            if not job.done and job.deadline is not None and now > job.deadline:
                expire(job)
            if job.done:
                dropped += 1
                self.tokens -= p.length
            else:
                keep.append(p)
        self._pieces = keep
        return dropped

    def take(self, pack: Pack, cross_request: bool = True) -> list[Piece]:
        """Remove and return the chunk holding the oldest piece, as ``pack`` groups the first
        ``WINDOW`` pieces (only the oldest job's, unless ``cross_request``)."""
        if cross_request:
            window = list(itertools.islice(self._pieces, WINDOW))
        else:  # batching within the oldest request only (the baseline benchmarks compare with)
            oldest = self._pieces[0].job
            window = [p for p in itertools.islice(self._pieces, WINDOW) if p.job is oldest]
        chosen = next(c for c in pack([p.length for p in window]) if 0 in c.indices)
        picked = [window[i] for i in chosen.indices]
        ids = {id(p) for p in picked}
        self._pieces = collections.deque(p for p in self._pieces if id(p) not in ids)
        self.tokens -= sum(p.length for p in picked)
        return picked

    def drain(self) -> list[Piece]:
        """Remove and return every piece."""
        leftover = list(self._pieces)
        self._pieces.clear()
        self.tokens = 0
        return leftover
