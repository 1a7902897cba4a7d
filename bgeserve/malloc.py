"""glibc's heap: give back what it keeps (a leaf: the tuner and the HTTP layer both trim it)."""

from __future__ import annotations

import ctypes
import gc


def trim_heap() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim``); False where unavailable.

    glibc raises its mmap threshold after a large block is freed (up to 32 MiB), so later
    blocks come from the heap and stay resident after ``free``. A probe that measures RSS above
    a baseline would then under-read any run that reuses them; trimming first makes every run
    fault its memory in afresh.
    """
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return False
    malloc_trim(0)
    return True


def release_heap() -> bool:
    """Free the cyclic garbage, then ``trim_heap``: what a large request leaves for the cyclic
    collector alone is not in the heap's free memory until it runs. A request cut at its
    deadline while tokenized leaves its ids in cycles (its exceptions' tracebacks hold the
    frames that hold them), and a full collection is rare in a server whose start-up objects
    are frozen: 2,048 texts of 2,300 words left the idle server at 181 MiB, 105 once
    collected (97 before); three in a row had it at 226, 349, 498 MiB (QA: OOM-killed under a
    500 MiB cap). A collection here costs milliseconds: the frozen objects are not walked."""
    gc.collect()
    return trim_heap()
