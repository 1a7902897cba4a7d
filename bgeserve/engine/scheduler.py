"""Cross-request batching: one queue, N worker threads, each owning one session.

The scheduler is the single owner of the queue of pending texts (guarded by one condition).
An idle worker pulls the next chunk: the first waiting text of the request served longest ago
(requests take turns, so a query is not stuck behind an ingestion batch and nobody starves;
``pending``) packed with the pending texts nearest to it in length, from any request, under the
memory budget and the chunk caps (``binpack``). Results are written into each request's slots in input order and a
request's future resolves when its last text is done. Every job gets exactly one answer: a
result, or the error of the chunk it was in, or DeadlineExceeded / NotReady.

Workers are supervised: a worker thread that dies (a bug outside a chunk's own error handling)
has the texts it held failed with EngineFailed and is replaced by a new thread after a backoff
that grows while it keeps dying; a session whose run fails with a runtime error is closed and
reopened on the next chunk, since it may be left unusable. A worker whose session cannot be
opened, or that is waiting out its backoff, is not counted as live, so ``/health`` shows it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

from bgeserve.engine.binpack import Chunk, Fits, chunk_length, plan
from bgeserve.engine.forward import Forward, pad_chunk
from bgeserve.engine.heads import ChunkOutputs
from bgeserve.engine.jobs import Job, Piece, answer
from bgeserve.engine.queue import PendingQueue
from bgeserve.errors import (
    BgeServeError,
    DeadlineExceeded,
    EngineFailed,
    NotReady,
    OutOfMemory,
    Overloaded,
    TooLarge,
)
from bgeserve.tuning import memory

log = logging.getLogger("bgeserve.scheduler")
# Delay before a dead worker's replacement starts, doubling per consecutive death: a worker that
# dies at once every time must not spin a core or flood the log.
MIN_RESTART_DELAY_S = 0.1
MAX_RESTART_DELAY_S = 5.0


@dataclass(frozen=True)
class SchedulerConfig:
    """Plain values the scheduler needs (the service derives them from Settings)."""

    workers: int = 1
    max_chunk: int = 64
    # Measured on ORT CPU (docs/benchmarks.md): batching pays for short texts, is neutral from
    # ~256 tokens up; 1,024 padded tokens keeps both the gain and the latency of a chunk bounded.
    max_chunk_tokens: int | None = 1024
    min_fill: float = 0.75
    # Chunk lengths rounded up to a multiple of this (1 = none), never past pad_cap (the
    # engine sets its max_seq): GPUs pay for every shape they run for the first time.
    pad_multiple: int = 1
    pad_cap: int | None = None
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
        self._pending = PendingQueue()
        self._stopping = False
        self._flushing = False  # no batch window: no more work is coming (shutdown began)
        n = config.workers
        self._threads: list[threading.Thread | None] = [None] * n
        self._forwards: list[Forward | None] = [None] * n
        self._busy = [False] * n
        # Pieces a worker has taken off the queue and not yet answered: failed if it dies.
        self._holding: list[list[Piece]] = [[] for _ in range(n)]
        self._restarting = [False] * n  # a replacement thread is waiting out its backoff
        self._open_failed = [False] * n  # the last attempt to open the session failed
        self._deaths = [0] * n  # consecutive deaths: sets the restart backoff
        self.counters = collections.Counter()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, preload: bool = True) -> None:
        """Start the workers; with ``preload`` open every session first (errors propagate)."""
        if preload:
            for w in range(self.config.workers):
                self._forwards[w] = self._open_forward(w)
        for w in range(self.config.workers):
            self._spawn(w, delay=0.0)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop accepting, finish what is queued within ``timeout`` (None: all of it), fail
        the rest, unload."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        # Read under the lock each time: a worker that died just before ``_stopping`` was set
        # may have been replaced, and the replacement is the thread to wait for.
        for w in range(self.config.workers):
            with self._cond:
                t = self._threads[w]
            if t is not None:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._fail_pending(NotReady("the server is shutting down"))
        for w, t in enumerate(self._threads):
            if t is None or not t.is_alive():
                self._drop_session(w)

    def unload(self) -> None:
        """Close every worker's session (the next chunk reopens it)."""
        for w in range(self.config.workers):
            self._drop_session(w)

    def flush(self) -> None:
        """Run what is queued without waiting out the batch window (a shutdown has begun)."""
        with self._cond:
            self._flushing = True
            self._cond.notify_all()

    def abort(self, error: BgeServeError) -> int:
        """Stop taking work and answer every job still waiting with ``error``: queued texts
        are dropped, running chunks finish but their results are discarded. Returns how many
        jobs it answered. For a shutdown whose time is up: a late answer beats none."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            waiting = {id(p.job): p.job for p in self._pending}
            waiting.update((id(p.job), p.job) for held in self._holding for p in held)
            self._pending.drain()
            jobs = [job for job in waiting.values() if not job.done]
        for job in jobs:
            self._fail(job, error)
        return len(jobs)

    # -- submission ------------------------------------------------------------------------
    def room(self) -> int:
        """Tokens the queue may still take."""
        with self._cond:
            return self.config.max_queue_tokens - self._pending.tokens

    def check_room(self, tokens: int) -> None:
        """Raise Overloaded now if ``tokens`` more would not fit the queue (a caller with a
        lower bound of its tokens skips tokenizing a request that will be refused anyway)."""
        with self._cond:
            self._check_room(tokens)

    def _check_room(self, tokens: int) -> None:
        # An empty queue takes any job: a request bigger than the whole limit still runs.
        if self._pending and self._pending.tokens + tokens > self.config.max_queue_tokens:
            self.counters["rejected"] += 1
            raise Overloaded(
                f"queue full ({self._pending.tokens} tokens waiting, limit "
                f"BGE_M3_MAX_QUEUE_TOKENS={self.config.max_queue_tokens}); retry shortly",
                retry_after=1.0)

    def submit(self, job: Job) -> Future:
        """Queue a job's texts; raises Overloaded when the queue is full, NotReady if stopping."""
        tokens = sum(len(x) for x in job.ids)
        now = time.monotonic()
        with self._cond:
            if self._stopping:
                raise NotReady("the server is shutting down")
            if self._no_worker_left():
                raise NotReady("no worker is left to run the model (see /health)")
            self._check_room(tokens)
            job.submitted = now
            if not job.ids:
                job.done = True
                answer(job.future, result=job.result())
                return job.future
            self._pending.add(job, now)
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
            answer(job.future, error=error)
        else:
            job.future.cancel()

    def set_max_chunk_tokens(self, tokens: int) -> None:
        """Padded tokens per run from the next chunk on (chunks already taken keep theirs)."""
        with self._cond:
            self.config = replace(self.config, max_chunk_tokens=tokens)

    # -- state -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Workers and queue. ``live``: workers able to take work — thread running, not waiting
        to restart, and its session not known to fail to open."""
        with self._cond:
            return {
                "total": self.config.workers,
                "live": sum(self._live(w) for w in range(self.config.workers)),
                "loaded": sum(f is not None for f in self._forwards),
                "busy": sum(self._busy),
                "queue_texts": len(self._pending),
                "queue_tokens": self._pending.tokens,
            }

    def _live(self, w: int) -> bool:
        t = self._threads[w]
        return (t is not None and t.is_alive() and not self._restarting[w]
                and not self._open_failed[w])

    def _no_worker_left(self) -> bool:
        """Started, and every worker thread but the caller's has ended (a replacement failed
        to start): nothing would ever take work off the queue."""
        threads = [t for t in self._threads if t is not None]
        me = threading.current_thread()
        return bool(threads) and not any(t.is_alive() and t is not me for t in threads)

    # -- internals -------------------------------------------------------------------------
    def _purge(self) -> int:
        """Remove pieces of finished or expired jobs from the queue; fail the expired jobs.

        The condition's lock is re-entrant, so this may be called with it held.
        """
        with self._cond:
            return self._pending.purge(time.monotonic(), self._expire)

    def _expire(self, job: Job) -> None:
        self.counters["deadline_exceeded"] += 1
        self._fail(job, DeadlineExceeded(
            "the request did not finish within BGE_M3_REQUEST_TIMEOUT_SECS"))

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
                    wait = (self._pending.oldest_arrival() + self.config.batch_delay_s
                            - time.monotonic())
                    if wait > 0 and not (self._stopping or self._flushing):
                        self._cond.wait(wait)
                        continue
                    # Held until answered, under the same lock: if this worker dies, the pieces
                    # are neither lost nor left waiting in the queue.
                    self._holding[worker] = chunk = self._take_chunk()
                    if self._pending:
                        # submit() woke one worker; pass the rest on, so one big request
                        # runs on every idle worker, not only the first.
                        self._cond.notify()
                    return chunk
                if not self._cond.wait(idle) and self._forwards[worker] is not None:
                    return "unload"

    def _take_chunk(self) -> list[Piece]:
        """The next chunk: the anchor text of the request served longest ago, with its
        length neighbours (``PendingQueue.take``; called with the lock held)."""
        return self._pending.take(self._pack, self.config.cross_request)

    def _pack(self, lengths: Sequence[int]) -> list[Chunk]:
        c = self.config
        return plan(lengths, fits=self._fits, max_chunk=c.max_chunk,
                    max_tokens=c.max_chunk_tokens, min_fill=c.min_fill,
                    pad_multiple=c.pad_multiple, pad_cap=c.pad_cap)

    # -- worker threads and supervision -----------------------------------------------------
    def _spawn(self, w: int, delay: float) -> None:
        """Start worker ``w``'s thread (called with the lock held, or before any thread runs)."""
        t = threading.Thread(target=self._supervised, args=(w, delay),
                             name=f"bgeserve-worker-{w}", daemon=True)
        self._threads[w] = t
        t.start()

    def _supervised(self, w: int, delay: float) -> None:
        """A worker thread's body: the worker loop, and whatever ends it gets cleaned up."""
        try:
            if delay:
                with self._cond:  # woken early by stop(), which then needs this thread to drain
                    self._cond.wait_for(lambda: self._stopping, delay)
            with self._cond:
                self._restarting[w] = False
            self._worker(w)
        except BaseException:  # whatever killed the loop, its callers must still get an answer
            log.exception("worker %d died", w)
        finally:
            self._after_exit(w)

    def _after_exit(self, w: int) -> None:
        """Unless the scheduler is stopping, replace the exiting worker; fail what it held."""
        with self._cond:
            held, self._holding[w] = self._holding[w], []
            self._busy[w] = False
            died = not self._stopping  # the loop only returns by itself when stopping
        try:
            if died:  # first: whoever gets the error below sees the worker already replaced
                self._restart(w)
        finally:
            for p in held:
                self._fail(p.job, EngineFailed(f"worker {w} died while running this text; "
                                               "retry"))

    def _restart(self, w: int) -> None:
        """Replace dead worker ``w`` with a new thread, after a backoff; its session reopens on
        the next chunk (the death may have left it in any state)."""
        self._drop_session(w)
        with self._cond:
            if self._stopping:
                return
            self._deaths[w] += 1
            delay = min(MAX_RESTART_DELAY_S,
                        MIN_RESTART_DELAY_S * 2 ** min(self._deaths[w] - 1, 16))
            self.counters["worker_restarts"] += 1
            self._restarting[w] = True
            try:
                self._spawn(w, delay)
            except Exception:  # e.g. "can't start new thread": stats and /health show it
                log.exception("worker %d could not be restarted", w)
                self._restarting[w] = False
            else:
                log.warning("worker %d died; restarting it in %.1fs", w, delay)
                return
            gone = self._no_worker_left()
        if gone:  # nobody is left to run what waits: answer it now rather than at its deadline
            self._fail_pending(NotReady("no worker is left to run the model (see /health)"))

    def _worker(self, w: int) -> None:
        while True:
            chunk = self._next_chunk(w)
            if chunk is None:
                return
            if chunk == "unload":
                if self._drop_session(w):
                    log.info("worker %d idle for %.0fs: session unloaded", w,
                             self.config.idle_timeout_s)
                continue
            self._busy[w] = True
            try:
                self._execute(w, chunk)  # type: ignore[arg-type]
            except Exception as exc:  # a bug must fail the chunk, never hang its callers
                log.exception("worker %d crashed on a chunk", w)
                self._reopen_later(w, f"unexpected error {exc!r}")
                for p in chunk:  # type: ignore[union-attr]
                    self._fail(p.job, EngineFailed(f"internal error: {exc!r}"))
            # Not in a ``finally``: if the thread dies here, _after_exit fails what it held.
            with self._cond:
                self._busy[w] = False
                self._holding[w] = []

    def _execute(self, w: int, pieces: list[Piece]) -> None:
        self._run(w, [p for p in pieces if not p.job.done])

    def _session(self, w: int, pieces: list[Piece]) -> Forward | None:
        """Worker ``w``'s session, opened if it is not; None (``pieces`` failed) if it cannot
        be. A failed open marks the worker not live until an open succeeds."""
        fwd = self._forwards[w]
        if fwd is not None:
            return fwd
        try:
            fwd = self._open_forward(w)
        except Exception as exc:
            log.error("worker %d: the session failed to open: %s", w, exc,
                      exc_info=not isinstance(exc, BgeServeError))
            with self._cond:
                self._open_failed[w] = True
            error = exc if isinstance(exc, BgeServeError) else EngineFailed(
                f"could not open the session: {exc!r}")
            for p in pieces:
                self._fail(p.job, error)
            return None
        with self._cond:
            self._forwards[w] = fwd
            self._open_failed[w] = False
        log.info("worker %d: session loaded", w)
        return fwd

    def _drop_session(self, w: int) -> bool:
        """Close worker ``w``'s session if it has one. A failing close is logged, not raised:
        it must not take the worker down, and the session is dropped either way."""
        with self._cond:
            fwd, self._forwards[w] = self._forwards[w], None
        if fwd is None:
            return False
        try:
            fwd.close()
        except Exception:
            log.exception("worker %d: closing its session failed", w)
        # Hand the freed weights and arena back to the OS: glibc keeps them in the heap of the
        # thread that loaded them, where the next load (often on another thread) cannot reuse
        # them. Measured, full-size int8: 570 MiB left after an idle unload, and the reload
        # peaked 354 MiB above the first load, past what the budget counted (a 2.75 GiB
        # container was OOM-killed); trimmed, 214 MiB left and the reload matches the first.
        memory.trim_heap()
        return True

    def _reopen_later(self, w: int, why: str) -> None:
        """Drop a session that failed at run time (it may stay broken: a poisoned CUDA context,
        a corrupted arena); the next chunk opens a fresh one. Counted as a restart."""
        log.warning("worker %d: %s; its session will be reopened", w, why)
        self._drop_session(w)
        with self._cond:
            self.counters["worker_restarts"] += 1

    def _fail_pending(self, error: BgeServeError) -> None:
        with self._cond:
            leftover = self._pending.drain()
        for piece in leftover:
            self._fail(piece.job, error)

    # -- running chunks ----------------------------------------------------------------------
    def _run(self, w: int, pieces: list[Piece]) -> None:
        if not pieces:
            return
        fwd = self._session(w, pieces)  # per call: an OOM split's halves may need a fresh one
        if fwd is None:
            return
        pad_to = chunk_length(len(pieces), max(p.length for p in pieces), fits=self._fits,
                              multiple=self.config.pad_multiple, cap=self.config.pad_cap)
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
            if isinstance(exc, EngineFailed):  # the runtime failed, not the input
                self._reopen_later(w, f"session.run failed: {exc}")
            for p in pieces:
                self._fail(p.job, exc)
            return
        seconds = time.perf_counter() - started
        self._deaths[w] = 0  # it works again: the next death starts the backoff afresh
        self._on_chunk(ChunkStats(w, len(pieces), pad_to, sum(p.length for p in pieces),
                                  seconds))
        self._deliver(pieces, out)

    def _deliver(self, pieces: list[Piece], out: ChunkOutputs) -> None:
        finished: list[Job] = []
        for row, p in enumerate(pieces):
            job = p.job
            if job.done:
                continue
            job.write(p.index, out, row)
            with self._cond:
                job.remaining -= 1
                if job.remaining == 0 and not job.done:
                    job.done = True
                    finished.append(job)
        for job in finished:
            answer(job.future, result=job.result())

    def _fail(self, job: Job, error: BaseException) -> None:
        with self._cond:
            if job.done:
                return
            job.done = True
        answer(job.future, error=error)

