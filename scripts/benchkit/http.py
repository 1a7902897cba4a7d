"""``http``, ``serve`` and ``load``: ``python -m bgeserve serve`` in a subprocess, over loopback.

``http`` posts the corpus (``--http-batch`` texts per request, ``--http-clients`` at once) to a
server pinned to the variant; ``serve`` the same to a server started with only the model path,
bind address and cache dir, which chooses its variant itself (``/health`` says which);
``load`` posts one short text per request at each client count, with cross-request batching
on and off. The client is aiohttp (``_drive``); the server's own counters come from /metrics.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchkit.common import REPO, free_port, log, percentiles, proc_status, save_vectors


class Server:
    """``python -m bgeserve serve`` as a subprocess on a free loopback port."""

    def __init__(self, spec: dict[str, Any], extra_env: dict[str, str], label: str):
        work = Path(spec["work_dir"])
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("BGE_M3_")}
        env.update({
            "BGE_M3_MODEL_PATH": spec["export_dir"], "BGE_M3_BIND": f"127.0.0.1:{self.port}",
            "BGE_M3_LOG_FORMAT": "json", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            # The load test cycles the corpus's texts: with the embedding cache on it would
            # time cache hits (and issue 17's default-variant figure is asked with it off).
            "BGE_M3_CACHE_MB": "0",
        })
        if spec.get("ep", "cpu") != "cpu":
            env["BGE_M3_EP"] = spec["ep"]
        if spec["mode"] == "serve":
            # Issue 17's "default variant over HTTP": `bgeserve serve` with only the model
            # path, the bind address and the cache dir set, so the server measures and picks
            # its variant, budget and chunk size as a user's does.
            env["BGE_M3_CACHE_DIR"] = spec["serve_cache"]
        else:
            env.update({
                "BGE_M3_MODEL": spec["variant"],
                "BGE_M3_INTRA_THREADS": str(max(1, spec["threads"] // spec.get("workers", 1))),
                "BGE_M3_WORKERS": str(spec.get("workers", 1)),
                "BGE_M3_CACHE_DIR": str(work / "cache"),
                "BGE_M3_IDLE_TIMEOUT_SECS": "0", "BGE_M3_HEARTBEAT_SECS": "0",
                "OMP_NUM_THREADS": str(spec["threads"]),
            })
            if spec["http_budget"] == "disabled":
                env["BGE_M3_DISABLE_AUTO_BUDGET"] = "1"
            if spec.get("max_seq"):
                env["BGE_M3_MAX_SEQ_LENGTH"] = str(spec["max_seq"])
            env.update(spec.get("http_env") or {})
            env.update(extra_env)
        self.env = {k: v for k, v in env.items() if k.startswith(("BGE_M3_", "HF_"))}
        self.log_path = work / "logs" / f"server-{label}-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "bgeserve", "serve"], env=env,
                                     cwd=str(REPO), stdout=self._log, stderr=subprocess.STDOUT)
        self.ready_s: float | None = None
        self.serving_s: float | None = None
        self.health: dict[str, Any] = {}

    def wait_ready(self, timeout: float, wait_probe: bool) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}: "
                                       f"{self.tail()}")
                try:
                    r = client.get("/health")
                    body = r.json()
                    tuning = (body.get("tuning") or {}).get("probe_status")
                    if r.status_code == 200 and self.serving_s is None:
                        # answering requests (a probe may still run behind it)
                        self.serving_s = time.perf_counter() - self.started
                    if r.status_code == 200 and (not wait_probe or tuning != "running"):
                        self.ready_s = time.perf_counter() - self.started
                        self.health = body
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout:.0f}s: {self.tail()}")

    def status(self) -> dict[str, int]:
        return proc_status(self.proc.pid)

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


async def _drive(base: str, bodies: list[bytes], clients: int,
                 timeout: float) -> tuple[float, list[float], list[Any], list[str], int]:
    """POST ``bodies`` with ``clients`` concurrent connections; returns wall, latencies,
    decoded responses (None on error), error messages, total prompt tokens.

    aiohttp, not httpx: httpx's AsyncClient is the bottleneck past a few connections. Against
    a bare Starlette app on this 2-core machine it managed 727 requests/s with 16 connections
    and 151 with 64 (p99 1.7 s); aiohttp 8,859 and 8,480 (p99 13 ms). Every load figure
    measured with it before 2026-11-30 was the client's limit, not the server's.
    """
    import aiohttp

    try:
        import orjson

        loads: Callable[[bytes | str], Any] = orjson.loads
    except ImportError:  # pragma: no cover
        loads = json.loads
    results: list[Any] = [None] * len(bodies)
    latencies: list[float] = []
    errors: list[str] = []
    tokens = 0
    cursor = iter(range(len(bodies)))
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=clients + 2)
    async with aiohttp.ClientSession(base, connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as client:

        async def worker() -> None:
            nonlocal tokens
            for i in cursor:
                s = time.perf_counter()
                try:
                    async with client.post("/v1/embeddings:both", data=bodies[i]) as r:
                        body = await r.read()
                        status = r.status
                    latencies.append(time.perf_counter() - s)
                    if status != 200:
                        errors.append(f"{status}: {body[:200]!r}")
                        continue
                    data = loads(body)
                    tokens += int(data["usage"]["prompt_tokens"])
                    results[i] = data
                except Exception as exc:  # noqa: BLE001 - every failure is a counted error
                    latencies.append(time.perf_counter() - s)
                    errors.append(repr(exc)[:200])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return wall, latencies, results, errors, tokens


_CHUNK_METRICS = ("bgeserve_chunk_texts_count", "bgeserve_chunk_texts_sum",
                  "bgeserve_tokens_total", "bgeserve_padding_tokens_total")


def scrape(base: str) -> dict[str, float]:
    """The server's chunk counters from /metrics (summed over labels); {} when unavailable."""
    import httpx

    out: dict[str, float] = {}
    try:
        text = httpx.get(base + "/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _CHUNK_METRICS:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def chunk_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Chunks run between two scrapes: count, mean texts per chunk, padding share."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _CHUNK_METRICS}
    chunks = int(d["bgeserve_chunk_texts_count"])
    if not after or chunks <= 0:
        return {"server_chunks": None, "texts_per_chunk": None, "server_padding_pct": None}
    real, pad = d["bgeserve_tokens_total"], d["bgeserve_padding_tokens_total"]
    return {"server_chunks": chunks,
            "texts_per_chunk": d["bgeserve_chunk_texts_sum"] / chunks,
            "server_padding_pct": 100.0 * pad / (real + pad) if real + pad else None}


def _body(texts: list[str]) -> bytes:
    return json.dumps({"model": "bge-m3", "input": texts, "encoding_format": "base64"},
                      ensure_ascii=False).encode()


def child_http(spec: dict[str, Any], corpus: dict[str, Any]) -> dict[str, Any]:
    texts = corpus["texts"]
    batch = max(1, spec["http_batch"])
    groups = [list(range(i, min(i + batch, len(texts)))) for i in range(0, len(texts), batch)]
    serve = spec["mode"] == "serve"
    server = Server(spec, {}, "serve" if serve else f"http-{spec['variant']}")
    try:
        # serve: its own start-up measurements (probe, variant choice) finish first
        server.wait_ready(spec["server_timeout"], serve or spec["http_budget"] == "probe")
        rss_load = server.status().get("VmRSS", 0)
        asyncio.run(_drive(server.base, [_body(["warm up"])], 1, spec["request_timeout"]))
        before = scrape(server.base)
        wall, latencies, results, errors, tokens = asyncio.run(_drive(
            server.base, [_body([texts[i] for i in g]) for g in groups], spec["http_clients"],
            spec["request_timeout"]))
        chunks = chunk_delta(before, scrape(server.base))
        st = server.status()
        env = server.env
        health = server.health
    finally:
        rc = server.stop()
    dense: np.ndarray | None = None
    sparse: list[tuple[np.ndarray, np.ndarray]] | None = None
    if not errors:
        rows, sparse = [], []
        for g, data in zip(groups, results):
            for item in data["data"]:
                rows.append(np.frombuffer(base64.b64decode(item["embedding"]), "<f4"))
                sv = item.get("sparse_values") or {"indices": [], "values": []}
                sparse.append((np.asarray(sv["indices"], np.int64),
                               np.asarray(sv["values"], np.float32)))
        dense = np.stack(rows)
    save_vectors(Path(spec["vectors"]), dense, sparse)
    return {"wall_s": wall, "load_s": server.ready_s, "rss_after_load": rss_load,
            "peak_rss_server": st.get("VmHWM", 0), "latencies": latencies,
            "errors": len(errors), "error_samples": errors[:5], "tokens_reported": tokens,
            "requests": len(groups), "clients": spec["http_clients"], "http_batch": batch,
            "server_env": env, "server_exit": rc, **chunks,
            "tuning": (health.get("tuning") or {}).get("probe_status"),
            **({"served": {**_served(health), "serving_s": server.serving_s}} if serve else {})}


def _served(health: dict[str, Any]) -> dict[str, Any]:
    """What a ``serve`` row's server chose for itself (its /health once ready)."""
    model, tuning = health.get("model") or {}, health.get("tuning") or {}
    return {"variant": model.get("variant"), "choice": model.get("choice"),
            "candidates": model.get("candidates"), "threads": model.get("threads_per_worker"),
            "chunk_tokens": tuning.get("chunk_tokens"),
            "chunk_tokens_source": tuning.get("chunk_tokens_source"),
            "run_cost": tuning.get("run_cost")}


def child_load(spec: dict[str, Any], corpus: dict[str, Any]) -> dict[str, Any]:
    texts = corpus["texts"]
    batching = spec["batching"]
    server = Server(spec, {"BGE_M3_CROSS_REQUEST_BATCHING": "1" if batching else "0"},
                    f"load-{spec['variant']}-{'on' if batching else 'off'}")
    levels = []
    try:
        server.wait_ready(spec["server_timeout"], spec["http_budget"] == "probe")
        rss_load = server.status().get("VmRSS", 0)
        asyncio.run(_drive(server.base, [_body(["warm up"])], 1, spec["request_timeout"]))
        for n in spec["clients"]:
            total = max(spec["load_requests"], n)
            bodies = [_body([texts[i % len(texts)]]) for i in range(total)]
            before = scrape(server.base)
            wall, latencies, _, errors, tokens = asyncio.run(
                _drive(server.base, bodies, n, spec["request_timeout"]))
            chunks = chunk_delta(before, scrape(server.base))
            p50, p99 = percentiles(latencies)
            levels.append({"clients": n, "requests": total, "wall_s": wall,
                           "requests_per_s": total / wall, "tokens": tokens,
                           "tokens_per_s": tokens / wall, "p50_ms": p50, "p99_ms": p99,
                           "errors": len(errors), "error_samples": errors[:3], **chunks})
            log(f"  load {spec['variant']} batching={'on' if batching else 'off'} clients={n}: "
                f"{total / wall:.1f} req/s, p50 {p50:.0f} ms, p99 {p99:.0f} ms, "
                f"{len(errors)} errors")
        st = server.status()
    finally:
        rc = server.stop()
    return {"levels": levels, "rss_after_load": rss_load, "peak_rss_server": st.get("VmHWM", 0),
            "load_s": server.ready_s, "server_exit": rc, "server_env": server.env}

