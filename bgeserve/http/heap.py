"""Give the heap a large request freed back to the OS once it ended (glibc ``malloc_trim``).

A request's parsed texts and token ids are freed when it ends, but glibc keeps the pages in
its heap: a body of 2,048 texts of 600 words (7.1 MiB) left +70 MiB resident after its texts
were tokenized and dropped, +4 MiB once trimmed (tiny model's tokenizer, 3.97 M ids as int64;
`/tmp/trimexp.py`-style, not kept). Under a 400 MiB memory cap the idle server's memory rose
252 -> 347 -> 397 MiB over bursts of such requests, none of it counted by any allowance, until
a burst the allowances had let in got it OOM-killed (QA). So a request whose body held at least
``TRIM_AFTER_BYTES`` has the heap trimmed when it ends: on a thread (``malloc_trim`` takes each
arena's lock in turn, ~25 ms on a 1 GiB heap), one at a time, at most once per ``every_s``; one
that comes sooner is done when that period is over, so the last of a burst is trimmed too.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from bgeserve.malloc import release_heap

TRIM_AFTER_BYTES = 1 << 20
TRIM_EVERY_S = 1.0


class HeapTrim:
    """``after(body_bytes)``, in the event loop, when a request ends: trim the heap if its
    body was large (``trim``: ``malloc.release_heap``, the cyclic garbage collected first;
    ``clock``: monotonic seconds)."""

    def __init__(self, trim: Callable[[], object] = release_heap,
                 clock: Callable[[], float] = time.monotonic,
                 every_s: float = TRIM_EVERY_S) -> None:
        self.trim = trim
        self.clock = clock
        self.every_s = every_s
        self.trims = 0  # started (tests, /metrics-free: a count, not a gauge worth exporting)
        self._last = -math.inf  # when the last trim started
        self._busy = False  # a trim running, or one scheduled for later

    def after(self, body_bytes: int) -> None:
        if body_bytes < TRIM_AFTER_BYTES or self._busy:
            return
        self._busy = True
        wait = self._last + self.every_s - self.clock()
        if wait <= 0:
            self._start()
            return
        try:
            asyncio.get_running_loop().call_later(wait, self._start)
        except RuntimeError:  # no loop running (a request's task closed by the collector)
            self._busy = False

    def _start(self) -> None:
        self._last = self.clock()
        try:
            done = asyncio.get_running_loop().run_in_executor(None, self.trim)
        except RuntimeError:  # the loop's executor shut down: the server is stopping
            self._busy = False
            return
        self.trims += 1
        done.add_done_callback(self._done)

    def _done(self, done: asyncio.Future[object]) -> None:
        self._busy = False
        if not done.cancelled():
            done.exception()  # retrieved: a failed trim only leaves the heap as it was
