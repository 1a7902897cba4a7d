"""The scheduler's worker threads: each owns one session, runs the chunks it takes, and is
supervised.

A worker thread that dies (a bug outside a chunk's own error handling) has the texts it held
failed with EngineFailed and is replaced by a new thread after a backoff that grows while it
keeps dying; a session whose run fails with a runtime error is closed and reopened on the next
chunk, since it may be left unusable. A worker whose session cannot be opened, or that is
waiting out its backoff, is not counted as live, so ``/health`` shows it.

``Workers`` is the part of ``Scheduler`` that owns the threads and sessions; it shares the
scheduler's lock and per-worker state (set up in ``Scheduler.__init__``) and calls back into
its queue (``_next_chunk``) and its chunk runs (``_run``, ``_fail``).
"""

from __future__ import annotations

import abc
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from bgeserve.engine.forward import Forward
from bgeserve.engine.jobs import Job, Piece
from bgeserve.engine.queue import Taken
from bgeserve.errors import BgeServeError, EngineFailed, NotReady
from bgeserve.tuning import memory

if TYPE_CHECKING:
    from bgeserve.engine.scheduler import SchedulerConfig

log = logging.getLogger("bgeserve.scheduler")
# Delay before a dead worker's replacement starts, doubling per consecutive death: a worker that
# dies at once every time must not spin a core or flood the log.
MIN_RESTART_DELAY_S = 0.1
MAX_RESTART_DELAY_S = 5.0


class Running(NamedTuple):
    """A chunk in progress."""

    seconds: float  # how long it has run (Workers._running: when it started, monotonic)
    tokens: int
    solo: bool  # a solo job's (the canary's)
    squares: int = 0  # its texts' lengths squared, summed (admission prices its work by it)


class Workers(abc.ABC):
    """Worker threads and their sessions: the base of ``Scheduler``, which sets up this state
    and implements the queue and chunk methods below."""

    config: SchedulerConfig
    counters: collections.Counter[str]
    _cond: threading.Condition
    _stopping: bool
    _open_forward: Callable[[int], Forward]
    _threads: list[threading.Thread | None]
    _forwards: list[Forward | None]
    _running: list[Running | None]  # the chunk in progress (seconds: its monotonic start)
    _holding: list[list[Piece]]  # taken off the queue, not yet answered: failed if it dies
    _restarting: list[bool]  # a replacement thread is waiting out its backoff
    _open_failed: list[bool]  # the last attempt to open the session failed
    _idle_unloaded: list[bool]  # its session was unloaded for idleness (not after a failure)
    _last_work: list[float]  # monotonic end of its last chunk of real work (not the canary's)
    _deaths: list[int]  # consecutive deaths: sets the restart backoff
    exiting = False  # stopped by the interpreter's exit (scheduler._end_runs_at_exit)

    @abc.abstractmethod
    def _next_chunk(self, worker: int) -> Taken | None | str:
        """Block for the next chunk; None = stop; "unload" = idle too long."""

    @abc.abstractmethod
    def _run(self, w: int, pieces: list[Piece], pad_to: int | None = None) -> None:
        """Run one chunk on worker ``w`` and answer its jobs."""

    @abc.abstractmethod
    def _fail(self, job: Job, error: BaseException) -> None:
        """Answer ``job`` with ``error`` (once)."""

    @abc.abstractmethod
    def _fail_pending(self, error: BgeServeError) -> None:
        """Answer every queued job with ``error``."""

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
            self._running[w] = None
            died = not self._stopping  # the loop only returns by itself when stopping
        try:
            if died:  # first: whoever gets the error below sees the worker already replaced
                self._restart(w)
            elif not self.exiting:  # stopping: a chunk that outlasted stop()'s wait leaves
                self._drop_session(w)  # its session here (QA: loaded after close(timeout));
                # at the interpreter's exit the process ends anyway: no close, no trim
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
            if isinstance(chunk, str):  # "unload": idle for BGE_M3_IDLE_TIMEOUT_SECS
                if self._drop_session(w):
                    with self._cond:
                        self._idle_unloaded[w] = True
                    log.info("worker %d idle for %.0fs: session unloaded", w,
                             self.config.idle_timeout_s)
                continue
            # From before the session (re)opens: a reload after an idle unload is the chunk's
            # time too, as its caller waits for it.
            self._running[w] = Running(time.monotonic(), sum(p.length for p in chunk),
                                       any(p.job.solo for p in chunk),
                                       sum(p.length * p.length for p in chunk))
            try:
                self._execute(w, chunk)
            except Exception as exc:  # a bug must fail the chunk, never hang its callers
                log.exception("worker %d crashed on a chunk", w)
                self._reopen_later(w, f"unexpected error {exc!r}")
                for p in chunk:
                    self._fail(p.job, EngineFailed(f"internal error: {exc!r}"))
            # Not in a ``finally``: if the thread dies here, _after_exit fails what it held.
            with self._cond:
                self._running[w] = None
                self._holding[w] = []
                if not all(p.job.solo for p in chunk):  # the canary is no work: idle still
                    self._last_work[w] = time.monotonic()

    def _execute(self, w: int, chunk: Taken) -> None:
        live = [p for p in chunk if not p.job.done]
        # Padded as packed, unless finished jobs left and took the longest text with them.
        self._run(w, live, chunk.pad_to if len(live) == len(chunk) else None)

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
            self._idle_unloaded[w] = False
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
