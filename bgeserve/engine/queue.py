"""The queue of texts waiting for a session, across every caller, served in turns.

Not thread-safe by itself: the scheduler holds its lock around every call. Pure bookkeeping
(no threads, no model), so its rules are testable on their own.

Each chunk is built around one *anchor* text, packed with the waiting texts nearest to it in
length: the first waiting text of the request served longest ago (a request never served
yet comes first, oldest first). So requests take turns: a one-text query that arrives behind
a 256-text ingestion batch waits for one chunk, not for the whole batch, and nobody starves
(every request with texts waiting gets a chunk within as many chunks as there are requests,
plus solo chunks — the canary's — which go first while the batch window is open).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterator, Sequence

from bgeserve.engine.binpack import Chunk
from bgeserve.engine.jobs import Job, Piece

WINDOW = 1024  # pending texts considered per dispatch: bounds the packing work
Pack = Callable[[Sequence[int]], list[Chunk]]


class Taken(list[Piece]):
    """A chunk taken off the queue: its pieces, and ``pad_to``, the length ``pack`` padded
    the chunk to (so the run pads it as it was packed, under the same cost model)."""

    def __init__(self, pieces: list[Piece], pad_to: int):
        super().__init__(pieces)
        self.pad_to = pad_to


class PendingQueue:
    """Pieces in arrival order, and how many tokens they hold."""

    def __init__(self) -> None:
        self._pieces: collections.deque[Piece] = collections.deque()
        self.tokens = 0
        self._solo = 0  # pieces of solo jobs among them
        self._turn = 0  # chunks taken so far: a job's ``served`` is the turn it last had

    def __len__(self) -> int:
        return len(self._pieces)

    def __iter__(self) -> Iterator[Piece]:
        return iter(self._pieces)

    def oldest_arrival(self) -> float:
        return self._pieces[0].arrived

    def _removed(self, pieces: Sequence[Piece]) -> None:
        self.tokens -= sum(p.length for p in pieces)
        self._solo -= sum(p.job.solo for p in pieces)

    def add(self, job: Job, now: float) -> None:
        """Queue every text of ``job`` still to run."""
        for i in job.pending():
            n = len(job.ids[i])
            self._pieces.append(Piece(job, i, n, now))
            self.tokens += n
            self._solo += job.solo

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
                self._removed([p])
            else:
                keep.append(p)
        self._pieces = keep
        return dropped

    def _anchor(self) -> Piece:
        """The first waiting piece of the job whose last turn is oldest (ties: oldest job)."""
        best: Piece | None = None
        seen: set[int] = set()
        for p in self._pieces:
            if id(p.job) in seen:
                continue
            seen.add(id(p.job))
            if best is None or p.job.served < best.job.served:
                best = p
                if best.job.served == 0:  # never served: nobody comes before it
                    break
        assert best is not None, "take() on an empty queue"
        return best

    def take(self, pack: Pack, cross_request: bool = True) -> Taken:
        """Remove and return the chunk holding the anchor (see the module doc), as ``pack``
        groups the anchor with the first ``WINDOW`` pieces (only the anchor job's, unless
        ``cross_request``)."""
        anchor = self._anchor()
        head = itertools.islice(self._pieces, WINDOW)
        if anchor.job.solo:  # a chunk of its own (the deep health check's canary)
            window = [anchor]
        elif cross_request:
            window = [p for p in head if not p.job.solo]
        else:  # batching within one request only (the baseline benchmarks compare with)
            window = [p for p in head if p.job is anchor.job]
        at = next((i for i, p in enumerate(window) if p is anchor), None)
        if at is None:  # the anchor lies past the window: it joins it
            window.insert(0, anchor)
            at = 0
        chosen = next(c for c in pack([p.length for p in window]) if at in c.indices)
        picked = [window[i] for i in chosen.indices]
        ids = {id(p) for p in picked}
        self._pieces = collections.deque(p for p in self._pieces if id(p) not in ids)
        return self._taken(picked, chosen.pad_to)

    def take_solo(self, pack: Pack) -> Taken | None:
        """Remove and return the first waiting piece of a solo job as a chunk of its own
        (None: no solo job waits). It runs alone whatever arrives later, so the batch window
        the other pieces wait out is nothing it could gain from."""
        if not self._solo:
            return None
        piece = next((p for p in self._pieces if p.job.solo), None)
        assert piece is not None, f"bug: {self._solo} solo pieces counted, none queued"
        self._pieces.remove(piece)
        return self._taken([piece], pack([piece.length])[0].pad_to)

    def _taken(self, picked: list[Piece], pad_to: int) -> Taken:
        self._removed(picked)
        self._turn += 1
        now = time.monotonic()
        for p in picked:
            p.job.served = self._turn
            p.job.started = p.job.started or now
        return Taken(picked, pad_to)

    def drain(self) -> list[Piece]:
        """Remove and return every piece."""
        leftover = list(self._pieces)
        self._pieces.clear()
        self.tokens = self._solo = 0
        return leftover
