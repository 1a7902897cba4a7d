"""Short queries beside one large ingestion request: what their 429s say, and how it ran.

Starts `bgeserve serve` on an export (tiny is enough) with ``BGE_M3_REQUEST_TIMEOUT_SECS`` at
``--deadline``, sends ``--warm`` short queries one after another (the drain rate is read off
them), then one request of ``--texts`` texts of ``--words`` words, and while it runs one short
query every ``--every`` seconds. Prints one JSON line: the large request's status and seconds,
the queries' statuses counted, each 429's Retry-After, and the seconds of work the first 429
said were queued. ``--tree`` runs the server from another checkout (``PYTHONPATH``), to
compare commits in turn:

    for r in 1 2 3; do for t in /tmp/before .; do
        python scripts/ingest_queries.py --export-dir /tmp/m3tiny --tree $t --seed $r; done; done
"""

from __future__ import annotations

import argparse
import json
import random
import re
import threading
import time
from collections import Counter

import httpx
from benchkit.common import REPO, tree_server
from deadline_burst import probed

WORDS = ["alpha", "river", "mountain", "quietly", "seventeen", "blue", "harbour", "market",
         "signal", "wander", "copper", "lantern", "meadow", "orbit", "pencil", "thunder"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export-dir", required=True)
    ap.add_argument("--tree", default=str(REPO), help="the checkout whose bgeserve serves")
    ap.add_argument("--port", type=int, default=8398)
    ap.add_argument("--deadline", type=float, default=40.0, help="BGE_M3_REQUEST_TIMEOUT_SECS")
    ap.add_argument("--warm", type=int, default=200, help="short queries before")
    ap.add_argument("--texts", type=int, default=450)
    ap.add_argument("--words", type=int, default=500)
    ap.add_argument("--every", type=float, default=0.2, help="seconds between queries")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tree_server(args.tree, args.export_dir, args.port, BGE_M3_CACHE_MB="0",
                     BGE_M3_REQUEST_TIMEOUT_SECS=str(args.deadline)) as url:
        probed(url)
        print(json.dumps(run(url, args)))


def run(url: str, args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    with httpx.Client(timeout=600) as c:
        for _ in range(args.warm):
            c.post(url + "/v1/embeddings", json={"input": text(10)}).raise_for_status()
    big = [text(args.words) for _ in range(args.texts)]
    queries = [text(10) for _ in range(10_000)]
    done: dict[str, object] = {}

    def ingest() -> None:
        began = time.monotonic()
        with httpx.Client(timeout=600) as c:
            r = c.post(url + "/v1/embeddings", json={"input": big})
        done.update(status=r.status_code, seconds=round(time.monotonic() - began, 1))

    thread = threading.Thread(target=ingest)
    thread.start()
    statuses: Counter[int] = Counter()
    retry_after: list[int] = []
    said: str | None = None
    with httpx.Client(timeout=600) as c:
        for query in queries:
            if not thread.is_alive():
                break
            r = c.post(url + "/v1/embeddings", json={"input": query})
            statuses[r.status_code] += 1
            if r.status_code == 429:
                retry_after.append(int(r.headers["retry-after"]))
                found = re.search(r"~([\d.]+)s of work are queued", r.json()["error"]["message"])
                if said is None and found:
                    said = found.group(1)
            time.sleep(args.every)
    thread.join()
    return {"tree": args.tree, "seed": args.seed, "ingest": done,
            "queries": dict(statuses), "retry_after": retry_after, "first_said_work_s": said}


if __name__ == "__main__":
    main()
