"""The queue of texts waiting for a session, across every caller, served in turns.

Not thread-safe by itself: the scheduler holds its lock around every call. Pure bookkeeping
(no threads, no model), so its rules are testable on their own.

Each chunk is built around one *anchor* text, packed with the waiting texts nearest to it in
length: the first waiting text of the request served longest ago, where a request never
served counts as served ``max(NEW_LEAD, requests waiting)`` turns before it arrived (ties:
the oldest). So requests take turns: a one-text query that arrives behind ingestion requests
goes ahead of every one of them served since the turn it counts as served at (with them in
turns, all of them: it waits for about one chunk, not for a batch), and nobody starves: a
request waits at most for the requests waiting when it was last served and those arriving
within that lead after, plus solo chunks (the canary's), which go first while the batch window
is open. (A request never served used to go ahead of every request served: under a steady
stream of new queries an ingestion request got no chunk at all, 1 text in 1,000 chunks beside 4
query clients that send again at once. A fixed lead of 8 turns left a query behind 40
ingestion requests in turns waiting 32 chunks: review.)
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from bgeserve.engine.binpack import Chunk
from bgeserve.engine.jobs import Job, Piece

WINDOW = 1024  # pending texts considered per dispatch: bounds the packing work
# Turns at least that a new request counts as served before it came (the module doc): under a
# stream of new one-text queries beside one ingestion request, that request still has about
# every (NEW_LEAD + queries waiting)th chunk.
NEW_LEAD = 8


class Pack(Protocol):
    """Packs texts of these lengths into chunks (``Packer.plan``); with ``until`` it may stop
    once the chunk holding that index is packed (the queue takes that chunk alone)."""

    def __call__(self, lengths: Sequence[int], *, until: int | None = None) -> list[Chunk]: ...


class Taken(list[Piece]):
    """A chunk taken off the queue: its pieces, and ``pad_to``, the length ``pack`` padded
    the chunk to (so the run pads it as it was packed, under the same cost model)."""

    def __init__(self, pieces: list[Piece], pad_to: int):
        super().__init__(pieces)
        self.pad_to = pad_to


class PendingQueue:
    """Pieces in arrival order, how many tokens they hold and the sum of their lengths'
    squares (what attention's share of their work grows with: ``service.admission``).

    Held job by job (each job's pieces arrive together, so the jobs in arrival order, each
    with its pieces in order, are the pieces in arrival order): a chunk costs work for the
    jobs waiting and the window it packs, not for every text queued. One deque of every piece
    cost each chunk a pass over the whole queue three times (the purge, the anchor, the
    removal of what was taken): with 4,000 texts waiting, QA measured 44 % of the worker's
    time outside ``session.run`` on a tiny model."""

    def __init__(self) -> None:
        # The jobs with pieces waiting, in arrival order (Job hashes by identity).
        self._jobs: dict[Job, collections.deque[Piece]] = {}
        self._count = 0
        self.tokens = 0
        self.squares = 0
        self._solo = 0  # pieces of solo jobs among them
        self._turn = 0  # chunks taken so far: a job's ``served`` is the turn it last had

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Piece]:
        return itertools.chain.from_iterable(list(self._jobs.values()))

    def waiting(self, job: Job) -> int:
        """How many of ``job``'s texts wait here."""
        return len(self._jobs.get(job, ()))

    def oldest_arrival(self) -> float:
        return next(iter(self._jobs.values()))[0].arrived

    def _removed(self, pieces: Sequence[Piece]) -> None:
        self._count -= len(pieces)
        self.tokens -= sum(p.length for p in pieces)
        self.squares -= sum(p.length * p.length for p in pieces)
        self._solo -= sum(p.job.solo for p in pieces)

    def add(self, job: Job, now: float) -> None:
        """Queue every text of ``job`` still to run."""
        if job not in self._jobs and not job.started:
            job.served = self._turn - max(NEW_LEAD, len(self._jobs))
        pieces = self._jobs.setdefault(job, collections.deque())
        for i in job.pending():
            n = len(job.ids[i])
            pieces.append(Piece(job, i, n, now))
            self._count += 1
            self.tokens += n
            self.squares += n * n
            self._solo += job.solo
        if not pieces:
            del self._jobs[job]

    def purge(self, now: float, expire: Callable[[Job], None]) -> int:
        """Drop the pieces of finished jobs; a job past its deadline is handed to ``expire``
        first (which must mark it done). Returns how many pieces were dropped."""
        dropped = 0
        for job in list(self._jobs):  # ``expire`` answers the job: it must not see a change
            if not job.done and job.deadline is not None and now > job.deadline:
                expire(job)
            pieces = self._jobs.pop(job, None) if job.done else None
            if pieces:  # (None: a callback of the answer purged it already)
                dropped += len(pieces)
                self._removed(pieces)
        return dropped

    def _anchor(self) -> Piece:
        """The first waiting piece of the job whose turn is oldest (ties: oldest job)."""
        best: Job | None = None
        for job in self._jobs:
            if best is None or job.served < best.served:
                best = job
        assert best is not None, "take() on an empty queue"
        return self._jobs[best][0]

    def take(self, pack: Pack, cross_request: bool = True) -> Taken:
        """Remove and return the chunk holding the anchor (see the module doc), as ``pack``
        groups the anchor with a window of up to ``WINDOW`` pieces (``_window``; only the
        anchor job's, unless ``cross_request``)."""
        anchor = self._anchor()
        if anchor.job.solo:  # a chunk of its own (the deep health check's canary)
            window = [anchor]
        elif cross_request:
            window = self._window()
        else:  # batching within one request only (the baseline benchmarks compare with)
            window = list(itertools.islice(self._jobs[anchor.job], WINDOW))
        at = next((i for i, p in enumerate(window) if p is anchor), None)
        if at is None:  # the anchor lies past the window: it joins it
            window.insert(0, anchor)
            at = 0
        chosen = next(c for c in pack([p.length for p in window], until=at)
                      if at in c.indices)
        picked = [window[i] for i in chosen.indices]
        self._remove(picked)
        return self._taken(picked, chosen.pad_to)

    def _window(self) -> list[Piece]:
        """Up to ``WINDOW`` pieces of the jobs not solo: each job's first ``WINDOW // jobs``,
        then the rest in arrival order. (The first ``WINDOW`` in arrival order left the queries
        behind a large request out: each ran alone, a run each, where they could share one.)
        Each job's share is the head of its deque, as ``_remove`` needs."""
        jobs = [job for job in self._jobs if not job.solo]
        share = max(1, WINDOW // max(1, len(jobs)))
        window: list[Piece] = []
        for job in jobs:
            window.extend(itertools.islice(self._jobs[job], share))
            if len(window) >= WINDOW:
                return window[:WINDOW]
        for job in jobs:
            room = WINDOW - len(window)
            if room <= 0:
                break
            window.extend(itertools.islice(self._jobs[job], share, share + room))
        return window

    def _remove(self, picked: list[Piece]) -> None:
        """Take ``picked`` out of their jobs' deques: each job's lie within its first
        ``WINDOW`` pieces (the window, or the anchor at its job's head), so only those are
        looked at."""
        by_job: dict[Job, set[int]] = {}
        for p in picked:
            by_job.setdefault(p.job, set()).add(id(p))
        for job, ids in by_job.items():
            pieces = self._jobs[job]
            kept: list[Piece] = []
            left = len(ids)
            while left:
                p = pieces.popleft()
                if id(p) in ids:
                    left -= 1
                else:
                    kept.append(p)
            pieces.extendleft(reversed(kept))
            if not pieces:
                del self._jobs[job]

    def take_solo(self, pack: Pack) -> Taken | None:
        """Remove and return the first waiting piece of a solo job as a chunk of its own
        (None: no solo job waits). It runs alone whatever arrives later, so the batch window
        the other pieces wait out is nothing it could gain from."""
        if not self._solo:
            return None
        job = next((j for j in self._jobs if j.solo), None)
        assert job is not None, f"bug: {self._solo} solo pieces counted, none queued"
        piece = self._jobs[job][0]
        self._remove([piece])
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
        leftover = list(self)
        self._jobs.clear()
        self._count = self.tokens = self.squares = self._solo = 0
        return leftover
