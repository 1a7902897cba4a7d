#!/usr/bin/env python3
"""``Engine.embed`` throughput of several exports, variants or worker layouts, interleaved.

Each ``NAME=EXPORT:VARIANT[:WORKERS:THREADS]`` gets its own in-process engine (configured as
``scripts/serving_loss.py``'s engine mode: the runtime's chunk budget, the embedding cache off);
all are loaded side by side, then every round embeds bench.py's mixed corpus once on each, the
order reversed every other round. The report gives each one's seconds per round, its speed
against the first per round with the median, and its dense cosine against the first: it answers
"is B faster than A on this machine" where the machine drifts (two exports of one model, say
int8 in two weight encodings):

    python scripts/engine_compare.py --rounds 4 --texts 24 s7=EXPORT_A:int8 u8=EXPORT_B:int8 \\
        fp32=EXPORT_A:fp32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving_loss import MAX_SEQ, corpus  # after the path above


def _engine(spec: str, work: Path) -> Any:
    from bgeserve import Engine, runtime
    from bgeserve.engine import EngineConfig
    from bgeserve.engine.scheduler import SchedulerConfig
    from bgeserve.model.artifacts import resolve
    from bgeserve.runtime import SessionConfig

    export, variant, *layout = spec.split(":")
    workers, threads = (int(layout[0]), int(layout[1])) if layout else (1, 2)
    session = SessionConfig(threads=threads, streams=workers)
    artifacts = resolve(model_path=Path(export), variant=variant, cache_dir=work / "cache",
                        offline=True)
    scheduler = SchedulerConfig(workers=workers, max_chunk_tokens=runtime.get(
        runtime.kind_of(artifacts, session.provider)).chunk_tokens)
    return Engine(artifacts=artifacts, config=EngineConfig(
        max_seq=MAX_SEQ, session=session, scheduler=scheduler, cache_bytes=0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engines", nargs="+", metavar="NAME=EXPORT:VARIANT[:WORKERS:THREADS]")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--texts", type=int, default=24, help="rows of bench.py's mixed corpus")
    p.add_argument("--work-dir", type=Path, default=Path("bench-out/engine-compare"))
    args = p.parse_args(argv)
    specs = dict(item.split("=", 1) for item in args.engines)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    first_export = Path(next(iter(specs.values())).split(":")[0])
    texts = corpus(first_export, args.work_dir, args.texts, 0.0)["texts"]
    engines = {name: _engine(spec, args.work_dir) for name, spec in specs.items()}
    try:
        for engine in engines.values():  # warm-up: first runs pay for allocations
            engine.embed(texts[:6], dense=True, sparse=True)
        names = list(engines)
        seconds: dict[str, list[float]] = {n: [] for n in names}
        dense: dict[str, np.ndarray] = {}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                started = time.perf_counter()
                out = engines[name].embed(texts, dense=True, sparse=True)
                seconds[name].append(time.perf_counter() - started)
                dense[name] = out.dense
            print(f"round {r + 1}: " + ", ".join(f"{n} {seconds[n][-1]:.1f} s" for n in names),
                  flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    base = names[0]
    print(f"\n{args.texts} texts, {args.rounds} rounds\n")
    print(f"| engine | seconds per round | median | speed vs {base} (per round) | "
          f"dense cos min vs {base} |")
    print("|---|---|---|---|---|")
    for name in names:
        ratios = [a / b for a, b in zip(seconds[base], seconds[name], strict=True)]
        a, b = dense[base], dense[name]
        cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
        print(f"| {name} | {' / '.join(f'{x:.1f}' for x in seconds[name])} | "
              f"{statistics.median(seconds[name]):.1f} | "
              f"{', '.join(f'{x:.3f}' for x in ratios)} → {statistics.median(ratios):.3f} | "
              f"{float(cos.min()):.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
