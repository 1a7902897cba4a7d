#!/usr/bin/env python3
"""Start ``bgeserve serve``, wait until its probe has ended, print what /health says of the
variant choice and the probe, print the cached fit and its samples; then restart with the same
cache and print again (the restart must be a probe ``cache_hit``).

    BGE_M3_MODEL_PATH=EXPORT [BGE_M3_...=...] scripts/serve-check.py LABEL CACHE_DIR [KEY=VALUE ...]

The servers' logs go to CACHE_DIR/LABEL-first.log and CACHE_DIR/LABEL-restart.log. Exit status
0 when the first start's probe completed (or hit the cache) and the restart was a cache_hit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

TUNING = ("probe_status", "probe_mode", "probe_error", "probe_seconds", "c_bytes_per_run",
          "a_bytes_per_token", "b_bytes_per_token_sq", "max_workspace_bytes",
          "max_seq_that_fits", "memory_source", "model_rss_bytes_per_worker", "chunk_tokens",
          "chunk_rates")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return json.load(r)
    except urllib.error.HTTPError as exc:
        return json.load(exc)
    except (OSError, ValueError):  # not listening yet
        return None


def serve(label: str, tag: str, env: dict[str, str], cache: Path) -> str | None:
    """One server start until its probe has ended; its probe_status (None if it died)."""
    port = free_port()
    env = dict(env, BGE_M3_BIND=f"127.0.0.1:{port}")
    started, ready, h = time.time(), None, None
    with open(cache / f"{label}-{tag}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bgeserve", "serve"], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            while time.time() - started < 3600:
                if proc.poll() is not None:
                    print(f"[{label} {tag}] server exited {proc.returncode}")
                    return None
                h = health(port)
                if h and h.get("status") in ("ok", "fail"):
                    ready = ready or time.time() - started
                    if h.get("status") == "fail" or h["tuning"]["probe_status"] != "running":
                        break
                time.sleep(2)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    assert h is not None and ready is not None
    t, m = h.get("tuning", {}), h.get("model", {})
    print(f"[{label} {tag}] ready after {ready:.0f} s, probe ended after "
          f"{time.time() - started:.0f} s; status {h.get('status')}")
    print(f"[{label} {tag}] model: " + json.dumps(
        {k: m.get(k) for k in ("variant", "choice", "candidates", "backend")}))
    print(f"[{label} {tag}] tuning: " + json.dumps({k: t.get(k) for k in TUNING}))
    return t.get("probe_status")


def main() -> int:
    label, cache = sys.argv[1], Path(sys.argv[2])
    cache.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, BGE_M3_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1",
               BGE_M3_LOG_FORMAT="text", BGE_M3_HEARTBEAT_SECS="0")
    env.update(kv.split("=", 1) for kv in sys.argv[3:])
    first = serve(label, "first", env, cache)
    try:
        rec = json.loads((cache / "probe-coefficients.json").read_text())
        print(f"[{label}] cache record: " + json.dumps(
            {k: rec.get(k) for k in ("a", "b", "c", "max_rel_residual", "held_out_rel_error",
                                     "cover", "failed")}))
        print(f"[{label}] samples (batch, seq, bytes, s): " + json.dumps(
            [[s["batch"], s["seq"], s["workspace_bytes"], round(s["seconds"], 2)]
             for s in rec.get("samples", [])]))
        ho = rec.get("held_out")
        print(f"[{label}] held_out: " + json.dumps(
            ho and [ho["batch"], ho["seq"], ho["workspace_bytes"], round(ho["seconds"], 2)]))
    except (OSError, ValueError, KeyError) as exc:
        print(f"[{label}] no cache record: {exc}")
    again = serve(label, "restart", env, cache)
    return 0 if first in ("complete", "cache_hit") and again == "cache_hit" else 1


if __name__ == "__main__":
    sys.exit(main())
