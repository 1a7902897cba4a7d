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

Under a deadline the queue holds at most a share of the deadline's work (``AdmissionGate``),
counted as ``work``: a text's tokens, each counting more the longer the text, since its
attention grows with its length. Counted in plain tokens, a rate read off short texts admitted
a burst of long ones several times over what runs in time (full-size ONNX Runtime int8 on a
2-core Zen 4: 771 tokens/s on a 512-token text, 313 on a 4,096-token one).

``Admission`` admits bge-m3's requests, ``PairAdmission`` the cross-encoder's (its engine, its
queue and its drain rate are its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from bgeserve import holds, stopping
from bgeserve.engine import normalize_inputs
from bgeserve.engine.scheduler import SHUTTING_DOWN
from bgeserve.errors import BgeServeError, NotReady, Overloaded
from bgeserve.service.outputs import OutputAllowance

if TYPE_CHECKING:
    from bgeserve.engine import Engine, Inputs
    from bgeserve.engine.jobs import Job
    from bgeserve.engine.pairs import PairPlan
    from bgeserve.engine.reranker import Reranker
    from bgeserve.engine.workers import Running
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
# How long past the Retry-After it was told the queue is kept for a request refused as let in
# only alone (AdmissionGate._keep_for_alone): a client's retry comes a little late (its own
# round trip, a retrying client's jitter).
KEPT_GRACE_S = 2.0
# A text of n tokens runs in about n x (per_token + n x per_pair) seconds (tuning.runcost):
# its work is n x (1 + n / A) tokens' worth, A the length at which its attention costs as much
# as the rest. The probe measures A on its runs of 1,024-8,192 tokens (RunCost.attention:
# full-size ov-int8 on 2-core Zen 4 VMs 1,759-2,057 on two starts, 3,056 on a third; the short
# shapes' per_token / per_pair, 1,801, 1,888 and 3,461 on those starts, is used where a cache
# predates that); where it did not measure A, this.
DEFAULT_ATTENTION_TOKENS = 2048.0
# Where the texts queued are on average this many times longer than those the drain rate was
# lately measured on (``DrainMeter.longest``, kept LONGEST_MEMORY_S), the rate of their work is
# a guess read off shorter runs (mostly a run's fixed cost, which the rate counts as work), and
# the share's 429 says Retry-After no later than when UNMEASURED_CHUNKS chunks of them have run
# at the speed the start-up probe measured (``chunk_seconds``), at least UNMEASURED_RETRY_S:
# by then their chunks have measured the rate.
UNMEASURED_SPREAD = 2.0
UNMEASURED_CHUNKS = 2  # the one running may run first
UNMEASURED_RETRY_S = 2.0
LONGEST_MEMORY_S = 60.0
# An A fitted on the short shapes below this is the fit's noise, not a model.
MIN_ATTENTION_TOKENS = 128.0
# One read off long runs is measured where it matters (the tiny test model, hidden 32: 20-200
# on runs of 2,048-8,192 tokens); below this it would be a disturbed start's.
MIN_LONG_ATTENTION_TOKENS = 16.0
Plan = TypeVar("Plan")
Made = TypeVar("Made")


def work(tokens: int, squares: int, attention: float) -> float:
    """Tokens' worth of work of texts with ``tokens`` in all and ``squares`` the sum of their
    lengths squared: each token counts 1 + its text's length / ``attention``."""
    return tokens + squares / attention


def attention_tokens(engine: Engine) -> float:
    """A in ``work`` for ``engine``: as its run cost's long runs measured it (at least
    ``MIN_LONG_ATTENTION_TOKENS``), else as its short shapes' fit has it (at least
    ``MIN_ATTENTION_TOKENS``), else the default."""
    cost = engine.run_cost
    if cost is not None and cost.attention is not None:
        return max(MIN_LONG_ATTENTION_TOKENS, cost.attention)
    measured = None if cost is None else cost.attention_tokens
    return DEFAULT_ATTENTION_TOKENS if measured is None else max(MIN_ATTENTION_TOKENS, measured)


def chunk_seconds(engine: Engine, length: float) -> float | None:
    """Seconds one chunk of texts of ``length`` tokens takes at the speed the start-up probe
    measured (its run cost; a text longer than the chunk budget runs alone); None before the
    probe measured it."""
    cost = engine.run_cost
    if cost is None or length <= 0:
        return None
    budget = engine.max_chunk_tokens or length
    texts = max(1, int(budget // length))
    return cost.fixed + cost.per_token * texts * work(
        round(length), round(length * length), attention_tokens(engine))


def where_late(jobs: Sequence[Job], drain: DrainMeter, attention: float,
               deadline_s: float) -> str:
    """What a 504 adds: how much of the request's ``jobs`` (none: not tokenized yet) had run,
    what their texts are at the measured drain rate, and so whether the request is too large
    for the deadline (send less a request) or waited behind others' work (retry later)."""
    if not jobs:
        # Not told apart here: waiting for a tokenizing slot, or its own tokenizing (QA: a
        # lone request of 24 MB was told "behind other requests" where there were none).
        return ("it was still being tokenized and admitted: behind other requests (retry "
                "later), or, if it was alone, too large to tokenize within the deadline "
                "(send fewer or shorter texts a request)")
    todo = [(job, i) for job in jobs for i in job.pending()]
    texts = sum(len(job.ids) for job in jobs)
    done = len(todo) - sum(job.remaining for job in jobs)
    said = f"{done} of the {len(todo)} texts it had to run were done"
    if len(todo) < texts:
        said += f" (of its {texts}: the others repeat them or were in the cache)"
    rate = drain.work_rate(attention)
    if not todo or rate <= 0:
        return said
    lengths = [len(job.ids[i]) for job, i in todo]
    seconds = work(sum(lengths), sum(n * n for n in lengths), attention) / rate
    said += (f"; their {sum(lengths)} tokens are ~{seconds:.1f}s of work at the measured "
             "drain rate")
    if seconds > QUEUE_DEADLINE_SHARE * deadline_s:
        return (said + ", too much for one request under this deadline: send fewer or shorter "
                "texts a request, or raise BGE_M3_REQUEST_TIMEOUT_SECS")
    return said + ", which fits: it waited behind other requests' work (retry later)"


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
        # (finish, start, tokens, squares), oldest first
        self._events: deque[tuple[float, float, int, int]] = deque(maxlen=MAX_EVENTS)
        # Tokens, lengths squared and busy seconds of the window, or of the last window that
        # held a chunk (0 seconds: nothing measured yet).
        self._last: tuple[int, int, float] = (0, 0, 0.0)
        self._stale = False  # the events changed since _last was read off them
        self._measured_work = False  # a chunk not solo was recorded
        # The window's mean text lengths (``longest``) of the last LONGEST_MEMORY_S and when
        # each was read, each shorter than the one before (a sliding maximum: the first is
        # the largest; QA: one kept until 60 s after it was set forgot a chunk as long
        # measured since).
        self._lengths: deque[tuple[float, float]] = deque()
        # The window's run seconds and run seconds x mean text length, summed (as it changes).
        self._timed = [0.0, 0.0]
        self._lock = threading.Lock()

    def record(self, tokens: int, seconds: float, squares: int = 0, solo: bool = False) -> None:
        """A chunk of ``tokens`` (real tokens; ``squares``: its texts' lengths squared,
        summed) that ran for ``seconds`` finished now. A ``solo`` one (the canary: one short
        text alone, mostly a run's fixed cost) counts only while nothing else was measured:
        /health/deep's every 20 s replaced the rate of the work before an idle spell with its
        own, several times lower, and the next burst was refused for it."""
        with self._lock:
            if solo and self._measured_work:
                return
            self._measured_work = self._measured_work or not solo
            now = self.clock()
            if len(self._events) == self._events.maxlen:
                self._forget(self._events.popleft())
            event = (now, now - max(0.0, seconds), tokens, squares)
            self._events.append(event)
            self._timed[0] += event[0] - event[1]
            self._timed[1] += (event[0] - event[1]) * (squares / tokens if tokens else 0.0)
            self._stale = True
            self._expire(now)
            # The window's mean text length, each chunk weighted by its run time: the rate
            # is mostly that of the chunks that took the time (``longest``).
            length = self._timed[1] / self._timed[0] if self._timed[0] > 0 else 0.0
            while self._lengths and self._lengths[-1][0] <= length:
                self._lengths.pop()
            self._lengths.append((length, now))
            while self._lengths[0][1] < now - LONGEST_MEMORY_S:
                self._lengths.popleft()

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._forget(self._events.popleft())
            self._stale = True
        if not self._events:
            self._timed = [0.0, 0.0]  # no rounding left over

    def _forget(self, event: tuple[float, float, int, int]) -> None:
        """Take a chunk leaving the window out of ``_timed``."""
        finish, start, tokens, squares = event
        self._timed[0] -= finish - start
        self._timed[1] -= (finish - start) * (squares / tokens if tokens else 0.0)

    def recent(self) -> bool:
        """Whether a chunk finished within the window (the queue is draining)."""
        with self._lock:
            self._expire(self.clock())
            return bool(self._events)

    def _measured(self) -> tuple[int, int, float]:
        with self._lock:
            self._expire(self.clock())
            if self._events and self._stale:
                self._last = (sum(e[2] for e in self._events), sum(e[3] for e in self._events),
                              max(MIN_BUSY_S, _busy(self._events)))
                self._stale = False
            return self._last

    def longest(self) -> float:
        """The text length the rate was lately measured on: the window's mean text length,
        each chunk's weighted by its run time (the rate is mostly that of the chunks that took
        the time: one chunk of long texts after 200 queries is not yet), the largest over the
        ``LONGEST_MEMORY_S`` up to the last chunk (0.0: nothing measured yet). Longer than the
        10 s window: a chunk of long texts on a CPU runs 15-40 s, and queries between two of
        them are no sign its texts were never measured."""
        with self._lock:
            return self._lengths[0][0] if self._lengths else 0.0

    def rate(self) -> float:
        """Tokens per second of running; the last measured rate when nothing finished lately
        (0.0 until a first chunk finished)."""
        tokens, _, busy = self._measured()
        return tokens / busy if busy else 0.0

    def work_rate(self, attention: float) -> float:
        """``work`` per second of running (as ``rate``), each token counting 1 + its text's
        length / ``attention``."""
        tokens, squares, busy = self._measured()
        return work(tokens, squares, attention) / busy if busy else 0.0


def _busy(events: deque[tuple[float, float, int, int]]) -> float:
    """Seconds covered by the union of the events' ``[start, finish]`` intervals."""
    total, end = 0.0, float("-inf")
    for finish, start, _, _ in sorted(events, key=lambda e: e[1]):
        if finish > end:
            total += finish - max(start, end)
            end = finish
    return total


class AdmissionGate:
    """The queue's room, with the requests still being tokenized counted in.

    ``queued`` reads the tokens the scheduler holds; ``max_tokens`` is
    BGE_M3_MAX_QUEUE_TOKENS. With a ``deadline_s`` (BGE_M3_REQUEST_TIMEOUT_SECS), once a drain
    rate was measured, the queue also holds at most the ``work`` that rate runs in
    ``QUEUE_DEADLINE_SHARE`` of it (``queued_squares``: the queued texts' lengths squared,
    summed; ``attention``: A in ``work``), and at most what it runs in the time left to the
    deadline of any request admitted and not yet answered (``track``) that is still in time.
    A reservation (a lower bound of tokens) counts as that much work, which it is at least;
    the jobs of a request admitted whole and queued one after another (``hold_later``) count
    as what they are. Like the queue, it lets any request in when nothing is queued or
    reserved (a request larger than the whole queue must still be served alone).
    """

    def __init__(self, max_tokens: int, queued: Callable[[], int], drain: DrainMeter,
                 deadline_s: float | None = None,
                 queued_squares: Callable[[], int] = lambda: 0,
                 attention: Callable[[], float] = lambda: DEFAULT_ATTENTION_TOKENS,
                 running: Callable[[], list[Running]] = list,
                 waiting: Callable[[Job], int] = lambda job: 1,
                 chunk_seconds: Callable[[float], float | None] = lambda length: None) -> None:
        self.max_tokens = max_tokens
        self.chunk_seconds = chunk_seconds
        self.queued = queued
        self.running = running
        self.waiting = waiting
        self.queued_squares = queued_squares
        self.attention = attention
        self.drain = drain
        self.deadline_s = deadline_s or None
        self.reserved = 0  # tokens of admitted requests not yet in the queue
        # The queue kept for a request refused as let in only alone (``_keep_for_alone``):
        # until when at most (monotonic; 0: for none), since when it was seen empty (None:
        # not yet), when it was kept from (its length is how long no other keep may begin).
        self._kept_until = 0.0
        self._kept_empty: float | None = None
        self._kept_from = 0.0
        self._no_keep_before = 0.0
        self._lock = threading.Lock()
        # The jobs admitted and not yet answered, and their deadlines (monotonic).
        self._deadlines: dict[Job, float] = {}
        # Jobs of requests admitted whole, not queued yet (a ColBERT rerank's later groups):
        # their texts' tokens and lengths squared.
        self._later: dict[Job, tuple[int, int]] = {}
        self._deadlines_lock = threading.Lock()  # taken inside _lock, never around it

    def track(self, job: Job, answered: Future) -> None:
        """Count an admitted ``job``'s deadline until its ``answered`` future is done, while
        texts of it wait in the queue (``waiting``: once its last chunk runs, nothing admitted
        later delays it; review).

        The queue takes turns: a request admitted later shares the runs with one admitted
        before, whose work then ends later than when it was admitted. Held to its own share
        only, an ingestion pipeline's requests of ~30 s each (full-size, 60 s deadline) were
        admitted one beside another as the queue drained, and those admitted first still
        ended in 504s (QA). So no admission may take the queue past the work the measured
        rate runs before such a deadline, while that deadline is still in reach."""
        if job.deadline is None or self.deadline_s is None:
            return
        with self._deadlines_lock:
            self._deadlines[job] = job.deadline
        answered.add_done_callback(lambda _: self._untrack(job))

    def _untrack(self, job: Job) -> None:
        with self._deadlines_lock:
            self._deadlines.pop(job, None)

    def hold_later(self, jobs: Sequence[Job]) -> None:
        """Count ``jobs``, admitted with a request whose first job is queued and queued one
        after another later (a ColBERT rerank's groups of windows: each one's vectors are
        scored and dropped before the next runs), as held until each is queued
        (``queued_later``) or the request ends (``drop_later``), their deadlines protected
        as ``track``'s. Between groups nothing of the request waited in the queue: others were
        admitted into its time, and a later group, let in unchecked, ran late among them
        (review); or the scheduler refused it past BGE_M3_MAX_QUEUE_TOKENS halfway through."""
        with self._deadlines_lock:
            for job in jobs:
                lengths = [len(ids) for ids in job.ids]
                self._later[job] = (sum(lengths), sum(n * n for n in lengths))

    def queued_later(self, job: Job) -> None:
        """``job`` of ``hold_later`` is queued now: the queue counts it."""
        with self._deadlines_lock:
            self._later.pop(job, None)

    def drop_later(self, jobs: Sequence[Job]) -> None:
        """The request of ``hold_later``'s ``jobs`` ended (answered, failed, its client
        gone): those not queued are not coming."""
        with self._deadlines_lock:
            for job in jobs:
                self._later.pop(job, None)

    def _later_held(self) -> tuple[int, int, list[float]]:
        """``hold_later``'s jobs: their tokens, lengths squared, and deadlines."""
        with self._deadlines_lock:
            later = list(self._later.items())
        return (sum(t for _, (t, _) in later), sum(q for _, (_, q) in later),
                [job.deadline for job, _ in later if job.deadline is not None])

    def _share(self, own_bound: int = 0) -> _Share | None:
        """The deadline's share now (None: no deadline, or no rate measured yet), not
        counting ``own_bound`` (the reservation of the request it is asked for)."""
        if self.deadline_s is None:
            return None
        attention = self.attention()
        rate = self.drain.work_rate(attention)
        if rate <= 0:
            return None
        later_tokens, later_squares, later = self._later_held()
        chunks = [r for r in self.running() if not r.solo]
        running = _running_work(chunks, rate, attention)
        tokens, squares = self.queued() + later_tokens, self.queued_squares() + later_squares
        held = work(tokens, squares, attention) + self.reserved - own_bound + running
        # The texts held, running ones included: their mean length against the rate's.
        tokens += sum(r.tokens for r in chunks)
        squares += sum(r.squares for r in chunks)
        length = squares / tokens if tokens else 0.0
        unmeasured = length if length > UNMEASURED_SPREAD * self.drain.longest() else 0.0
        now = time.monotonic()  # the jobs' deadlines' clock
        with self._deadlines_lock:
            tracked = list(self._deadlines.items())
        # Those already out of reach are not protected by refusing everyone else, nor those
        # with nothing left to wait for (a later group still to queue has).
        earlier = min(itertools.chain(
            (r for job, d in tracked if (r := (d - now) * rate) >= held and self.waiting(job)),
            (r for d in later if (r := (d - now) * rate) >= held)), default=math.inf)
        # Every job queued has a deadline and leaves the queue by it (the scheduler expires
        # what is left of it), a request being tokenized (not the one asking) within a
        # deadline from now, and a chunk in progress runs to its end past its deadline (review:
        # Retry-After 1 for the ~15 s an 8k-token chunk of a 3 s request still ran), counted
        # for at most a deadline (the rate's estimate of a long chunk read off short ones can
        # be far off: 1,204 s of work held, on the tiny model, for a request cut at 3 s): what
        # is held is gone by the last of them, whatever the rate says of it (none known: no
        # bound).
        horizon = max([d - now for _, d in tracked] + [d - now for d in later]
                      + ([self.deadline_s] if self.reserved - own_bound > 0 else []),
                      default=math.inf)
        if not math.isinf(horizon):
            horizon = max(horizon, min(running / rate, self.deadline_s))
        return _Share(rate * self.deadline_s * QUEUE_DEADLINE_SHARE, held, rate, attention,
                      earlier, horizon, unmeasured)

    def _rooms(self) -> tuple[int, _Share | None, int]:
        """The room under BGE_M3_MAX_QUEUE_TOKENS, the deadline's share, and ``room``."""
        tokens = self.max_tokens - self.queued() - self.reserved - self._later_held()[0]
        share = self._share()
        return tokens, share, tokens if share is None else min(tokens, share.room)

    def room(self) -> int:
        """Tokens that may still be admitted (negative: over, by reservations): the room
        under BGE_M3_MAX_QUEUE_TOKENS, or the work left in the deadline's share, where less."""
        return self._rooms()[2]

    def limit(self) -> int:
        """Tokens the queue may hold now: what it holds (queued and reserved) and its
        ``room`` (under the deadline's share, tokens of short texts: a long text's count more;
        none when it holds more than its share, as long texts let in alone can)."""
        return self.queued() + self.reserved + self._later_held()[0] + max(0, self.room())

    def retry_after(self, needed: float, rate: float | None = None) -> float:
        """Seconds until ``needed`` more tokens of room have drained at ``rate`` (default:
        the measured tokens/s); at least 1, at most ``MAX_RETRY_AFTER_S``; 1 before anything
        was measured."""
        rate = self.drain.rate() if rate is None else rate
        if rate <= 0 or needed <= 0:
            return 1.0
        return float(min(MAX_RETRY_AFTER_S, max(1, math.ceil(needed / rate))))

    def refusal(self, needed: float, tokens_room: int, share: _Share | None,
                keep: bool = True) -> Overloaded:
        """The 429 for a request of at least ``needed`` tokens (under the ``share``, its
        work), more than the room under BGE_M3_MAX_QUEUE_TOKENS (``tokens_room``) or the
        deadline's ``share`` has."""
        # Not the bound itself: it stops counting once past the room (a request of 2,880
        # tokens was said to need "at least 448").
        if share is not None and share.room < tokens_room:
            return self._late(needed, share, keep=keep)
        return Overloaded(
            f"the queue is full: {self.max_tokens - tokens_room} of {self.max_tokens} tokens "
            "(BGE_M3_MAX_QUEUE_TOKENS) are queued or being admitted, and this request needs "
            f"more than the {max(tokens_room, 0)} free; retry after the Retry-After seconds",
            retry_after=self._by_horizon(self.retry_after(needed - tokens_room), share))

    def _late(self, needed: float, share: _Share, whole: _Share | None = None,
              keep: bool = True) -> Overloaded:
        """The 429 for ``needed`` work past the ``share``; Retry-After from ``whole`` (default
        ``share``: a retry has its whole deadline again)."""
        assert self.deadline_s is not None
        whole = share if whole is None else whole
        why = ("the time left to the deadline of a request admitted before: more would "
               "make it late, as requests take turns" if share.tight else
               f"{QUEUE_DEADLINE_SHARE:g} of BGE_M3_REQUEST_TIMEOUT_SECS={self.deadline_s:g} "
               "or of what this request's deadline has left: more would finish late together")
        # Where the rate is a guess (``_Share.unmeasured``), not for one let in only alone: the
        # queue is kept for it by its Retry-After (review: a keep of 2 s ended before the
        # queue drained).
        chunk = (self.chunk_seconds(whole.unmeasured)
                 if whole.unmeasured and needed <= whole.own else None)
        guess = ("" if chunk is None else
                 "; a guess: that rate was measured on shorter texts than those queued, whose "
                 f"chunks take ~{chunk:.1f}s each at the speed the start-up probe measured and "
                 "will measure it")
        said = (f"the queue is full: ~{share.held / share.rate:.1f}s of work are queued, "
                "running or being admitted (at the measured drain rate, a long text's tokens "
                f"counting more for attention{guess}), and the queue takes at most "
                f"{share.budget / share.rate:.1f}s of it ({why}), and this request needs "
                f"~{needed / share.rate:.1f}s, more than the "
                f"~{max(share.room, 0) / share.rate:.1f}s free")
        if needed > whole.own:
            # It goes in only alone: when what is held now has drained (QA: such requests
            # were told to retry in 29-60 s, as if room for them would come), and the queue
            # is kept for it until then.
            retry_after = self._by_horizon(self.retry_after(whole.held, share.rate), whole)
            kept = (" (the queue is kept for it until then)"
                    if keep and self._keep_for_alone(retry_after) else "")
            return Overloaded(
                said + "; more than the deadline's share by itself, it is let in only when "
                f"nothing else is queued{kept}, and may still miss the deadline: send fewer or "
                "shorter texts a request, or raise BGE_M3_REQUEST_TIMEOUT_SECS",
                retry_after=retry_after)
        # Bound by an earlier request's deadline, the room stays as it is while the queue
        # drains (both fall together) until that request is answered (review: Retry-After 1,
        # refused again): when its deadline or all that is held has passed, whichever first.
        wait = min(whole.earlier, whole.held) if whole.tight else needed - whole.room
        retry_after = self._by_horizon(self.retry_after(wait, share.rate), whole)
        if chunk is not None:
            retry_after = min(retry_after, max(UNMEASURED_RETRY_S,
                                               math.ceil(UNMEASURED_CHUNKS * chunk)))
        return Overloaded(said + "; retry after the Retry-After seconds",
                          retry_after=retry_after)

    @staticmethod
    def _by_horizon(retry_after: float, share: _Share | None) -> float:
        """``retry_after``, no later than when what is held has left the queue by its
        deadlines (QA: behind one request of ~30 s of work under a 3 s deadline, let in
        alone, queries were told Retry-After 29-30 s, and an openai client's took 15 s for a
        server free again after 3 s); as it is without a share or a known horizon."""
        if share is None or math.isinf(share.horizon):
            return retry_after
        return float(min(retry_after, max(1, math.ceil(share.horizon))))

    def full(self) -> Overloaded | None:
        """The refusal when no request can be admitted whatever its size (O(1)), else None."""
        with self._lock:
            tokens, share, room = self._rooms()
            # As in reserve(): while the queue is kept, others' reservations do not stop the
            # request it is kept for (review).
            reserved = 0 if self._keeping(time.monotonic()) else self.reserved
            busy = reserved or self.queued() or self._later_held()[0]
        # Not a keep: no request of this size exists (review: with a sub-second share it
        # began one, unlocked, for no one).
        return self.refusal(1, tokens, share, keep=False) if busy and room <= 0 else None

    def reserve(self, bound: int) -> None:
        """Hold ``bound`` tokens of room (while tokenizing, until the exact tokens are
        queued; ``release`` them then); raises ``Overloaded`` if they are not there."""
        with self._lock:
            tokens, share, room = self._rooms()
            # While the queue is kept, the reservations of requests it will refuse once
            # tokenized do not make the one it is kept for wait (review).
            reserved = 0 if self._keeping(time.monotonic()) else self.reserved
            if (reserved or self.queued() or self._later_held()[0]) and bound > room:
                raise self.refusal(bound, tokens, share)
            self.reserved += bound

    def release(self, bound: int) -> None:
        with self._lock:
            self.reserved -= bound

    def check_in_time(self, tokens: int, bound: int, left_s: float | None = None, *,
                      squares: int) -> None:
        """Refuse (``Overloaded``) a request of ``tokens`` exact tokens to queue (``squares``:
        their texts' lengths squared, summed; ``bound`` of them still reserved) whose work
        would take the queue past what drains in its share of the deadline, or of the
        ``left_s`` seconds its own deadline leaves (it waited for a tokenizing slot); the
        lower bound reserved before tokenizing counts words, and ids ran ~3x past it. The
        scheduler's own check is BGE_M3_MAX_QUEUE_TOKENS'; alone, a request always goes in."""
        with self._lock:
            whole = self._share(bound)
            if whole is None:
                return
            assert self.deadline_s is not None
            share = whole
            if left_s is not None:
                share = share.within(max(0.0, left_s) / self.deadline_s)
            needed = work(tokens, squares, share.attention)
            # Nothing queued (a chunk may run; others may be tokenizing, their own check to
            # come: counting their reservations, a large request refused as "let in alone"
            # never was under steady traffic; review), nor a later group of one admitted.
            alone = not (self.queued() or self._later_held()[0])
            if not alone and tokens and needed > share.room:
                # The share's refusal whatever BGE_M3_MAX_QUEUE_TOKENS' room (the scheduler's
                # to check): it is what this request does not fit (review).
                raise self._late(needed, share, whole)
            if not tokens:
                return
            now = time.monotonic()
            if needed > whole.own:
                if self._keeping(now):
                    self._end_keep(now)  # the request it was kept for: in, alone
            elif self._keeping(now):
                raise self._kept(share)

    def _keep_for_alone(self, retry_after: float) -> bool:
        """Keep the queue for a request refused as let in only alone, told to come back in
        ``retry_after`` seconds: no other request is admitted (``_kept``) until it is back,
        so the queue drains and it finds it empty. Under steady traffic of small requests it
        never did (QA: one of 6 texts of 2,500 words, which ran in 3.1-3.9 s alone, refused
        35-36 times in 40 s, each time Retry-After 1 s, beside 432-752 small requests
        answered). Not past ``KEPT_GRACE_S`` after the queue was first seen empty, nor past
        its Retry-After and that grace: one that does not come back (a client that split
        its request, as the 429 advises) is not waited for (review: everyone was refused
        for the whole Retry-After, up to a minute, on an idle queue). One at a time, and none
        begins before as long again as the last one lasted has passed, so other traffic has
        its turn between requests too large to share the queue. Whether the queue is kept
        now (for this request or one that came before it)."""
        now = time.monotonic()
        if self._keeping(now):
            return True
        if now < self._no_keep_before:
            return False
        self._kept_until, self._kept_empty, self._kept_from = (
            now + retry_after + KEPT_GRACE_S, None, now)
        return True

    def _keeping(self, now: float) -> bool:
        """Whether the queue is kept now (``_keep_for_alone``); ends the keep whose time is
        up, or whose queue has been empty for ``KEPT_GRACE_S``."""
        if not self._kept_until:
            return False
        # Empty: nothing queued nor running (a chunk in progress is part of the Retry-After it
        # was told; counted from the queue alone, the keep ended while a 15 s chunk ran and it
        # came back to a busy queue: review).
        if (self.queued() or self._later_held()[0]
                or any(not r.solo for r in self.running())):
            self._kept_empty = None
        elif self._kept_empty is None:
            self._kept_empty = now
        if now >= self._keep_ends():
            self._end_keep(now)
            return False
        return True

    def _keep_ends(self) -> float:
        """When the keep ends at the latest: its Retry-After and grace, or the grace once the
        queue was seen empty."""
        if self._kept_empty is None:
            return self._kept_until
        return min(self._kept_until, self._kept_empty + KEPT_GRACE_S)

    def _end_keep(self, now: float) -> None:
        self._no_keep_before = now + max(KEPT_GRACE_S, now - self._kept_from)
        self._kept_until, self._kept_empty = 0.0, None

    def _kept(self, share: _Share) -> Overloaded:
        """The 429 of a request that would fit, while the queue is kept for one that goes in
        only alone: Retry-After when it is no longer kept (by then that one is in, and what
        it holds bounds the next admission as any request's does)."""
        assert self.deadline_s is not None
        wait = max(1.0, self._keep_ends() - time.monotonic())
        return Overloaded(
            "the queue is full: it is kept for a request too large to share it (past "
            f"{QUEUE_DEADLINE_SHARE:g} of BGE_M3_REQUEST_TIMEOUT_SECS={self.deadline_s:g} by "
            "itself, it is let in only when nothing else is queued) while what is held "
            f"drains (~{share.held / share.rate:.1f}s of work at the measured drain rate); "
            "retry after the Retry-After seconds",
            retry_after=float(min(MAX_RETRY_AFTER_S, math.ceil(wait))))


def _running_work(running: list[Running], rate: float, attention: float) -> float:
    """What the chunks in progress still have to run: each one's work less what ``rate``
    (all workers') shared among them ran of it so far. A text leaves the queue when its chunk
    starts: uncounted, a 20-40 s chunk of long texts was room for the next request (QA)."""
    runs = [r for r in running if not r.solo]
    each = rate / max(1, len(runs))
    return sum(max(0.0, work(r.tokens, r.squares, attention) - r.seconds * each) for r in runs)


@dataclass(frozen=True)
class _Share:
    """The work the queue may hold (``budget``): the deadline's share (``own``) or what runs
    before the deadline of a request admitted before (``earlier``), where less; what it holds
    (``held``: queued and reserved), at ``rate`` work per second, ``attention`` A."""

    own: float
    held: float
    rate: float
    attention: float
    earlier: float = math.inf
    horizon: float = math.inf  # seconds until what is held has left the queue at the latest
    # The texts held, where far longer than those the rate was measured on
    # (UNMEASURED_SPREAD): their mean length (0.0: the rate is theirs).
    unmeasured: float = 0.0

    @property
    def budget(self) -> float:
        return min(self.own, self.earlier)

    @property
    def tight(self) -> bool:
        """Whether an earlier request's deadline is what bounds it."""
        return self.earlier < self.own

    @property
    def room(self) -> int:
        return math.floor(self.budget - self.held)

    def within(self, part: float) -> _Share:
        """The share of ``part`` of the deadline's time (what a request's deadline has left)."""
        return replace(self, own=min(self.own, self.own * part))



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
        self.gate = AdmissionGate(max_queue_tokens, engine.queued_tokens, drain, deadline_s,
                                  engine.queued_squares,
                                  functools.partial(attention_tokens, engine), engine.running,
                                  engine.waiting, functools.partial(chunk_seconds, engine))
        self.refused = 0
        self._lock = threading.Lock()
        self._bounds = ThreadPoolExecutor(1, thread_name_prefix="bgeserve-admission")
        self._aborted: BgeServeError | None = None
        self._slots = slots
        self._tokenizing: asyncio.Semaphore | None = None  # made on the loop that serves
        self._waiting = 0  # requests waiting for a tokenizing slot
        self._stops: set[threading.Event] = set()  # of the requests being tokenized

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

    def queue(self, job: Job, bound: int = 0, later: bool = False,
              rest: Sequence[Job] = ()) -> Future:
        """Submit ``job`` (its ``bound`` still reserved): the queue's exact checks, the share
        of the deadline's (``AdmissionGate.check_in_time``; not for ``later`` jobs of a
        request admitted already, as a ColBERT rerank's later groups) and the scheduler's,
        its refusal (counted by the scheduler) with a Retry-After from the drain rate, not the
        scheduler's 1 s. ``rest``: the request's jobs to queue ``later``, one after another:
        checked with this one, and held for until queued (``AdmissionGate.hold_later``)."""
        if later:
            self.gate.queued_later(job)
        elif self.gate.deadline_s is not None:
            # What it queues: not the texts the cache answered or a repeat of another of its
            # texts runs for (review: a request the cache answered whole was a 429); and the
            # later jobs whole (a rerank's groups: a request is answered in time or not at
            # all, so it is judged whole, as a 429 at once rather than a 504 half way).
            left = None if job.deadline is None else job.deadline - time.monotonic()
            lengths = [len(job.ids[i]) for i in job.pending()]
            lengths += [len(ids) for other in rest for ids in other.ids]
            try:
                self.gate.check_in_time(sum(lengths), bound, left,
                                        squares=sum(n * n for n in lengths))
            except Overloaded as exc:
                raise self._refuse(exc) from None
        try:
            answered = self.engine.submit(job)
        except Overloaded as exc:
            tokens = sum(len(x) for x in job.ids)
            # The scheduler's is BGE_M3_MAX_QUEUE_TOKENS' refusal: tokens, beside this
            # request's own reservation.
            gate = self.gate
            needed = tokens - (gate.max_tokens - gate.queued() - gate.reserved) - bound
            raise Overloaded(exc.message, retry_after=self.gate.retry_after(needed)) from None
        if self.gate.deadline_s is not None:
            self.gate.track(job, answered)
        if rest:
            self.gate.hold_later(rest)
        return answered

    async def submit_jobs(self, chars: int, lower_bound: Callable[[int], int],
                          make: Callable[[], tuple[Plan, list[Job]]],
                          before: Callable[[Job], Awaitable[None]] | None = None
                          ) -> tuple[Plan, list[Job], Future | None]:
        """Admit a request of ``chars`` characters by ``lower_bound(room)``, make its jobs
        on a thread (``make`` tokenizes) and queue the first one: the plan, the jobs and the
        first one's future (None: no job); Overloaded (429) as ``Admission.submit`` raises
        it. The jobs after the first are the caller's to queue, one after another.
        ``before(job)`` is awaited before the first is queued (room for its output). The
        later jobs are held for (``AdmissionGate.hold_later``) until queued with ``queue(job,
        later=True)``; ``gate.drop_later(jobs)`` when the request ends."""
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
            first = self.queue(jobs[0], bound, rest=jobs[1:]) if jobs else None
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
            with stopping.stoppable() as stop:  # the thread's context is a copy of this one
                running = asyncio.ensure_future(asyncio.to_thread(work))
            self._stops.add(stop)
            try:
                return await asyncio.shield(running)
            except stopping.Stopped:
                if self._aborted is None:
                    raise
                raise self._aborted from None  # the stop's time is up (abort)
            except asyncio.CancelledError:
                # The caller left (client gone, deadline): the thread stops at its next group
                # of texts (bgeserve.stopping; it tokenized the whole request for no one:
                # 29 MiB under a 15 s deadline, a 504 after 67.7 s). Its slot, its reservation
                # and the body allowance the HTTP layer holds until this returns stay taken
                # until it ends, through a second cancel too (review: the deadline's, then
                # the client's going gave the slot back with the thread still running).
                stop.set()
                while not running.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait({running})
                if not running.cancelled():
                    running.exception()  # retrieved: its error (Stopped) has no one to go to
                raise
            finally:
                self._stops.discard(stop)
        finally:
            self._tokenizing.release()

    def abort(self, error: BgeServeError) -> int:
        """Answer ``error`` to every request waiting for a tokenizing slot or being tokenized,
        and to every request from now on; returns how many. A shutdown's time is up: behind a
        backlog of big requests, or tokenizing one, they would go on past the HTTP server's
        grace, which cancels them (a plain-text 500; QA: a request of 1.2M tokens at SIGTERM
        with BGE_M3_SHUTDOWN_TIMEOUT_SECS=2). Those tokenizing stop at their next group of
        texts (``stopping``)."""
        self._aborted = error
        waiting = self._waiting
        if self._tokenizing is not None:
            for _ in range(waiting):  # each wakes, sees the error and gives its slot back
                self._tokenizing.release()
        for stop in self._stops:
            stop.set()
        return waiting + len(self._stops)

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
