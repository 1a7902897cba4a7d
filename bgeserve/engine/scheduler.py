"""Cross-request batching: one queue, N worker threads, each owning one session.

The scheduler is the single owner of the queue of pending texts (guarded by one condition).
An idle worker pulls the next chunk: the first waiting text of the request served longest ago
(requests take turns, so a query is not stuck behind an ingestion batch and nobody starves;
``queue``) packed with the pending texts nearest to it in length, from any request, under the
memory budget and the chunk caps (the ``Packer``). Results are written into each request's
slots in input order and a request's future resolves when its last text is done. Every job
gets exactly one answer: a result, or the error of the chunk it was in, or DeadlineExceeded /
NotReady. The worker threads and their supervision are in ``workers``.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from bgeserve.engine.forward import Forward, pad_chunk
from bgeserve.engine.heads import ChunkOutputs
from bgeserve.engine.jobs import Job, Piece, answer, fold
from bgeserve.engine.names import SettingNames
from bgeserve.engine.packing import Cost, Packer, Rules
from bgeserve.engine.queue import PendingQueue, Taken
from bgeserve.engine.shapes import RunShapes
from bgeserve.engine.workers import Running, Workers
from bgeserve.errors import (
    BgeServeError,
    DeadlineExceeded,
    EngineFailed,
    NotReady,
    OutOfMemory,
    Overloaded,
    TooLarge,
)
from bgeserve.tuning.audit import WorkspaceAudit

log = logging.getLogger("bgeserve.scheduler")


def _nothing_run(tokens: int) -> bool:
    """``RunShapes.known`` of a session not opened yet."""
    return False


SHUTTING_DOWN = "the engine is shutting down (the server is stopping, or Engine.close() was called)"


UNBOUNDED_QUEUE = 1 << 62


@dataclass(frozen=True)
class SchedulerConfig:
    """Plain values the scheduler needs (the service derives them from Settings); the chunk
    caps are the packer's starting rules (``rules``)."""

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
    # The server's queue is bounded (BGE_M3_MAX_QUEUE_TOKENS: a full one answers 429); an
    # in-process caller has no one to retry for it, so its jobs wait their turn (QA: 3 of 4
    # threads embedding long documents were refused "queue full; retry shortly").
    max_queue_tokens: int = UNBOUNDED_QUEUE
    idle_timeout_s: float = 0.0
    names: SettingNames = field(default_factory=SettingNames)  # what errors tell to change

    @property
    def rules(self) -> Rules:
        return Rules(self.max_chunk, self.max_chunk_tokens, self.min_fill, self.pad_multiple,
                     self.pad_cap)


@dataclass
class ChunkStats:
    """What one ``session.run`` did (for metrics and logs)."""

    worker: int
    batch: int
    pad_to: int
    real_tokens: int
    seconds: float
    # The sum of its texts' lengths squared: with ``real_tokens``, what its work was
    # (attention's grows with each text's length; ``service.admission.work``).
    squares: int = 0
    solo: bool = False  # a solo job's chunk (the canary's): one short text, alone


class Scheduler(Workers):
    """Owns the pending queue and the worker threads.

    ``cost``: the memory cost model chunks are packed under (None: no limit); the engine swaps
    it, and the chunk budget, through ``packer``.
    """

    def __init__(self, open_forward: Callable[[int], Forward], cost: Cost | None,
                 config: SchedulerConfig,
                 on_chunk: Callable[[ChunkStats], None] | None = None):
        self._open_forward = open_forward
        self.packer = Packer(config.rules, cost)
        self.config = config
        self._on_chunk = on_chunk or (lambda stats: None)
        self._cond = threading.Condition(threading.RLock())
        self._pending = PendingQueue()
        self._stopping = False
        self._flushing = False  # no batch window: no more work is coming (shutdown began)
        self._window_closed_at = -math.inf  # what arrived by then has no window left
        n = config.workers
        self._threads = [None] * n
        self._forwards = [None] * n
        self._running: list[Running | None] = [None] * n
        self._holding = [[] for _ in range(n)]
        self._restarting = [False] * n
        self._open_failed = [False] * n
        # Whose session was unloaded for idleness (not dropped after a failure): /health/deep
        # answers "idle" without loading it only when every worker's was.
        self._idle_unloaded = [False] * n
        # When each worker last finished a chunk of real work: the idle timer's start. A solo
        # chunk (the /health/deep canary) is not work: a liveness probe every 20 s kept the
        # sessions loaded for good past BGE_M3_IDLE_TIMEOUT_SECS.
        self._last_work = [time.monotonic()] * n
        self._deaths = [0] * n
        self._pid = os.getpid()
        # What each worker's session has run (engine/shapes.py), with a weak reference to the
        # session it is for: an unloaded session must not be kept alive by it.
        self._shapes: list[tuple[weakref.ref[Forward], RunShapes] | None] = [None] * n
        self.counters = collections.Counter()
        self.audit: WorkspaceAudit | None = None  # sampled chunks against the cost model

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, preload: bool = True) -> None:
        """Start the workers; with ``preload`` open every session first (errors propagate)."""
        if preload:
            for w in range(self.config.workers):
                self._forwards[w] = self._open_forward(w)
        self._pid = os.getpid()  # the process whose threads run the work (see submit)
        for w in range(self.config.workers):
            self._spawn(w, delay=0.0)
        _STARTED.add(self)

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
        self._fail_pending(NotReady(SHUTTING_DOWN))
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

    def queued_tokens(self) -> int:
        """Tokens waiting now (one int read, no lock: admission asks it for every request)."""
        return self._pending.tokens

    def waiting(self, job: Job) -> int:
        """How many of ``job``'s texts wait in the queue (one dict read, no lock)."""
        return self._pending.waiting(job)

    def queued_squares(self) -> int:
        """The sum of the waiting texts' lengths squared (as ``queued_tokens``)."""
        return self._pending.squares

    def forked(self) -> bool:
        """Whether this is a forked child's copy of a scheduler started in its parent."""
        return os.getpid() != self._pid

    def check_process(self) -> None:
        """NotReady in a forked child: a fork copies no thread, so nothing would ever run its
        work (QA: "no worker is left ... (see /health)", while cached texts were answered)."""
        if self.forked():
            raise NotReady(f"this engine was started in process {self._pid}, and a forked "
                           "child has none of its worker threads: create an Engine (or "
                           "Reranker) in the child process")

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
                f"{self.config.max_queue_tokens}, {self.config.names.max_queue}); retry shortly",
                retry_after=1.0)

    def submit(self, job: Job) -> Future:
        """Queue a job's texts; raises Overloaded when the queue is full, NotReady if stopping."""
        self.check_process()  # before the lock: a fork may have copied it held
        tokens = sum(len(job.ids[i]) for i in job.pending())
        now = time.monotonic()
        with self._cond:
            if self._stopping:
                raise NotReady(SHUTTING_DOWN)
            if self._no_worker_left():
                raise NotReady("no worker is left to run the model (see /health)")
            self._check_room(tokens)
            job.submitted = now
            if job.remaining == 0:  # no texts, or every one answered by the cache
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
            dropped = self._pending.waiting(job)
            self._purge()
        self.counters["cancelled_texts"] += dropped
        if error is not None:
            answer(job.future, error=error)
        else:
            job.future.cancel()

    # -- state -----------------------------------------------------------------------------
    def running(self) -> list[Running]:
        """Each chunk in progress: seconds it has run so far, its tokens, and whether it is a
        solo job's (the canary's)."""
        chunks = list(self._running)  # each entry is swapped whole: no lock needed to read
        now = time.monotonic()
        return [r._replace(seconds=now - r.seconds) for r in chunks if r is not None]

    def stats(self) -> dict[str, int]:
        """Workers and queue. ``live``: workers able to take work — thread running, not waiting
        to restart, and its session not known to fail to open."""
        with self._cond:
            return {
                "total": self.config.workers,
                "live": sum(self._live(w) for w in range(self.config.workers)),
                "loaded": sum(f is not None for f in self._forwards),
                "idle_unloaded": sum(self._idle_unloaded),
                "busy": sum(r is not None for r in self._running),
                "queue_texts": len(self._pending),
                "queue_tokens": self._pending.tokens,
            }

    # -- internals -------------------------------------------------------------------------
    def _purge(self) -> int:
        """Remove pieces of finished or expired jobs from the queue; fail the expired jobs.

        The condition's lock is re-entrant, so this may be called with it held.
        """
        with self._cond:
            return self._pending.purge(time.monotonic(), self._expire)

    def _expire(self, job: Job) -> None:
        self.counters["deadline_exceeded"] += 1
        # Its texts still waiting are dropped (counted as ``cancel`` counts a gone client's).
        self.counters["cancelled_texts"] += self._pending.waiting(job)
        self._fail(job, DeadlineExceeded(
            f"the request did not finish within {self.config.names.timeout}"))

    def _next_chunk(self, worker: int) -> Taken | None | str:
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
                    chunk = self._chunk_now(worker)
                    if chunk is None:  # waited (part of) the batch window: look again
                        continue
                    # Held until answered, under the same lock: if this worker dies, the pieces
                    # are neither lost nor left waiting in the queue.
                    self._holding[worker] = chunk
                    if self._pending:
                        # submit() woke one worker; pass the rest on, so one big request
                        # runs on every idle worker, not only the first.
                        self._cond.notify()
                    return chunk
                if idle is None or self._forwards[worker] is None:
                    self._cond.wait()
                    continue
                left = self._last_work[worker] + idle - time.monotonic()
                if left <= 0:
                    return "unload"
                self._cond.wait(left)

    def _chunk_now(self, worker: int) -> Taken | None:
        """The next chunk for ``worker``, unless the batch window is still open for it: then
        wait (None), or take a solo job's chunk (called with the lock held)."""
        wait = self._pending.oldest_arrival() + self.config.batch_delay_s - time.monotonic()
        if wait <= 0 or self._stopping or self._flushing or self._window_closed():
            return self._take_chunk(worker)
        # A solo job (the canary, at start-up and for /health/deep; the reranker's priming
        # pair) runs alone whatever arrives: the window would only delay it (the start by
        # BGE_M3_BATCH_DELAY_MS, a deep check past its own deadline).
        solo = self._pending.take_solo(self.packer.plan)
        if solo is None:
            self._cond.wait(wait)
        return solo

    def _window_closed(self) -> bool:
        """Whether the batch window is over for what is queued: it once held a full chunk's
        texts or tokens, so the window has nothing left to gather for them, nor for the rest
        of their requests (QA: 200 short texts waited out a 2 s window, as one did). Texts
        that arrive later have their window."""
        if self._pending.oldest_arrival() <= self._window_closed_at:
            return True
        rules, pending = self.packer.rules, self._pending
        if len(pending) >= rules.max_chunk or (
                rules.max_tokens is not None and pending.tokens >= rules.max_tokens):
            self._window_closed_at = time.monotonic()
            return True
        return False

    def _take_chunk(self, worker: int) -> Taken:
        """The next chunk: the anchor text of the request served longest ago, with its
        length neighbours (``PendingQueue.take``; called with the lock held), packed as
        ``worker``'s session would run them: a run of a token count it has not met costs
        it a new shape (``binpack.plan``'s ``known``)."""
        fwd = self._forwards[worker]
        # No session yet: the one it opens will have run nothing. (A session unloaded between
        # this take and the run prices one chunk by the old session's counts: a cost, no more.)
        known = self._run_shapes(worker, fwd).known if fwd is not None else _nothing_run
        return self._pending.take(functools.partial(self.packer.plan, known=known),
                                  self.config.cross_request)

    def _run_shapes(self, w: int, fwd: Forward) -> RunShapes:
        """What worker ``w``'s session ``fwd`` has run: nothing yet where it is a new one."""
        held = self._shapes[w]
        if held is None or held[0]() is not fwd:
            held = self._shapes[w] = (weakref.ref(fwd), RunShapes())
        return held[1]

    def _fail_pending(self, error: BgeServeError) -> None:
        with self._cond:
            leftover = self._pending.drain()
        for piece in leftover:
            self._fail(piece.job, error)

    # -- running chunks ----------------------------------------------------------------------
    def _run(self, w: int, pieces: list[Piece], pad_to: int | None = None,
             lengthen: bool = True) -> None:
        """Run ``pieces`` as one chunk padded to ``pad_to`` (None: as the packer pads them),
        or longer to a shape the session has run (``lengthen``; never a solo job's chunk: the
        canary is checked bit for bit), and deliver or fail them; after running out of memory
        at a lengthened shape, again as packed; else halves."""
        if not pieces:
            return
        whole = pieces  # what an OOM split halves (each half is folded again)
        folded = fold(pieces)
        self._deliver_cached(folded.cached)
        pieces = folded.run
        if not pieces:
            return
        taking = [*pieces, *(t for ts in folded.twins.values() for t in ts)]
        fwd = self._session(w, taking)  # per call: an OOM split's halves may need a fresh one
        if fwd is None:
            return
        if pad_to is None or len(pieces) < len(whole):
            pad_to = self.packer.pad_length(len(pieces), max(p.length for p in pieces))
        packed, shapes = pad_to, self._run_shapes(w, fwd)
        pad_to = self.packer.run_length(shapes, len(pieces), pad_to,
                                        lengthen=lengthen and not any(p.job.solo for p in pieces))
        ids, mask = pad_chunk([p.job.ids[p.index] for p in pieces], pad_to)
        opts = [p.job.options for p in taking]  # a twin's outputs are computed for it too
        audit = self.audit
        measure = None if audit is None else audit.begin(len(pieces), pad_to)
        started = time.perf_counter()
        try:
            out = fwd.run(ids, mask, dense=any(o.dense for o in opts),
                          sparse=any(o.sparse for o in opts),
                          colbert=any(o.colbert for o in opts))
        except OutOfMemory as exc:
            self.counters["oom_splits"] += 1
            if pad_to != packed:  # the padding it took to reuse a shape may be what did not fit
                log.warning("chunk %dx%d ran out of memory; running it at %d", len(pieces),
                            pad_to, packed)
                self._run(w, whole, packed, lengthen=False)
            elif len(pieces) > 1:
                half = len(whole) // 2
                log.warning("chunk %dx%d ran out of memory; splitting", len(pieces), pad_to)
                self._run(w, whole[:half])
                self._run(w, whole[half:])
            else:
                p = pieces[0]
                self._fail(p.job, TooLarge(
                    f"input[{p.index}] ({p.length} tokens) ran out of memory even alone; "
                    f"lower {self.config.names.max_seq} or {self.config.names.more_memory}: "
                    f"{exc}",
                    param=f"input[{p.index}]"))
            return
        except BgeServeError as exc:
            if isinstance(exc, EngineFailed):  # the runtime failed, not the input
                self._reopen_later(w, f"session.run failed: {exc}")
            for p in taking:
                self._fail(p.job, exc)
            return
        finally:
            if audit is not None:
                audit.end(measure)
        seconds = time.perf_counter() - started
        shapes.ran(len(pieces), pad_to)
        self._deaths[w] = 0  # it works again: the next death starts the backoff afresh
        self._on_chunk(ChunkStats(w, len(pieces), pad_to, sum(p.length for p in pieces),
                                  seconds, sum(p.length * p.length for p in pieces),
                                  any(p.job.solo for p in pieces)))
        self._deliver(pieces, out, folded.twins)

    def _deliver(self, pieces: list[Piece], out: ChunkOutputs,
                 twins: dict[int, list[Piece]] | None = None) -> None:
        """Write each row into its piece's job (and into the pieces repeating it); answer the
        jobs that are complete."""
        finished: list[Job] = []
        for row, first in enumerate(pieces):
            for p in (first, *(twins or {}).get(row, ())):
                if p.job.done:
                    continue
                p.job.write(p.index, out, row)
                self._count_done(p.job, finished)
        for job in finished:
            answer(job.future, result=job.result())

    def _deliver_cached(self, cached: list) -> None:
        """Answer the pieces the cache held by the time their chunk ran."""
        finished: list[Job] = []
        for p, entry in cached:
            if not p.job.done:
                p.job.answer_from(p.index, entry)
                self._count_done(p.job, finished)
        for job in finished:
            answer(job.future, result=job.result())

    def _count_done(self, job: Job, finished: list[Job]) -> None:
        with self._cond:
            job.remaining -= 1
            if job.remaining == 0 and not job.done:
                job.done = True
                finished.append(job)

    def _fail(self, job: Job, error: BaseException) -> None:
        with self._cond:
            if job.done:
                return
            job.done = True
        answer(job.future, error=error)


# Schedulers whose worker threads may still run. The workers are daemon threads (an engine
# never closed must not hang the interpreter's exit), but one still inside ``session.run``
# when the interpreter finalizes aborts the process ("terminate called without an active
# exception", exit 134): a script that ended right after Engine.close(timeout) with work in
# flight, or without closing at all. At exit, queued work is dropped and running chunks end.
_STARTED: weakref.WeakSet[Scheduler] = weakref.WeakSet()
EXIT_WAIT_S = 60.0


@atexit.register
def _end_runs_at_exit() -> None:
    schedulers = list(_STARTED)
    for scheduler in schedulers:
        scheduler.exiting = True
        scheduler.abort(NotReady("the Python interpreter is exiting"))
    me = threading.current_thread()
    running = [t for scheduler in schedulers for t in scheduler._threads
               if t is not None and t is not me and t.is_alive()]
    if running:
        log.info("exiting: waiting for %d worker(s) to end the run in progress", len(running))
    deadline = time.monotonic() + EXIT_WAIT_S
    for t in running:  # bounded: a run that never ends must not hang the exit
        t.join(max(0.0, deadline - time.monotonic()))
