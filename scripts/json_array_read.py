#!/usr/bin/env python3
"""Peak memory and time of ``bgeserve bulk``'s reader over one ``.json`` file that is one
array (``--mb`` MB of ``{"id", "text"}`` items, written once to ``--file``), the rows consumed
and dropped as the job does. ``--repo`` measures another checkout; each run is its own process
(peak RSS is per process), and ``--rounds`` alternates the checkouts::

    python scripts/json_array_read.py --repo OLD_CHECKOUT --rounds 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_file(path: Path, mb: int) -> None:
    """``mb`` MB of items whose texts mix ASCII, accents and CJK (escaped and not)."""
    words = ["retrieval", "dense", "vecteur", "représentation", "向量", "检索", "emoji 😀"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("[")
        i, size = 0, 0
        while size < mb << 20:
            text = " ".join(words[(i + k) % len(words)] for k in range(60 + i % 90))
            line = json.dumps({"id": f"doc-{i}", "text": text, "meta": {"n": i}},
                              ensure_ascii=i % 2 == 0)
            f.write(("," if i else "") + "\n" + line)
            size += len(line) + 2
            i += 1
        f.write("\n]\n")


def child(repo: Path, path: Path) -> None:
    """Read ``path`` with ``repo``'s reader; print rows, seconds, peak RSS MiB as JSON."""
    sys.path.insert(0, str(repo))
    from bgeserve.bulk.readers import read
    from bgeserve.bulk.sources import Source

    started = time.perf_counter()
    rows = sum(len(piece) for piece in read(Source(path, "jsonl"), "text", "id"))
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows": rows, "seconds": seconds, "peak_mib": peak}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, help="another checkout, measured alternately")
    p.add_argument("--file", type=Path, default=Path("/tmp/bgeserve-array.json"))
    p.add_argument("--mb", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.file)
        return 0
    if not args.file.exists():
        write_file(args.file, args.mb)
    print(f"{args.file}: {args.file.stat().st_size / 2**20:.0f} MiB")
    repos = {"this": REPO, **({"other": args.repo.resolve()} if args.repo else {})}
    results: dict[str, list[dict]] = {name: [] for name in repos}
    for _ in range(args.rounds):
        for name, repo in repos.items():
            out = subprocess.run([sys.executable, __file__, "--child", str(repo), "--file",
                                  str(args.file)], check=True, capture_output=True, text=True)
            results[name].append(json.loads(out.stdout))
            print(name, results[name][-1], flush=True)
    for name, runs in results.items():
        print(f"{name}: {runs[0]['rows']} rows, median "
              f"{statistics.median(r['seconds'] for r in runs):.1f} s, peak RSS median "
              f"{statistics.median(r['peak_mib'] for r in runs):.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
