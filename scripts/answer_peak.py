"""A server's peak RSS growth while it answers one large ColBERT request, for code trees side by side.

Starts ``bgeserve serve`` from each ``--tree`` in turn (``PYTHONPATH`` = that tree, so two commits
compare: ``git worktree add /tmp/before <commit>``), on ``--export-dir`` with ``--variant``,
the probe off, the embedding cache off; resets the server's VmHWM once it is ready
(``/proc/<pid>/clear_refs``), sends ``--texts`` texts of ~1,900 tokens asking for ColBERT
vectors only (float JSON), and prints the growth of VmHWM over the RSS before the request, the
answer's size and the time. The trees alternate (A B, B A, ...) for ``--rounds`` rounds; the
medians come last.

    python scripts/answer_peak.py --export-dir /tmp/fs/exp --variant int8 --texts 16 \\
        --rounds 2 --tree before=/tmp/before --tree after=.

Run from the repository root or ``scripts/`` (it imports ``benchkit``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from benchkit.common import wait_healthy


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            out[line.split(":")[0]] = int(line.split()[1]) >> 10
    return out


def one(tree: Path, args: argparse.Namespace, texts: list[str], work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "BGE_M3_MODEL_PATH": str(args.export_dir),
           "BGE_M3_MODEL": args.variant, "BGE_M3_CACHE_DIR": str(work / "cache"),
           "BGE_M3_DISABLE_AUTO_BUDGET": "1", "BGE_M3_CACHE_MB": "0",
           "BGE_M3_HEARTBEAT_SECS": "0", "BGE_M3_LOG_FORMAT": "json", "HF_HUB_OFFLINE": "1"}
    url = f"http://127.0.0.1:{args.port}"
    with open(work / "server.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bgeserve", "serve", "--bind",
                                 f"127.0.0.1:{args.port}"], cwd=tree, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, timeout=600)
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = status(proc.pid)
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/embeddings:both", timeout=3600,
                       json={"input": texts, "outputs": ["colbert"]})
        took = time.monotonic() - started
        after = status(proc.pid)
        r.raise_for_status()
        data = r.json()["data"]
        floats = sum(len(item["colbert"]) * len(item["colbert"][0]) for item in data)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return {"answer_mib": round(len(r.content) / 2**20), "vectors_mib": round(floats * 4 / 2**20),
            "rss_before_mib": before["VmRSS"], "peak_growth_mib": after["VmHWM"] - before["VmRSS"],
            "seconds": round(took, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export-dir", type=Path, required=True)
    p.add_argument("--variant", default="int8")
    p.add_argument("--texts", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--tree", action="append", required=True, metavar="LABEL=PATH",
                   help="a code tree to start the server from (repeat: two to compare)")
    args = p.parse_args()
    trees = [(label, Path(path).resolve()) for label, _, path in
             (t.partition("=") for t in args.tree)]
    texts = [f"{i} " + " ".join(f"word{(i * 7 + j) % 997} lorem" for j in range(240))
             for i in range(args.texts)]
    results: dict[str, list[dict]] = {label: [] for label, _ in trees}
    with tempfile.TemporaryDirectory(prefix="answer-peak-") as tmp:
        for r in range(args.rounds):
            for label, tree in (trees if r % 2 == 0 else trees[::-1]):
                rec = one(tree, args, texts, Path(tmp))
                results[label].append(rec)
                print(json.dumps({"round": r, "tree": label, **rec}), flush=True)
    for label, recs in results.items():
        print(f"{label}: median peak growth {statistics.median(x['peak_growth_mib'] for x in recs)}"
              f" MiB, median {statistics.median(x['seconds'] for x in recs)} s")


if __name__ == "__main__":
    main()
