#!/usr/bin/env python3
"""bgeserve benchmark: FlagEmbedding vs raw ONNX Runtime / OpenVINO vs bgeserve in-process vs HTTP.

Everything runs from one invocation, so the ratios hold on a noisy machine. Each measurement
runs in its own child process (``bench.py _child SPEC``), so its peak RSS (VmHWM) is its own.

    .venv/bin/python scripts/bench.py                      # full-size random bge-m3, mixed corpus
    .venv/bin/python scripts/bench.py --quick              # tiny model: checks the script works
    .venv/bin/python scripts/bench.py --corpus both --load --rss-vs-length

Variants: ``fp32`` and ``int8`` run on ONNX Runtime, ``bf16`` (an OpenVINO IR) on OpenVINO.
Modes (each per variant, except ``flag`` and ``ort1``, which are fp32 baselines):

- ``flag``:   FlagEmbedding ``BGEM3FlagModel`` fp32 on CPU, batch_size 16, max_length 8192,
              dense + sparse, ``torch.set_num_threads(--threads)``.
- ``ort1``:   ``onnxruntime.InferenceSession`` with ORT's default options (threads aside) on a
              plain-attention fp32 graph (``--plain-graph``), batch 1: what a user running the
              stock ORT export gets. Skipped without ``--plain-graph``.
- ``raw``:    the variant's runtime called directly (``InferenceSession.run``, or OpenVINO's
              ``compile_model`` + ``infer`` for bf16), texts packed exactly as bgeserve packs
              them (``bgeserve.engine.binpack.plan`` + ``bgeserve.engine.forward.pad_chunk``).
- ``raw1``:   the same session, each text alone (batch 1): the "raw runtime at batch 1" baseline.
- ``engine``: ``bgeserve.Engine`` in-process, one ``embed(all texts, dense, sparse)`` call,
              then a per-text latency pass.
- ``http``:   ``python -m bgeserve serve`` in a subprocess; ``--http-clients`` concurrent aiohttp
              clients POST ``--http-batch`` texts per request to ``/v1/embeddings:both``.
- ``--load``: N concurrent clients (``--clients 1,16,64``), one short text per request, with
              cross-request batching on and off (``BGE_M3_CROSS_REQUEST_BATCHING=0``).
- ``--rss-vs-length``: one child per variant (``--rss-variants``) and length (512 … 8192) loads
              the engine and measures the RSS growth while embedding one text of that length.
- ``--chunk-sweep N,…``: ``raw`` on the mixed corpus per variant with ``plan(max_tokens=N)``,
              one child per point: throughput against padded tokens per chunk.
- ``--rerank-export DIR``: ``/v1/rerank`` (the reranker beside bge-m3) vs FlagReranker, and
              their agreement (scripts/rerank_bench.py; ``--rerank-args`` for its options).
- ``--plots DIR``: SVG plots of the sweep and of RSS growth vs length (needs matplotlib).

Results: markdown tables and ratios on stdout, JSON (and the same markdown) in ``--work-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as _dt
import hashlib
import json
import os
import platform
import random
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO))

MODES = ("flag", "ort1", "raw", "raw1", "engine", "http")
VARIANT_MODES = ("raw", "raw1", "engine", "http")  # once per variant; flag and ort1 once
RSS_VARIANTS = ("fp32", "bf16")
CORPUS_SEED = 20240
MIXED_RANGE = (16, 512)
LONG_LENGTHS = (2048, 4096, 8192)
LOAD_LENGTHS = (8, 32)
RSS_LENGTHS = (512, 2048, 4096, 8192)
MAX_SEQ = 8192
FLAG_BATCH = 16
MiB = 1 << 20


# ============================================================================ small helpers
def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile (bytes) of a process from /proc/PID/status."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def rss_now() -> int:
    return proc_status().get("VmRSS", 0)


def peak_rss() -> int:
    """This process's peak RSS: VmHWM, else ru_maxrss (kB on Linux)."""
    return proc_status().get("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def percentiles(latencies: list[float]) -> tuple[float | None, float | None]:
    if not latencies:
        return None, None
    p50, p99 = np.percentile(np.asarray(latencies) * 1000.0, [50, 99])
    return float(p50), float(p99)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def save_vectors(path: Path, dense: np.ndarray | None,
                 sparse: list[tuple[np.ndarray, np.ndarray]] | None) -> None:
    """Dense rows and sparse (ids, weights) per text, for the agreement check in the parent."""
    arrays: dict[str, np.ndarray] = {}
    if dense is not None:
        arrays["dense"] = np.asarray(dense, dtype=np.float32)
    if sparse is not None:
        arrays["sparse_offsets"] = np.cumsum([0] + [len(i) for i, _ in sparse]).astype(np.int64)
        arrays["sparse_ids"] = (np.concatenate([np.asarray(i, np.int64) for i, _ in sparse])
                                if sparse else np.empty(0, np.int64))
        arrays["sparse_values"] = (np.concatenate([np.asarray(v, np.float32) for _, v in sparse])
                                   if sparse else np.empty(0, np.float32))
    np.savez(path, **arrays)


def load_vectors(path: Path) -> tuple[np.ndarray | None, list[dict[int, float]] | None]:
    with np.load(path) as z:
        dense = z.get("dense")
        sparse = None
        if "sparse_offsets" in z:
            off, ids, vals = z["sparse_offsets"], z["sparse_ids"], z["sparse_values"]
            sparse = [dict(zip(ids[off[i]:off[i + 1]].tolist(), vals[off[i]:off[i + 1]].tolist()))
                      for i in range(len(off) - 1)]
    return dense, sparse


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for pkg in ("bgeserve", "onnxruntime", "openvino", "torch", "FlagEmbedding", "transformers",
                "tokenizers", "numpy", "aiohttp", "uvicorn",
                "onnxruntime-gpu"):  # installed instead of (or, wrongly, beside) onnxruntime
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    gpus = ""
    if shutil.which("nvidia-smi"):
        try:
            gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                                   "--format=csv,noheader"], capture_output=True, text=True,
                                  timeout=30, check=False).stdout.strip().replace("\n", "; ")
        except (OSError, subprocess.SubprocessError):
            pass
    return {
        "gpus": gpus,
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_model": cpu, "mem_total_gib": round(mem / 2**30, 1),
        "machine": platform.machine(), "kernel": platform.release(),
        "python": platform.python_version(), "versions": versions,
    }


# ================================================================================= corpus
def _tokenizer(path: Path):
    import tokenizers

    tk = tokenizers.Tokenizer.from_file(str(path))
    tk.no_padding()
    tk.no_truncation()
    return tk


def _exact_text(tk, pool: list[str], start: int, target: int) -> str:
    """A text of exactly ``target`` tokens (special tokens included), when the tokenizer allows.

    Pool texts from ``start`` on are joined until long enough, then cut at a token boundary;
    cut points near the wanted one are tried until re-tokenizing gives exactly ``target``.
    """
    need = target - 2
    parts: list[str] = []
    approx = 0
    k = start
    while approx < need + 16:
        piece = pool[k % len(pool)]
        parts.append(piece)
        approx += len(tk.encode(piece, add_special_tokens=False).ids)
        k += 1
    joined = " ".join(parts)
    enc = tk.encode(joined, add_special_tokens=False)
    while len(enc.ids) < need + 4:  # joins merged pieces; add more
        joined += " " + pool[k % len(pool)]
        k += 1
        enc = tk.encode(joined, add_special_tokens=False)
    offsets = enc.offsets
    best, best_gap = joined[: offsets[need - 1][1]], None
    for delta in (0, -1, 1, -2, 2, -3, 3, -4, 4, -5, 5, -6, 6):
        j = need - 1 + delta
        if not 0 <= j < len(offsets):
            continue
        candidate = joined[: offsets[j][1]].rstrip()
        n = len(tk.encode(candidate, add_special_tokens=True).ids)
        if n == target:
            return candidate
        if best_gap is None or abs(n - target) < best_gap:
            best, best_gap = candidate, abs(n - target)
    for cut in range(1, 24):  # last resort: shorten the nearest candidate char by char
        candidate = best[:-cut].rstrip()
        if len(tk.encode(candidate, add_special_tokens=True).ids) == target:
            return candidate
    return best


def build_corpus(tokenizer_path: Path, kind: str, n: int) -> dict[str, Any]:
    """The fixed corpus: deterministic texts with a spread of exact token lengths."""
    from bgeserve.export.texts import random_texts

    if kind == "mixed":
        lo, hi = MIXED_RANGE
        targets = [round(x) for x in np.linspace(lo, hi, n)] if n > 1 else [lo]
        random.Random(CORPUS_SEED).shuffle(targets)  # input order is not length order
    elif kind == "long":
        targets = list(LONG_LENGTHS)
    elif kind == "load":  # short queries for the load test
        lo, hi = LOAD_LENGTHS
        targets = [round(x) for x in np.linspace(lo, hi, n)]
        random.Random(CORPUS_SEED + 1).shuffle(targets)
    elif kind.startswith("single-"):  # one text of exactly that length (rss-vs-length)
        targets = [int(kind.split("-", 1)[1])]
    else:
        raise ValueError(kind)
    tk = _tokenizer(tokenizer_path)
    pool = random_texts(CORPUS_SEED, 2000, min_words=10, max_words=60)
    texts = []
    for i, t in enumerate(targets):
        start = (i * 7919 + hash_int(kind)) % len(pool)
        for attempt in range(8):  # another start in the pool when no cut gives exactly t
            text = _exact_text(tk, pool, start + attempt, t)
            if len(tk.encode(text, add_special_tokens=True).ids) == t:
                break
        texts.append(text)
    lengths = [len(e.ids) for e in tk.encode_batch(texts, add_special_tokens=True)]
    lengths = [min(x, MAX_SEQ) for x in lengths]
    return {"kind": kind, "targets": targets, "texts": texts, "lengths": lengths}


def hash_int(s: str) -> int:
    return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16)


def corpus_file(work: Path, tokenizer_path: Path, kind: str, n: int) -> Path:
    """Build the corpus once per (tokenizer, kind, n) and keep it in the work dir."""
    tag = hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()[:12]
    path = work / "corpus" / f"{kind}-{n}-{tag}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        corpus = build_corpus(tokenizer_path, kind, n)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(corpus, ensure_ascii=False))
        tmp.rename(path)
    return path


# ============================================================================ child modes
def _session_options(threads: int):
    """The session and run options bgeserve uses (runtime/onnx.py), so raw differs only in
    packing."""
    from bgeserve.runtime import SessionConfig
    from bgeserve.runtime.onnx import run_options, session_options

    config = SessionConfig(threads=threads)
    return session_options(config), run_options(config)


def variant_runtime(export_dir: Path, variant: str) -> str:
    """Which runtime reads a variant: "onnxruntime" or "openvino" (the manifest says)."""
    manifest = json.loads((export_dir / "manifest.json").read_text())
    return manifest["variants"][variant].get("runtime", "onnxruntime")


def _export_graph(export_dir: Path, variant: str) -> Path:
    manifest = json.loads((export_dir / "manifest.json").read_text())
    return export_dir / manifest["variants"][variant]["path"]


RAW_OUTPUTS = ["dense", "sparse_weights"]


def _check_outputs(have: set[str]) -> None:
    if not set(RAW_OUTPUTS) <= have:
        raise SystemExit(f"raw modes need a bgeserve export (outputs {RAW_OUTPUTS}); "
                         f"got {sorted(have)}")


def _stock_options(threads: int):
    """ORT's default session options (arena on, parallel defaults) with only the thread count
    set: what ``ort1`` uses, as a user running the stock export would."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return opts


def _open_ort(graph: Path, opts, run_opts=None):
    """``run(ids, mask) -> [dense, sparse_weights]`` on an ONNX Runtime CPU session."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph), sess_options=opts,
                                   providers=["CPUExecutionProvider"])
    _check_outputs({o.name for o in session.get_outputs()})
    return lambda ids, mask: session.run(RAW_OUTPUTS, {"input_ids": ids, "attention_mask": mask},
                                         run_opts)


def _open_openvino(xml: Path, precision: str, threads: int):
    """The same ``run`` on a compiled OpenVINO model (one stream, latency hint)."""
    import openvino as ov  # only in this child: the parent never loads OpenVINO

    compiled = ov.Core().compile_model(str(xml), "CPU", {
        "INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads,
        "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"})
    _check_outputs({o.get_any_name() for o in compiled.outputs})
    request = compiled.create_infer_request()
    outputs = [compiled.output(name) for name in RAW_OUTPUTS]

    def run(ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
        result = request.infer({"input_ids": ids, "attention_mask": mask})  # copies outputs
        return [result[o] for o in outputs]

    return run


def child_flag(spec: dict[str, Any], corpus: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from FlagEmbedding import BGEM3FlagModel

    texts = corpus["texts"]
    kwargs = {"batch_size": FLAG_BATCH, "max_length": MAX_SEQ, "return_dense": True,
              "return_sparse": True, "return_colbert_vecs": False}
    t0 = time.perf_counter()
    model = BGEM3FlagModel(spec["model_dir"], use_fp16=False, devices="cpu")
    load_s = time.perf_counter() - t0
    rss_load = rss_now()
    model.encode(["warm up"], **kwargs)
    t0 = time.perf_counter()
    out = model.encode(texts, **kwargs)
    wall = time.perf_counter() - t0
    latencies = []
    if spec["latency_pass"]:
        for t in texts:
            s = time.perf_counter()
            model.encode([t], **{**kwargs, "batch_size": 1})
            latencies.append(time.perf_counter() - s)
    dense = np.asarray(out["dense_vecs"], dtype=np.float32)
    sparse = []
    for weights in out["lexical_weights"]:
        ids = np.asarray(sorted(int(k) for k in weights), dtype=np.int64)
        sparse.append((ids, np.asarray([weights[str(i)] for i in ids], dtype=np.float32)))
    save_vectors(Path(spec["vectors"]), dense, sparse)
    return {"wall_s": wall, "load_s": load_s, "rss_after_load": rss_load,
            "latencies": latencies, "chunks": None}


def child_raw(spec: dict[str, Any], corpus: dict[str, Any], batch1: bool) -> dict[str, Any]:
    from bgeserve.engine.binpack import plan
    from bgeserve.engine.forward import pad_chunk
    from bgeserve.engine.heads import sparse_vector
    from bgeserve.engine.scheduler import SchedulerConfig
    from bgeserve.engine.tokenizer import Tokenizer

    export_dir = Path(spec["export_dir"])
    variant = spec["variant"]
    texts = corpus["texts"]
    t0 = time.perf_counter()
    if spec["mode"] == "ort1":  # the plain-attention graph as a user would run it
        run_graph = _open_ort(Path(spec["plain_graph"]), _stock_options(spec["threads"]))
    elif variant_runtime(export_dir, variant) == "openvino":
        run_graph = _open_openvino(_export_graph(export_dir, variant), variant, spec["threads"])
    else:
        run_graph = _open_ort(_export_graph(export_dir, variant),
                              *_session_options(spec["threads"]))
    tokenizer = Tokenizer.load(export_dir / "tokenizer.json", MAX_SEQ)
    load_s = time.perf_counter() - t0
    rss_load = rss_now()

    def run(ids_list: list[np.ndarray]) -> list[np.ndarray]:
        pad_to = max(len(x) for x in ids_list)
        return run_graph(*pad_chunk(ids_list, pad_to))

    run([tokenizer.encode(["warm up"]).ids[0]])
    dense = np.zeros((len(texts), 0), np.float32)
    sparse_rows: list[np.ndarray | None] = [None] * len(texts)
    all_ids: list[np.ndarray] = []
    latencies: list[float] = []
    chunks: list[tuple[int, int]] = []
    if batch1:
        t0 = time.perf_counter()
        for i, text in enumerate(texts):
            s = time.perf_counter()
            ids = tokenizer.encode([text]).ids[0]
            d, w = run([ids])
            if dense.shape[1] == 0:
                dense = np.zeros((len(texts), d.shape[1]), np.float32)
            dense[i] = d[0]
            sparse_rows[i] = w[0, : len(ids)]
            all_ids.append(ids)
            chunks.append((1, len(ids)))
            latencies.append(time.perf_counter() - s)
        wall = time.perf_counter() - t0
    else:
        cfg = SchedulerConfig()  # the engine's packing defaults (max_tokens: --chunk-sweep)
        t0 = time.perf_counter()
        all_ids = tokenizer.encode(texts).ids
        for chunk in plan([len(x) for x in all_ids], fits=lambda b, s: True,
                          max_chunk=cfg.max_chunk,
                          max_tokens=spec.get("max_tokens") or cfg.max_chunk_tokens,
                          min_fill=cfg.min_fill):
            d, w = run([all_ids[i] for i in chunk.indices])
            if dense.shape[1] == 0:
                dense = np.zeros((len(texts), d.shape[1]), np.float32)
            for row, i in enumerate(chunk.indices):
                dense[i] = d[row]
                sparse_rows[i] = w[row, : len(all_ids[i])]
            chunks.append((len(chunk.indices), chunk.pad_to))
        wall = time.perf_counter() - t0
    sparse = [sparse_vector(all_ids[i], sparse_rows[i]) for i in range(len(texts))]
    save_vectors(Path(spec["vectors"]), dense, sparse)
    return {"wall_s": wall, "load_s": load_s, "rss_after_load": rss_load,
            "latencies": latencies if batch1 else [], "chunks": chunks}


def _open_engine(spec: dict[str, Any], on_chunk=None):
    """An Engine as ``bgeserve serve`` would run it: ``workers`` sharing the threads, chunks of
    the backend's best padded-token count."""
    from bgeserve import Engine, runtime
    from bgeserve.engine import EngineConfig
    from bgeserve.engine.scheduler import SchedulerConfig
    from bgeserve.model.artifacts import resolve
    from bgeserve.runtime import SessionConfig

    workers = spec.get("workers", 1)
    if spec.get("ep", "cpu") != "cpu":
        return _open_gpu_engine(spec, on_chunk)
    session = SessionConfig(threads=max(1, spec["threads"] // workers), streams=workers)
    artifacts = resolve(model_path=Path(spec["export_dir"]), variant=spec["variant"],
                        cache_dir=Path(spec["work_dir"]) / "cache", offline=True)
    scheduler = SchedulerConfig(workers=workers, max_chunk_tokens=runtime.get(
        runtime.kind_of(artifacts, session.provider)).chunk_tokens)
    return Engine(artifacts=artifacts, on_chunk=on_chunk,
                  config=EngineConfig(max_seq=MAX_SEQ, session=session, scheduler=scheduler))


def _open_gpu_engine(spec: dict[str, Any], on_chunk=None):
    """An Engine on a GPU execution provider, configured exactly as ``bgeserve serve`` would
    configure it from the same environment (provider options, device pinning, chunk size)."""
    from bgeserve import Engine
    from bgeserve.config import Settings
    from bgeserve.model.artifacts import resolve
    from bgeserve.service.plan import engine_config, resolve_gpu

    env = {"BGE_M3_EP": spec["ep"], "BGE_M3_MODEL": spec["variant"],
           "BGE_M3_MODEL_PATH": spec["export_dir"], "BGE_M3_WORKERS": str(spec.get("workers", 1)),
           "BGE_M3_CACHE_DIR": str(Path(spec["work_dir"]) / "cache"),
           "BGE_M3_MAX_SEQ_LENGTH": str(spec.get("max_seq") or MAX_SEQ), "HF_HUB_OFFLINE": "1"}
    env.update(spec.get("http_env") or {})
    s = resolve_gpu(Settings.from_env(env))
    artifacts = resolve(model_path=s.model_path, variant=s.variant, cache_dir=s.cache_dir,
                        offline=True)
    return Engine(artifacts=artifacts, on_chunk=on_chunk, config=engine_config(s))


def child_engine(spec: dict[str, Any], corpus: dict[str, Any]) -> dict[str, Any]:
    texts = corpus["texts"]
    chunks: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    engine = _open_engine(spec, on_chunk=lambda st: chunks.append((st.batch, st.pad_to)))
    load_s = time.perf_counter() - t0
    rss_load = rss_now()
    try:
        engine.embed(["warm up"], dense=True, sparse=True)
        chunks.clear()
        t0 = time.perf_counter()
        out = engine.embed(texts, dense=True, sparse=True)
        wall = time.perf_counter() - t0
        batch_chunks = list(chunks)
        latencies = []
        if spec["latency_pass"]:
            for t in texts:
                s = time.perf_counter()
                engine.embed([t], dense=True, sparse=True)
                latencies.append(time.perf_counter() - s)
    finally:
        engine.close()
    save_vectors(Path(spec["vectors"]), out.dense, out.sparse)
    return {"wall_s": wall, "load_s": load_s, "rss_after_load": rss_load,
            "latencies": latencies, "chunks": batch_chunks,
            "tokens_reported": int(out.n_tokens.sum())}


# ------------------------------------------------------------------------------------ http
class Server:
    """``python -m bgeserve serve`` as a subprocess on a free loopback port."""

    def __init__(self, spec: dict[str, Any], extra_env: dict[str, str], label: str):
        work = Path(spec["work_dir"])
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("BGE_M3_")}
        env.update({
            "BGE_M3_MODEL_PATH": spec["export_dir"], "BGE_M3_MODEL": spec["variant"],
            "BGE_M3_INTRA_THREADS": str(max(1, spec["threads"] // spec.get("workers", 1))),
            "BGE_M3_WORKERS": str(spec.get("workers", 1)),
            "BGE_M3_CACHE_DIR": str(work / "cache"), "BGE_M3_BIND": f"127.0.0.1:{self.port}",
            "BGE_M3_IDLE_TIMEOUT_SECS": "0", "BGE_M3_HEARTBEAT_SECS": "0",
            "BGE_M3_LOG_FORMAT": "json", "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": str(spec["threads"]), "PYTHONUNBUFFERED": "1",
        })
        if spec.get("ep", "cpu") != "cpu":
            env["BGE_M3_EP"] = spec["ep"]
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

        loads = orjson.loads
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
    server = Server(spec, {}, f"http-{spec['variant']}")
    try:
        server.wait_ready(spec["server_timeout"], spec["http_budget"] == "probe")
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
            "tuning": (health.get("tuning") or {}).get("probe_status")}


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


def child_rss(spec: dict[str, Any], corpus: dict[str, Any]) -> dict[str, Any]:
    from bgeserve.tuning.memory import trim_heap

    engine = _open_engine(spec)
    try:
        engine.embed(["warm up"], dense=True, sparse=True)
        trim_heap()
        before = rss_now()
        start = proc_status()
        was_reset = reset_peak()
        # The kernel keeps no peak of the anonymous part alone: sample it. Anonymous memory is
        # the run's workspace; file-backed growth is the memory-mapped weights (the embedding
        # table's rows, with readahead) paging in as new token ids appear: model, not workspace.
        anon_peak = [start.get("RssAnon", 0)]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.02):
                anon_peak[0] = max(anon_peak[0], proc_status().get("RssAnon", 0))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        try:
            out = engine.embed(corpus["texts"], dense=True, sparse=True)
        finally:
            done.set()
            sampler.join()
        seconds = time.perf_counter() - t0
        peak = peak_rss()
        end = proc_status()
    finally:
        engine.close()
    return {"length": int(out.n_tokens[0]), "rss_before": before, "peak": peak,
            "growth": peak - before, "seconds": seconds, "peak_reset": was_reset,
            "anon_growth": anon_peak[0] - start.get("RssAnon", 0),
            "file_growth": end.get("RssFile", 0) - start.get("RssFile", 0)}


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    corpus = json.loads(Path(spec["corpus"]).read_text())
    mode = spec["mode"]
    try:
        if mode == "flag":
            result = child_flag(spec, corpus)
        elif mode in ("raw", "raw1", "ort1"):
            result = child_raw(spec, corpus, batch1=mode != "raw")
        elif mode == "engine":
            result = child_engine(spec, corpus)
        elif mode == "http":
            result = child_http(spec, corpus)
        elif mode == "load":
            result = child_load(spec, corpus)
        elif mode == "rss":
            result = child_rss(spec, corpus)
        else:
            raise ValueError(mode)
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as an error row
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    result["peak_rss"] = peak_rss()
    Path(spec["result"]).write_text(json.dumps(result, default=str))
    return 0 if result["ok"] else 1


# ================================================================================ parent
def _kill_group(proc: subprocess.Popen) -> None:
    """End what is left of a child's process group (the child itself included)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(10 if sig == signal.SIGTERM else 5)
        except subprocess.TimeoutExpired:
            continue
        # the child is gone; a leftover server may still be stopping: give it a moment
        time.sleep(0.5 if sig == signal.SIGTERM else 0)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break


class Runner:
    def __init__(self, args: argparse.Namespace, work: Path, export_dir: Path,
                 model_dir: Path | None, run_id: str):
        self.args = args
        self.work = work
        self.export_dir = export_dir
        self.model_dir = model_dir
        self.run_id = run_id
        self.run_dir = work / "runs" / run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def child(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Run one measurement in a fresh interpreter; never raises."""
        spec = {
            "work_dir": str(self.work), "export_dir": str(self.export_dir),
            "model_dir": str(self.model_dir) if self.model_dir else None,
            "threads": self.args.threads, "workers": self.args.workers, "ep": self.args.ep,
            "latency_pass": not self.args.no_latency_pass,
            "plain_graph": self.args.plain_graph,
            "http_clients": self.args.http_clients,
            "http_batch": self.args.http_batch, "http_budget": self.args.http_budget,
            "http_env": dict(kv.split("=", 1) for kv in self.args.http_env),
            "server_timeout": self.args.server_timeout, "request_timeout": 3600.0,
            "vectors": str(self.run_dir / f"{name}.npz"),
            "result": str(self.run_dir / f"{name}.result.json"), **spec,
        }
        spec_path = self.run_dir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = self.run_dir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(self.args.threads),
               "MKL_NUM_THREADS": str(self.args.threads), "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "TOKENIZERS_PARALLELISM": "true"}
        log(f"{name}: running (log {log_path})")
        started = time.perf_counter()
        with open(log_path, "wb") as out:
            # Its own session (process group): a killed or crashed child must not leave its
            # server behind, so the whole group is ended once the child is done.
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_child",
                                     str(spec_path)], stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd=str(REPO), start_new_session=True)
            try:
                rc: int | str = proc.wait(self.args.child_timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            finally:
                _kill_group(proc)
        elapsed = time.perf_counter() - started
        result_path = Path(spec["result"])
        if result_path.exists():
            result = json.loads(result_path.read_text())
        else:
            tail = log_path.read_bytes()[-800:].decode("utf-8", "replace")
            why = (f"killed after --child-timeout {self.args.child_timeout:g}s"
                   if rc == "timeout" else f"child exited with {rc} (killed? out of memory?)")
            result = {"ok": False, "error": f"{why}: {tail}"}
        result["child_seconds"] = elapsed
        result["vectors"] = spec["vectors"] if result.get("ok") else None
        if not result.get("ok"):
            log(f"{name}: FAILED: {result.get('error')}")
        return result


def summarize(name: str, mode: str, variant: str, corpus_kind: str, corpus: dict[str, Any],
              res: dict[str, Any]) -> dict[str, Any]:
    tokens = int(sum(corpus["lengths"]))
    row: dict[str, Any] = {"name": name, "mode": mode, "variant": variant, "corpus": corpus_kind,
                           "texts": len(corpus["texts"]), "tokens": tokens, "ok": res.get("ok"),
                           "error": res.get("error")}
    if not res.get("ok"):
        return row
    wall = res["wall_s"]
    p50, p99 = percentiles(res.get("latencies") or [])
    peak = res.get("peak_rss_server") if mode == "http" else res.get("peak_rss")
    chunks = res.get("chunks")
    padded = sum(b * s for b, s in chunks) if chunks else None
    row.update({
        "wall_s": wall, "tokens_per_s": tokens / wall, "texts_per_s": len(corpus["texts"]) / wall,
        "p50_ms": p50, "p99_ms": p99, "peak_rss": peak, "rss_after_load": res.get("rss_after_load"),
        "load_s": res.get("load_s"), "chunks": len(chunks) if chunks else None,
        "padding_pct": 100.0 * (1 - tokens / padded) if padded else None,
        "errors": res.get("errors", 0), "vectors": res.get("vectors"),
    })
    if mode == "http" and res.get("server_chunks"):
        row["chunks"], row["padding_pct"] = res["server_chunks"], res["server_padding_pct"]
    for key in ("tokens_reported", "requests", "clients", "http_batch", "error_samples",
                "server_env", "tuning", "peak_rss", "texts_per_chunk"):
        if key in res:
            row["client_peak_rss" if (key == "peak_rss" and mode == "http") else key] = res[key]
    return row


def agreement(rows: list[dict[str, Any]]) -> None:
    """Dense cosine (min/mean) and sparse max |Δweight| against the reference vectors."""
    by_corpus: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_corpus.setdefault(r["corpus"], []).append(r)
    prefer = [("flag", "fp32"), ("engine", "fp32"), ("raw", "fp32"), ("raw1", "fp32"),
              ("http", "fp32"), ("ref", "fp32"), ("ort1", "fp32")]
    for corpus_rows in by_corpus.values():
        ref = None
        for mode, variant in prefer:
            ref = next((r for r in corpus_rows if r["mode"] == mode and r["variant"] == variant
                        and r.get("vectors")), None)
            if ref is not None:
                break
        if ref is None:
            continue
        ref_dense, ref_sparse = load_vectors(Path(ref["vectors"]))
        for r in corpus_rows:
            if not r.get("vectors"):
                continue
            r["reference"] = ref["name"]
            dense, sparse = load_vectors(Path(r["vectors"]))
            if dense is not None and ref_dense is not None and dense.shape == ref_dense.shape:
                cos = (dense * ref_dense).sum(1) / (np.linalg.norm(dense, axis=1)
                                                   * np.linalg.norm(ref_dense, axis=1))
                r["cos_min"], r["cos_mean"] = float(cos.min()), float(cos.mean())
            if sparse is not None and ref_sparse is not None and len(sparse) == len(ref_sparse):
                worst, same_keys = 0.0, 0
                for a, b in zip(sparse, ref_sparse):
                    same_keys += set(a) == set(b)
                    for k in set(a) | set(b):
                        worst = max(worst, abs(a.get(k, 0.0) - b.get(k, 0.0)))
                r["sparse_max_abs"] = worst
                r["sparse_same_keys"] = same_keys / max(len(sparse), 1)


def _fmt(v: Any, spec: str = ".1f") -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _cell(v: Any) -> str:
    return " ".join(str(v).replace("|", "/").split())[:100]


def _mib(v: Any) -> str:
    return "—" if not v else f"{v / MiB:,.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| corpus | mode | variant | texts | tokens | wall s | tokens/s | texts/s | p50 ms "
            "| p99 ms | peak RSS MiB | RSS after load MiB | chunks | pad % | cos min | cos mean "
            "| sparse max Δ | errors |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['corpus']} | {r['mode']} | {r['variant']} | {r['texts']} | "
                         f"{r['tokens']} | FAILED: {_cell(r.get('error'))} |" + " |" * 12)
            continue
        lines.append("| " + " | ".join([
            r["corpus"], r["mode"] + (f" ×{r['clients']}c/{r['http_batch']}t"
                                      if r["mode"] == "http" else ""), r["variant"],
            str(r["texts"]), str(r["tokens"]), _fmt(r["wall_s"], ".2f"), _fmt(r["tokens_per_s"]),
            _fmt(r["texts_per_s"], ".2f"), _fmt(r["p50_ms"], ".0f"), _fmt(r["p99_ms"], ".0f"),
            _mib(r["peak_rss"]), _mib(r["rss_after_load"]), _fmt(r["chunks"]),
            _fmt(r["padding_pct"]), _fmt(r.get("cos_min"), ".6f"), _fmt(r.get("cos_mean"), ".6f"),
            _fmt(r.get("sparse_max_abs"), ".2e"), str(r.get("errors", 0)),
        ]) + " |")
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]], default_variant: str | None = None) -> dict[str, float]:
    """tokens/s ratios; ``default_variant``: what the server serves with neither BGE_M3_MODEL
    nor BGE_M3_EP set (``server_default_variant``)."""
    out: dict[str, float] = {}
    tps = {(r["corpus"], r["mode"], r["variant"]): r["tokens_per_s"] for r in rows if r.get("ok")}
    corpora = sorted({r["corpus"] for r in rows})
    variants = [v for v in ("fp32", "int8", "bf16") if any(r["variant"] == v for r in rows)]
    variants += sorted({r["variant"] for r in rows} - set(variants))

    def put(label: str, a: tuple[str, str, str], b: tuple[str, str, str]) -> None:
        if a in tps and b in tps:
            out[label] = tps[a] / tps[b]

    for c in corpora:
        for v in variants:
            put(f"{c}: engine {v} / flag fp32", (c, "engine", v), (c, "flag", "fp32"))
            put(f"{c}: http {v} / flag fp32"
                + (" (the server's default variant)" if v == default_variant else ""),
                (c, "http", v), (c, "flag", "fp32"))
            put(f"{c}: http {v} / engine {v}", (c, "http", v), (c, "engine", v))
            put(f"{c}: engine {v} / raw {v} (same packing)", (c, "engine", v), (c, "raw", v))
            put(f"{c}: engine {v} / raw1 {v}", (c, "engine", v), (c, "raw1", v))
            put(f"{c}: raw {v} / raw1 {v}", (c, "raw", v), (c, "raw1", v))
            if v != "fp32":
                put(f"{c}: engine {v} / engine fp32", (c, "engine", v), (c, "engine", "fp32"))
        put(f"{c}: engine fp32 / raw1 fp32 (raw ORT batch 1)", (c, "engine", "fp32"),
            (c, "raw1", "fp32"))
        put(f"{c}: engine fp32 / ort1 (stock ORT, plain attention, batch 1)",
            (c, "engine", "fp32"), (c, "ort1", "fp32"))
    return out


def load_table(load_rows: list[dict[str, Any]]) -> str:
    lines = [("| variant | cross-request batching | clients | requests | wall s | requests/s "
              "| tokens/s | p50 ms | p99 ms | texts/chunk | errors | server peak RSS MiB |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in load_rows:
        if not r.get("ok"):
            lines.append(f"| {r['variant']} | {'on' if r['batching'] else 'off'} | FAILED: "
                         f"{_cell(r.get('error'))} |" + " |" * 9)
            continue
        for lv in r["levels"]:
            lines.append("| " + " | ".join([
                r["variant"], "on" if r["batching"] else "off", str(lv["clients"]),
                str(lv["requests"]), _fmt(lv["wall_s"], ".2f"), _fmt(lv["requests_per_s"]),
                _fmt(lv["tokens_per_s"]), _fmt(lv["p50_ms"], ".0f"), _fmt(lv["p99_ms"], ".0f"),
                _fmt(lv.get("texts_per_chunk"), ".2f"), str(lv["errors"]),
                _mib(r["peak_rss_server"])]) + " |")
    return "\n".join(lines)


def load_gains(load_rows: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    level = {(r["variant"], r["batching"], lv["clients"]): lv["requests_per_s"]
             for r in load_rows if r.get("ok") for lv in r["levels"]}
    for (variant, batching, clients), rps in level.items():
        off = level.get((variant, False, clients))
        if batching and off:
            label = f"{clients} client{'' if clients == 1 else 's'}"
            out[f"load {variant}, {label}: batching on / off (requests/s)"] = rps / off
    return out


def rss_table(rows: list[dict[str, Any]]) -> str:
    lines = [("| text tokens | variant | RSS before MiB | peak MiB | growth MiB | of which "
              "anonymous (workspace, sampled peak) MiB | file-backed (mapped weights) MiB "
              "| seconds |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['target']} | {r['variant']} | FAILED: {_cell(r.get('error'))}"
                         " | | | | | |")
            continue
        lines.append(f"| {r['length']} | {r['variant']} | {_mib(r['rss_before'])} | "
                     f"{_mib(r['peak'])} | {_mib(r['growth'])} | {_mib(r.get('anon_growth'))} | "
                     f"{_mib(r.get('file_growth'))} | {r['seconds']:.2f} |"
                     + ("" if r.get("peak_reset") else " (peak not reset: includes load)"))
    return "\n".join(lines)


def sweep_row(name: str, variant: str, runtime: str, max_tokens: int, corpus: dict[str, Any],
              res: dict[str, Any]) -> dict[str, Any]:
    """One --chunk-sweep point: tokens/s of ``raw`` against the padded tokens per chunk."""
    row: dict[str, Any] = {"name": name, "variant": variant, "runtime": runtime,
                           "max_tokens": max_tokens, "ok": res.get("ok"),
                           "error": res.get("error")}
    if res.get("ok"):
        tokens = int(sum(corpus["lengths"]))
        chunks = res["chunks"]
        padded = sum(b * s for b, s in chunks)
        row.update({"tokens": tokens, "wall_s": res["wall_s"],
                    "tokens_per_s": tokens / res["wall_s"], "chunks": len(chunks),
                    "padded_per_chunk": padded / len(chunks),
                    "padding_pct": 100.0 * (1 - tokens / padded), "peak_rss": res["peak_rss"]})
    return row


def sweep_table(rows: list[dict[str, Any]]) -> str:
    lines = [("| variant | runtime | max tokens/chunk | chunks | padded tokens/chunk | pad % "
              "| tokens/s | peak RSS MiB |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['variant']} | {r['runtime']} | {r['max_tokens']} | FAILED: "
                         f"{_cell(r.get('error'))} | | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['runtime']} | {r['max_tokens']} | {r['chunks']} | "
                     f"{r['padded_per_chunk']:.0f} | {r['padding_pct']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {_mib(r['peak_rss'])} |")
    return "\n".join(lines)


def server_default_variant(export_dir: Path) -> str | None:
    """The variant ``bgeserve serve`` picks with neither BGE_M3_MODEL nor BGE_M3_EP set (bf16
    on OpenVINO where this CPU has native bf16, else fp32). Asked in a child, so the parent
    never imports OpenVINO."""
    code = ("import sys; from bgeserve import backend; from bgeserve.config import Settings; "
            "s = Settings.from_env({'BGE_M3_MODEL_PATH': sys.argv[1]}); "
            "print(backend.resolve(s, model_explicit=False, ep_explicit=False).variant)")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(export_dir)], cwd=str(REPO),
                             capture_output=True, text=True, timeout=120, check=True)
        return out.stdout.strip().splitlines()[-1]
    except (subprocess.SubprocessError, IndexError) as exc:
        log(f"server default variant unknown ({exc}): no 'http <default> / flag' ratio")
        return None


def server_max_seq(args: argparse.Namespace, corpus: dict[str, Any]) -> int | None:
    """BGE_M3_MAX_SEQ_LENGTH for the server: ``auto`` = the corpus's longest text, at least
    512 (nothing is truncated); ``server`` = leave the server's default (8192)."""
    if args.http_max_seq == "server":
        return None
    if args.http_max_seq == "auto":
        return min(MAX_SEQ, max(512, max(corpus["lengths"])))
    return int(args.http_max_seq)


# ------------------------------------------------------------------------------ set-up
def run_tool(cmd: list[str], what: str) -> None:
    log(f"{what}: {shlex.join(cmd)}")
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=str(REPO))
    log(f"{what}: done in {time.perf_counter() - started:.0f}s")


def prepare(args: argparse.Namespace, work: Path, need_model: bool) -> tuple[Path, Path | None]:
    """Resolve (building or exporting when missing) the export dir and the PyTorch model dir."""
    size = "tiny" if args.quick else "full"
    model_dir = Path(args.model_dir).resolve() if args.model_dir else None
    export_dir = Path(args.export_dir).resolve() if args.export_dir else None
    if export_dir is None:
        export_dir = work / (f"onnx-{model_dir.name}" if model_dir else f"onnx-{size}")
    manifest_path = export_dir / "manifest.json"
    if model_dir is None and manifest_path.exists():  # the export knows its source
        src = json.loads(manifest_path.read_text()).get("source", {}).get("model")
        if src and (Path(src) / "config.json").exists():
            model_dir = Path(src)
    needs_export = not manifest_path.exists()
    if model_dir is None and (need_model or needs_export):
        model_dir = work / f"model-{size}"
        if not (model_dir / "config.json").exists():
            run_tool([sys.executable, "-m", "bgeserve", "build-random-model", "--size", size,
                      "--out", str(model_dir)], f"building the {size} random model")
    if needs_export:
        if args.export_dir and export_dir.exists() and any(export_dir.iterdir()):
            raise SystemExit(f"{export_dir} has no manifest.json: not a complete export")
        cmd = [sys.executable, "-m", "bgeserve", "export", "--model", str(model_dir),
               "--out", str(export_dir)]
        # no --variants: the export's own default (fp32, int8, and bf16 with openvino installed)
        for v in sorted(set(args.variants) | {"fp32"}) if args.variants else []:
            cmd += ["--variant", v]
        run_tool(cmd, "exporting")
    have = json.loads(manifest_path.read_text()).get("variants", {})
    if args.variants is None:
        args.variants = ["fp32", "int8"] + (["bf16"] if "bf16" in have else [])
    missing = [v for v in args.variants if v not in have]
    if args.rss_vs_length and args.rss_variants is None:  # the default: those the export has
        args.rss_variants = [v for v in RSS_VARIANTS if v in have]
        for v in sorted(set(RSS_VARIANTS) - set(args.rss_variants)):
            log(f"rss-vs-length: the export has no {v} variant: skipped")
    elif args.rss_vs_length:
        missing += [v for v in args.rss_variants if v not in have and v not in missing]
    if missing:
        raise SystemExit(f"{export_dir} has no {', '.join(missing)} variant (has "
                         f"{', '.join(have)}); re-export with --variant")
    return export_dir, model_dir


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default=str(REPO / "bench-out"),
                   help="models, exports, corpora, logs and results (default ./bench-out)")
    p.add_argument("--model-dir", help="PyTorch bge-m3 directory (default: the export's source, "
                                       "else build a random one in the work dir)")
    p.add_argument("--export-dir", help="bgeserve export (default: export into the work dir)")
    p.add_argument("--variants", default=None,
                   help="comma list of export variants: fp32, int8 (ONNX Runtime), bf16 "
                        "(OpenVINO) (default fp32,int8, plus bf16 when the export has it)")
    p.add_argument("--ep", choices=["cpu", "cuda", "tensorrt"], default="cpu",
                   help="execution provider for the engine, http and load modes (BGE_M3_EP); "
                        "GPU providers take only those modes")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (ORT and torch)")
    p.add_argument("--workers", type=int, default=1,
                   help="engine/http workers, sharing --threads (BGE_M3_WORKERS; CPU workers "
                        "share one session)")
    p.add_argument("--texts", type=int, default=None,
                   help="texts in the mixed corpus (default 64; 16 with --quick)")
    p.add_argument("--corpus", choices=["mixed", "long", "both"], default="mixed")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma list of {', '.join(MODES)}, or 'none' (default: all; ort1 "
                        "only with --plain-graph)")
    p.add_argument("--plain-graph", metavar="MODEL.onnx",
                   help="ort1 mode: a plain-attention fp32 graph with the dense and "
                        "sparse_weights outputs (`bgeserve export --attention-block 0 --variant "
                        "fp32`); without it ort1 is skipped")
    p.add_argument("--quick", action="store_true", help="tiny model, fewer texts")
    p.add_argument("--no-latency-pass", action="store_true",
                   help="skip the per-text latency passes of flag and engine")
    p.add_argument("--http-clients", type=int, default=4,
                   help="http mode: concurrent clients (default 4)")
    p.add_argument("--http-batch", type=int, default=1,
                   help="http mode: texts per request (default 1)")
    p.add_argument("--http-budget", choices=["disabled", "probe"], default="disabled",
                   help="server memory model: BGE_M3_DISABLE_AUTO_BUDGET=1 (default), or run the "
                        "probe (cached in the work dir) and wait for it before measuring")
    p.add_argument("--http-max-seq", default="auto", metavar="auto|server|N",
                   help="server BGE_M3_MAX_SEQ_LENGTH: auto = the corpus's longest text (at "
                        "least 512; the memory floor check is then for that length), server = "
                        "its default 8192, or a number")
    p.add_argument("--http-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra server environment (repeatable), e.g. BGE_M3_BATCH_DELAY_MS=2")
    p.add_argument("--load", action="store_true",
                   help="also run the load test (short texts, batching on and off)")
    p.add_argument("--clients", default="1,16,64", help="load test client counts")
    p.add_argument("--load-requests", type=int, default=None,
                   help="requests per client count in the load test (default 256; 48 quick)")
    p.add_argument("--rss-vs-length", action="store_true",
                   help="also measure RSS growth for one text of 512..8192 tokens")
    p.add_argument("--rss-lengths", default=",".join(map(str, RSS_LENGTHS)))
    p.add_argument("--rss-variants", default=None,
                   help="variants for --rss-vs-length (default fp32,bf16: those the export has)")
    p.add_argument("--chunk-sweep", default="", metavar="N,N,...",
                   help="also run raw on the mixed corpus per variant with each max padded "
                        "tokens per chunk, e.g. 256,512,1024,2048,4096 (one child per point)")
    p.add_argument("--plots", metavar="DIR",
                   help="write SVG plots (throughput vs chunk size, RSS growth vs length) into "
                        "DIR; needs matplotlib")
    p.add_argument("--rerank-export", metavar="DIR",
                   help="also measure /v1/rerank with this reranker export (beside the bge-m3 "
                        "export) against FlagReranker: scripts/rerank_bench.py, in this run")
    p.add_argument("--rerank-args", default="", metavar="'OPTIONS'",
                   help="rerank_bench.py options for --rerank-export, e.g. '--variants "
                        "fp32,int8 --pairs 16 --docs-per-request 1'")
    p.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds to wait for the server's /health")
    p.add_argument("--child-timeout", type=float, default=7200.0,
                   help="seconds before a measurement is killed")
    args = p.parse_args(argv)
    def comma(value: str | None) -> list[str] | None:
        return None if value is None else [v.strip() for v in value.split(",") if v.strip()]

    args.variants = comma(args.variants)
    args.rss_variants = comma(args.rss_variants)
    args.modes = [] if args.modes.strip() == "none" else [
        m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {MODES}")
    if args.ep != "cpu":
        cpu_only = [m for m in args.modes if m not in ("engine", "http")]
        if cpu_only or args.rss_vs_length or args.chunk_sweep:
            p.error(f"--ep {args.ep} measures the engine, http and load modes only; drop "
                    f"{', '.join(cpu_only) or '--rss-vs-length / --chunk-sweep'}")
    if args.http_max_seq not in ("auto", "server") and not args.http_max_seq.isdigit():
        p.error("--http-max-seq must be auto, server or a number of tokens")
    args.clients = [int(x) for x in args.clients.split(",") if x.strip()]
    args.rss_lengths = [int(x) for x in args.rss_lengths.split(",") if x.strip()]
    args.chunk_sweep = [int(x) for x in args.chunk_sweep.split(",") if x.strip()]
    if args.plain_graph:
        args.plain_graph = str(Path(args.plain_graph).resolve())
        if not Path(args.plain_graph).is_file():
            p.error(f"--plain-graph {args.plain_graph}: no such file")
    if args.texts is None:
        args.texts = 16 if args.quick else 64
    if args.load_requests is None:
        args.load_requests = 48 if args.quick else 256
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["_child"]:
        return child_main(argv[1])
    args = parse_args(argv)
    command = "python scripts/bench.py " + shlex.join(argv)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    export_dir, model_dir = prepare(args, work, need_model="flag" in args.modes)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    runner = Runner(args, work, export_dir, model_dir, run_id)
    tokenizer_path = export_dir / "tokenizer.json"
    started = time.perf_counter()
    runtimes = {v: variant_runtime(export_dir, v)
                for v in args.variants + (args.rss_variants if args.rss_vs_length else [])}
    default_variant = None
    if "http" in args.modes:  # GPU providers default to fp16 (runtime/gpu.py)
        default_variant = "fp16" if args.ep != "cpu" else server_default_variant(export_dir)
    meta = {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": command, "machine": machine_info(), "ep": args.ep,
            "export_dir": str(export_dir),
            "model_dir": str(model_dir) if model_dir else None, "threads": args.threads,
            "variants": args.variants, "runtimes": runtimes, "quick": args.quick,
            "plain_graph": args.plain_graph, "server_default_variant": default_variant}
    log(f"export {export_dir}, model {model_dir}, {args.threads} threads, run {run_id}, variants "
        + ", ".join(f"{v} ({runtimes[v]})" for v in args.variants)
        + (f"; server default {default_variant}" if default_variant else ""))
    if "ort1" in args.modes and not args.plain_graph:
        log("ort1: skipped (no --plain-graph)")

    rows: list[dict[str, Any]] = []
    corpora = ["mixed", "long"] if args.corpus == "both" else [args.corpus]
    for kind in corpora if args.modes else []:
        n = args.texts if kind == "mixed" else len(LONG_LENGTHS)
        cpath = corpus_file(work, tokenizer_path, kind, n)
        corpus = json.loads(cpath.read_text())
        log(f"corpus {kind}: {len(corpus['texts'])} texts, {sum(corpus['lengths'])} tokens, "
            f"lengths {min(corpus['lengths'])}..{max(corpus['lengths'])}")
        plan_ = [("flag", "fp32")] if "flag" in args.modes else []
        if "ort1" in args.modes and args.plain_graph:
            plan_.append(("ort1", "fp32"))
        plan_ += [(m, v) for v in args.variants for m in VARIANT_MODES if m in args.modes]
        for mode, variant in plan_:
            if mode == "flag" and model_dir is None:
                rows.append({"name": f"{kind}-flag", "mode": mode, "variant": variant,
                             "corpus": kind, "texts": len(corpus["texts"]),
                             "tokens": sum(corpus["lengths"]), "ok": False,
                             "error": "no PyTorch model directory (--model-dir)"})
                continue
            name = f"{kind}-{mode}-{variant}"
            res = runner.child(name, {"mode": mode, "variant": variant, "corpus": str(cpath),
                                      "max_seq": server_max_seq(args, corpus)})
            row = summarize(name, mode, variant, kind, corpus, res)
            if row.get("ok"):
                log(f"{name}: {row['tokens_per_s']:.1f} tokens/s, peak RSS "
                    f"{_mib(row['peak_rss'])} MiB")
            rows.append(row)
        if plan_ and not any(r["corpus"] == kind and r.get("ok") and r["variant"] == "fp32"
                             for r in rows):
            # No fp32 vectors to compare with: an untimed fp32 engine pass as the reference.
            name = f"{kind}-ref-fp32"
            res = runner.child(name, {"mode": "engine", "variant": "fp32", "corpus": str(cpath),
                                      "latency_pass": False})
            rows.append(summarize(name, "ref", "fp32", kind, corpus, res))
    agreement(rows)

    sweep_rows: list[dict[str, Any]] = []
    if args.chunk_sweep:
        cpath = corpus_file(work, tokenizer_path, "mixed", args.texts)
        sweep_corpus = json.loads(cpath.read_text())
        for variant in args.variants:
            for max_tokens in args.chunk_sweep:
                name = f"sweep-{variant}-{max_tokens}"
                res = runner.child(name, {"mode": "raw", "variant": variant, "corpus": str(cpath),
                                          "max_tokens": max_tokens})
                row = sweep_row(name, variant, runtimes[variant], max_tokens, sweep_corpus, res)
                if row["ok"]:
                    log(f"{name}: {row['tokens_per_s']:.1f} tokens/s, "
                        f"{row['padded_per_chunk']:.0f} padded tokens per chunk")
                sweep_rows.append(row)

    load_rows: list[dict[str, Any]] = []
    if args.load:
        cpath = corpus_file(work, tokenizer_path, "load", 64)
        load_corpus = json.loads(cpath.read_text())
        for variant in args.variants:
            for batching in (True, False):
                name = f"load-{variant}-{'on' if batching else 'off'}"
                res = runner.child(name, {"mode": "load", "variant": variant,
                                          "corpus": str(cpath), "batching": batching,
                                          "max_seq": server_max_seq(args, load_corpus),
                                          "clients": args.clients,
                                          "load_requests": args.load_requests})
                load_rows.append({"name": name, "variant": variant, "batching": batching, **res})

    rss_rows: list[dict[str, Any]] = []
    if args.rss_vs_length:
        for variant in args.rss_variants:
            for length in args.rss_lengths:
                cpath = corpus_file(work, tokenizer_path, f"single-{length}", 1)
                name = f"rss-{variant}-{length}"
                res = runner.child(name, {"mode": "rss", "variant": variant, "corpus": str(cpath)})
                rss_rows.append({"name": name, "target": length, "variant": variant, **res})

    rerank = None
    if args.rerank_export:  # scripts/rerank_bench.py, next to this file (sys.path[0])
        import rerank_bench

        rerank = rerank_bench.run(rerank_bench.parse_args(
            ["--reranker-export", args.rerank_export, "--m3-export", str(export_dir),
             "--threads", str(args.threads), "--work", str(runner.run_dir / "rerank"),
             *shlex.split(args.rerank_args)]))

    plots: list[str] = []
    if args.plots:
        from bench_plots import write_plots  # scripts/, next to this file (sys.path[0])

        plots = [str(x) for x in write_plots(Path(args.plots), sweep_rows, rss_rows, log)]

    all_ratios = {**ratios(rows, default_variant), **load_gains(load_rows)}
    m = meta["machine"]
    out = [f"# bgeserve benchmark {run_id}", "",
           f"- date: {meta['date']}",
           f"- machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['mem_total_gib']} GiB, "
           f"{m['machine']}, Linux {m['kernel']}" + (f"; GPUs: {m['gpus']}" if m.get("gpus") else ""),
           "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
           f"- model: {model_dir or '—'}; export: {export_dir}; threads: {args.threads}"
           + (f"; engine/http workers: {args.workers} (one shared session, "
              f"{max(1, args.threads // args.workers)} thread(s) each)" if args.workers > 1
              else ""),
           "- variants: " + ", ".join(f"{v} ({runtimes[v]})" for v in args.variants)
           + (f"; execution provider: {args.ep}" if args.ep != "cpu" else "")
           + (f"; server default: {default_variant}" if default_variant else "")
           + (f"; ort1 graph: {args.plain_graph}" if args.plain_graph else ""),
           f"- command: `{command}`", ""]
    if rows:
        out += ["## Corpus runs", "", table(rows), ""]
    if all_ratios:
        out += ["## Ratios (tokens/s unless noted)", ""]
        out += [f"- {k}: **{v:.2f}×**" for k, v in all_ratios.items()] + [""]
    if load_rows:
        out += ["## Load (one short text per request)", "", load_table(load_rows), ""]
    if sweep_rows:
        out += ["## Chunk size sweep (raw, mixed corpus)", "", sweep_table(sweep_rows), ""]
    if rss_rows:
        out += ["## RSS vs text length (engine, one text)", "", rss_table(rss_rows), ""]
    if rerank:
        out += ["## Rerank (/v1/rerank vs FlagReranker, scripts/rerank_bench.py)", "",
                rerank["markdown"], ""]
    if plots:
        out += ["## Plots", ""] + [f"- `{x}`" for x in plots] + [""]
    out += [f"Total time: {time.perf_counter() - started:.0f} s."]
    report = "\n".join(out)
    print(report)
    results = {"meta": meta, "runs": rows, "ratios": all_ratios, "load": load_rows,
               "chunk_sweep": sweep_rows, "rss_vs_length": rss_rows, "plots": plots,
               "rerank": rerank}
    for path in (runner.run_dir / "results.json", work / "results-latest.json"):
        path.write_text(json.dumps(results, indent=2, default=str))
    (runner.run_dir / "results.md").write_text(report + "\n")
    log(f"results: {runner.run_dir / 'results.json'} (and {work / 'results-latest.json'})")
    failed = [r["name"] for r in rows + sweep_rows + load_rows + rss_rows if not r.get("ok")]
    if failed:
        log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
