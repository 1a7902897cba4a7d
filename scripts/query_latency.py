#!/usr/bin/env python3
"""Query latency while an ingestion batch runs: what a search front end sees when it shares
the server with a bulk indexer.

Starts ``python -m bgeserve serve`` on an export, posts one bulk request of ``--bulk`` mixed
texts (16–512 tokens, the benchmark's corpus generator), and once its texts are queued sends
``--queries`` one-text queries one after another, timing each. Prints the bulk request's wall
time and the queries' latencies. ``--repo`` runs another checkout's server (to compare two
versions in one run on a noisy machine)::

    python scripts/query_latency.py --export-dir EXPORT --variant int8
    python scripts/query_latency.py --export-dir EXPORT --variant int8 --repo /tmp/old-checkout
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bulk_texts(n: int) -> list[str]:
    sys.path.insert(0, str(REPO))
    from bgeserve.export.texts import random_texts

    # ~12 words per sentence, ~1.5 tokens per word: 1-28 sentences is ~16-512 tokens.
    return [" ".join(random_texts(1000 + i, 1 + (i * 7) % 28, 8, 16)) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export-dir", type=Path, required=True)
    p.add_argument("--variant", default="int8")
    p.add_argument("--repo", type=Path, default=REPO, help="checkout whose server runs")
    p.add_argument("--bulk", type=int, default=64, help="texts in the ingestion request")
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BGE_M3_")}
    env.update({"BGE_M3_MODEL_PATH": str(args.export_dir), "BGE_M3_MODEL": args.variant,
                "BGE_M3_BIND": f"127.0.0.1:{port}", "BGE_M3_INTRA_THREADS": str(args.threads),
                "BGE_M3_CACHE_DIR": tempfile.mkdtemp(prefix="qlat-cache-"),
                "BGE_M3_HEARTBEAT_SECS": "0", "BGE_M3_LOG_FORMAT": "json",
                # No probe (minutes on a full-size model, and not what is measured here).
                "BGE_M3_DISABLE_AUTO_BUDGET": "1",
                "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(args.repo)})
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open for the server, named in errors
        prefix="qlat-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "bgeserve", "serve"], cwd=args.repo, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited {proc.returncode}; log {log.name}")
            try:
                health = httpx.get(f"{url}/health", timeout=5).json()
                if health.get("status") == "ok" and \
                        health.get("tuning", {}).get("probe_status") != "running":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"server not ready; log {log.name}")
            time.sleep(0.5)
        texts = bulk_texts(args.bulk)
        httpx.post(f"{url}/v1/embeddings", json={"input": ["warm up"]}, timeout=60)
        bulk: dict[str, float] = {}

        def ingest() -> None:
            started = time.perf_counter()
            r = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=3600)
            r.raise_for_status()
            bulk["wall"] = time.perf_counter() - started
            bulk["tokens"] = r.json()["usage"]["prompt_tokens"]

        thread = threading.Thread(target=ingest)
        thread.start()
        while httpx.get(f"{url}/health", timeout=5).json()["queue"]["texts"] == 0:
            time.sleep(0.01)
        latencies = []
        for i in range(args.queries):
            started = time.perf_counter()
            r = httpx.post(f"{url}/v1/embeddings", json={"input": f"what is query {i}?"},
                           timeout=3600)
            r.raise_for_status()
            latencies.append(time.perf_counter() - started)
        thread.join()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    print(f"repo {args.repo}  variant {args.variant}  bulk {args.bulk} texts "
          f"({bulk['tokens']:.0f} tokens) in {bulk['wall']:.1f} s")
    print(f"queries during the bulk: p50 {statistics.median(latencies) * 1000:.0f} ms, "
          f"max {max(latencies) * 1000:.0f} ms, all: "
          + " ".join(f"{x * 1000:.0f}" for x in latencies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
