"""How much workspace each worker may use: one formula, one set of defaults.

``(available − workers·model − headroom) · safety / workers`` (SPEC §4.5). The server's tuner,
a plain ``Engine`` and ``bgeserve probe`` all size their budget here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from bgeserve.tuning import memory

log = logging.getLogger("bgeserve.tuning")
HEADROOM_BYTES = 256 << 20  # for the Python heap, tokenizer buffers and the HTTP layer
DEFAULT_SAFETY_FACTOR = 0.7  # BGE_M3_MEMORY_SAFETY_FACTOR's default


def budget(available: int, workers: int, model_cost: int, *,
           safety_factor: float = DEFAULT_SAFETY_FACTOR, extra_sessions: int = 0) -> int:
    """Workspace bytes per worker, counting ``extra_sessions`` (a probe's) as more workers."""
    return worker_budget(available, workers + extra_sessions, model_cost,
                         headroom=HEADROOM_BYTES, safety_factor=safety_factor)


def split_available(available: int, resident: tuple[int, int], share: float) -> tuple[int, int]:
    """The memory two models in one process each tune with (bge-m3 and its reranker): each
    keeps its own ``resident`` weights, and what both leave free is shared, ``share`` of it to
    the second. Each tuner then takes its headroom and safety factor from its part, so the two
    budgets together never exceed what one process may use."""
    if not 0 < share < 1:
        raise ValueError(f"share={share} must be in (0, 1); check BGE_M3_RERANK_MEMORY_SHARE")
    free = max(0, available - resident[0] - resident[1])
    second = int(free * share)
    return resident[0] + free - second, resident[1] + second


def worker_budget(
    available: int, workers: int, model_cost: int, *, headroom: int, safety_factor: float
) -> int:
    """Workspace bytes each worker may use: ``(available − workers·model − headroom)·safety / workers``.

    Floored at 0; the caller refuses to start when that cannot hold one ``max_seq`` text.
    """
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 (this is a bug in the caller)")
    if not 0 < safety_factor <= 1:
        raise ValueError(
            f"safety_factor={safety_factor} must be in (0, 1]; check BGE_M3_MEMORY_SAFETY_FACTOR"
        )
    free = available - workers * model_cost - headroom
    return max(0, int(free * safety_factor / workers))


def measure_model_cost(load: Callable[[], None], workers: int, model_bytes: int = 0,
                       copies: int | None = None) -> int:
    """Memory per worker: RSS growth while ``load`` opens every session and primes it.

    Never less than ``copies`` × ``model_bytes`` (the ONNX files) shared among the workers:
    ONNX Runtime maps external weight data, so a primed session is not yet fully resident
    (full-size fp32: 1.35 GiB of 2.27 GB) and grows as texts touch new rows of the embedding
    table. The budget must hold the end state. ``copies``: weight copies the workers keep
    (1 where they share one session, as on the CPU; default one per worker).
    """
    workers = max(workers, 1)
    copies = workers if copies is None else max(1, copies)
    memory.trim_heap()
    before = memory.rss_bytes()
    started = time.monotonic()
    load()
    measured = max(0, memory.rss_bytes() - before) // workers
    cost = max(measured, model_bytes * copies // workers)
    log.info("model loaded in %.1fs: %d MiB RSS per worker (counted as %d MiB; %d worker%s, "
             "%d cop%s of the weights)", time.monotonic() - started, measured >> 20, cost >> 20,
             workers, "s" if workers > 1 else "", copies, "ies" if copies > 1 else "y")
    return cost
