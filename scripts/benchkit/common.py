"""What every part of the benchmark shares: constants, logging, RSS, vectors, machine facts.

RSS is read with bgeserve's own readers (``bgeserve.tuning.memory``): the bench measures the
same figures the server reports.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bgeserve.tuning.memory import parse_meminfo, peak_rss_bytes, reset_peak_rss, rss_bytes

REPO = Path(__file__).resolve().parent.parent.parent
MODES = ("flag", "ort1", "raw", "raw1", "engine", "http", "serve")
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


def wait_healthy(url: str, timeout: float = 600.0) -> None:
    """Until ``url``'s ``/health`` answers 200 (a server the script started); SystemExit past
    ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit("the server did not get ready")


@contextlib.contextmanager
def tree_server(tree: str, export_dir: str, port: int, **settings: str) -> Iterator[str]:
    """`bgeserve serve` of the checkout ``tree`` (``PYTHONPATH``; run from the temporary
    folder, so not this one's) on ``export_dir`` and ``port``, with ``settings``
    (``BGE_M3_*``), a fresh cache folder and warnings only: its URL once healthy; stopped
    after. To compare commits in turn, each from its own worktree."""
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), BGE_M3_MODEL_PATH=export_dir,
               BGE_M3_BIND=f"127.0.0.1:{port}", BGE_M3_LOG_LEVEL="warning",
               BGE_M3_CACHE_DIR=tempfile.mkdtemp(prefix="tree-server-"), **settings)
    server = subprocess.Popen([sys.executable, "-m", "bgeserve", "serve"], env=env,
                              cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL)
    try:
        wait_healthy(url)
        yield url
    finally:
        server.terminate()
        server.wait(30)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile (bytes) of a process (another one's too: the server)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="ascii")
    except OSError:
        return {}
    found = {key: parse_meminfo(text, key) for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    return {key: value for key, value in found.items() if value is not None}


def rss_now() -> int:
    return rss_bytes()


def peak_rss() -> int:
    """This process's peak RSS (VmHWM) since start or the last ``reset_peak``."""
    return peak_rss_bytes()


def reset_peak() -> bool:
    return reset_peak_rss()


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
    np.savez(path, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool


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

    versions: dict[str, str | None] = {}
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

