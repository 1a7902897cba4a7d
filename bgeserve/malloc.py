"""glibc's heap: give back what it keeps (a leaf: the tuner and the HTTP layer both trim it)."""

from __future__ import annotations

import ctypes


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
