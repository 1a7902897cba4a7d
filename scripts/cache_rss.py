"""Peak RSS and time of one Engine embedding a corpus of unique texts: the embedding cache on
with its heap trim (the default), on without it, and off — interleaved rounds, medians.

Each mode runs in a process of its own (the heap is the thing measured):

    python scripts/cache_rss.py --model-path /tmp/tiny-export --texts 15000 --rounds 3

Why: the cache's entries are small blocks that live on among the chunks' freed buffers, and
glibc cannot give back the heap between them (docs/benchmarks.md, "The embedding cache and
the heap").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time

MODES = {"cache+trim": (128, None), "cache, no trim": (128, float("inf")), "no cache": (0, None)}
WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed",
         "do", "eiusmod", "tempor", "ñ", "日本", "😀"]


def texts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct texts of 1-120 words (a few short repeats are fine: ids differ)."""
    rnd = random.Random(seed)
    return [f"{i} " + " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, 120)))
            for i in range(n)]


def child(model_path: str, n: int, cache_mb: int, trim_every_s: float | None,
          block: int, chunk_tokens: int) -> dict[str, float]:
    from bgeserve.engine.cache import EmbeddingCache

    if trim_every_s is not None:
        EmbeddingCache.__init__.__kwdefaults__["trim_every_s"] = trim_every_s  # type: ignore[index]
    from bgeserve import Engine
    from bgeserve.engine import EngineConfig
    from bgeserve.tuning import memory

    peak = [0]

    def watch() -> None:
        while True:
            peak[0] = max(peak[0], memory.rss_bytes())
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    corpus = texts(n)
    engine = Engine(model_path=model_path, config=EngineConfig(cache_bytes=cache_mb << 20))
    engine.set_max_chunk_tokens(chunk_tokens)
    started = time.perf_counter()
    for b in range(0, n, block):
        engine.embed(corpus[b:b + block], sparse=True)
    seconds = time.perf_counter() - started
    cached = engine.cache.bytes if engine.cache is not None else 0
    engine.close()
    return {"seconds": seconds, "peak_mib": peak[0] / 2**20, "cached_mib": cached / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--texts", type=int, default=15000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", type=int, default=1024, help="texts per embed call")
    parser.add_argument("--chunk-tokens", type=int, default=4096)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        cache_mb, trim = MODES[args.child]
        print(json.dumps(child(args.model_path, args.texts, cache_mb, trim, args.block,
                               args.chunk_tokens)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES:  # interleaved: the machine drifts
            out = subprocess.run([sys.executable, __file__, "--child", mode, *sys.argv[1:]],
                                 capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {mode}: {runs[mode][-1]}", flush=True)
    print("| mode | peak RSS MiB (median) | seconds (median) | cached MiB |")
    print("|---|---|---|---|")
    for mode, rows in runs.items():
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        print(f"| {mode} | {med['peak_mib']:.0f} | {med['seconds']:.1f} | "
              f"{med['cached_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
