"""``BGE_M3_WARMUP_ONLY=1``: build every TensorRT engine into the cache, fsync it, exit.

Meant for an init container (ECS ``dependsOn: SUCCESS``, a Kubernetes ``initContainer``) that
shares the cache volume with the server, so the server starts on a warm cache. No port is bound.
Each worker opens its session on its own GPU (worker 0 first: it builds the engine, the other
devices then load it instead of compiling the same plan at once) and runs its stride share of
``BGE_M3_TRT_WARMUP_SHAPES`` once. Exit status: 0 when every shape ran and the engine folder
holds engines (or, with a non-TensorRT EP, once the model is in place: nothing to compile);
1 when anything failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bgeserve.config import Settings
from bgeserve.engine.forward import forward_factory
from bgeserve.errors import BgeServeError
from bgeserve.model.artifacts import resolve, validate_cache_dir
from bgeserve.runtime import gpu, trt
from bgeserve.service import plan

log = logging.getLogger("bgeserve.warmup")


@dataclass
class ShapeResult:
    """One warm-up shape on one worker: how long it took, or why it failed."""

    worker: int
    batch: int
    seq: int
    seconds: float = 0.0
    error: str | None = None


def synthetic_chunk(batch: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """``<s> … </s>`` ids of exactly ``seq`` tokens (any vocabulary has id 5), all unmasked."""
    ids = np.full((batch, seq), 5, dtype=np.int64)
    ids[:, 0] = 0
    ids[:, -1] = 2
    return ids, np.ones((batch, seq), dtype=np.int64)


def warm(open_forward: Callable[[int], Any], shapes: Sequence[tuple[int, int]], workers: int,
         engines: Path, device_count: int = 1) -> list[ShapeResult]:
    """Open one session per worker and run each worker's shard of ``shapes`` once on it."""
    forwards: list[Any] = [None] * workers
    errors: dict[int, str] = {}

    def open_one(worker: int) -> None:
        started = time.monotonic()
        try:
            forwards[worker] = open_forward(worker)
        except BgeServeError as exc:
            errors[worker] = str(exc)
            log.error("worker %d: session failed to open: %s", worker, exc)
            return
        trt.fsync_tree(engines)
        log.info("worker %d (device %d): session ready in %.1fs", worker,
                 gpu.device_for_worker(worker, device_count), time.monotonic() - started)

    def run_shard(worker: int) -> list[ShapeResult]:
        results = []
        for batch, seq in trt.shard(shapes, worker, workers):
            result = ShapeResult(worker, batch, seq)
            started = time.monotonic()
            try:
                if worker in errors:
                    raise BgeServeError(f"no session: {errors[worker]}")
                ids, mask = synthetic_chunk(batch, seq)
                forwards[worker].run(ids, mask, dense=True, sparse=True, colbert=True)
                trt.fsync_tree(engines)
            except (BgeServeError, OSError) as exc:
                result.error = str(exc)
            result.seconds = time.monotonic() - started
            level = logging.ERROR if result.error else logging.INFO
            log.log(level, "warm-up %dx%d on worker %d: %s in %.1fs", batch, seq, worker,
                    result.error or "ok", result.seconds,
                    extra={"batch": batch, "seq": seq, **gpu.heartbeat_fields()})
            results.append(result)
        return results

    try:
        open_one(0)
        with ThreadPoolExecutor(max_workers=max(workers, 1)) as pool:
            list(pool.map(open_one, range(1, workers)))
            return [r for shard in pool.map(run_shard, range(workers)) for r in shard]
    finally:
        for fwd in forwards:
            if fwd is not None:
                fwd.close()


def run(settings: Settings) -> int:
    """Warm-up-only mode for resolved ``settings``; returns the process exit status."""
    s = settings
    started = time.monotonic()
    try:
        cache_dir = validate_cache_dir(s.cache_dir)
        # Resolving also downloads the model into the shared cache when it is not there yet.
        artifacts = resolve(model_path=s.model_path, variant=s.variant, cache_dir=cache_dir,
                            offline=s.offline)
    except BgeServeError as exc:
        log.error("warmup-only mode failed: %s", exc)
        return 1
    if s.execution_provider != "tensorrt":
        log.warning("BGE_M3_WARMUP_ONLY=1 with BGE_M3_EP=%s: only TensorRT builds engines ahead "
                    "of time, so there is nothing to compile; model %s is in place, exiting",
                    s.execution_provider, artifacts.source)
        return 0
    engines = trt.engine_dir(cache_dir)
    try:
        session = plan.session_config(s)
        shapes = trt.parse_warmup_shapes(s.trt_warmup_shapes, s.max_seq_length,
                                         max_batch=plan.profile_max_batch(s))
        results = warm(forward_factory(artifacts, session), shapes, s.workers, engines,
                       session.device_count)
        synced = trt.fsync_tree(engines) + trt.fsync_tree(trt.timing_dir(cache_dir))
    except (BgeServeError, OSError) as exc:
        log.error("warmup-only mode failed: %s", exc)
        return 1
    count = trt.count_engines(engines)
    failed = [f"{r.batch}x{r.seq}" for r in results if r.error]
    summary = {"engine_count": count, "cache_path": str(engines), "shapes": len(results),
               "failed_shapes": failed, "workers": s.workers, "files_synced": synced,
               "seconds": round(time.monotonic() - started, 1)}
    if failed or count == 0:
        log.error("warmup-only mode: %s; %d engine(s) at %s, exiting with failure",
                  f"shapes {', '.join(failed)} failed" if failed else "no engine was written",
                  count, engines, extra=summary)
        return 1
    log.info("warmup-only mode: all TRT engines compiled and cached, exiting (%d engine(s) at "
             "%s, %d shape(s) on %d worker(s))", count, engines, len(results), s.workers,
             extra=summary)
    return 0
