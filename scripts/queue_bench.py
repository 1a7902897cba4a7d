"""What the scheduler's bookkeeping costs per chunk against the texts queued, for code trees
side by side: ``PendingQueue.purge`` and ``take`` as a worker calls them before each run, with
the server's packing rules and a measured run cost, no model.

One job of ``--texts`` texts of 200-500 tokens (every text a chunk of its own at 256 tokens a
chunk, a few per chunk at 2,048), with ``--queries`` one-text jobs arriving as it drains (a
new one every other chunk while more than 100 texts wait), taken until empty. Each tree runs
in its own process (``cwd`` = the tree, so ``git worktree add /tmp/before <commit>`` compares
two commits); the trees alternate (A B, B A, ...) for ``--rounds`` rounds; medians printed.

    python scripts/queue_bench.py --tree before=/tmp/before --tree now=. --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import functools, json, random, sys, time
import numpy as np
from bgeserve.engine.jobs import Job
from bgeserve.engine.packing import Packer, Rules
from bgeserve.engine.queue import PendingQueue
from bgeserve.results import EmbedOptions
from bgeserve.tuning.runcost import RunCost

texts, chunk_tokens, queries = map(int, sys.argv[1:4])
rng = random.Random(0)


def job(n, lo, hi):
    ids = [np.zeros(rng.randint(lo, hi), np.int64) for _ in range(n)]
    return Job(ids=ids, truncated=np.zeros(n, bool), options=EmbedOptions())


class Budget:  # a memory model that admits what a 2-core CPU server runs
    def fits(self, batch, seq):
        return batch * seq * seq < 64 * 512 * 512


packer = Packer(Rules(max_chunk=64, max_tokens=chunk_tokens, min_fill=0.75,
                      run_cost=RunCost(0.012, 0.0009, 3e-7, 0.035)), Budget())
pack = functools.partial(packer.plan, known=lambda count: count % 7 == 0)
q = PendingQueue()
q.add(job(texts, 200, 500), 0.0)
for _ in range(queries):
    q.add(job(1, 8, 16), 0.0)
takes = 0
began = time.perf_counter()
while True:
    q.purge(time.monotonic(), lambda j: None)
    if not len(q):
        break
    q.take(pack)
    takes += 1
    if queries and takes % 2 == 0 and len(q) > 100:
        q.add(job(1, 8, 16), 0.0)
print(json.dumps({"takes": takes, "ms": (time.perf_counter() - began) * 1e3 / takes}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=PATH of a bgeserve checkout (repeatable; default: now=.)")
    parser.add_argument("--texts", default="300,1000,4000")
    parser.add_argument("--chunk-tokens", default="256,2048")
    parser.add_argument("--queries", default="0,4")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = [t.split("=", 1) for t in args.tree or ["now=."]]
    cases = [(n, c, q) for n in map(int, args.texts.split(","))
             for c in map(int, args.chunk_tokens.split(",")) for q in map(int, args.queries.split(","))]
    times: dict[tuple, list[float]] = {}
    takes: dict[tuple, int] = {}
    for r in range(args.rounds):
        for name, path in trees if r % 2 == 0 else trees[::-1]:
            for case in cases:
                out = subprocess.run([sys.executable, "-c", CHILD, *map(str, case)],
                                     cwd=Path(path).resolve(), capture_output=True, text=True,
                                     check=True)
                got = json.loads(out.stdout)
                times.setdefault((name, *case), []).append(got["ms"])
                takes[(name, *case)] = got["takes"]
    names = [name for name, _ in trees]
    print("| texts queued | tokens per chunk | query jobs | chunks | "
          + " | ".join(f"{n}: ms per chunk" for n in names) + " |")
    print("|---" * (4 + len(names)) + "|")
    for case in cases:
        cells = [f"{statistics.median(times[(n, *case)]):.3f}" for n in names]
        print(f"| {case[0]:,} | {case[1]:,} | {case[2]} | {takes[(names[-1], *case)]:,} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
