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
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bgeserve.errors import Overloaded

DRAIN_WINDOW_S = 10.0  # finished chunks younger than this measure the rate
MIN_SPAN_S = 1.0  # a burst of chunks in 50 ms is not a rate of 20x their tokens per second
MAX_RETRY_AFTER_S = 60.0


class DrainMeter:
    """Tokens finished per second over the last ``window`` seconds (thread-safe)."""

    def __init__(self, window: float = DRAIN_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0
        self._last_rate = 0.0
        self._lock = threading.Lock()

    def record(self, tokens: int) -> None:
        """A chunk of ``tokens`` (real tokens) finished now."""
        with self._lock:
            now = self.clock()
            self._events.append((now, tokens))
            self._total += tokens
            self._expire(now)

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._total -= self._events.popleft()[1]

    def rate(self) -> float:
        """Tokens per second; the last measured rate when nothing finished lately (0.0 until
        a first chunk finished)."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            if self._events:
                span = max(MIN_SPAN_S, now - self._events[0][0])
                self._last_rate = self._total / span
            return self._last_rate


class AdmissionGate:
    """The queue's room, with the requests still being tokenized counted in.

    ``queued`` reads the tokens the scheduler holds; ``max_tokens`` is
    BGE_M3_MAX_QUEUE_TOKENS. Like the queue, it lets any request in when nothing is queued
    or reserved (a request larger than the whole queue must still be served alone).
    """

    def __init__(self, max_tokens: int, queued: Callable[[], int], drain: DrainMeter) -> None:
        self.max_tokens = max_tokens
        self.queued = queued
        self.drain = drain
        self.reserved = 0  # tokens of admitted requests not yet in the queue
        self._lock = threading.Lock()

    def room(self) -> int:
        """Tokens that may still be admitted (negative: over, by reservations)."""
        return self.max_tokens - self.queued() - self.reserved

    def retry_after(self, needed: int) -> float:
        """Seconds until ``needed`` more tokens of room have drained, from the measured rate;
        at least 1, at most ``MAX_RETRY_AFTER_S``; 1 before anything was measured."""
        rate = self.drain.rate()
        if rate <= 0 or needed <= 0:
            return 1.0
        return float(min(MAX_RETRY_AFTER_S, max(1, math.ceil(needed / rate))))

    def refusal(self, bound: int, room: int | None = None) -> Overloaded:
        """The 429 for a request of at least ``bound`` tokens."""
        room = self.room() if room is None else room
        return Overloaded(
            f"the queue is full: {self.max_tokens - room} of {self.max_tokens} tokens are "
            f"queued or being admitted and this request needs at least {bound} "
            "(BGE_M3_MAX_QUEUE_TOKENS); retry after the Retry-After seconds",
            retry_after=self.retry_after(bound - room))

    def full(self) -> Overloaded | None:
        """The refusal when no request can be admitted whatever its size (O(1)), else None."""
        with self._lock:
            room, busy = self.room(), self.reserved or self.queued()
        return self.refusal(1, room) if busy and room <= 0 else None

    @contextmanager
    def reserve(self, bound: int) -> Iterator[None]:
        """Hold ``bound`` tokens of room while the block runs (tokenizing, submitting);
        raises ``Overloaded`` if they are not there."""
        with self._lock:
            room, busy = self.room(), self.reserved or self.queued()
            if busy and bound > room:
                raise self.refusal(bound, room)
            self.reserved += bound
        try:
            yield
        finally:
            with self._lock:
                self.reserved -= bound
