"""Admission before tokenizing: a cheap bound decides at once, the exact check comes after.

Tokenizing a request costs ~120 ms for 8 texts of 12k characters, and only a few run at once
(one per core). Deciding only after it made a flood's refusals wait behind everyone's
tokenizing: 48 such requests against a 20,000-token queue got their 429s after 0.2-2.7 s.
``AdmissionGate`` decides from a lower bound of each request's tokens (words, capped at
max_seq per text: ``Tokenizer.min_tokens``), reserved until the request's exact tokens join
the queue: requests waiting to be tokenized count against the queue's room, so the second of
48 simultaneous requests already sees the first. Refusals that need no bound (the room is
gone) cost nothing. The queue's own exact check still follows tokenizing.

``DrainMeter`` measures how fast the queue empties (tokens of finished chunks per second), so
``Retry-After`` says how long the tokens ahead of a request take to drain.

``Admission`` admits bge-m3's requests, ``PairAdmission`` the cross-encoder's (its engine, its
queue and its drain rate are its own).
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from bgeserve import holds
from bgeserve.engine import normalize_inputs
from bgeserve.engine.scheduler import SHUTTING_DOWN
from bgeserve.errors import BgeServeError, NotReady, Overloaded
from bgeserve.service.outputs import OutputAllowance

if TYPE_CHECKING:
    from bgeserve.engine import Engine, Inputs
    from bgeserve.engine.jobs import Job
    from bgeserve.engine.pairs import PairPlan
    from bgeserve.engine.reranker import Reranker
    from bgeserve.results import EmbedOptions, RerankOptions

# The bound walks the texts (~2-3 ms for 96k characters, stopping once past the room): past
# this many characters it runs on a thread of its own (never behind the tokenizing threads),
# else on the event loop, where the next request already sees its reservation.
BOUND_ON_LOOP_CHARS = 256 * 1024
DRAIN_WINDOW_S = 10.0  # finished chunks younger than this measure the rate
MIN_BUSY_S = 1e-3  # a rate is never read off less busy time than this
# The newest chunks the rate is read from at most: a GPU finishing a chunk every few ms fills
# the window with thousands, and a flood's refusals each read the rate on the event loop.
MAX_EVENTS = 512
MAX_RETRY_AFTER_S = 60.0
# The queue holds at most this share of BGE_M3_REQUEST_TIMEOUT_SECS of work, at the measured
# drain rate (AdmissionGate). Its requests take turns (engine/queue.py), so past the deadline's
# worth of work they all finish late together: 64 requests of 0.31 s each under a 10 s
# deadline, 1 answered and 63 504s after 10 s of work (client QA; one after another, 32 would
# have been answered). Under it, what is admitted finishes in time and the rest is told at
# once to come back (429, Retry-After). Not all of it: requests that come while the queue
# drains take their turns too.
QUEUE_DEADLINE_SHARE = 0.75
Plan = TypeVar("Plan")
Made = TypeVar("Made")


class DrainMeter:
    """Tokens the engine drains per second while it runs, over the chunks that finished in
    the last ``window`` seconds (thread-safe).

    The time is the runs' own: the union of each chunk's ``[start, finish]``, so idle gaps
    between requests do not count, and runs of several workers at once count once. Dividing
    by the wall time since the window's first chunk instead (with a 1 s floor) read a burst
    after an idle spell as one chunk's tokens per second: 57 of 58 refusals of a flood on the
    tiny model said Retry-After 22 s, one 60 s, for a queue that drained in 0.2 s.
    """

    def __init__(self, window: float = DRAIN_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.clock = clock
        # (finish, start, tokens), oldest first
        self._events: deque[tuple[float, float, int]] = deque(maxlen=MAX_EVENTS)
        self._last_rate = 0.0
        self._stale = False  # the events changed since _last_rate was read off them
        self._lock = threading.Lock()

    def record(self, tokens: int, seconds: float) -> None:
        """A chunk of ``tokens`` (real tokens) that ran for ``seconds`` finished now."""
        with self._lock:
            now = self.clock()
            self._events.append((now, now - max(0.0, seconds), tokens))
            self._stale = True
            self._expire(now)

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()
            self._stale = True

    def recent(self) -> bool:
        """Whether a chunk finished within the window (the queue is draining)."""
        with self._lock:
            self._expire(self.clock())
            return bool(self._events)

    def rate(self) -> float:
        """Tokens per second of running; the last measured rate when nothing finished lately
        (0.0 until a first chunk finished)."""
        with self._lock:
            self._expire(self.clock())
            if self._events and self._stale:
                tokens = sum(e[2] for e in self._events)
                self._last_rate = tokens / max(MIN_BUSY_S, _busy(self._events))
                self._stale = False
            return self._last_rate


def _busy(events: deque[tuple[float, float, int]]) -> float:
    """Seconds covered by the union of the events' ``[start, finish]`` intervals."""
    total, end = 0.0, float("-inf")
    for finish, start, _ in sorted(events, key=lambda e: e[1]):
        if finish > end:
            total += finish - max(start, end)
            end = finish
    return total


class AdmissionGate:
    """The queue's room, with the requests still being tokenized counted in.

    ``queued`` reads the tokens the scheduler holds; ``max_tokens`` is
    BGE_M3_MAX_QUEUE_TOKENS, and with a ``deadline_s`` (BGE_M3_REQUEST_TIMEOUT_SECS) the
    tokens the measured drain rate runs in ``QUEUE_DEADLINE_SHARE`` of it, where fewer. Like
    the queue, it lets any request in when nothing is queued or reserved (a request larger
    than the whole queue must still be served alone).
    """

    def __init__(self, max_tokens: int, queued: Callable[[], int], drain: DrainMeter,
                 deadline_s: float | None = None) -> None:
        self.max_tokens = max_tokens
        self.queued = queued
        self.drain = drain
        self.deadline_s = deadline_s or None
        self.reserved = 0  # tokens of admitted requests not yet in the queue
        self._lock = threading.Lock()

    def limit(self) -> int:
        """Tokens the queue may hold: BGE_M3_MAX_QUEUE_TOKENS, or what drains in the share of
        the deadline (once a rate was measured), where fewer."""
        if self.deadline_s is None or (rate := self.drain.rate()) <= 0:
            return self.max_tokens
        return min(self.max_tokens, max(1, int(rate * self.deadline_s * QUEUE_DEADLINE_SHARE)))

    def room(self) -> int:
        """Tokens that may still be admitted (negative: over, by reservations)."""
        return self.limit() - self.queued() - self.reserved

    def retry_after(self, needed: int) -> float:
        """Seconds until ``needed`` more tokens of room have drained, from the measured rate;
        at least 1, at most ``MAX_RETRY_AFTER_S``; 1 before anything was measured."""
        rate = self.drain.rate()
        if rate <= 0 or needed <= 0:
            return 1.0
        return float(min(MAX_RETRY_AFTER_S, max(1, math.ceil(needed / rate))))

    def refusal(self, bound: int, room: int | None = None,
                limit: int | None = None) -> Overloaded:
        """The 429 for a request of at least ``bound`` tokens, more than ``room`` under
        ``limit`` (default: now's)."""
        limit = self.limit() if limit is None else limit
        room = limit - self.queued() - self.reserved if room is None else room
        # Not the bound itself: it stops counting once past the room (a request of 2,880
        # tokens was said to need "at least 448").
        if limit < self.max_tokens:  # the deadline's share: a rate was measured
            assert self.deadline_s is not None
            rate = self.drain.rate()
            held = (f"{limit - room} tokens are queued or being admitted, "
                    f"~{(limit - room) / rate:.1f}s of work at the measured "
                    f"{rate:.0f} tokens/s, and the queue takes at most "
                    f"{QUEUE_DEADLINE_SHARE * self.deadline_s:g}s of it ({limit} tokens, "
                    f"{QUEUE_DEADLINE_SHARE:g} of BGE_M3_REQUEST_TIMEOUT_SECS="
                    f"{self.deadline_s:g}: more would finish late together)")
        else:
            held = (f"{self.max_tokens - room} of {self.max_tokens} tokens "
                    "(BGE_M3_MAX_QUEUE_TOKENS) are queued or being admitted")
        return Overloaded(
            f"the queue is full: {held}, and this request needs more than the "
            f"{max(room, 0)} free; retry after the Retry-After seconds",
            retry_after=self.retry_after(bound - room))

    def full(self) -> Overloaded | None:
        """The refusal when no request can be admitted whatever its size (O(1)), else None."""
        with self._lock:
            room, busy = self.room(), self.reserved or self.queued()
        return self.refusal(1, room) if busy and room <= 0 else None

    def reserve(self, bound: int) -> None:
        """Hold ``bound`` tokens of room (while tokenizing, until the exact tokens are
        queued; ``release`` them then); raises ``Overloaded`` if they are not there."""
        with self._lock:
            room, busy = self.room(), self.reserved or self.queued()
            if busy and bound > room:
                raise self.refusal(bound, room)
            self.reserved += bound

    def release(self, bound: int) -> None:
        with self._lock:
            self.reserved -= bound

    def check_in_time(self, tokens: int, bound: int, left_s: float | None = None) -> None:
        """Refuse (``Overloaded``) a request of ``tokens`` exact tokens to queue (``bound`` of
        them still reserved) that would take the queue past what drains in its share of the
        deadline, or of the ``left_s`` seconds its own deadline leaves (it waited for a
        tokenizing slot); the lower bound reserved before tokenizing counts words, and ids ran
        ~3x past it. The scheduler's own check is BGE_M3_MAX_QUEUE_TOKENS'; alone, a request
        always goes in."""
        with self._lock:
            limit = self.limit()
            if left_s is not None and self.deadline_s is not None and limit < self.max_tokens:
                limit = min(limit, int(limit * max(0.0, left_s) / self.deadline_s))
            others = self.queued() + self.reserved - bound
            if limit < self.max_tokens and others and tokens and others + tokens > limit:
                raise self.refusal(tokens, limit - others, limit)


class _Admitting:
    """What both admissions share: the gate, the 429s counted, a lower bound reserved on the
    event loop (or, for a big request, on the admission thread), tokenizing slots, the exact
    check's refusal given a Retry-After from the drain rate, the abort at shutdown.

    ``slots`` requests tokenize at once (more than the cores only adds memory, each holding
    its encodings, never speed). ``deadline_s``: BGE_M3_REQUEST_TIMEOUT_SECS (None: none).
    """

    def __init__(self, engine: Engine, max_queue_tokens: int, drain: DrainMeter,
                 slots: int, deadline_s: float | None = None) -> None:
        self.engine = engine
        self.gate = AdmissionGate(max_queue_tokens, engine.queued_tokens, drain, deadline_s)
        self.refused = 0
        self._lock = threading.Lock()
        self._bounds = ThreadPoolExecutor(1, thread_name_prefix="bgeserve-admission")
        self._aborted: BgeServeError | None = None
        self._slots = slots
        self._tokenizing: asyncio.Semaphore | None = None  # made on the loop that serves
        self._waiting = 0  # requests waiting for a tokenizing slot

    def refuse_now(self) -> Overloaded | None:
        """The refusal when no request can be admitted now, whatever its size (counted)."""
        refusal = self.gate.full()
        return None if refusal is None else self._refuse(refusal)

    def _admit(self, lower_bound: Callable[[int], int]) -> int:
        """Reserve ``lower_bound(room)`` (a lower bound of the request's tokens, counted until
        past the room) against the room as it is now; the bound, or Overloaded. Big requests
        run this one after another on the admission thread, so each sees the reservations of
        those before it (and, refused, costs a text's walk at most)."""
        refusal = self.gate.full()
        if refusal is not None:
            raise self._refuse(refusal)
        bound = lower_bound(max(0, self.gate.room()))
        try:
            self.gate.reserve(bound)
        except Overloaded as exc:
            raise self._refuse(exc) from None
        return bound

    async def _reserve(self, chars: int, lower_bound: Callable[[int], int]) -> int:
        """``_admit`` on the event loop for a request of at most BOUND_ON_LOOP_CHARS
        characters, else on the admission thread."""
        if chars <= BOUND_ON_LOOP_CHARS:
            return self._admit(lower_bound)
        refusal = self.gate.full()  # no need to wait for the thread to know that
        if refusal is not None:
            raise self._refuse(refusal)
        loop = asyncio.get_running_loop()
        try:
            work = loop.run_in_executor(self._bounds, self._admit, lower_bound)
        except RuntimeError:  # closed: the server is stopping (a 503, not a 500)
            raise NotReady(SHUTTING_DOWN) from None
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # The caller left (client gone) while its bound was being walked: the thread
            # still reserves it, and no one else would release it (each leak shrank the
            # queue's room for good, invisible in /metrics, until every request was a 429).
            work.add_done_callback(self._release_orphan)
            raise

    def _release_orphan(self, work: asyncio.Future[int]) -> None:
        if not work.cancelled() and work.exception() is None:
            self.gate.release(work.result())

    def _refuse(self, refusal: Overloaded) -> Overloaded:
        with self._lock:
            self.refused += 1
        return refusal

    def queue(self, job: Job, bound: int = 0, later: bool = False) -> Future:
        """Submit ``job`` (its ``bound`` still reserved): the queue's exact checks, the share
        of the deadline's (``AdmissionGate.check_in_time``; not for ``later`` jobs of a
        request admitted already, as a ColBERT rerank's later groups) and the scheduler's,
        its refusal (counted by the scheduler) with a Retry-After from the drain rate, not the
        scheduler's 1 s."""
        if not later and self.gate.deadline_s is not None:
            # What it queues: not the texts the cache answered or a repeat of another of its
            # texts runs for (review: a request the cache answered whole was a 429).
            left = None if job.deadline is None else job.deadline - time.monotonic()
            try:
                self.gate.check_in_time(sum(len(job.ids[i]) for i in job.pending()), bound,
                                        left)
            except Overloaded as exc:
                raise self._refuse(exc) from None
        try:
            return self.engine.submit(job)
        except Overloaded as exc:
            tokens = sum(len(x) for x in job.ids)
            needed = tokens - self.gate.room() - bound  # this request's own reservation
            raise Overloaded(exc.message, retry_after=self.gate.retry_after(needed)) from None

    async def submit_jobs(self, chars: int, lower_bound: Callable[[int], int],
                          make: Callable[[], tuple[Plan, list[Job]]],
                          before: Callable[[Job], Awaitable[None]] | None = None
                          ) -> tuple[Plan, list[Job], Future | None]:
        """Admit a request of ``chars`` characters by ``lower_bound(room)``, make its jobs
        on a thread (``make`` tokenizes) and queue the first one: the plan, the jobs and the
        first one's future (None: no job); Overloaded (429) as ``Admission.submit`` raises
        it. The jobs after the first are the caller's to queue, one after another.
        ``before(job)`` is awaited before the first is queued (room for its output)."""
        if self._aborted is not None:
            raise self._aborted
        bound = await self._reserve(chars, lower_bound)
        try:
            plan, jobs = await self.on_thread(make)
            if jobs and before is not None:
                # As Admission.submit: while it waits it holds none of the queue's room.
                self.gate.release(bound)
                bound = 0
                await before(jobs[0])
            first = self.queue(jobs[0], bound) if jobs else None
        finally:
            self.gate.release(bound)
        return plan, jobs, first

    async def on_thread(self, work: Callable[[], Made]) -> Made:
        """``work()`` (tokenizing) on a thread once a tokenizing slot is free."""
        if self._tokenizing is None:
            self._tokenizing = asyncio.Semaphore(self._slots)
        self._waiting += 1
        try:
            await self._tokenizing.acquire()
        finally:
            self._waiting -= 1
        try:
            if self._aborted is not None:
                raise self._aborted
            running = asyncio.ensure_future(asyncio.to_thread(work))
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                # The caller left (client gone, deadline), but the thread tokenizes on: its
                # slot, its reservation and the body allowance the HTTP layer holds until
                # this returns stay taken until it ends.
                await asyncio.wait({running})
                if not running.cancelled():
                    running.exception()  # retrieved: its error has no one to go to
                raise
        finally:
            self._tokenizing.release()

    def abort(self, error: BgeServeError) -> int:
        """Answer ``error`` to every request waiting for a tokenizing slot, and to every
        request from now on; returns how many were waiting. A shutdown's time is up: behind a
        backlog of big requests they would wait past the HTTP server's grace, which cancels
        them (a plain-text 500). Those tokenizing now go on; the engine refuses their jobs."""
        self._aborted = error
        waiting = self._waiting
        if self._tokenizing is not None:
            for _ in range(waiting):  # each wakes, sees the error and gives its slot back
                self._tokenizing.release()
        return waiting

    def close(self) -> None:
        self._bounds.shutdown(wait=False)


class Admission(_Admitting):
    """A request's way into the engine's queue: the gate, a tokenizing slot, room for its
    ColBERT output (``outputs``: shared by the requests in progress, None: unbounded), the
    submission. ``refused`` counts the 429s decided here (the scheduler counts its own)."""

    def __init__(self, engine: Engine, max_queue_tokens: int, drain: DrainMeter, slots: int,
                 outputs: OutputAllowance | None = None,
                 deadline_s: float | None = None) -> None:
        super().__init__(engine, max_queue_tokens, drain, slots, deadline_s)
        self.outputs = outputs

    def abort(self, error: BgeServeError) -> int:
        """As ``_Admitting.abort``, and to the requests waiting for room for their ColBERT
        output (behind a holder whose answer is slow to send they would outwait the grace)."""
        waiting = super().abort(error)
        if self.outputs is not None:
            waiting += self.outputs.abort(error)
        return waiting

    def lower_bound(self, inputs: Inputs, stop_above: int) -> int:
        """Tokens ``inputs`` give at least (words, capped at max_seq per text; token ids
        count as they are), counted until past ``stop_above``."""
        texts, ids = normalize_inputs(inputs)
        tokenizer = self.engine.tokenizer
        if texts is not None:
            return tokenizer.min_tokens(texts, stop_above=stop_above)
        return sum(min(len(x) + 2, tokenizer.max_seq) for x in ids or ())

    async def submit(self, inputs: Inputs, options: EmbedOptions, request_id: str,
                     arrived: float) -> tuple[Job, Future]:
        """Admit, tokenize and queue a request; its job and the future of its result.

        Raises Overloaded (a 429, its Retry-After from the drain rate) at once when a lower
        bound of its tokens does not fit beside what is queued and being tokenized, or after
        tokenizing when its exact tokens do not fit the queue.
        """
        if self._aborted is not None:
            raise self._aborted
        texts, _ = normalize_inputs(inputs)
        # Token ids are counted as they are: no walk, so never on the thread.
        chars = 0 if texts is None else sum(map(len, texts))
        bound = await self._reserve(chars, lambda room: self.lower_bound(inputs, room))
        try:
            job = await self._tokenize(inputs, options, request_id, arrived)
            size = self.engine.colbert_bytes(job.ids) if options.colbert else 0
            if size and self.outputs is not None:
                # Its exact tokens are known now: while it waits for room for its vectors it
                # holds none of the queue's (the queue checks them again below).
                if not holds.in_scope():  # checked first: a hold no scope releases leaks
                    raise RuntimeError("Admission.submit outside holds.answering()")
                self.gate.release(bound)
                bound = 0
                job.room_wait = await self.outputs.acquire(size)
                outputs = self.outputs
                holds.release_when_answered(lambda: outputs.release(size))
            future = self.queue(job, bound)
        finally:
            self.gate.release(bound)
        return job, future

    async def _tokenize(self, inputs: Inputs, options: EmbedOptions, request_id: str,
                        arrived: float) -> Job:
        if small(inputs):
            # A query or two: tokenizing it here costs less than handing it to a thread and
            # waiting to be woken (measured in docs/benchmarks.md, "Short-query latency").
            return self.engine.make_job(inputs, options, request_id, arrived)
        return await self.on_thread(functools.partial(
            self.engine.make_job, inputs, options, request_id, arrived))


class PairAdmission(_Admitting):
    """The cross-encoder's way into its engine's queue, as ``Admission`` is bge-m3's: a lower
    bound of the pair rows' tokens (``Reranker.min_tokens``) reserved before tokenizing, the
    rows built on a thread, the exact check's refusal with a Retry-After from the reranker's
    own drain rate.

    Without it every rerank request tokenized its query and documents before the queue could
    refuse it, and every refusal said ``Retry-After: 1``: 48 at once against a full queue got
    their 429s at p50 1.7-2.2 s, now 0.4 s, Retry-After 2-4 s for fillers that drained in ~10 s
    (docs/reliability.md §3).
    """

    def __init__(self, reranker: Reranker, max_queue_tokens: int, drain: DrainMeter,
                 slots: int, deadline_s: float | None = None) -> None:
        super().__init__(reranker.engine, max_queue_tokens, drain, slots, deadline_s)
        self.reranker = reranker

    async def submit(self, query: str, documents: list[str], options: RerankOptions,
                     request_id: str, arrived: float) -> tuple[PairPlan, Job, Future]:
        """Admit, tokenize and queue a rerank request: its plan, its job and the future of its
        rows' logits; Overloaded (429) as ``Admission.submit`` raises it."""
        def make() -> tuple[PairPlan, list[Job]]:
            plan, job = self.reranker.make_job(query, documents, options, request_id, arrived)
            return plan, [job]

        plan, jobs, future = await self.submit_jobs(
            len(query) + sum(map(len, documents)),
            lambda room: self.reranker.min_tokens(query, documents, options, stop_above=room),
            make)
        assert future is not None
        return plan, jobs[0], future


# Requests up to this many characters (or token ids) are tokenized on the event loop: at
# ~5-10 us per token (bge-m3's tokenizer here) that blocks it for well under a millisecond,
# less than a round trip through a thread costs a query on a busy machine.
INLINE_TOKENIZE_CHARS = 512


def small(inputs: Inputs, limit: int = INLINE_TOKENIZE_CHARS) -> bool:
    """Whether ``inputs`` hold at most ``limit`` characters (token ids: ids) in all."""
    if isinstance(inputs, str):
        return len(inputs) <= limit
    total = 0
    for item in inputs:
        total += len(item) if isinstance(item, (str, list, tuple)) else 1
        if total > limit:
            return False
    return True
