"""What the probe runs: exact-shape synthetic chunks on a dedicated session.

``synthetic_run`` feeds a session ids of exactly the asked shape (no text, no tokenizer);
``chunk_timing_run`` wraps it the way the chunk-budget timing needs it; ``time_workload``
times the fixed workload the measured variant choice compares candidates on.
"""

from __future__ import annotations

import time
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


SERVING_MMAP_THRESHOLD = memory.SERVING_MMAP_THRESHOLD  # what chunk timing must reproduce


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


# The variant choice's workload (``time_workload``): short queries, one text per run (the
# unpadded path a lone text takes), then a mixed batch of 16 texts of 24-400 tokens packed the
# way the scheduler packs length neighbours under the runtime's chunk budget (padded chunks:
# the masked path mixed lengths take). ~1,500 tokens: a few seconds per round on 2 cores.
QUERY_LENGTHS = (16, 16, 16, 16)
MIXED_LENGTHS = (24,) * 8 + (64,) * 6 + (160,) * 3 + (400,)


def workload_chunks(chunk_tokens: int, max_seq: int | None = None) -> list[tuple[int, int]]:
    """The workload's runs, ``(batch, seq)``: each query alone, then the mixed batch in
    chunks of equal lengths holding as many texts as ``chunk_tokens`` allows (a text longer
    than that runs alone). A length past ``max_seq`` is cut to it, as the server truncates
    such a text: a model of fewer positions failed every candidate on the longer shapes."""
    cap = max_seq or max(MIXED_LENGTHS)
    chunks = [(1, min(n, cap)) for n in QUERY_LENGTHS]
    lengths = [min(n, cap) for n in MIXED_LENGTHS]
    for length in sorted(set(lengths)):
        count, per = lengths.count(length), max(1, chunk_tokens // length)
        while count:
            chunks.append((min(per, count), length))
            count -= chunks[-1][0]
    return chunks


def time_workload(run: Callable[..., None], chunk_tokens: int, *, max_seq: int | None = None,
                  rounds: int = 2, max_seconds: float = 60.0,
                  clock: Callable[[], float] = time.perf_counter) -> tuple[float, int]:
    """Tokens/s of ``run(batch, seq, padded=batch > 1)`` over ``workload_chunks``, and the
    rounds timed.

    One warm-up round first (first runs of a shape pay for allocations and, on OpenVINO, for
    compiling it), then ``rounds`` rounds; each chunk's fastest run counts, so a machine whose
    speed drifts (a shared VM) costs the candidate least. A warm-up longer than
    ``max_seconds`` is the answer by itself (0 rounds): a variant that slow is not the fastest.
    """
    chunks = workload_chunks(chunk_tokens, max_seq)
    best = [float("inf")] * len(chunks)
    done = -1  # the warm-up is round -1
    started = clock()
    while done < rounds:
        for i, (batch, seq) in enumerate(chunks):
            start = clock()
            run(batch, seq, padded=batch > 1)
            best[i] = min(best[i], clock() - start)
        done += 1
        if done == 0 and clock() - started > max_seconds:
            break
    tokens = sum(batch * seq for batch, seq in chunks)
    return tokens / max(sum(best), 1e-9), done
