#!/usr/bin/env python3
"""Intra-op threads under a cgroup CPU quota: the quota's count against more, side by side.

    sudo python scripts/cpu_quota_ab.py --export-dir EXPORT --variant int8 --quota 1 \
        --threads 2,1 --rounds 3

Makes a cgroup with a CFS quota of ``--quota`` CPUs (cgroup v2 ``cpu.max``, or v1
``cpu.cfs_quota_us``; needs root), then runs one child process per (round, thread count), each
moved into it before it loads the engine: one ``Engine.embed`` of ``--texts`` mixed texts
(20-120 words, dense + sparse) and ``--texts`` one-query latencies (12 words). The order of the
thread counts flips every round (A B, B A, ...), so the machine's drift falls on both. Prints
each child's figures, then per thread count the medians and the paired ratios against the
first count. The cgroup is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "données", "混合", "检索", "tempor", "labore"]


def make_cgroup(name: str, quota: float) -> Path:
    """A cgroup of ``quota`` CPUs (period 100 ms): its directory."""
    period = 100_000
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists():
        root = Path("/sys/fs/cgroup")
        if "cpu" not in (root / "cgroup.subtree_control").read_text().split():
            (root / "cgroup.subtree_control").write_text("+cpu")
        group = root / name
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{int(quota * period)} {period}")
    else:
        group = Path("/sys/fs/cgroup/cpu") / name
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(int(quota * period)))
    return group


def child(group: Path, export: str, variant: str, threads: int, n: int) -> dict:
    (group / "cgroup.procs").write_text(str(os.getpid()))
    from dataclasses import replace

    from bgeserve import Engine

    rng = random.Random(3)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) for _ in range(n)]
    config = Engine(export, variant, start=False).config
    config = replace(config, session=replace(config.session, threads=threads))
    with Engine(export, variant, config=config) as engine:
        engine.embed(texts[:2])  # the first runs' allocations
        start = time.perf_counter()
        engine.embed(texts, dense=True, sparse=True)
        batch = time.perf_counter() - start
        latencies = []
        for text in texts:
            start = time.perf_counter()
            engine.embed([" ".join(text.split()[:12])])
            latencies.append(time.perf_counter() - start)
    return {"threads": threads, "batch_s": round(batch, 3),
            "query_p50_ms": round(statistics.median(latencies) * 1e3, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export-dir", required=True)
    ap.add_argument("--variant", default="int8")
    ap.add_argument("--quota", type=float, default=1.0, help="CPUs of the cgroup's quota")
    ap.add_argument("--threads", default="2,1", help="the thread counts compared (A,B)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--texts", type=int, default=6)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--group", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(Path(args.group), args.export_dir, args.variant, args.child,
                               args.texts)))
        return 0
    counts = [int(t) for t in args.threads.split(",")]
    group = make_cgroup(f"bgeserve-quota-{os.getpid()}", args.quota)
    print(f"cgroup {group}: quota {args.quota:g} CPUs; affinity "
          f"{len(os.sched_getaffinity(0))} CPUs; threads {counts}")
    runs: dict[int, list[dict]] = {t: [] for t in counts}
    try:
        for r in range(args.rounds):
            for threads in counts if r % 2 == 0 else counts[::-1]:
                out = subprocess.run(
                    [sys.executable, __file__, "--export-dir", args.export_dir, "--variant",
                     args.variant, "--texts", str(args.texts), "--child", str(threads),
                     "--group", str(group)], check=True, capture_output=True, text=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"round {r + 1}: {result}", flush=True)
                runs[threads].append(result)
    finally:
        group.rmdir()
    base = runs[counts[0]]
    for threads in counts:
        batch = [x["batch_s"] for x in runs[threads]]
        p50 = [x["query_p50_ms"] for x in runs[threads]]
        ratio = [b["batch_s"] / x["batch_s"] for b, x in zip(base, runs[threads], strict=True)]
        print(f"{threads} threads: batch median {statistics.median(batch):.2f} s, query p50 "
              f"median {statistics.median(p50):.0f} ms; speed vs {counts[0]} threads per round "
              f"{', '.join(f'{x:.2f}' for x in ratio)} -> {statistics.median(ratio):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
