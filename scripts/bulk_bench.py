"""``bgeserve bulk`` against ``Engine.embed`` on the same texts, interleaved, one child each.

    flock /tmp/fullsize.lock python scripts/bulk_bench.py --export-dir /work/fullsize/bge-full-onnx

Each round runs the two modes in fresh child processes (so each peak RSS is its own), A B then
B A, and the table gives medians and the ratio bulk / engine of rows/s and tokens/s:

- ``engine``: the service-built engine (``bgeserve.bulk.model.BulkModel``, the same settings)
  embeds the whole list in one ``embed`` call; the clock starts after the model is loaded;
- ``bulk``: ``bgeserve.bulk.local.run`` over a JSONL file of the same texts into a new folder
  (reading, tokenizing, the engine, writing the shards); its clock also starts after loading.

Both use ``BGE_M3_*`` from the environment plus ``--export-dir`` (and ``--variant``, default:
the variant ``serve`` would choose), with ``BGE_M3_DISABLE_AUTO_BUDGET=1`` unless the
environment says otherwise, so neither runs the probe in the background.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("data", "model", "vector", "search", "index", "query", "token", "memory", "budget",
         "probe", "shard", "parquet", "cluster", "replica", "queue", "latency", "throughput",
         "dense", "sparse", "embedding", "retrieval", "ranking", "passage", "document", "batch")


def corpus(n: int, seed: int, max_words: int = 400) -> list[str]:
    """``n`` texts of 8 to ``max_words`` words (mixed lengths, as an ingestion corpus has)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, max_words)))
            for _ in range(n)]


def child(mode: str, texts_file: Path, shard_rows: int) -> dict:
    from bgeserve.bulk.model import BulkModel, resolve_settings
    from bgeserve.bulk.progress import peak_rss_bytes

    settings = resolve_settings(os.environ)
    texts = [json.loads(line)["text"] for line in texts_file.read_text().splitlines()]
    if mode == "engine":
        with BulkModel(settings) as model:
            started = time.perf_counter()
            emb = model.engine.embed(texts, dense=True, sparse=True)
            seconds = time.perf_counter() - started
        return {"rows": len(emb), "tokens": emb.prompt_tokens, "seconds": seconds,
                "peak_rss": peak_rss_bytes(), "variant": settings.variant}
    from bgeserve.bulk.job import BulkJob
    from bgeserve.bulk.local import run

    with tempfile.TemporaryDirectory() as out:
        job = BulkJob(inputs=(str(texts_file),), output=Path(out) / "shards",
                      shard_rows=shard_rows)
        s = run(job, settings, bar=False)
    return {"rows": s.rows, "tokens": s.tokens, "seconds": s.seconds,
            "peak_rss": s.peak_rss_bytes, "variant": settings.variant}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export-dir", required=True)
    parser.add_argument("--variant", default=None, help="fp32|int8|bf16 (default: serve's)")
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shard-rows", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-words", type=int, default=400)
    parser.add_argument("--child", choices=("engine", "bulk"), help=argparse.SUPPRESS)
    parser.add_argument("--texts-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.texts_file, args.shard_rows)))
        return 0
    env = {**os.environ, "BGE_M3_MODEL_PATH": args.export_dir, "BGE_M3_LOG_FORMAT": "text",
           "BGE_M3_LOG_LEVEL": "warning", "HF_HUB_OFFLINE": "1"}
    env.setdefault("BGE_M3_DISABLE_AUTO_BUDGET", "1")
    env.setdefault("BGE_M3_CACHE_DIR", tempfile.mkdtemp(prefix="bulk-bench-cache-"))
    if args.variant:
        env["BGE_M3_MODEL"] = args.variant
    results: dict[str, list[dict]] = {"engine": [], "bulk": []}
    with tempfile.TemporaryDirectory() as tmp:
        texts_file = Path(tmp) / "texts.jsonl"
        texts_file.write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                                      for i, t in enumerate(corpus(args.texts, args.seed,
                                                                       args.max_words))))
        for r in range(args.rounds):
            order = ("engine", "bulk") if r % 2 == 0 else ("bulk", "engine")
            for mode in order:
                out = subprocess.run([sys.executable, __file__, "--child", mode, "--texts-file",
                                      str(texts_file), "--shard-rows", str(args.shard_rows),
                                      "--export-dir", args.export_dir], env=env, check=True,
                                     capture_output=True, text=True).stdout
                line = next(x for x in out.splitlines() if x.startswith("RESULT "))
                res = json.loads(line[len("RESULT "):])
                results[mode].append(res)
                print(f"round {r + 1} {mode}: {res['rows']} rows, {res['tokens']} tokens in "
                      f"{res['seconds']:.1f} s ({res['tokens'] / res['seconds']:.1f} tokens/s), "
                      f"peak RSS {res['peak_rss'] >> 20} MiB", flush=True)
    variant = results["engine"][0]["variant"]
    print(f"\n{args.texts} texts, variant {variant}, shards of {args.shard_rows} rows, "
          f"{args.rounds} interleaved rounds (medians)\n")
    print("| mode | rows/s | tokens/s | peak RSS MiB |")
    print("|---|---|---|---|")
    med = {}
    for mode, runs in results.items():
        rows = statistics.median(x["rows"] / x["seconds"] for x in runs)
        tokens = statistics.median(x["tokens"] / x["seconds"] for x in runs)
        rss = statistics.median(x["peak_rss"] for x in runs) / 2**20
        med[mode] = (rows, tokens)
        print(f"| {mode} | {rows:.2f} | {tokens:.1f} | {rss:.0f} |")
    print(f"\nbulk / engine: rows/s {med['bulk'][0] / med['engine'][0]:.3f}x, tokens/s "
          f"{med['bulk'][1] / med['engine'][1]:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
