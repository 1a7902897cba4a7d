#!/usr/bin/env python3
"""What a run pays the first time its runtime meets its shape, per variant (raw runtime).

Each variant's session is opened as bgeserve opens it (``serving_loss._open_raw``), warmed on a
16-token run, then each shape below runs once new and twice more (two interleaved rounds, as
the probe times them): the first run less the best repeat is what that shape cost new. The shapes hold token counts (batch × length) the session
has not run; the last ones hold counts it has, split otherwise (what ``engine/shapes.py``
counts as known). ``bgeserve probe`` measures the same on three short shapes
(``tuning.runcost.measure_new_shape``):

    python scripts/new_shape_cost.py --export-dir EXPORT --variants ov-int8,bf16,int8,fp32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving_loss import _open_raw  # after the path above

NEW = ((1, 67), (1, 131), (1, 263), (2, 131), (1, 521), (4, 131), (2, 263))
SPLIT = ((1, 262), (1, 524), (2, 262))  # 262, 524, 524 tokens: counts NEW ran, split otherwise


def costs(run, shapes, clock=time.perf_counter) -> list[tuple[tuple[int, int], float, float]]:
    """``(shape, first-run extra seconds, best repeat seconds)`` per shape, in order (each once,
    then two interleaved rounds: ``runcost.first_and_best``, as the probe times them)."""
    from bgeserve.tuning.runcost import first_and_best

    return [(shape, first - best, best)
            for shape, (first, best) in first_and_best(run, shapes, 2, clock).items()]


def main(argv: list[str] | None = None) -> int:
    from bgeserve.service.warmup import synthetic_chunk

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export-dir", type=Path, required=True)
    ap.add_argument("--variants", default="ov-int8,bf16,int8,fp32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    print("| variant | new counts: extra ms on the first run / best repeat ms | "
          "known counts split otherwise |")
    print("|---|---|---|")
    for variant in args.variants.split(","):
        session = _open_raw(args.export_dir, variant, args.threads)

        def run(batch: int, seq: int, session=session) -> None:
            session(*synthetic_chunk(batch, seq))

        run(1, 16)
        cells = [", ".join(f"{b}×{s} +{x * 1e3:.1f} / {t * 1e3:.0f}"
                           for (b, s), x, t in costs(run, shapes)) for shapes in (NEW, SPLIT)]
        print(f"| {variant} | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
