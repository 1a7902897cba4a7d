"""What every runtime adapter does the same way: the feeds of a chunk and the errors of a run.

Kept runtime-neutral (no runtime import) so ONNX Runtime and OpenVINO translate failures with
one rule: an allocation failure becomes ``OutOfMemory`` (the scheduler splits the chunk and
retries), anything else ``EngineFailed``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np

from bgeserve.errors import BgeServeError, EngineFailed, OutOfMemory

# Lower-cased fragments of allocation-failure messages: ORT's CPU and CUDA allocators,
# std::bad_alloc, OpenVINO's CPU plugin.
OOM_MARKERS = ("failed to allocate", "bad_alloc", "out of memory", "cudaerrormemoryallocation",
               "cannot allocate")


T = TypeVar("T")


class Shared(Generic[T]):
    """One runtime object (a session, a compiled model) for every worker that asks for it.

    ``acquire()`` opens it on first use (once, under a lock, while the others wait) and counts
    its users; ``release()`` drops it with the last user, so an idle unload frees the weights
    and the next load opens afresh.
    """

    def __init__(self, open_: Callable[[], T]):
        self._open = open_
        self._lock = threading.Lock()
        self._value: T | None = None
        self._users = 0

    def acquire(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._open()
            self._users += 1
            return self._value

    def release(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users == 0:
                self._value = None

    @property
    def users(self) -> int:
        return self._users


def feeds(input_names: Sequence[str], input_ids: np.ndarray,
          attention_mask: np.ndarray) -> dict[str, np.ndarray]:
    """The graph inputs of one padded chunk (token_type_ids, all zero, where a graph has it)."""
    out = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "token_type_ids" in input_names:
        out["token_type_ids"] = np.zeros_like(input_ids)
    return out


def run_failure(exc: Exception, shape: tuple[int, ...], runtime: str) -> BgeServeError:
    """The error a failed run of a chunk of ``shape`` raises (chained to ``exc`` by the caller)."""
    text = str(exc)
    if any(marker in text.lower() for marker in OOM_MARKERS):
        return OutOfMemory(f"{runtime} could not allocate memory for a chunk of shape "
                           f"{shape}: {text}")
    return EngineFailed(f"inference failed for shape {shape}: {text}")
