#!/usr/bin/env python3
"""Soak: a live ``bgeserve serve`` under mixed load and faults for ``--duration`` seconds.

    python scripts/soak.py --duration 1800 --model-path EXPORT_DIR   # the 30-minute run
    python scripts/soak.py --duration 60 --tiny                      # builds a tiny model first

The timeline (fractions of the duration):
- capacity (first 8 %, 6-30 s): 8 closed-loop clients send the normal mix; requests/s measured;
- then open-loop Poisson arrivals at ``--load`` (0.8) of that capacity, of which ~14 % are
  faults: clients that disconnect after 1-30 ms, malformed bodies (400/415), bodies over
  BGE_M3_MAX_BODY_BYTES (413) and unauthorized ones (401) sent by http.client (which writes the
  whole body before reading, so a reset instead of the answer shows);
- at 15 % a SIGTERM restart, at 25 % a SIGHUP restart: arrivals pause (a load balancer takes
  the pod out), a burst of ~0.5 s of work is sent, the signal follows; every request of the
  burst must be answered and the server must exit 0; a new server then starts;
- from 30 %, quiet gaps of 2x BGE_M3_IDLE_TIMEOUT_SECS + 1 s every max(15 s, duration / 25),
  during which /health must say ``idle`` (sessions unloaded); the next requests reload them.

Every 200 is checked: one item per input, in order, and a fixed canary text's dense vector
equals the one recorded at start (1e-5 for fp32, cosine 0.999 otherwise). The server's RSS is
sampled every 2 s; the report gives it per minute (median while loaded) and its slope over the
last server's life after a warm-up. Exit 1 if anything was lost (a request sent and never
answered), any 5xx, an unreadable refusal, a wrong result, an unexpected status, a restart
that did not exit 0, no idle cycle, or (with ``--max-rss-slope``) a steeper RSS slope.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO))

from soak_server import KEY, SoakServer  # scripts/ is on the path: run as a script

CANARY = "bgeserve soak canary: the quick brown fox jumps over the lazy dog"
WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed",
         "do", "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna",
         "aliqua", "混合", "检索", "données", "été"]
ENDPOINTS = ("/v1/embeddings", "/v1/sparse-embeddings", "/v1/embeddings:both")
FAULTS = {"disconnect": 0.05, "malformed": 0.04, "oversized": 0.025, "unauthorized": 0.025}
MALFORMED = [(b"{not json", "application/json", 400), (b'{"input": [1, "a"]}', "application/json",
             400), (b'{"input": []}', "application/json", 400),
             (b'{"input": "x"}', "text/plain", 415)]
AUTH = {"Authorization": f"Bearer {KEY}"}


class Stats:
    """Everything the report counts."""

    def __init__(self) -> None:
        self.by_status: Counter[str] = Counter()  # "kind status"
        self.latencies: list[float] = []
        self.failures: dict[str, list[str]] = {k: [] for k in (
            "lost", "5xx", "unreadable", "mismatch", "unexpected")}

    def fail(self, kind: str, what: str) -> None:
        self.failures[kind].append(what)


def texts_for(rng: random.Random, canary: bool) -> list[str]:
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 120))) for _ in range(rng.randint(1, 8))]
    if canary:
        texts.insert(rng.randrange(len(texts) + 1), CANARY)
    return texts


def check_body(body: dict[str, Any], texts: list[str], endpoint: str,
               reference: np.ndarray, fp32: bool) -> str | None:
    """What is wrong with a 200 body, or None."""
    data = body.get("data", [])
    if [d.get("index") for d in data] != list(range(len(texts))):
        return f"{endpoint}: indices {[d.get('index') for d in data]} for {len(texts)} inputs"
    if endpoint == "/v1/sparse-embeddings":
        return None
    for text, item in zip(texts, data, strict=True):
        if text == CANARY:
            got = np.asarray(item["embedding"], dtype=np.float32)
            close = (np.abs(got - reference).max() <= 1e-5 if fp32
                     else float(got @ reference) / float(np.linalg.norm(got)) >= 0.999)
            if not close:
                return f"{endpoint}: the canary's vector changed"
    return None


async def normal(session: aiohttp.ClientSession, url: str, rng: random.Random, stats: Stats,
                 ref: np.ndarray, fp32: bool, *, kind: str = "normal",
                 cancel_after: float | None = None) -> None:
    endpoint = rng.choice(ENDPOINTS)
    texts = texts_for(rng, canary=rng.random() < 0.3)
    started = time.monotonic()
    try:
        async with asyncio.timeout(cancel_after):
            async with session.post(url + endpoint, json={"input": texts}, headers=AUTH) as r:
                status, body = r.status, await r.read()
    except TimeoutError:
        if cancel_after is not None:
            stats.by_status[f"{kind} gone"] += 1  # the client left on purpose
            return
        stats.fail("lost", f"{kind} {endpoint}: no answer within the client timeout")
        return
    except aiohttp.ClientError as exc:
        stats.fail("lost", f"{kind} {endpoint}: {exc!r}")
        return
    stats.by_status[f"{kind} {status}"] += 1
    if status == 200:
        if kind == "normal":
            stats.latencies.append(time.monotonic() - started)
        problem = check_body(json.loads(body), texts, endpoint, ref, fp32)
        if problem:
            stats.fail("mismatch", problem)
    elif status >= 500:
        stats.fail("5xx", f"{kind} {endpoint}: {status} {body[:200]!r}")
    elif status != 429:
        stats.fail("unexpected", f"{kind} {endpoint}: {status} {body[:200]!r}")


async def malformed(session: aiohttp.ClientSession, url: str, rng: random.Random,
                    stats: Stats) -> None:
    body, content_type, want = rng.choice(MALFORMED)
    try:
        async with session.post(url + "/v1/embeddings", data=body,
                                headers={**AUTH, "Content-Type": content_type}) as r:
            status, text = r.status, await r.read()
    except aiohttp.ClientError as exc:
        stats.fail("lost", f"malformed: {exc!r}")
        return
    stats.by_status[f"malformed {status}"] += 1
    if status != want or b'"error"' not in text:
        (stats.fail("5xx", f"malformed: {status}") if status >= 500
         else stats.fail("unexpected", f"malformed: {status}, wanted {want}"))


def _blocking_post(port: int, size: int, key: str) -> tuple[int, bytes]:
    """POST ``size`` bytes the way urllib does: all of it, then read (Connection: close)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/embeddings", body=b'{"input": "' + b"x" * size + b'"}',
                     headers={"Content-Type": "application/json", "Connection": "close",
                              "Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


async def refused(port: int, kind: str, max_body: int, stats: Stats) -> None:
    size, key, want = ((max_body + max_body // 2, KEY, 413) if kind == "oversized"
                       else (256 * 1024, "wrong-key", 401))
    try:
        status, body = await asyncio.to_thread(_blocking_post, port, size, key)
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        stats.fail("unreadable", f"{kind}: {exc!r}")
        return
    stats.by_status[f"{kind} {status}"] += 1
    if status != want or b'"error"' not in body:
        stats.fail("unexpected", f"{kind}: {status}, wanted {want}")


class Soak:
    """The timeline of one run."""

    def __init__(self, args: argparse.Namespace, server: SoakServer) -> None:
        self.args, self.server, self.stats = args, server, Stats()
        self.rng = random.Random(args.seed)
        self.started = time.monotonic()
        self.paused = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.rss: list[tuple[float, int, int, str]] = []  # (t, pid, rss, health status)
        self.events: list[dict[str, Any]] = []
        self.reference = np.zeros(1, dtype=np.float32)
        self.fp32 = args.variant == "fp32"

    def now(self) -> float:
        return time.monotonic() - self.started

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def fault(self, session: aiohttp.ClientSession) -> Any:
        url, rng, stats = self.server.url, self.rng, self.stats
        pick = rng.random()
        for kind, weight in FAULTS.items():
            if pick < weight:
                if kind == "disconnect":
                    return normal(session, url, rng, stats, self.reference, self.fp32,
                                  kind="disconnect", cancel_after=rng.uniform(0.001, 0.03))
                if kind == "malformed":
                    return malformed(session, url, rng, stats)
                return refused(self.server.port, kind, self.args.max_body_bytes, stats)
            pick -= weight
        return normal(session, url, rng, stats, self.reference, self.fp32)

    async def sample_rss(self) -> None:
        async with aiohttp.ClientSession() as probe:
            while True:
                status = "down"
                try:
                    async with probe.get(self.server.url + "/health",
                                         timeout=aiohttp.ClientTimeout(total=2)) as r:
                        status = (await r.json()).get("status", "?")
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
                rss = self.server.rss()
                if rss:
                    self.rss.append((self.now(), self.server.pid, rss, status))
                await asyncio.sleep(self.args.sample_secs)

    async def capacity(self, session: aiohttp.ClientSession, seconds: float) -> float:
        before = self.stats.by_status["normal 200"]
        deadline = time.monotonic() + seconds
        latencies = len(self.stats.latencies)

        async def client() -> None:
            while time.monotonic() < deadline:
                await normal(session, self.server.url, self.rng, self.stats, self.reference,
                             self.fp32)

        await asyncio.gather(*(client() for _ in range(8)))
        del self.stats.latencies[latencies:]  # closed-loop latencies are not the soak's
        return (self.stats.by_status["normal 200"] - before) / seconds

    async def restart(self, session: aiohttp.ClientSession, sig: signal.Signals,
                      rate: float) -> None:
        self.paused.set()
        await asyncio.sleep(0.05)  # connections in flight get accepted
        burst = [asyncio.ensure_future(normal(session, self.server.url, self.rng, self.stats,
                                              self.reference, self.fp32, kind="drain"))
                 for _ in range(max(2, round(0.5 * rate)))]
        await asyncio.sleep(0.05)
        lost_before = len(self.stats.failures["lost"])
        at = self.now()
        rc = await asyncio.to_thread(self.server.stop, sig)
        await asyncio.gather(*burst)
        self.events.append({"event": sig.name, "at_s": round(at, 1), "exit_code": rc,
                            "in_flight": len(burst),
                            "lost": len(self.stats.failures["lost"]) - lost_before})
        if rc != 0:
            self.stats.fail("unexpected", f"{sig.name}: exit code {rc}")
        await asyncio.to_thread(self.server.start)
        self.paused.clear()

    async def idle_gap(self) -> None:
        self.paused.set()
        await asyncio.gather(*list(self.tasks), return_exceptions=True)
        gap = 2 * self.args.idle_secs + 1
        at, seen_idle = self.now(), False
        async with aiohttp.ClientSession() as probe:
            end = time.monotonic() + gap
            while time.monotonic() < end:
                async with probe.get(self.server.url + "/health") as r:
                    seen_idle |= (await r.json()).get("status") == "idle"
                await asyncio.sleep(0.25)
        self.events.append({"event": "idle", "at_s": round(at, 1), "unloaded": seen_idle})
        self.paused.clear()

    async def run(self) -> dict[str, Any]:
        d = self.args.duration
        connector = aiohttp.TCPConnector(force_close=True, limit=0)  # a connection per request
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.post(self.server.url + "/v1/embeddings", headers=AUTH,
                                    json={"input": [CANARY]}) as r:
                self.reference = np.asarray((await r.json())["data"][0]["embedding"], np.float32)
            sampler = asyncio.ensure_future(self.sample_rss())
            capacity = await self.capacity(session, min(30.0, max(6.0, 0.08 * d)))
            rate = max(1.0, self.args.load * capacity)
            every = max(15.0, d / 25)
            schedule = [(0.15 * d, "SIGTERM"), (0.25 * d, "SIGHUP")]
            schedule += [(t, "idle") for t in np.arange(0.30 * d, d - every / 2, every)]
            while self.now() < d:
                if schedule and self.now() >= schedule[0][0]:
                    _, what = schedule.pop(0)
                    await (self.idle_gap() if what == "idle"
                           else self.restart(session, signal.Signals[what], rate))
                    continue
                if len(self.tasks) < self.args.max_outstanding:
                    self.spawn(self.fault(session))
                else:
                    self.stats.by_status["shed by the load generator"] += 1
                await asyncio.sleep(self.rng.expovariate(rate))
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
            sampler.cancel()
        return self.report(capacity, rate)

    def report(self, capacity: float, rate: float) -> dict[str, Any]:
        lat = sorted(self.stats.latencies)
        last_pid = self.rss[-1][1] if self.rss else None
        life = [(t, rss) for t, pid, rss, status in self.rss if pid == last_pid]
        loaded = [(t, rss) for t, pid, rss, status in self.rss if pid == last_pid
                  and status == "ok"]
        warm = life[0][0] + self.args.warmup_frac * (life[-1][0] - life[0][0]) if life else 0
        tail = [(t, rss) for t, rss in loaded if t >= warm]
        slope = None
        if len(tail) >= 3 and tail[-1][0] > tail[0][0]:
            ts, rs = np.array([t for t, _ in tail]) / 60, np.array([r for _, r in tail]) / 2**20
            slope = float(np.polyfit(ts, rs, 1)[0])
        minutes: dict[int, list[int]] = {}
        for t, _, rss, status in self.rss:
            if status == "ok":
                minutes.setdefault(int(t // 60), []).append(rss)
        return {
            "duration_s": self.args.duration, "capacity_rps": round(capacity, 1),
            "target_rps": round(rate, 1), "requests": dict(sorted(self.stats.by_status.items())),
            "latency_ms": {"p50": round(1000 * lat[len(lat) // 2], 1) if lat else None,
                           "p99": round(1000 * lat[int(0.99 * (len(lat) - 1))], 1) if lat
                           else None, "n": len(lat)},
            "rss_mib_per_minute": {m: round(statistics.median(v) / 2**20, 1)
                                   for m, v in sorted(minutes.items())},
            "rss_slope_mib_per_min": None if slope is None else round(slope, 3),
            "events": self.events,
            "failures": {k: len(v) for k, v in self.stats.failures.items()},
            "failure_examples": {k: v[:5] for k, v in self.stats.failures.items() if v},
        }


def verdict(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What breaches the bar (empty: a pass)."""
    bad = [f"{k}: {n}" for k, n in report["failures"].items() if n]
    restarts = [e for e in report["events"] if e["event"] in ("SIGTERM", "SIGHUP")]
    if len(restarts) != 2:
        bad.append(f"{len(restarts)} restarts happened, 2 were planned")
    idle = [e for e in report["events"] if e["event"] == "idle"]
    if not idle or not all(e["unloaded"] for e in idle):
        bad.append(f"idle gaps without an unload: {[e for e in idle if not e['unloaded']]}")
    slope = report["rss_slope_mib_per_min"]
    if args.max_rss_slope is not None and (slope is None or slope >= args.max_rss_slope):
        bad.append(f"RSS slope {slope} MiB/min (bar: < {args.max_rss_slope})")
    return bad


def tiny_export(work: Path) -> Path:
    from bgeserve.export.main import export
    from bgeserve.testing.randmodel import cached_random_model

    out = work / "tiny-export"
    if not (out / "manifest.json").exists():
        export(str(cached_random_model(work, "tiny", seed=0)), out, ("fp32",))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, required=True, help="seconds of load (>= 40)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", type=Path, help="a `bgeserve export` directory")
    src.add_argument("--tiny", action="store_true", help="build and serve the tiny model")
    p.add_argument("--variant", default="fp32")
    p.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity")
    p.add_argument("--idle-secs", type=float, default=2.0, help="BGE_M3_IDLE_TIMEOUT_SECS")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="BGE_M3_MAX_BODY_BYTES")
    p.add_argument("--max-outstanding", type=int, default=64)
    p.add_argument("--sample-secs", type=float, default=2.0)
    p.add_argument("--warmup-frac", type=float, default=0.2,
                   help="part of the last server's life left out of the RSS slope")
    p.add_argument("--max-rss-slope", type=float, default=None, help="MiB/min; breach if not <")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for the server")
    args = p.parse_args(argv)
    if args.duration < 40:
        p.error("--duration must be at least 40 s (capacity, two restarts, an idle gap)")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bgeserve-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model_path or tiny_export(work)
    env = {"BGE_M3_MODEL_PATH": str(model), "BGE_M3_MODEL": args.variant,
           "BGE_M3_CACHE_DIR": str(work / "cache"), "BGE_M3_IDLE_TIMEOUT_SECS": str(args.idle_secs),
           "BGE_M3_MAX_BODY_BYTES": str(args.max_body_bytes),
           **dict(kv.split("=", 1) for kv in args.env)}
    server = SoakServer(env, work / "server.log")
    server.start()
    try:
        report = asyncio.run(Soak(args, server).run())
    finally:
        rc = server.stop(signal.SIGTERM)
    report["final_exit_code"] = rc
    report["server_log"] = str(work / "server.log")
    report["tracebacks_in_log"] = server.log_text().count("Traceback")
    problems = verdict(report, args)
    if rc != 0:
        problems.append(f"the last server exited {rc}")
    if report["tracebacks_in_log"]:
        problems.append(f"{report['tracebacks_in_log']} tracebacks in the server log")
    report["verdict"] = "PASS" if not problems else "FAIL: " + "; ".join(problems)
    text = json.dumps(report, indent=2, ensure_ascii=False)
    if args.report:
        args.report.write_text(text)
    print(text)
    return 0 if not problems else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    socket.setdefaulttimeout(60)
    sys.exit(main())
