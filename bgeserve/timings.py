"""Where one request's time went, for the answer's headers and its access-log line.

The HTTP layer opens a request's ``measuring()`` scope (``http.context.RequestContext``); the
service ``record``s each model call inside it: the characters and tokens it embedded and its
seconds tokenizing (a tokenizing slot's wait included), queued, and running. The answer then
carries TEI's headers (``x-compute-tokens``, ``x-tokenization-time``, ``x-queue-time``,
``x-inference-time``, ...), which TEI's clients and HF Inference Endpoints' dashboards read. A
leaf, as ``holds``: both layers use it, neither through the other.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Timings:
    """One request's model calls, summed (a similarity or rerank request may make several)."""

    characters: int = 0
    tokens: int = 0
    tokenization_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0
    calls: int = 0

    def headers(self, total_s: float, compute_type: str) -> list[tuple[bytes, bytes]]:
        """TEI's ``ResponseMetadata`` headers (router/src/lib.rs), times in ms, rounded."""
        def ms(seconds: float) -> bytes:
            return str(round(seconds * 1000)).encode()

        return [(b"x-compute-type", compute_type.encode()), (b"x-compute-time", ms(total_s)),
                (b"x-compute-characters", str(self.characters).encode()),
                (b"x-compute-tokens", str(self.tokens).encode()),
                (b"x-total-time", ms(total_s)),
                (b"x-tokenization-time", ms(self.tokenization_s)),
                (b"x-queue-time", ms(self.queue_s)),
                (b"x-inference-time", ms(self.inference_s))]


# The open request's timings (None: no request measured here, e.g. a library caller).
_CURRENT: contextvars.ContextVar[Timings | None] = contextvars.ContextVar(
    "bgeserve_timings", default=None)


@contextlib.contextmanager
def measuring(timings: Timings) -> Iterator[Timings]:
    """One request's scope: what the service records inside it is summed in ``timings``."""
    token = _CURRENT.set(timings)
    try:
        yield timings
    finally:
        _CURRENT.reset(token)


def active() -> bool:
    """Whether a request's scope is open here (what ``record`` needs is then worth computing)."""
    return _CURRENT.get() is not None


class Queued(Protocol):
    """What ``record`` reads of a queued job (``engine.jobs.Job``)."""

    submitted: float
    started: float
    room_wait: float


def record(characters: int, tokens: int, arrived: float, queued: float,
           jobs: Sequence[Queued], ended: float) -> None:
    """Add one model call to the open request's timings (nothing outside one), its parts
    adding up to ``ended - arrived`` (monotonic seconds): tokenizing until the first job was
    submitted (``queued`` where none was), less its wait for room for its ColBERT output;
    each job's waits (for that room, and from its submission to its first chunk: queue);
    and the rest (inference)."""
    timings = _CURRENT.get()
    if timings is None:
        return
    tokenized = jobs[0].submitted if jobs and jobs[0].submitted else queued
    waited = sum(max(0.0, j.started - j.submitted) for j in jobs if j.started and j.submitted)
    # Room for ColBERT output: the first job's wait came before its submission, the later
    # jobs' (a rerank's groups of windows) after the first's.
    first_room = jobs[0].room_wait if jobs else 0.0
    later_room = sum(j.room_wait for j in jobs[1:])
    timings.characters += characters
    timings.tokens += tokens
    timings.tokenization_s += max(0.0, tokenized - arrived - first_room)
    timings.queue_s += waited + first_room + later_room
    timings.inference_s += max(0.0, ended - tokenized - waited - later_room)
    timings.calls += 1
