"""The chunk budgets the probe times: padded tokens per run, so the packer's budget fits the
machine (``time_chunk_budgets`` measures, ``choose_chunk_tokens`` decides). Never imports a
runtime: runs arrive as callables."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from bgeserve.tuning.costmodel import CostModel

logger = logging.getLogger("bgeserve.probe")

# Chunk budgets (padded tokens per run) the probe times, as texts of CHUNK_SEQ tokens batched up
# to each; the backend default (256 ORT CPU, 1,024 OpenVINO: benchmark sweeps) is replaced only
# by a budget at least CHUNK_MARGIN faster, so timing noise cannot move it. Timed without
# padding: a padded chunk takes the graph's masked attention path, whose fixed cost per run
# flatters big batches (full-size int8, 2x128 -> 32x128: 695 -> 864 tokens/s padded, but
# 944 -> 909 unpadded, and 256 is the best budget on the mixed corpus).
CHUNK_CANDIDATES = (256, 1024, 4096)
CHUNK_SEQ = 128
CHUNK_MARGIN = 0.10
CHUNK_ROUNDS = 2
CHUNK_MAX_RUN_SECONDS = 5.0  # a budget whose run takes longer is no chunk size (latency)


def time_chunk_budgets(run: Callable[[int, int], None], candidates: Sequence[int],
                       guard: CostModel, *, seq: int = CHUNK_SEQ,
                       clock: Callable[[], float] = time.perf_counter,
                       log: Callable[[str], None] = logger.info,
                       rounds: int = CHUNK_ROUNDS,
                       max_run_seconds: float = CHUNK_MAX_RUN_SECONDS) -> dict[int, float]:
    """Tokens/s of ``run(T // seq, seq)`` for each budget ``T``.

    Each budget is run once to warm up (its first run pays for allocations), smallest first;
    a budget the ``guard`` says would not fit, whose warm-up fails or takes longer than
    ``max_run_seconds`` (too slow a run to serve as a chunk), ends the list untimed. Then ``rounds``
    rounds each time every budget once, interleaved, and the fastest run counts: a machine
    whose speed drifts (a shared VM) drifts for all budgets alike.
    """
    batches: dict[int, int] = {}  # budget -> texts of ``seq`` tokens per run
    for budget in sorted(candidates):
        batch = max(1, budget // seq)
        if not guard.fits(batch, seq):
            log(f"probe chunk {batch}x{seq}: skipped, predicted not to fit")
            break
        try:
            start = clock()
            run(batch, seq)
            warm = clock() - start
        except Exception as exc:  # noqa: BLE001 - a failing shape is data, not fatal
            log(f"probe chunk {batch}x{seq}: failed, {type(exc).__name__}: {exc}")
            break
        if warm > max_run_seconds:
            log(f"probe chunk {batch}x{seq}: one run took {warm:.1f} s, not a chunk budget "
                "(latency): not timed")
            break
        batches[budget] = batch
    best: dict[int, float] = {}
    try:
        for _ in range(rounds):
            for budget, batch in batches.items():
                start = clock()
                run(batch, seq)
                elapsed = clock() - start
                best[budget] = min(best.get(budget, elapsed), elapsed)
    except Exception as exc:  # noqa: BLE001 - no timing then; the memory fit stands
        log(f"probe chunk timing failed, {type(exc).__name__}: {exc}")
        return {}
    rates = {budget: batch * seq / max(best[budget], 1e-9) for budget, batch in batches.items()}
    for budget, batch in batches.items():
        log(f"probe chunk {batch}x{seq} ({budget} padded tokens): {rates[budget]:.0f} tokens/s")
    return rates


def choose_chunk_tokens(default: int, rates: Mapping[int, float],
                        margin: float = CHUNK_MARGIN) -> int:
    """``default``, unless a timed budget ran at least ``margin`` faster than it did (a
    default that was not timed stays)."""
    if default not in rates:
        return default
    best = max(rates, key=lambda t: rates[t])
    return best if rates[best] / rates[default] >= 1 + margin - 1e-9 else default
