"""Cross-request batching: one queue, N worker threads, each owning one session.

The scheduler is the single owner of the queue of pending texts (guarded by one condition).
An idle worker pulls the next chunk: the oldest pending text (so nobody starves) packed with
the pending texts nearest to it in length, from any request, under the memory budget and the
chunk caps (``binpack``). Results are written into each request's slots in input order and a
request's future resolves when its last text is done. Every job gets exactly one answer: a
result, or the error of the chunk it was in, or DeadlineExceeded / NotReady.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from .binpack import Fits, plan
from .errors import (BgeServeError, DeadlineExceeded, EngineFailed, NotReady, OutOfMemory,
                     Overloaded, TooLarge)
from .forward import Forward, pad_chunk
from .heads import colbert_rows, sparse_vector
from .results import EmbedOptions, Embeddings

log = logging.getLogger("bgeserve.scheduler")
WINDOW = 1024  # pending texts considered per dispatch: bounds the packing work


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

    def __post_init__(self) -> None:
        n = len(self.ids)
        self.remaining = n
        self.sparse = [None] * n if self.options.sparse else None
        self.colbert = [None] * n if self.options.colbert else None

    def result(self) -> Embeddings:
        return Embeddings(self.dense, self.sparse, self.colbert,
                          np.fromiter((len(x) for x in self.ids), np.int64, len(self.ids)),
                          self.truncated)


@dataclass(eq=False)
class Piece:
    job: Job
    index: int
    length: int
    arrived: float


@dataclass(frozen=True)
class SchedulerConfig:
    """Plain values the scheduler needs (the service derives them from Settings)."""

    workers: int = 1
    max_chunk: int = 64
    # Measured on ORT CPU (docs/benchmarks.md): batching pays for short texts, is neutral from
    # ~256 tokens up; 1,024 padded tokens keeps both the gain and the latency of a chunk bounded.
    max_chunk_tokens: int | None = 1024
    min_fill: float = 0.75
    batch_delay_s: float = 0.0
    cross_request: bool = True
    max_queue_tokens: int = 1_000_000
    idle_timeout_s: float = 0.0


@dataclass
class ChunkStats:
    """What one ``session.run`` did (for metrics and logs)."""

    worker: int
    batch: int
    pad_to: int
    real_tokens: int
    seconds: float


class Scheduler:
    """Owns the pending queue and the worker threads."""

    def __init__(self, open_forward: Callable[[int], Forward], fits: Fits, config: SchedulerConfig,
                 on_chunk: Callable[[ChunkStats], None] | None = None):
        self._open_forward = open_forward
        self._fits = fits
        self.config = config
        self._on_chunk = on_chunk or (lambda stats: None)
        self._cond = threading.Condition(threading.RLock())
        self._pending: collections.deque[Piece] = collections.deque()
        self._pending_tokens = 0
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._forwards: list[Forward | None] = [None] * config.workers
        self._busy = [False] * config.workers
        self.counters = collections.Counter()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, preload: bool = True) -> None:
        """Start the workers; with ``preload`` open every session first (errors propagate)."""
        if preload:
            for w in range(self.config.workers):
                self._forwards[w] = self._open_forward(w)
        for w in range(self.config.workers):
            t = threading.Thread(target=self._worker, args=(w,), name=f"bgeserve-worker-{w}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, finish what is queued within ``timeout``, fail the rest, unload."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            leftover = list(self._pending)
            self._pending.clear()
            self._pending_tokens = 0
        for piece in leftover:
            self._fail(piece.job, NotReady("the server is shutting down"))
        for w, fwd in enumerate(self._forwards):
            if fwd is not None and not self._threads[w].is_alive():
                fwd.close()
                self._forwards[w] = None

    # -- submission ------------------------------------------------------------------------
    def submit(self, job: Job) -> Future:
        """Queue a job's texts; raises Overloaded when the queue is full, NotReady if stopping."""
        tokens = sum(len(x) for x in job.ids)
        now = time.monotonic()
        with self._cond:
            if self._stopping:
                raise NotReady("the server is shutting down")
            if self._pending and self._pending_tokens + tokens > self.config.max_queue_tokens:
                self.counters["rejected"] += 1
                raise Overloaded(
                    f"queue full ({self._pending_tokens} tokens waiting, limit "
                    f"BGE_M3_MAX_QUEUE_TOKENS={self.config.max_queue_tokens}); retry shortly",
                    retry_after=1.0)
            job.submitted = now
            if not job.ids:
                job.done = True
                job.future.set_result(job.result())
                return job.future
            for i, x in enumerate(job.ids):
                self._pending.append(Piece(job, i, len(x), now))
            self._pending_tokens += tokens
            self._cond.notify()
        return job.future

    def cancel(self, job: Job, error: BgeServeError | None = None) -> None:
        """Drop a job's texts that have not started; its future gets ``error`` (or is cancelled)."""
        with self._cond:
            if job.done:
                return
            job.done = True
            # Count only this job's texts: the purge also drops other jobs' expired ones.
            dropped = sum(p.job is job for p in self._pending)
            self._purge()
        self.counters["cancelled_texts"] += dropped
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.cancel()

    # -- state -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "total": self.config.workers,
                "live": sum(t.is_alive() for t in self._threads),
                "loaded": sum(f is not None for f in self._forwards),
                "busy": sum(self._busy),
                "queue_texts": len(self._pending),
                "queue_tokens": self._pending_tokens,
            }

    # -- internals -------------------------------------------------------------------------
    def _purge(self) -> int:
        """Remove pieces of finished or expired jobs from the queue; fail the expired jobs.

        The condition's lock is re-entrant, so this may be called with it held.
        """
        now = time.monotonic()
        with self._cond:
            keep: collections.deque[Piece] = collections.deque()
            dropped = 0
            for p in self._pending:
                job = p.job
                if not job.done and job.deadline is not None and now > job.deadline:
                    self.counters["deadline_exceeded"] += 1
                    self._fail(job, DeadlineExceeded(
                        "the request did not finish within BGE_M3_REQUEST_TIMEOUT_SECS"))
                if job.done:
                    dropped += 1
                    self._pending_tokens -= p.length
                else:
                    keep.append(p)
            self._pending = keep
        return dropped

    def _next_chunk(self, worker: int) -> list[Piece] | None | str:
        """Block until there is a chunk for this worker; None = stop; "unload" = idle too long."""
        idle = self.config.idle_timeout_s or None
        with self._cond:
            while True:
                if self._stopping and not self._pending:
                    return None
                if self._pending:
                    self._purge()
                    if not self._pending:
                        continue
                    wait = self._pending[0].arrived + self.config.batch_delay_s - time.monotonic()
                    if wait > 0 and not self._stopping:
                        self._cond.wait(wait)
                        continue
                    return self._take_chunk()
                if not self._cond.wait(idle) and self._forwards[worker] is not None:
                    return "unload"

    def _take_chunk(self) -> list[Piece]:
        """The chunk holding the oldest pending text (called with the lock held)."""
        if self.config.cross_request:
            window = list(itertools.islice(self._pending, WINDOW))
        else:  # batching within the oldest request only (the baseline benchmarks compare with)
            oldest = self._pending[0].job
            window = [p for p in itertools.islice(self._pending, WINDOW) if p.job is oldest]
        chunks = plan([p.length for p in window], fits=self._fits,
                      max_chunk=self.config.max_chunk, max_tokens=self.config.max_chunk_tokens,
                      min_fill=self.config.min_fill)
        chosen = next(c for c in chunks if 0 in c.indices)
        picked = [window[i] for i in chosen.indices]
        ids = {id(p) for p in picked}
        self._pending = collections.deque(p for p in self._pending if id(p) not in ids)
        self._pending_tokens -= sum(p.length for p in picked)
        return picked

    def _worker(self, w: int) -> None:
        while True:
            chunk = self._next_chunk(w)
            if chunk is None:
                return
            if chunk == "unload":
                fwd, self._forwards[w] = self._forwards[w], None
                if fwd is not None:
                    fwd.close()
                    log.info("worker %d idle for %.0fs: session unloaded", w,
                             self.config.idle_timeout_s)
                continue
            self._busy[w] = True
            try:
                self._execute(w, chunk)  # type: ignore[arg-type]
            except BaseException as exc:  # a bug must fail the chunk, never hang its callers
                log.exception("worker %d crashed on a chunk", w)
                for p in chunk:  # type: ignore[union-attr]
                    self._fail(p.job, EngineFailed(f"internal error: {exc!r}"))
            finally:
                self._busy[w] = False

    def _execute(self, w: int, pieces: list[Piece]) -> None:
        if self._forwards[w] is None:
            try:
                self._forwards[w] = self._open_forward(w)
                log.info("worker %d: session loaded", w)
            except BgeServeError as exc:
                for p in pieces:
                    self._fail(p.job, exc)
                return
        self._run(w, [p for p in pieces if not p.job.done])

    def _run(self, w: int, pieces: list[Piece]) -> None:
        if not pieces:
            return
        fwd = self._forwards[w]
        assert fwd is not None
        pad_to = max(p.length for p in pieces)
        ids, mask = pad_chunk([p.job.ids[p.index] for p in pieces], pad_to)
        opts = [p.job.options for p in pieces]
        started = time.perf_counter()
        try:
            out = fwd.run(ids, mask, dense=any(o.dense for o in opts),
                          sparse=any(o.sparse for o in opts),
                          colbert=any(o.colbert for o in opts))
        except OutOfMemory as exc:
            self.counters["oom_splits"] += 1
            if len(pieces) > 1:
                half = len(pieces) // 2
                log.warning("chunk %dx%d ran out of memory; splitting", len(pieces), pad_to)
                self._run(w, pieces[:half])
                self._run(w, pieces[half:])
            else:
                p = pieces[0]
                self._fail(p.job, TooLarge(
                    f"input[{p.index}] ({p.length} tokens) ran out of memory even alone; "
                    f"lower BGE_M3_MAX_SEQ_LENGTH or give the server more memory: {exc}",
                    param=f"input[{p.index}]"))
            return
        except BgeServeError as exc:
            for p in pieces:
                self._fail(p.job, exc)
            return
        seconds = time.perf_counter() - started
        self._on_chunk(ChunkStats(w, len(pieces), pad_to, sum(p.length for p in pieces),
                                  seconds))
        self._deliver(pieces, out)

    def _deliver(self, pieces: list[Piece], out) -> None:
        finished: list[Job] = []
        for row, p in enumerate(pieces):
            job, n = p.job, p.length
            if job.done:
                continue
            if job.options.dense:
                if job.dense is None:
                    job.dense = np.empty((len(job.ids), out.dense.shape[1]), dtype=np.float32)
                job.dense[p.index] = out.dense[row]
            if job.options.sparse:
                job.sparse[p.index] = sparse_vector(job.ids[p.index],  # type: ignore[index]
                                                    out.sparse_weights[row, :n])
            if job.options.colbert:
                job.colbert[p.index] = colbert_rows(out.colbert[row], n)  # type: ignore[index]
            with self._cond:
                job.remaining -= 1
                if job.remaining == 0 and not job.done:
                    job.done = True
                    finished.append(job)
        for job in finished:
            job.future.set_result(job.result())

    def _fail(self, job: Job, error: BaseException) -> None:
        with self._cond:
            if job.done:
                return
            job.done = True
        job.future.set_exception(error)
