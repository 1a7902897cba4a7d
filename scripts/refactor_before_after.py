"""Issue 21's before/after: Engine.embed on the same texts from two source trees, interleaved.

    git worktree add /tmp/old-tree 60e3fb4   # the last commit before the layers refactor
    flock /tmp/fullsize.lock python scripts/refactor_before_after.py --export-dir DIR \
        --old /tmp/old-tree --new .

Each round runs every variant in both trees, each in a fresh child (its own peak RSS), the
trees' order swapped every round; the table gives medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import json, sys, time, tempfile
spec = json.loads(sys.argv[1])
texts = json.load(open(spec["corpus"]))
from bgeserve import Engine
with tempfile.TemporaryDirectory() as cache:
    t0 = time.perf_counter()
    e = Engine(model_path=spec["export"], variant=spec["variant"], cache_dir=cache, offline=True,
               auto_budget=False)
    load = time.perf_counter() - t0
    e.embed(texts[:2], dense=True, sparse=True)
    t0 = time.perf_counter()
    out = e.embed(texts, dense=True, sparse=True)
    wall = time.perf_counter() - t0
    tokens = int(out.n_tokens.sum())
    e.close()
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"tps": tokens / wall, "tokens": tokens, "wall": wall, "load": load,
                  "peak_rss_mb": int(hwm) / 1024}))
'''

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--export-dir", required=True)
    p.add_argument("--old", required=True); p.add_argument("--new", required=True)
    p.add_argument("--variants", default="fp32,int8"); p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--texts", type=int, default=24); p.add_argument("--max-words", type=int, default=300)
    a = p.parse_args()
    sys.path.insert(0, a.new)
    from bgeserve.export.texts import random_texts
    texts = random_texts(7, a.texts, min_words=10, max_words=a.max_words)
    corpus = Path(tempfile.mkdtemp()) / "corpus.json"; corpus.write_text(json.dumps(texts))
    res = {}
    for r in range(a.rounds):
        order = [("old", a.old), ("new", a.new)]
        if r % 2: order.reverse()
        for v in a.variants.split(","):
            for name, tree in order:
                env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "2"}
                spec = {"export": a.export_dir, "variant": v, "corpus": str(corpus)}
                out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], check=False, env=env,
                                     capture_output=True, text=True, cwd=tree)
                if out.returncode:
                    print(out.stderr[-3000:]); sys.exit(1)
                d = json.loads(out.stdout.strip().splitlines()[-1])
                res.setdefault((v, name), []).append(d)
                print(r, v, name, {k: round(x, 2) for k, x in d.items()}, flush=True)
    print("\n| variant | tree | tokens/s (median) | peak RSS MiB (median) | new/old tokens/s |")
    print("|---|---|---|---|---|")
    for v in a.variants.split(","):
        med = {n: statistics.median(d["tps"] for d in res[(v, n)]) for n in ("old", "new")}
        for n in ("old", "new"):
            rss = statistics.median(d["peak_rss_mb"] for d in res[(v, n)])
            ratio = f"{med['new'] / med['old']:.3f}" if n == "new" else ""
            print(f"| {v} | {n} | {med[n]:.0f} | {rss:.0f} | {ratio} |")

main()
