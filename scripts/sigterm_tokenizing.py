"""SIGTERM while a big request is being tokenized: its status, content type and seconds after
the signal, and the server's exit (docs/reliability.md §7).

    python scripts/sigterm_tokenizing.py --tree . --model /tmp/tinyx --port 18951
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=".", help="the checkout to serve (PYTHONPATH)")
    ap.add_argument("--model", required=True, help="an export (bgeserve export)")
    ap.add_argument("--port", type=int, default=18951)
    ap.add_argument("--texts", type=int, default=150, help="texts of 8,200 words each")
    ap.add_argument("--after", type=float, default=3.0, help="seconds to the SIGTERM")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="sigterm-")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(args.tree),
           "BGE_M3_MODEL_PATH": args.model, "BGE_M3_MODEL": "fp32",
           "BGE_M3_BIND": f"127.0.0.1:{args.port}", "BGE_M3_CACHE_DIR": work,
           "BGE_M3_SHUTDOWN_TIMEOUT_SECS": "2", "BGE_M3_CACHE_MB": "0",
           "BGE_M3_LOG_FORMAT": "text"}
    with open(os.path.join(work, "server.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bgeserve", "serve"], env=env,
                                cwd=work, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    body = {"input": [f"w{i} " + "word " * 8200 for i in range(args.texts)]}
    out: dict[str, object] = {}

    def post() -> None:
        try:
            r = httpx.post(url + "/v1/embeddings", json=body, timeout=120)
            out.update(status=r.status_code, type=r.headers.get("content-type"),
                       text=r.text[:120])
        except httpx.HTTPError as exc:
            out.update(status=repr(exc))
        out["at"] = time.monotonic()

    thread = threading.Thread(target=post)
    thread.start()
    time.sleep(args.after)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    thread.join()
    proc.wait(60)
    print(f"{args.tree}: {out['status']} {out.get('type')} at +{out['at'] - sent:.1f}s "
          f"after SIGTERM; exit {proc.returncode} at +{time.monotonic() - sent:.1f}s; "
          f"{out.get('text', '')}")


if __name__ == "__main__":
    main()
