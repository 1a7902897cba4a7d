"""Texts past BGE_M3_MAX_TEXT_CHARS over HTTP: served from their leading words when truncated.

Starts ``bgeserve serve`` on an export (variant pinned), posts texts of 140k, 1M and 30M
characters of English (and 140k of CJK, without spaces) to ``/v1/embeddings`` a few rounds
each, and prints each answer's status, wall time and the server's RSS before and after; then
the cosine of each served vector against ``Engine.embed`` of the text's first 65,536
characters in-process (the tokens truncation keeps, from the library, which has no limit).
Then ``/v1/rerank`` (bge-m3's hybrid scores) with such texts as documents truncated from the
right (``truncate: true``) and as the query, against ``Engine.rerank`` of their first 65,536
characters; and a long document scored to its end (windows, the default), a 413.

    python scripts/long_text.py --export-dir /tmp/fs/exp --variant int8 --max-seq 512
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import psutil
from benchkit.common import wait_healthy

WORDS = "hybrid retrieval keeps dense and sparse vectors of every passage in one index. "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export-dir", required=True)
    ap.add_argument("--variant", default="int8")
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=8391)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    cache = tempfile.mkdtemp(prefix="long-text-")
    env = dict(os.environ, BGE_M3_MODEL_PATH=args.export_dir, BGE_M3_MODEL=args.variant,
               BGE_M3_CACHE_DIR=cache, HF_HUB_OFFLINE="1", BGE_M3_LOG_LEVEL="warning",
               BGE_M3_MAX_SEQ_LENGTH=str(args.max_seq))
    proc = subprocess.Popen([sys.executable, "-m", "bgeserve", "serve", "--bind",
                             f"127.0.0.1:{args.port}"], env=env)
    served: dict[str, np.ndarray] = {}
    reranked: dict[str, np.ndarray] = {}
    try:
        started = time.monotonic()
        wait_healthy(url)
        print(f"ready in {time.monotonic() - started:.0f} s", flush=True)
        server = psutil.Process(proc.pid)
        cases = [("english 140k", (WORDS * 2_000)[:140_000]),
                 ("english 1M", (WORDS * 13_000)[:1_000_000]),
                 ("english 30M", (WORDS * 380_000)[:30_000_000]),
                 ("cjk 140k", "混合检索" * 35_000)]
        for name, text in cases:
            for rnd in range(args.rounds):
                before = server.memory_info().rss
                t = time.perf_counter()
                r = httpx.post(url + "/v1/embeddings", json={"input": text}, timeout=600)
                took = time.perf_counter() - t
                after = server.memory_info().rss
                body = r.json()
                if r.status_code == 200:
                    served[name] = np.asarray(body["data"][0]["embedding"], np.float32)
                    said = (f"truncated={body['data'][0].get('truncated')} "
                            f"tokens={body['usage']['prompt_tokens']}")
                else:
                    said = body["error"]["message"][:150]
                print(f"{name} round {rnd}: {r.status_code} in {took:.2f} s, server RSS "
                      f"{before / 2**20:.0f} -> {after / 2**20:.0f} MiB; {said}", flush=True)
        for name, body in rerank_cases():
            for rnd in range(args.rounds):
                before = server.memory_info().rss
                t = time.perf_counter()
                r = httpx.post(url + "/v1/rerank", json=body, timeout=600)
                took = time.perf_counter() - t
                after = server.memory_info().rss
                answer = r.json()
                if r.status_code == 200:
                    scores = {x["index"]: x["relevance_score"] for x in answer["results"]}
                    reranked[name] = np.asarray([scores[i] for i in range(len(scores))])
                    said = f"tokens={answer['usage']['total_tokens']}"
                else:
                    said = answer["error"]["message"][:150]
                print(f"rerank {name} round {rnd}: {r.status_code} in {took:.2f} s, server RSS "
                      f"{before / 2**20:.0f} -> {after / 2**20:.0f} MiB; {said}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    from bgeserve import Engine
    from bgeserve.engine import EngineConfig

    with Engine(args.export_dir, args.variant, config=EngineConfig(max_seq=args.max_seq)) as e:
        want = e.embed([(WORDS * 2_000)[:65_536]]).dense[0]
        expected = {name: e.rerank(body["query"][:65_536],
                                   [d[:65_536] for d in body["documents"]],
                                   long_documents="truncate").scores
                    for name, body in rerank_cases() if name in reranked}
    for name, got in served.items():
        cos = float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))
        print(f"{name}: cos vs Engine.embed(first 65,536 characters) = {cos:.7f}")
    for name, got in reranked.items():
        gap = float(np.max(np.abs(got - expected[name])))
        print(f"rerank {name}: max |score - Engine.rerank(first 65,536 characters)| = {gap:.2e}")


def rerank_cases() -> list[tuple[str, dict]]:
    """Rerank bodies with texts past the limit: documents truncated from the right, a long
    query, and a long document scored to its end (a 413)."""
    docs = ["dense vectors", (WORDS * 2_000)[:140_000], (WORDS * 13_000)[:1_000_000]]
    return [("documents 140k + 1M, truncate", {"query": "which vectors does retrieval keep?",
                                               "documents": docs, "truncate": True}),
            ("query 1M", {"query": (WORDS * 13_000)[:1_000_000],
                          "documents": ["dense vectors", "sparse vectors"]}),
            ("document 140k, windows", {"query": "q", "documents": docs[:2]})]


if __name__ == "__main__":
    main()
