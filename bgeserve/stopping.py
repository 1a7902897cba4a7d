"""Work on a thread that its caller gave up on stops at its next step (a leaf: the service
asks, the engine's tokenizer checks).

A request past its deadline, or whose client left, while its texts were being tokenized was
answered only when the thread ended, and the thread tokenized the whole request for no one:
29 MiB of texts under a 15 s deadline were a 504 after 67.7 s, a core busy all along (tiny
model, 2-core Zen 3). ``asyncio.to_thread`` runs its function in a copy of the caller's
context, so the flag set here before the thread starts is the one the thread reads; the
tokenizer checks it between its groups of texts (``engine.tokenizer.GROUP_CHARS``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

_FLAG: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "bgeserve_stop", default=None)


class Stopped(Exception):
    """Raised by ``check`` in work whose caller gave up on it: no one takes its result."""


@contextlib.contextmanager
def stoppable() -> Iterator[threading.Event]:
    """Inside: threads started (``asyncio.to_thread``) see the event this yields; set it to
    have their ``check`` raise ``Stopped``."""
    event = threading.Event()
    token = _FLAG.set(event)
    try:
        yield event
    finally:
        _FLAG.reset(token)


def check() -> None:
    """Raise ``Stopped`` where the work's caller set its event (outside ``stoppable``: never)."""
    event = _FLAG.get()
    if event is not None and event.is_set():
        raise Stopped("the caller gave up on this work")
