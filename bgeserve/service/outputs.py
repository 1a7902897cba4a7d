"""ColBERT output of the requests in progress, held together within one allowance.

A request's ColBERT vectors (``tokens - 1`` rows of 1,024 floats per text) live until the answer
is sent (a large one as it is rendered, ``http/render.py``: rendered whole, its JSON text, ~3x
their float32 size, and its unsent part's copy came on top). ``Engine.admit`` caps one request's
(BGE_M3_MAX_COLBERT_MB, a 413 above it), but requests in progress added up: in a 600 MiB
container three concurrent requests at the 30 MiB cap peaked at 537 MiB (rendered whole).
``OutputAllowance`` holds them all within that same cap: a request whose vectors do not fit
beside those of the requests being answered waits for them, first come first served (its
request deadline bounds the wait); a request alone always fits.

The hold ends once the answer is sent: ``bgeserve.holds.answering()`` opens a request's scope
(the HTTP layer, around the whole request), and ``release_when_answered`` hands the release to
it; under bgeserve's protocol the HTTP layer keeps it until the client has taken the answer
(``guards.InflightLimit``), so unread answers can hold the allowance with no request in
progress, for up to the stall bound (``http/stalls.py``), and a request alone then waits. Outside such a scope (the library) ``Service.embed``'s own ends when its result is returned.
bge-m3's ColBERT rerank scores (``Holding``) hold one group of windows' vectors at a time and
give it back when the request returns (the answer holds scores only): no scope needed.
"""

from __future__ import annotations

import asyncio
from collections import deque


class OutputAllowance:
    """Bytes of ColBERT output held by the requests in progress, at most ``max_bytes`` unless
    one request alone holds more. Used on the event loop only (no lock)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self.waiting = 0  # requests waiting for room (a count: /metrics reads it off the loop)
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._aborted: BaseException | None = None

    def _fits(self, size: int) -> bool:
        return self.held == 0 or self.held + size <= self.max_bytes

    async def acquire(self, size: int) -> float:
        """Hold ``size`` bytes, waiting (in arrival order) until they fit; ``release`` them.
        Returns the seconds waited (a request's queue time, ``timings.record``)."""
        if size <= 0:
            return 0.0
        if self._aborted is not None:
            raise self._aborted
        self._grant()  # drops waiters that left from the head: they hold no turn
        if not self._waiting and self._fits(size):
            self.held += size
            return 0.0
        loop = asyncio.get_running_loop()
        began = loop.time()
        granted = loop.create_future()
        self._waiting.append((size, granted))
        self.waiting += 1
        try:
            await granted
            return loop.time() - began
        except asyncio.CancelledError:
            # The caller left (deadline, client gone): a grant that raced the cancel is given
            # back, and a waiter that was first lets those behind it through.
            if granted.done() and not granted.cancelled():
                self.release(size)
            else:
                self._grant()
            raise
        finally:
            self.waiting -= 1

    def abort(self, error: BaseException) -> int:
        """Answer ``error`` to every request waiting for room, and to every request from now
        on (a shutdown whose time is up); returns how many were waiting. Those holding room go
        on: their answers are being sent (a ColBERT rerank's next group is refused: the
        engine is stopping)."""
        self._aborted = error
        answered = 0
        while self._waiting:
            _, granted = self._waiting.popleft()
            if not granted.done():
                granted.set_exception(error)
                answered += 1
        return answered

    def release(self, size: int) -> None:
        if size <= 0:
            return
        self.held -= size
        self._grant()

    def _grant(self) -> None:
        while self._waiting:
            size, granted = self._waiting[0]
            if granted.done():  # cancelled while waiting
                self._waiting.popleft()
                continue
            if not self._fits(size):
                return
            self._waiting.popleft()
            self.held += size
            granted.set_result(None)


class Holding:
    """One request's room taken group after group (bge-m3's ColBERT rerank scores one group
    of windows at a time, then drops its vectors): ``take`` gives back what the last group
    held, then waits for the next one's; ``give_back`` once the request ends, however."""

    def __init__(self, allowance: OutputAllowance) -> None:
        self.allowance = allowance
        self.size = 0

    async def take(self, size: int) -> float:
        """Hold ``size`` bytes in place of what was held; the seconds waited for them."""
        # Given back first: two requests each waiting for more while holding some could wait
        # on each other for ever. So the query's vectors, kept to the last group, go uncounted
        # while it waits (at most max_seq - 1 rows: 32 MiB at 8,192 tokens).
        self.give_back()
        waited = await self.allowance.acquire(size)
        self.size = size
        return waited

    def give_back(self) -> None:
        size, self.size = self.size, 0
        self.allowance.release(size)
