"""Turns at measuring: starts that share one cache directory (replicas on one volume) time
the variant choice one at a time, the others waiting for its result in the cache.

Replicas started at once each timed their candidates while the others ran (bf16 21-42k
tokens/s against 182-282k alone) and the last one's skewed choice was kept for all. An flock
is let go however its holder ends (``kill -9`` included). Where none can be taken (a read-only
cache, a mount without locks: NFS without lockd answers ENOLCK) the start measures without
one, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("bgeserve.probe")
POLL_S = 0.2  # how often a waiting start looks again (and at its stop event)


@dataclass(frozen=True)
class Turn:
    """``held``: this process holds the lock (False: none could be taken, or it stopped
    waiting); ``waited``: another process held it first (its result may be cached now)."""

    held: bool
    waited: bool


@contextmanager
def measuring(cache_dir: Path, key: str, stop: threading.Event | None = None,
              on_wait: Callable[[], None] | None = None) -> Iterator[Turn]:
    """Hold ``key``'s measuring lock in ``cache_dir`` for the body, waiting for another
    process that holds it (``on_wait`` is told once), until ``stop`` is set."""
    path = Path(cache_dir) / f".measuring-{key[:32]}.lock"
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        # Read-only is enough for flock: a lock file another uid made (0644) opens so.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError as exc:
        log.debug("no measuring lock at %s (%s)", path, exc)
        yield Turn(held=False, waited=False)
        return
    held = waited = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                pass
            except OSError as exc:
                log.warning("cannot lock %s (%s): measuring without waiting for other "
                            "processes on this cache directory", path, exc.strerror)
                break
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            if stop is None:
                time.sleep(POLL_S)
            elif stop.wait(POLL_S):
                break  # stopping: the caller ends without measuring
        yield Turn(held=held, waited=waited)
    finally:
        if held:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
