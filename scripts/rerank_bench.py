#!/usr/bin/env python3
"""Rerank throughput: bgeserve's ``/v1/rerank`` vs FlagReranker, interleaved in one run.

    flock /tmp/fullsize.lock .venv/bin/python scripts/rerank_bench.py \\
        --reranker-export /work/fullsize/reranker-full-onnx --m3-export /work/fullsize/bge-full-onnx \\
        --variants fp32,int8,bf16 --pairs 16 --docs-per-request 1 --clients 16

or as part of a ``scripts/bench.py`` run: ``bench.py ... --rerank-export DIR`` (its
``--rerank-args`` pass these options on; the bge-m3 export is bench.py's).

The corpus: one query of ``--query-tokens`` tokens and ``--pairs`` documents of
``--doc-tokens`` tokens (specials included, exact where the tokenizer allows). Modes, each run
``--rounds`` times in the order ``flag, http-<variant>...`` (A B A B: the ratios hold on a noisy
machine; medians reported):

- ``flag``: FlagEmbedding's ``FlagReranker(use_fp16=False)`` on the PyTorch checkpoint,
  ``compute_score(pairs, batch_size=16, max_length=8192)``, ``torch.set_num_threads(--threads)``,
  in a child process (its own peak RSS), after a warm-up call.
- ``http-<variant>``: ``bgeserve serve`` (bge-m3 ``--m3-variant`` beside the reranker's
  ``<variant>``), ``--clients`` concurrent aiohttp clients POSTing ``--docs-per-request``
  documents per request to ``/v1/rerank`` (raw logits) until every pair is scored. The servers
  start once, before the rounds (each idles while the others are measured).

Printed: pairs/s, tokens/s, p50/p99 request latency, peak RSS, and each HTTP mode's agreement
with FlagReranker (largest |Δlogit|, Kendall tau over the pairs, the same top document).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODEL_ID = "bge-reranker-v2-m3"


def log(msg: str) -> None:
    print(f"[rerank-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def exact_text(tk: Any, words: list[str], start: int, target: int) -> tuple[str, int]:
    """Words from ``start`` on, skipping any that would overshoot, until the text has
    ``target`` tokens (specials included) or 400 words were tried; returns it and its length."""
    text, n = "", 2
    for k in range(start, start + 400):
        candidate = (text + " " + words[k % len(words)]).strip()
        m = len(tk.encode([candidate]).ids[0])
        if m <= target:
            text, n = candidate, m
        if n == target:
            break
    return text, n


def corpus(tokenizer: Path, pairs: int, query_tokens: int, doc_tokens: int) -> dict[str, Any]:
    from bgeserve.engine.tokenizer import Tokenizer
    from bgeserve.export.texts import random_texts

    tk = Tokenizer.load(tokenizer, 1 << 30)
    words = " ".join(random_texts(4242, 400, 30, 40)).split()
    query, qn = exact_text(tk, words, 0, query_tokens)
    docs, lengths = [], []
    for i in range(pairs):
        text, n = exact_text(tk, words, 97 * (i + 1), doc_tokens)
        docs.append(text)
        lengths.append(n)
    return {"query": query, "query_tokens": qn, "docs": docs, "doc_tokens": lengths}


# ------------------------------------------------------------------------------------ children
def child_flag(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from FlagEmbedding import FlagReranker

    torch.set_num_threads(spec["threads"])
    model = FlagReranker(spec["model"], use_fp16=False, devices="cpu")
    pairs = [[spec["query"], d] for d in spec["docs"]]
    model.compute_score(pairs[:2], batch_size=16, max_length=8192)  # warm-up
    started = time.perf_counter()
    scores = model.compute_score(pairs, batch_size=16, max_length=8192)
    wall = time.perf_counter() - started
    return {"wall_s": wall, "scores": [float(s) for s in scores], "peak_rss": peak_rss()}


def peak_rss(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    return 0


# -------------------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace, variant: str, work: Path) -> tuple[Any, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BGE_M3_")}
    env.update({"BGE_M3_MODEL_PATH": str(args.m3_export), "BGE_M3_MODEL": args.m3_variant,
                "BGE_M3_RERANK_MODEL_PATH": str(args.reranker_export),
                "BGE_M3_RERANK_VARIANT": variant, "BGE_M3_BIND": f"127.0.0.1:{port}",
                "BGE_M3_CACHE_DIR": str(work / f"cache-{variant}"), "HF_HUB_OFFLINE": "1",
                "BGE_M3_LOG_FORMAT": "json", "BGE_M3_DISABLE_AUTO_BUDGET": "1",
                "BGE_M3_REQUEST_TIMEOUT_SECS": "0", "BGE_M3_IDLE_TIMEOUT_SECS": "0",
                "BGE_M3_CACHE_MB": "0",  # every round sends the same pairs: no cache hits
                "PYTHONPATH": str(REPO)})
    logf = open(work / f"server-{variant}.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([sys.executable, "-m", "bgeserve", "serve"], env=env, cwd=REPO,
                            stdout=logf, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: Any, base: str, timeout: float = 900.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server not ready")


async def drive(base: str, query: str, docs: list[str], per_request: int,
                clients: int) -> tuple[float, list[float], np.ndarray]:
    """All ``docs`` scored by ``clients`` concurrent clients, ``per_request`` at a time."""
    import aiohttp

    groups = [list(range(i, min(i + per_request, len(docs))))
              for i in range(0, len(docs), per_request)]
    scores = np.full(len(docs), np.nan)
    latencies: list[float] = []
    cursor = iter(groups)
    async with aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=clients + 2),
                                     timeout=aiohttp.ClientTimeout(total=7200)) as session:

        async def worker() -> None:
            for group in cursor:
                body = {"model": MODEL_ID, "query": query, "normalize": False,
                        "documents": [docs[i] for i in group]}
                started = time.perf_counter()
                async with session.post("/v1/rerank", json=body) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {data}")
                latencies.append(time.perf_counter() - started)
                for item in data["results"]:
                    scores[group[item["index"]]] = item["relevance_score"]

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return time.perf_counter() - started, latencies, scores


# ---------------------------------------------------------------------------------------- main
def kendall_tau(a: np.ndarray, b: np.ndarray) -> float:
    da, db = np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :])
    upper = np.triu_indices(len(a), 1)
    return float((da[upper] * db[upper]).sum() / max(1, len(upper[0])))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rerank_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--reranker-export", type=Path, required=True)
    p.add_argument("--reranker-pt", type=Path, default=None,
                   help="the PyTorch checkpoint FlagReranker loads (default: the export's "
                        "source, from its manifest)")
    p.add_argument("--m3-export", type=Path, required=True,
                   help="the bge-m3 export the server loads beside the reranker")
    p.add_argument("--m3-variant", default="int8")
    p.add_argument("--variants", default="fp32,int8")
    p.add_argument("--pairs", type=int, default=48)
    p.add_argument("--query-tokens", type=int, default=16)
    p.add_argument("--doc-tokens", type=int, default=256)
    p.add_argument("--docs-per-request", type=int, default=4)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work", type=Path, default=Path("/tmp/rerank-bench"))
    args = p.parse_args(argv)
    if args.reranker_pt is None:
        args.reranker_pt = source_model(args.reranker_export)
        if args.reranker_pt is None:
            p.error(f"{args.reranker_export}/manifest.json names no source model that exists "
                    "here; pass --reranker-pt (the PyTorch checkpoint FlagReranker loads)")
    return args


def source_model(export: Path) -> Path | None:
    """The PyTorch checkpoint an export was made from, when its manifest names one that
    exists."""
    try:
        src = json.loads((export / "manifest.json").read_text())["source"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Path(src) if src and Path(src).is_dir() else None


def main(argv: list[str]) -> int:
    if argv[:1] == ["_flag"]:
        spec = json.loads(Path(argv[1]).read_text())
        Path(spec["result"]).write_text(json.dumps(child_flag(spec)))
        return 0
    result = run(parse_args(argv))
    print(result["markdown"])
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode, ``args.rounds`` times interleaved; the figures, with ``"markdown"`` (a
    table and the ratios) and the raw walls, also written to ``args.work/result.json``."""
    args.work.mkdir(parents=True, exist_ok=True)
    data = corpus(args.reranker_export / "tokenizer.json", args.pairs, args.query_tokens,
                  args.doc_tokens)
    pair_tokens = sum(data["query_tokens"] - 2 + n - 2 + 4 for n in data["doc_tokens"])
    log(f"query {data['query_tokens']} tokens, {args.pairs} documents of "
        f"{min(data['doc_tokens'])}-{max(data['doc_tokens'])} tokens, {pair_tokens} pair tokens")
    variants = args.variants.split(",")
    servers = {v: start_server(args, v, args.work) for v in variants}
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in ["flag", *(f"http-{v}" for v in
                                                                     variants)]}
    try:
        for proc, base in servers.values():
            wait_ready(proc, base)
        for proc, base in servers.values():  # warm-up: the first request's shapes and pages
            asyncio.run(drive(base, data["query"], data["docs"][:4], 4, 1))
        for r in range(args.rounds):
            spec = {**data, "model": str(args.reranker_pt), "threads": args.threads,
                    "result": str(args.work / f"flag-{r}.json")}
            spec_path = args.work / f"flag-{r}.spec.json"
            spec_path.write_text(json.dumps(spec))
            log(f"round {r + 1}: flag")
            subprocess.run([sys.executable, __file__, "_flag", str(spec_path)], check=True,
                           env={**os.environ, "OMP_NUM_THREADS": str(args.threads),
                                "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
            rows["flag"].append(json.loads(Path(spec["result"]).read_text()))
            log(f"round {r + 1}: flag {rows['flag'][-1]['wall_s']:.1f} s")
            for v, (proc, base) in servers.items():
                wall, lat, scores = asyncio.run(drive(base, data["query"], data["docs"],
                                                      args.docs_per_request, args.clients))
                log(f"round {r + 1}: http-{v} {wall:.1f} s")
                rows[f"http-{v}"].append({"wall_s": wall, "latencies": lat,
                                          "scores": scores.tolist(),
                                          "peak_rss": peak_rss(proc.pid)})
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    out = summarize(rows, args.pairs, pair_tokens)
    out.update({"machine": {"cpu": _cpu(), "threads": args.threads},
                "args": {k: str(v) for k, v in vars(args).items()}, "pair_tokens": pair_tokens,
                "query_tokens": data["query_tokens"], "doc_tokens": data["doc_tokens"]})
    (args.work / "result.json").write_text(json.dumps(out, indent=1))
    return out


def summarize(rows: dict[str, list[dict[str, Any]]], pairs: int,
              pair_tokens: int) -> dict[str, Any]:
    """Per mode: median wall over its rounds, pairs/s, tokens/s, latency percentiles, peak
    RSS, and its scores' agreement with FlagReranker's (largest |Δlogit|, Kendall tau, the
    same top document); ``"markdown"``: the table and each HTTP mode's ratio to flag."""
    ref = np.asarray(rows["flag"][0]["scores"])
    modes: dict[str, Any] = {}
    header = ("| mode | pairs/s | tokens/s | p50 s | p99 s | peak RSS MiB | max \\|Δlogit\\| vs "
              "flag | Kendall tau vs flag | same top-1 |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for mode, runs in rows.items():
        wall = statistics.median(x["wall_s"] for x in runs)
        lat = sorted(x for run in runs for x in run.get("latencies", []))
        scores = np.asarray(runs[-1]["scores"])
        diff = float(np.abs(scores - ref).max())
        tau = kendall_tau(ref, scores)
        top1 = bool(np.argmax(scores) == np.argmax(ref))
        p50 = lat[len(lat) // 2] if lat else None
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None
        rss = max(x["peak_rss"] for x in runs)
        modes[mode] = {"walls": [x["wall_s"] for x in runs], "pairs_per_s": pairs / wall,
                       "tokens_per_s": pair_tokens / wall, "p50_s": p50, "p99_s": p99,
                       "peak_rss": rss, "max_abs_vs_flag": diff, "kendall_vs_flag": tau,
                       "top1_vs_flag": top1}
        lines.append(f"| {mode} | {pairs / wall:.2f} | {pair_tokens / wall:.0f} | "
                     f"{'-' if p50 is None else f'{p50:.2f}'} | "
                     f"{'-' if p99 is None else f'{p99:.2f}'} | {rss >> 20} | {diff:.2e} | "
                     f"{tau:.4f} | {'yes' if top1 else 'no'} |")
    flag = modes["flag"]["pairs_per_s"]
    ratios = {f"{m} / flag": modes[m]["pairs_per_s"] / flag for m in modes if m != "flag"}
    lines += [""] + [f"- {k}: **{v:.2f}x**" for k, v in ratios.items()]
    return {"modes": modes, "ratios": ratios, "markdown": "\n".join(lines)}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
