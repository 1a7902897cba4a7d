"""What the probe runs: exact-shape synthetic chunks on a dedicated session.

``synthetic_run`` feeds a session ids of exactly the asked shape (no text, no tokenizer);
``chunk_timing_run`` wraps it the way the chunk-budget timing needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from bgeserve.tuning import memory
from bgeserve.vocab import PAD_ID

SYNTHETIC_IDS = 260  # probe token ids are drawn from [4, 260): a few pages of embedding rows


def synthetic_run(open_forward: Callable[[], Any],
                  vocab_size: int) -> tuple[Callable[..., None], Callable[[], None]]:
    """A ``run(batch, seq, padded=True)`` over a dedicated session with exact-length synthetic
    ids (``padded=False``: no padding token, the unmasked path; the chunk timing uses it).

    The ids come from a small fixed set (compute does not depend on their values): random ids
    over the whole vocabulary would fault new rows of a memory-mapped embedding table into RSS
    on every run (with readahead, ~1 MiB per token measured), which is model memory growing,
    not workspace.
    """
    forward = open_forward()
    rng = np.random.default_rng(0)
    top = min(max(vocab_size, 5), SYNTHETIC_IDS)

    def run(batch: int, seq: int, padded: bool = True) -> None:
        ids = rng.integers(4, top, size=(batch, seq), dtype=np.int64)
        ids[:, 0], ids[:, -1] = 0, 2
        mask = np.ones((batch, seq), dtype=np.int64)
        if padded and seq > 2:
            # One padding token sends the chunk down the exported graph's masked path (blocked
            # attention) rather than the fused kernel an unpadded chunk gets. The masked path
            # needs more workspace, so every shape measures it: one model then bounds both
            # paths (a lone text's cost is over-, never under-estimated). Measuring lone texts
            # fused and padded batches masked mixed two regimes no single fit describes once
            # the FFN is row-blocked (held-out errors over 30 %).
            ids[-1, -2:] = (2, PAD_ID)
            mask[-1, -1] = 0
        forward.run(ids, mask, dense=True, sparse=True, colbert=True)

    return run, forward.close


# glibc's own mmap threshold in a long-running process (it rises to this after large frees):
# the serving process's allocator state, which chunk timing must reproduce.
SERVING_MMAP_THRESHOLD = 32 << 20


def chunk_timing_run(run: Callable[..., None]) -> Callable[[int, int], None]:
    """``run`` as the probe's chunk timing needs it: unpadded, and under the serving process's
    allocator. The memory probe pins glibc's mmap threshold at 1 MiB so each shape's workspace
    is mapped and unmapped per run; timed that way, every run pays its page faults anew and
    small chunks look up to ~25 % slower than they serve (full-size int8, 2x128 vs 8x128)."""
    state = {"set": False}

    def timed(batch: int, seq: int) -> None:
        if not state["set"]:
            memory.pin_mmap_threshold(SERVING_MMAP_THRESHOLD)
            state["set"] = True
        run(batch, seq, padded=False)

    return timed
