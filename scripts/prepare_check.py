#!/usr/bin/env python3
"""The first-start check of a hub snapshot (issue 16): prepare on first start, then measure.

One run, on a hub-layout snapshot (e.g. ``scripts/hub_snapshot.py`` of the full-size random
model) and a fresh cache directory:

1. first start of ``bgeserve serve`` (from ``--serve-python``: a venv with ``pip install -e .``
   only, no torch): time to ready, the start-up steps as /health showed them, and the peak
   RSS of the server and its prepare steps (``/usr/bin/time -v``; per step in the manifest);
2. dense cosine of the served default variant vs FlagEmbedding fp32 (this Python, which needs
   torch and FlagEmbedding) on ``--texts`` texts of the mixed corpus;
3. RSS growth of the server for one 8,192-token text (peak VmHWM after a reset, minus RSS
   before): the default prepared server, each ``--long-also`` variant, and the stock graph
   (last, the other servers stopped);
4. HTTP throughput on the mixed corpus (scripts/bench.py's corpus and client), the prepared
   server (and one per ``--also-variant``) vs the stock graph of the same snapshot
   (``BGE_M3_PREPARE=0 BGE_M3_MODEL=fp32``), all up, rounds interleaved A B C / C B A, medians;
5. second start from the cache: time to ready.

Both servers run with ``BGE_M3_DISABLE_AUTO_BUDGET=1`` (no background probe competing for the
cores). Results: JSON on stdout and in ``--work``.

    python scripts/prepare_check.py --snapshot /tmp/bge-full-baai \\
        --model-dir /work/fullsize/bge-full --serve-python /tmp/notorch-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
from benchkit import common, corpus  # scripts/bench.py's corpus, HTTP client and /proc readers
from benchkit import http as bench_http

READY_TIMEOUT_S = 3600
STARTED: list[Server] = []  # every server started, for the clean-up when a step fails


def log(msg: str) -> None:
    print(f"[prepare-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Server:
    """``bgeserve serve`` under ``/usr/bin/time -v`` on a free port; ``pid`` is the server's."""

    def __init__(self, python: str, env: dict[str, str], work: Path, label: str):
        self.port = common.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.time_file = work / f"time-{label}.txt"
        self.log_file = work / f"server-{label}.log"
        full = {k: v for k, v in os.environ.items()
                if not k.startswith(("BGE_M3_", "HF_", "PYTHONPATH"))}
        full.update({"BGE_M3_BIND": f"127.0.0.1:{self.port}", "BGE_M3_LOG_FORMAT": "json",
                     "BGE_M3_HEARTBEAT_SECS": "0", "BGE_M3_IDLE_TIMEOUT_SECS": "0",
                     "BGE_M3_DISABLE_AUTO_BUDGET": "1", "HF_HUB_OFFLINE": "1",
                     # Every round sends the same texts: the embedding cache would answer
                     # fp32's (not int8's) from memory after the first.
                     "BGE_M3_CACHE_MB": "0",
                     "BGE_M3_REQUEST_TIMEOUT_SECS": "0",  # a long text on a busy machine
                     "PYTHONUNBUFFERED": "1", **env})
        STARTED.append(self)
        self._log = open(self.log_file, "wb")  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(["/usr/bin/time", "-v", "-o", str(self.time_file), python,
                                      "-m", "bgeserve", "serve"], env=full, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
        self.pid = self._child()

    def _child(self) -> int:
        for _ in range(100):
            try:
                kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
            except OSError:
                kids = ""
            if kids.split():
                return int(kids.split()[0])
            time.sleep(0.05)
        raise RuntimeError("the server process did not start")

    def wait_ready(self) -> tuple[float, dict[str, Any], list[tuple[float, str]]]:
        """Seconds to ready, the ready /health body, and (seconds, step) as each step began."""
        import httpx

        steps: list[tuple[float, str]] = []
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: see {self.log_file}")
            try:
                body = httpx.get(self.base + "/health", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                time.sleep(0.5)
                continue
            at = round(time.monotonic() - self.started, 1)
            step = body.get("step")
            if step and (not steps or steps[-1][1] != step):
                steps.append((at, step))
                log(f"  {at:7.1f}s {step}")
            if body.get("status") == "ok":
                return at, body, steps
            if body.get("status") == "fail":
                raise RuntimeError(f"server failed: {body.get('error')}")
            time.sleep(0.5)
        raise RuntimeError("not ready in time")

    def status(self) -> dict[str, int]:
        return common.proc_status(self.pid)

    def stop(self) -> dict[str, str]:
        """SIGTERM the server; returns /usr/bin/time's figures."""
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.proc.wait(120)
        self._log.close()
        figures = {}
        for line in self.time_file.read_text().splitlines():
            key, _, value = line.strip().rpartition(": ")
            figures[key] = value
        return {"max_rss_mib": str(int(figures.get("Maximum resident set size (kbytes)", 0))
                                   >> 10),
                "wall": figures.get("Elapsed (wall clock) time (h:mm:ss or m:ss)", "")}


def embed(base: str, texts: list[str]) -> np.ndarray:
    import httpx

    rows = []
    for text in texts:
        r = httpx.post(base + "/v1/embeddings", json={"model": "bge-m3", "input": [text]},
                       timeout=600)
        r.raise_for_status()
        rows.append(r.json()["data"][0]["embedding"])
    return np.asarray(rows, dtype=np.float64)


def flag_reference(model_dir: Path, texts: list[str], out: Path) -> None:
    """FlagEmbedding fp32 dense vectors of ``texts`` (in a child: torch's memory goes after)."""
    code = ("import json, sys, numpy as np\nfrom FlagEmbedding import BGEM3FlagModel\n"
            "texts = json.load(open(sys.argv[2]))\n"
            "m = BGEM3FlagModel(sys.argv[1], use_fp16=False, devices='cpu')\n"
            "out = m.encode(texts, batch_size=1, max_length=8192)['dense_vecs']\n"
            "np.save(sys.argv[3], np.asarray(out, dtype=np.float64))\n")
    spec = out.with_suffix(".json")
    spec.write_text(json.dumps(texts))
    subprocess.run([sys.executable, "-c", code, str(model_dir), str(spec), str(out)],
                   check=True)


def one_long_text(server: Server, text: str) -> dict[str, Any]:
    """RSS growth of the server for one text: peak after a reset minus the RSS before."""
    embed(server.base, ["warm up"])
    before = server.status()["VmRSS"]
    Path(f"/proc/{server.pid}/clear_refs").write_text("5")
    started = time.monotonic()
    embed(server.base, [text])
    after = server.status()
    return {"seconds": round(time.monotonic() - started, 1), "rss_before_mib": before >> 20,
            "peak_growth_mib": (after["VmHWM"] - before) >> 20}


def throughput(server: Server, texts: list[str], clients: int) -> float:
    """Tokens/s over HTTP: every text one request, ``clients`` at a time."""
    bodies = [bench_http._body([t]) for t in texts]
    wall, _, _, errors, tokens = asyncio.run(bench_http._drive(server.base, bodies, clients, 600))
    if errors:
        raise RuntimeError(f"{len(errors)} errors: {errors[:2]}")
    return tokens / wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--snapshot", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True,
                        help="the PyTorch model the snapshot was made from (FlagEmbedding)")
    parser.add_argument("--serve-python", default=sys.executable)
    parser.add_argument("--work", type=Path, default=Path("/tmp/prepare-check"))
    parser.add_argument("--texts", type=int, default=24, help="texts for the cosine check")
    parser.add_argument("--corpus", type=int, default=64, help="mixed corpus size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--skip-flag", action="store_true")
    parser.add_argument("--flag-ref", type=Path, default=None,
                        help="FlagEmbedding vectors of an earlier run on the same model and "
                             "texts (its WORK/flag.npy) instead of computing them again")
    parser.add_argument("--variant", default=None,
                        help="BGE_M3_MODEL for the prepared server (default: its own choice)")
    parser.add_argument("--also-variant", action="append", default=[],
                        help="another prepared server with BGE_M3_MODEL=V in the 8,192-token "
                             "and throughput measurements (repeatable)")
    parser.add_argument("--long-also", action="append", default=[], metavar="V",
                        help="an --also-variant V whose server is measured on the 8,192-token "
                             "text too (repeatable; the default prepared server and the stock "
                             "graph always are)")
    parser.add_argument("--reuse-cache", action="store_true",
                        help="allow a cache that holds the prepared export already (the "
                             "'first start' then measures a cached start)")
    parser.add_argument("--first-start-only", action="store_true",
                        help="first start, cosine and second start only (no 8,192-token text, "
                             "no stock-graph comparison)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    cache = args.work / "cache"
    if cache.exists() and not args.reuse_cache:
        raise SystemExit(f"{cache} exists: the first start must find an empty cache")
    tokenizer = args.snapshot / "tokenizer.json"
    mixed = corpus.build_corpus(tokenizer, "mixed", args.corpus)["texts"]
    long_text = corpus.build_corpus(tokenizer, "single-8192", 1)["texts"][0]
    check = mixed[:args.texts]
    result: dict[str, Any] = {"snapshot": str(args.snapshot), "cpu": bench_cpu()}
    flag = args.flag_ref or args.work / "flag.npy"
    if not args.skip_flag and args.flag_ref is None:
        log("FlagEmbedding fp32 reference")
        flag_reference(args.model_dir, check, flag)

    env = {"BGE_M3_MODEL_PATH": str(args.snapshot), "BGE_M3_CACHE_DIR": str(cache),
           **({"BGE_M3_MODEL": args.variant} if args.variant else {})}
    log("first start (prepares)")
    a = Server(args.serve_python, env, args.work, "first")
    ready, health, steps = a.wait_ready()
    manifest = json.loads((Path(health["model"]["prepare"]["path"]) / "manifest.json")
                          .read_text())
    result["first_start"] = {"ready_s": ready, "steps": steps, "model": health["model"],
                             "prepared": manifest["prepared"],
                             "agreement": {v: e.get("agreement")
                                           for v, e in manifest["variants"].items()}}
    if not args.skip_flag:
        ref = np.load(flag)
        ours = embed(a.base, check)
        cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
        result["dense_cos_vs_flagembedding"] = {"min": round(float(cos.min()), 6),
                                                "mean": round(float(cos.mean()), 6),
                                                "texts": len(check)}
        log(f"dense cos vs FlagEmbedding: {result['dense_cos_vs_flagembedding']}")
    if args.first_start_only:
        result["first_start"]["time"] = a.stop()
        return second_start(args, env, result)
    arms = {f"prepared ({health['model']['variant']}, default)": a}
    for variant in args.also_variant:
        if variant == health["model"]["variant"]:
            continue  # the default server is that variant's already
        log(f"prepared server, BGE_M3_MODEL={variant}")
        arms[f"prepared ({variant})"] = extra = Server(
            args.serve_python, {**env, "BGE_M3_MODEL": variant}, args.work, variant)
        extra.wait_ready()
    result["one_8192_token_text"] = {}
    for name, server in arms.items():
        if server is a or any(name == f"prepared ({v})" for v in args.long_also):
            result["one_8192_token_text"][name] = one_long_text(server, long_text)
            log(f"8192 tokens, {name}: {result['one_8192_token_text'][name]}")

    log("stock graph server")
    stock = {**env, "BGE_M3_PREPARE": "0", "BGE_M3_MODEL": "fp32"}
    # Up to 512 tokens here (the mixed corpus's longest): beside the prepared servers, the
    # stock graph's plain attention at 8,192 tokens (~13 GiB of workspace) does not fit, and
    # the server refuses to start. Its 8,192-token text runs last, on a server of its own.
    arms["stock (fp32)"] = b = Server(args.serve_python, {**stock, "BGE_M3_MAX_SEQ_LENGTH":
                                                          "512"}, args.work, "stock")
    b.wait_ready()
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for server in arms.values():
        throughput(server, mixed[:4], args.clients)
    for r in range(args.rounds):
        # A B C, then C B A, ...: a machine drifting within a round favours no arm.
        order = list(arms.items()) if r % 2 == 0 else list(arms.items())[::-1]
        for name, server in order:
            rates[name].append(throughput(server, mixed, args.clients))
            log(f"round {r + 1} {name}: {rates[name][-1]:.0f} tokens/s")
    med = {k: statistics.median(v) for k, v in rates.items()}
    result["http_tokens_per_s"] = {
        "rounds": rates, "median": med, "clients": args.clients, "texts": len(mixed),
        "vs_stock": {k: round(v / med["stock (fp32)"], 2) for k, v in med.items()}}
    # The stock graph's long text last, the other servers stopped: its plain attention's
    # workspace (~8-13 GiB, docs/startup-probe.md) must not meet theirs on a 24 GiB machine.
    result["first_start"]["time"] = a.stop()
    result["stops"] = {name: server.stop() for name, server in arms.items() if server is not a}
    log("stock graph server for the 8,192-token text (the others stopped)")
    # The conservative memory model asks ~13 GiB of workspace for it (plain attention) and
    # gives 0.7 of the free memory: on a 24 GiB machine that refuses to start, so this server
    # may use all of it (BGE_M3_MEMORY_SAFETY_FACTOR=1.0; the text is what is measured).
    long_stock = Server(args.serve_python, {**stock, "BGE_M3_MEMORY_SAFETY_FACTOR": "1.0"},
                        args.work, "stock-long")
    long_stock.wait_ready()
    result["one_8192_token_text"]["stock (fp32)"] = one_long_text(long_stock, long_text)
    log(f"8192 tokens, stock (fp32): {result['one_8192_token_text']['stock (fp32)']}")
    result["stops"]["stock (fp32), 8,192 tokens"] = long_stock.stop()
    return second_start(args, env, result)


def second_start(args: argparse.Namespace, env: dict[str, str], result: dict[str, Any]) -> int:
    """Start again on the same cache: time to ready; writes and prints the results."""
    log("second start (cached)")
    c = Server(args.serve_python, env, args.work, "second")
    ready, health, _ = c.wait_ready()
    result["second_start"] = {"ready_s": ready, "prepare": health["model"]["prepare"],
                              "time": c.stop()}
    out = json.dumps(result, indent=1)
    (args.work / "result.json").write_text(out)
    print(out)
    return 0


def bench_cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return "?"


def _stop_leftovers() -> None:
    """A failed step must not leave its servers running (and holding GiBs) behind."""
    for server in STARTED:
        if server.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGTERM)
            try:
                server.proc.wait(60)
            except subprocess.TimeoutExpired:
                server.proc.kill()


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        _stop_leftovers()
