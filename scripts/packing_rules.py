#!/usr/bin/env python3
"""The raw runtime on one corpus under several packing rules, interleaved in one process.

Each rule is ``NAME=MAX_CHUNK,MAX_TOKENS,MIN_FILL[,WINDOW[,RUN_COST]]`` for
``bgeserve.engine.binpack.plan`` (texts per run, padded tokens per run, least share of real
tokens; ``WINDOW``: pack only that many texts at a time, in corpus order — what WINDOW clients
sending one text each and waiting for its answer can offer a server — 0 or absent: the whole
corpus at once, as the engine gets it; ``RUN_COST``: ``FIXED/PER_TOKEN/PER_PAIR`` in ms, a
``binpack.RunCost``, or ``measure``: the one ``bgeserve.tuning.runcost`` measures on this
session); the first rule is the baseline of the ratios. Every
round runs each rule once over the whole corpus on the same session (the order
reversed every other round); the report gives each rule's padded tokens, tokens/s per round and
the per-round ratio to the baseline with its median. It answers whether a runtime gains from
batching more than it loses to padding (``scripts/serving_loss.py`` for where the engine and the
server lose against the runtime):

    python scripts/packing_rules.py --export-dir EXPORT --variant ov-int8 --texts 24 --rounds 3 \\
        --rule default=64,1024,0.75 --rule tokens256=64,256,0.75 --rule alone=1,1024,0.75
    python scripts/packing_rules.py --export-dir EXPORT --variant ov-int8 --texts 64 \\
        --rule all=64,1024,0.75 --rule four-clients=64,1024,0.75,4 --rule alone=1,1024,0.75
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving_loss import MAX_SEQ, _open_raw, corpus  # after the path above


def _rule(text: str) -> tuple[str, tuple[int, int, float, int, str]]:
    name, _, spec = text.partition("=")
    chunk, tokens, fill, *rest = spec.split(",") + ["", ""]
    return name, (int(chunk), int(tokens), float(fill), int(rest[0] or 0), rest[1])


def _run_cost(spec: str, measured):
    from bgeserve.tuning.runcost import RunCost

    if not spec:
        return None
    if spec == "measure":
        return measured()
    fixed, per_token, per_pair = (float(x) / 1000 for x in spec.split("/"))
    return RunCost(fixed, per_token, per_pair)


def windowed(lengths: list[int], window: int, **rules) -> list:
    """``binpack.plan`` over each run of ``window`` consecutive texts (0: all at once), the
    chunks' indices into ``lengths``."""
    from dataclasses import replace

    from bgeserve.engine.binpack import plan

    step = window or len(lengths) or 1
    out = []
    for start in range(0, len(lengths), step):
        part = lengths[start:start + step]
        out += [replace(c, indices=tuple(start + i for i in c.indices))
                for c in plan(part, fits=lambda b, s: True, **rules)]
    return out


def main(argv: list[str] | None = None) -> int:
    from bgeserve.engine.forward import pad_chunk
    from bgeserve.engine.tokenizer import Tokenizer
    from bgeserve.service.warmup import synthetic_chunk

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export-dir", type=Path, required=True)
    p.add_argument("--variant", default="fp32")
    p.add_argument("--texts", type=int, default=24, help="rows of bench.py's mixed corpus")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rule", action="append", type=_rule, required=True,
                   metavar="NAME=MAX_CHUNK,MAX_TOKENS,MIN_FILL[,WINDOW[,RUN_COST]]")
    p.add_argument("--work-dir", type=Path, default=Path("bench-out/packing"))
    p.add_argument("--warm-all", action="store_true",
                   help="run every rule's shapes once before timing (a server that has seen its "
                        "shapes), not only the baseline's")
    args = p.parse_args(argv)
    rules = dict(args.rule)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    texts = corpus(args.export_dir, args.work_dir, args.texts, 0.0)["texts"]
    run = _open_raw(args.export_dir, args.variant, args.threads)
    ids = Tokenizer.load(args.export_dir / "tokenizer.json", MAX_SEQ).encode(texts).ids
    tokens = sum(map(len, ids))
    @functools.cache  # once per session, however many rules ask for it
    def measure():
        from bgeserve.tuning.runcost import measure_run_cost

        cost = measure_run_cost(lambda b, s: run(*synthetic_chunk(b, s)))
        print(f"measured {cost}", file=sys.stderr, flush=True)
        return cost

    chunks = {name: windowed([len(x) for x in ids], window, max_chunk=mc, max_tokens=mt,
                             min_fill=mf, run_cost=_run_cost(cost, measure))
              for name, (mc, mt, mf, window, cost) in rules.items()}
    warm = list(rules) if args.warm_all else [next(iter(rules))]
    for name in warm:  # warm-up: the baseline's shapes once (every rule's with --warm-all)
        for chunk in chunks[name]:
            run(*pad_chunk([ids[i] for i in chunk.indices], chunk.pad_to))
    rates: dict[str, list[float]] = {name: [] for name in rules}
    for r in range(args.rounds):
        for name in (list(rules) if r % 2 == 0 else list(rules)[::-1]):
            started = time.perf_counter()
            for chunk in chunks[name]:
                run(*pad_chunk([ids[i] for i in chunk.indices], chunk.pad_to))
            rates[name].append(tokens / (time.perf_counter() - started))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()),
              file=sys.stderr, flush=True)
    base = next(iter(rules))
    print(f"{args.variant}: {len(texts)} texts, {tokens} tokens, {args.rounds} rounds, "
          f"{args.threads} threads\n")
    print(f"| rule | runs | padded tokens | tokens/s per round | median | / {base} (median) |")
    print("|---|---|---|---|---|---|")
    for name, values in rates.items():
        ratios = [a / b for a, b in zip(values, rates[base], strict=True)]
        print(f"| {name} {rules[name]} | {len(chunks[name])} | "
              f"{sum(c.padded_tokens for c in chunks[name])} | "
              f"{' / '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} | "
              f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
