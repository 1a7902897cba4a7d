"""A body near the allowance of bodies in progress beside small requests: when it gets in.

Starts `bgeserve serve` on an export (tiny is enough: the point is the HTTP layer's allowance)
with ``BGE_M3_MAX_INFLIGHT_MB`` at ``--allowance-mb``, runs ``--smalls`` clients that post
~400 KB of texts one request after another, then posts one large body (~30 MB by default,
under the 32 MiB body limit) and posts it again at each 429 after its Retry-After, until a 200
or ``--limit`` seconds. Prints one JSON line: the seconds to the large body's 200 (its own
run included), its tries, and the small requests served, refused and their latency. ``--tree``
runs the server from another checkout (``PYTHONPATH``), to compare commits in turn:

    for r in 1 2 3; do for t in /tmp/before .; do
        python scripts/body_line.py --export-dir /tmp/m3tiny --tree $t --smalls 5; done; done
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time

import httpx
from benchkit.common import REPO, tree_server

WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed",
         "do", "eiusmod"]


def texts(chars: int, count: int, seed: int) -> list[str]:
    """``count`` texts of ``chars`` characters, 16 distinct ones repeated: a request's repeated
    texts run once, so the time measured is mostly the wait for room, not the model's."""
    rng = random.Random(seed)
    distinct = [" ".join(rng.choice(WORDS) for _ in range(chars // 6))[:chars]
                for _ in range(16)]
    return [distinct[i % 16] for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export-dir", required=True)
    ap.add_argument("--tree", default=str(REPO), help="the checkout whose bgeserve serves")
    ap.add_argument("--port", type=int, default=8398)
    ap.add_argument("--allowance-mb", type=int, default=32)
    ap.add_argument("--smalls", type=int, default=5, help="clients posting ~400 KB in a loop")
    ap.add_argument("--large-texts", type=int, default=2000, help="texts of 15,500 characters")
    ap.add_argument("--limit", type=float, default=90.0, help="seconds the large one tries")
    args = ap.parse_args()

    # The large body's ~8M tokens pass the queue's 1M: a 429 unless the queue is empty
    # (service/admission.py), which is not what is measured here.
    with tree_server(args.tree, args.export_dir, args.port, BGE_M3_CACHE_MB="0",
                     BGE_M3_MAX_INFLIGHT_MB=str(args.allowance_mb),
                     BGE_M3_MAX_QUEUE_TOKENS="100000000") as url:
        print(json.dumps(run(url, args)))


def run(url: str, args: argparse.Namespace) -> dict[str, object]:
    small = json.dumps({"input": texts(4000, 100, 1), "model": "bge-m3"}).encode()
    large = json.dumps({"input": texts(15500, args.large_texts, 2), "model": "bge-m3"}).encode()
    headers = {"content-type": "application/json"}
    stop = threading.Event()
    latencies: list[float] = []
    refused = [0]

    def client() -> None:
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                began = time.monotonic()
                r = c.post(url + "/v1/embeddings", content=small, headers=headers)
                if r.status_code == 200:
                    latencies.append(time.monotonic() - began)
                elif r.status_code == 429:
                    refused[0] += 1
                    time.sleep(float(r.headers.get("retry-after", "1")))
                else:
                    print("small:", r.status_code, r.text[:200], file=sys.stderr)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.smalls)]
    for t in threads:
        t.start()
    time.sleep(3)  # the small clients under way
    began, tries, admitted = time.monotonic(), 0, None
    why: dict[str, int] = {}  # the large body's 429s by what they said
    with httpx.Client(timeout=600) as c:
        while time.monotonic() - began < args.limit:
            tries += 1
            r = c.post(url + "/v1/embeddings", content=large, headers=headers)
            if r.status_code == 200:
                admitted = time.monotonic() - began
                break
            if r.status_code != 429:
                print("large:", r.status_code, r.text[:300], file=sys.stderr)
                break
            said = r.json()["error"]["message"]
            kind = ("queue" if "queue is full" in said else "decoding" if "decoding" in said
                    else "waited" if "waited" in said else "at once")
            why[kind] = why.get(kind, 0) + 1
            time.sleep(float(r.headers.get("retry-after", "1")))
    stop.set()
    for t in threads:
        t.join(timeout=300)
    latencies.sort()

    def quantile(q: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3) \
            if latencies else None

    return {"tree": args.tree, "large_mb": round(len(large) / 2**20, 1),
            "large_200_after_s": None if admitted is None else round(admitted, 1),
            "large_tries": tries, "large_429s": why, "small_served": len(latencies), "small_429": refused[0],
            "small_p50_s": quantile(0.5), "small_p99_s": quantile(0.99)}


if __name__ == "__main__":
    main()
