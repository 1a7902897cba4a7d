"""Unfinished request heads against `bgeserve serve`: the server's RSS, bounded vs stock uvicorn.

Starts the server on an export (tiny is enough: the point is the HTTP layer) with bgeserve's
protocol (``http/headlimits.py``, ``http/stalls.py``) or, with ``--stock``, uvicorn's own httptools protocol, then
opens ``--connections`` connections that each send ``--mib`` MiB of one header without ending
it; prints the server's RSS before, at its peak and after, what each client read back, and the
status of one ordinary request afterwards. ``--requests N`` first times N sequential one-text
requests on one kept-alive connection (the same text: the embedding cache answers, so the HTTP
layer is most of each), the protocol's cost. Run both modes in turn, several rounds:

    for r in 1 2 3 4; do for m in --stock ""; do
        python scripts/head_flood.py --export-dir /tmp/m3tiny --requests 600 $m; done; done
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil
from benchkit.common import wait_healthy

STOCK = ("import bgeserve.http.stalls as s, uvicorn.protocols.http.httptools_impl as u; "
         "s.StallBoundHttpTools = u.HttpToolsProtocol; ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export-dir", required=True)
    ap.add_argument("--variant", default="fp32")
    ap.add_argument("--stock", action="store_true", help="uvicorn's own httptools protocol")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--port", type=int, default=8399)
    ap.add_argument("--requests", type=int, default=0, help="time this many requests first")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    env = dict(os.environ, BGE_M3_MODEL_PATH=args.export_dir, BGE_M3_MODEL=args.variant,
               BGE_M3_CACHE_DIR=tempfile.mkdtemp(prefix="head-flood-"), HF_HUB_OFFLINE="1",
               BGE_M3_LOG_LEVEL="error")
    start = (f"import sys; sys.argv = ['bgeserve', 'serve', '--bind', '127.0.0.1:{args.port}']; "
             "from bgeserve.cli import main; sys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", (STOCK if args.stock else "") + start],
                            env=env)
    try:
        wait_healthy(url)
        mode = "stock uvicorn" if args.stock else "bgeserve"
        if args.requests:
            with httpx.Client() as client:
                for _ in range(50):  # warm: the text cached, the connection open
                    client.post(url + "/v1/embeddings", json={"input": "same text"})
                began = time.perf_counter()
                for _ in range(args.requests):
                    client.post(url + "/v1/embeddings", json={"input": "same text"})
                took = time.perf_counter() - began
            print(f"{mode}: {args.requests / took:.0f} requests/s")
        server = psutil.Process(proc.pid)
        before = peak = server.memory_info().rss
        outcome: list[str] = []

        def flood() -> None:
            with socket.create_connection(("127.0.0.1", args.port)) as conn:
                conn.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nX-Big: ")
                sent = 0
                try:
                    while sent < args.mib:
                        conn.sendall(b"a" * (1 << 20))
                        sent += 1
                except OSError:
                    pass
                conn.settimeout(5)
                try:
                    said = conn.recv(200).split(b"\r\n", 1)[0].decode() or "closed"
                except OSError as exc:
                    said = repr(exc)
                outcome.append(f"{sent} MiB sent, read {said!r}")

        threads = [threading.Thread(target=flood) for _ in range(args.connections)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak = max(peak, server.memory_info().rss)
            time.sleep(0.05)
        status = httpx.post(url + "/v1/embeddings", json={"input": "still here"}).status_code
        print(f"{mode}: server RSS {before / 2**20:.0f} -> peak {peak / 2**20:.0f} MiB, after "
              f"{server.memory_info().rss / 2**20:.0f} MiB; the next request {status}")
        for line in outcome:
            print("  " + line)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
