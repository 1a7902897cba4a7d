"""A burst of more work than the deadline allows, all at once: how many are answered in time.

Starts `bgeserve serve` on an export (tiny is enough) with ``BGE_M3_REQUEST_TIMEOUT_SECS`` at
``--deadline``, times one request alone, then sends ``--requests`` requests of ``--texts``
distinct texts of ``--words`` words each at once (one thread each) and prints one JSON line:
the statuses counted, when the answered ones came back, and how many one after another would
have been answered (``deadline / alone``). ``--tree`` runs the server from another checkout
(``PYTHONPATH``), to compare commits in turn:

    for r in 1 2; do for t in /tmp/before .; do
        python scripts/deadline_burst.py --export-dir /tmp/m3tiny --tree $t; done; done
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter

import httpx
from benchkit.common import REPO, tree_server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export-dir", required=True)
    ap.add_argument("--tree", default=str(REPO), help="the checkout whose bgeserve serves")
    ap.add_argument("--port", type=int, default=8399)
    ap.add_argument("--deadline", type=float, default=10.0, help="BGE_M3_REQUEST_TIMEOUT_SECS")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--texts", type=int, default=16)
    ap.add_argument("--words", type=int, default=200)
    ap.add_argument("--alone-words", type=int, default=None,
                    help="words of the texts timed alone first (default --words): shorter, "
                         "the drain rate is read off short texts before a burst of long ones")
    ap.add_argument("--setting", action="append", default=[], metavar="BGE_M3_X=VALUE",
                    help="more server settings (BGE_M3_VARIANT=ov-int8, ...)")
    args = ap.parse_args()

    settings = dict(item.split("=", 1) for item in args.setting)
    with tree_server(args.tree, args.export_dir, args.port, BGE_M3_CACHE_MB="0",
                     BGE_M3_REQUEST_TIMEOUT_SECS=str(args.deadline), **settings) as url:
        probed(url)
        print(json.dumps(run(url, args)))


def probed(url: str, timeout: float = 900.0) -> None:
    """Wait until the start-up probe (in the background: it takes the cores) is done."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        tuning = httpx.get(url + "/health", timeout=30).json().get("tuning") or {}
        if tuning.get("probe_status") != "running":
            return
        time.sleep(2)


def run(url: str, args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(5000)]

    def body(k: int, words: int) -> dict[str, object]:
        return {"model": "bge-m3", "input": [
            " ".join(rng.choice(vocab) for _ in range(words)) + f" {k}-{j}"
            for j in range(args.texts)]}

    bodies = [body(k, args.words) for k in range(args.requests)]
    alone_words = args.words if args.alone_words is None else args.alone_words
    with httpx.Client(timeout=600) as c:
        began = time.monotonic()
        r = c.post(url + "/v1/embeddings", json=body(-1, alone_words))
        alone = time.monotonic() - began
        r.raise_for_status()
    results: list[tuple[int, float]] = [(0, 0.0)] * args.requests

    def one(i: int) -> None:
        began = time.monotonic()
        with httpx.Client(timeout=600) as c:
            status = c.post(url + "/v1/embeddings", json=bodies[i]).status_code
        results[i] = (status, time.monotonic() - began)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    answered = sorted(s for status, s in results if status == 200)
    if alone_words != args.words:  # the burst's own request alone, once the burst is over
        with httpx.Client(timeout=600) as c:
            began = time.monotonic()
            c.post(url + "/v1/embeddings", json=body(-2, args.words)).raise_for_status()
            alone = time.monotonic() - began
    return {"tree": args.tree, "alone_s": round(alone, 2),
            "statuses": dict(Counter(status for status, _ in results)),
            "answered_by_s": round(answered[-1], 2) if answered else None,
            "one_after_another": int(args.deadline // alone),
            "last_answer_s": round(max(s for _, s in results), 2)}


if __name__ == "__main__":
    main()
