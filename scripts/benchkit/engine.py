"""``engine`` and ``rss``: ``bgeserve.Engine`` in-process, configured as ``bgeserve serve`` is.

Every backend goes the server's way: the environment a server would get → ``Settings`` →
``service.plan.resolve`` (runtime, provider, variant) → ``service.plan.for_model`` (max_seq,
sessions, chunk tokens, workers: the engine's configuration), so the engine rows measure what
the server runs, minus HTTP.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from benchkit.common import MAX_SEQ, peak_rss, proc_status, reset_peak, rss_now, save_vectors


def engine_env(spec: dict[str, Any]) -> dict[str, str]:
    """The BGE_M3_* environment of a server for this measurement (threads split by workers;
    no idle unload or request deadline inside a timed pass)."""
    workers = spec.get("workers", 1)
    env = {"BGE_M3_MODEL": spec["variant"], "BGE_M3_MODEL_PATH": spec["export_dir"],
           "BGE_M3_WORKERS": str(workers),
           "BGE_M3_INTRA_THREADS": str(max(1, spec["threads"] // workers)),
           "BGE_M3_CACHE_DIR": str(Path(spec["work_dir"]) / "cache"),
           "BGE_M3_IDLE_TIMEOUT_SECS": "0", "BGE_M3_REQUEST_TIMEOUT_SECS": "0",
           "HF_HUB_OFFLINE": "1",
           # The embedding cache off: the latency pass repeats the corpus's texts.
           "BGE_M3_CACHE_MB": "0"}
    ep = spec.get("ep", "cpu")
    if ep != "cpu":
        env["BGE_M3_EP"] = ep
        # GPU engines are sized for the corpus's longest text (TensorRT's profile), CPU ones
        # for bge-m3's 8,192 tokens, as before.
        env["BGE_M3_MAX_SEQ_LENGTH"] = str(spec.get("max_seq") or MAX_SEQ)
        env.update(spec.get("http_env") or {})
    else:
        env["BGE_M3_MAX_SEQ_LENGTH"] = str(MAX_SEQ)
    return env


def open_engine(spec: dict[str, Any], on_chunk=None):
    """An Engine as ``bgeserve serve`` would run it from ``engine_env(spec)``."""
    from bgeserve import Engine
    from bgeserve.config import Settings
    from bgeserve.model.artifacts import resolve
    from bgeserve.service import plan

    s = plan.resolve(Settings.from_env(engine_env(spec)))
    artifacts = resolve(model_path=s.model_path, variant=s.variant, cache_dir=s.cache_dir,
                        offline=True)
    planned = plan.for_model(s, artifacts, s.cache_dir)
    return Engine(artifacts=artifacts, on_chunk=on_chunk, config=planned.engine)


def child_engine(spec: dict[str, Any], corpus: dict[str, Any]) -> dict[str, Any]:
    texts = corpus["texts"]
    chunks: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    engine = open_engine(spec, on_chunk=lambda st: chunks.append((st.batch, st.pad_to)))
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


def child_rss(spec: dict[str, Any], corpus: dict[str, Any]) -> dict[str, Any]:
    from bgeserve.tuning.memory import trim_heap

    engine = open_engine(spec)
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

