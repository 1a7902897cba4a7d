"""The server's composition root: settings → artifacts → engine → tuning; request use-cases.

``Service.start`` returns at once and loads in the background, so ``/health`` says
``loading`` until the sessions are up; a fatal start-up error (model missing, memory floor)
is kept in ``fatal_error`` and ``on_fatal`` is called so the CLI can exit non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from bgeserve import __version__, runtime
from bgeserve.config import Settings
from bgeserve.engine import Engine, Inputs
from bgeserve.engine.jobs import Job
from bgeserve.errors import BgeServeError, DeadlineExceeded, NotReady
from bgeserve.model.artifacts import ModelArtifacts, resolve, validate_cache_dir
from bgeserve.results import Embeddings, EmbedOptions
from bgeserve.runtime import gpu
from bgeserve.service import plan
from bgeserve.service.metrics import Metrics
from bgeserve.tuning import cache, memory
from bgeserve.tuning.budget import measure_model_cost
from bgeserve.tuning.tuner import Tuner, UnmeasuredFloor

log = logging.getLogger("bgeserve.service")


def probe_source(engine: Engine, spec: dict[str, Any]) -> Any:
    """What the probe measures: the child-process spec (a seam tests replace)."""
    return spec


class Service:
    """What the HTTP layer calls: embed, health, metrics, token strings."""

    model_name = "bge-m3"

    def __init__(self, settings: Settings, on_fatal: Callable[[BaseException], None] | None = None):
        self.settings = settings
        self.metrics_registry = Metrics()
        self.engine: Engine | None = None
        self.tuner: Tuner | None = None
        self.artifacts: ModelArtifacts | None = None
        self.fatal_error: BaseException | None = None
        self.on_fatal = on_fatal
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._loader: threading.Thread | None = None
        self._abort_timer: asyncio.TimerHandle | None = None
        # Requests tokenizing at once: more than the cores only adds memory (each holds its
        # encodings), never speed. Made on first use, on the loop that serves.
        self._tokenizing: asyncio.Semaphore | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Begin loading in the background; returns at once."""
        self._loader = threading.Thread(target=self._load, name="bgeserve-loader", daemon=True)
        self._loader.start()
        if self.settings.heartbeat_secs > 0:
            threading.Thread(target=self._heartbeat, name="bgeserve-heartbeat",
                             daemon=True).start()

    def load_blocking(self) -> None:
        """Load synchronously (warm-up mode, tests); raises the start-up error if any."""
        self._load()
        if self.fatal_error is not None:
            raise self.fatal_error

    def _load(self) -> None:
        engine: Engine | None = None
        try:
            # Runtime, provider and variant decided, GPUs counted (a no-op if the CLI did it).
            s = self.settings = plan.resolve(self.settings)
            cache_dir = validate_cache_dir(s.cache_dir)
            self.artifacts = artifacts = resolve(model_path=s.model_path, variant=s.variant,
                                                 cache_dir=cache_dir, offline=s.offline)
            serving = plan.for_model(s, artifacts, cache_dir)
            # Everything below (engine, probe, /health) sees the tokens the model holds.
            s = self.settings = serving.settings
            log.info("model: %s (%s layout, variant %s, %s)", artifacts.source,
                     artifacts.layout.value, artifacts.variant,
                     runtime.get(serving.runtime).version())
            engine = Engine(artifacts=artifacts, config=serving.engine, start=False,
                            auto_budget=False,  # the Tuner owns the budget here
                            on_chunk=self.metrics_registry.observe_chunk)
            chunks = serving.engine.scheduler
            log.info("chunks: up to %d texts and %s padded tokens per run, lengths rounded up "
                     "to a multiple of %d, cross-request batching %s", chunks.max_chunk,
                     chunks.max_chunk_tokens or "unlimited", chunks.pad_multiple,
                     "on" if chunks.cross_request else "off")
            self.tuner = tuner = Tuner(serving.tuning, apply=engine.set_cost_model,
                                       apply_chunk_tokens=engine.set_max_chunk_tokens)
            tuner.detect_memory()

            def load() -> None:
                engine.start()
                ready = engine.embed("ready", dense=True, sparse=True, colbert=True)
                assert ready.dense is not None
                engine.width = int(ready.dense.shape[1])  # what the graph gives is the truth

            model_bytes = sum(p.stat().st_size for p in (artifacts.onnx_path,
                                                          *artifacts.external_data))
            model_cost = measure_model_cost(
                load, s.workers, model_bytes,
                copies=runtime.weight_copies(serving.runtime, s.workers))
            parts = plan.probe_parts(s, artifacts)
            fingerprint = cache.fingerprint(parts)
            spec = {"model_path": str(s.model_path) if s.model_path else None,
                    "variant": s.variant, "cache_dir": str(cache_dir),
                    "provider": s.execution_provider, "threads": s.threads_per_worker,
                    "max_seq": s.max_seq_length}
            try:
                cost = tuner.initial(model_cost, fingerprint)
            except UnmeasuredFloor as exc:
                # The conservative estimate is far above what shapes really cost (2.5x for
                # bge-m3 int8 at 8,192 tokens): measure before refusing. The probe loads its
                # own copy of the model, so the server's sessions make room meanwhile.
                log.warning("%s. Measuring with the probe before deciding (the server's "
                            "sessions are unloaded meanwhile)", exc.message.split(". ")[0])
                engine.unload()
                tuner.measure_first(probe_source(engine, spec), model_cost, fingerprint, parts)
                cost = tuner.initial(model_cost, fingerprint)  # refuses if still too short
                load()
            self.engine = engine
            self._ready.set()
            log.info("ready: probe %s, a=%.0f b=%.2f, %d MiB workspace per worker, texts up to "
                     "%d tokens fit", tuner.state.probe_status, cost.a, cost.b,
                     cost.max_workspace_bytes >> 20, cost.max_seq())
            if tuner.state.probe_status == "running":
                tuner.start_probe(probe_source(engine, spec), model_cost, fingerprint, parts)
        except BaseException as exc:  # start-up failures are reported, not raised on a thread
            log.error("start-up failed: %s", exc, exc_info=not isinstance(exc, BgeServeError))
            self.fatal_error = exc
            if engine is not None and self.engine is None:
                # Sessions may be loaded (e.g. the memory floor refused after loading): release
                # them and their worker threads; stop() only closes a published engine.
                engine.close(5.0)
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _heartbeat(self) -> None:
        """Log RSS, workers, queue and probe status every BGE_M3_HEARTBEAT_SECS."""
        period = self.settings.heartbeat_secs
        while not self._stopping.wait(period):
            fields: dict[str, Any] = {"rss_mb": memory.rss_bytes() >> 20}
            if self.engine is not None:
                stats = self.engine.stats()
                fields.update(live_workers=stats["live"], loaded_workers=stats["loaded"],
                              busy_workers=stats["busy"], queue_texts=stats["queue_texts"],
                              queue_tokens=stats["queue_tokens"])
            if self.tuner is not None:
                fields["probe_status"] = self.tuner.state.probe_status
            if runtime.on_gpu(self.settings.execution_provider):
                fields["gpus"] = gpu.heartbeat_fields()
            log.info("heartbeat", extra=fields)

    def begin_shutdown(self) -> None:
        """SIGTERM (called on the event loop as the server stops accepting): queued texts run
        at once, and whatever still waits after BGE_M3_SHUTDOWN_TIMEOUT_SECS is answered 503.

        The HTTP server waits a little longer than that for its requests (cli.py), so every
        request gets an answer in the envelope, never a connection cut by the server's own
        grace timeout.
        """
        if self.engine is not None:
            self.engine.flush()
        if self.settings.shutdown_timeout_secs:  # 0: no bound, everything is finished
            loop = asyncio.get_running_loop()
            self._abort_timer = loop.call_later(self.settings.shutdown_timeout_secs,
                                                self._abort_waiting)

    def _abort_waiting(self) -> None:
        if self.engine is None:
            return
        answered = self.engine.abort(NotReady(
            "the server is shutting down and this request did not finish within "
            "BGE_M3_SHUTDOWN_TIMEOUT_SECS; retry (another instance will answer)"))
        if answered:
            log.warning("shutdown: %d requests were still waiting after %gs and were answered "
                        "503", answered, self.settings.shutdown_timeout_secs)

    async def stop(self) -> None:
        """Drain in-flight work (bounded by BGE_M3_SHUTDOWN_TIMEOUT_SECS) and unload."""
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        self._stopping.set()
        if self.tuner is not None:
            self.tuner.stop()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close,
                                    self.settings.shutdown_timeout_secs or None)

    # -- use-cases -------------------------------------------------------------------------
    def _engine(self) -> Engine:
        if self.engine is None or not self._ready.is_set():
            if self.fatal_error is not None:
                raise NotReady(f"the model failed to load: {self.fatal_error}")
            raise NotReady("the model is still loading; retry shortly")
        return self.engine

    async def embed(self, inputs: Inputs, options: EmbedOptions, *,
                    request_id: str = "") -> Embeddings:
        """Embed one request's inputs (texts or token ids) in input order."""
        engine = self._engine()
        started = time.perf_counter()
        arrived = time.monotonic()  # the deadline counts tokenizing too
        # Near a full queue, a lower bound of the tokens may refuse the request before it is
        # tokenized: on a thread (it walks the texts), before the tokenizing slot (so a
        # refusal never waits behind other requests' tokenizing).
        if engine.queue_nearly_full():
            await asyncio.to_thread(engine.refuse_early, inputs)
        if small(inputs):
            # A query or two: tokenizing it here costs less than handing it to a thread and
            # waiting to be woken (measured in docs/benchmarks.md, "Short-query latency").
            job = engine.make_job(inputs, options, request_id, arrived)
        else:
            job = await self._make_job(engine, inputs, options, request_id, arrived)
        timeout = self.settings.request_timeout_secs or None
        remaining = None if timeout is None else max(0.0, job.deadline - time.monotonic()) \
            if job.deadline is not None else timeout
        try:
            # Not wait_for: its task would submit the job one loop iteration later.
            async with asyncio.timeout(remaining):
                result = await engine.await_job(job)
        except TimeoutError:
            self.metrics_registry.deadline_exceeded()
            raise DeadlineExceeded(
                f"the request did not finish within BGE_M3_REQUEST_TIMEOUT_SECS={timeout:g}s"
            ) from None
        self.metrics_registry.observe_request(result, time.perf_counter() - started)
        return result

    async def _make_job(self, engine: Engine, inputs: Inputs, options: EmbedOptions,
                        request_id: str, arrived: float) -> Job:
        """``engine.make_job`` on a thread, holding one of the tokenizing slots."""
        if self._tokenizing is None:
            self._tokenizing = asyncio.Semaphore(max(2, len(os.sched_getaffinity(0))))
        async with self._tokenizing:
            work = asyncio.ensure_future(asyncio.to_thread(
                engine.make_job, inputs, options, request_id, arrived))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                # The caller left (client gone), but the thread tokenizes on: its slot, and
                # the body allowance the HTTP layer holds until this returns, stay taken
                # until it ends.
                await asyncio.wait({work})
                if not work.cancelled():
                    work.exception()  # retrieved: its error has no one to go to
                raise

    def dense_width(self) -> int:
        """The loaded model's vector width (1,024 for bge-m3)."""
        return self._engine().width

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings for token ids (sparse_format=tokens)."""
        return self._engine().tokenizer.id_to_token(ids)

    def health(self) -> dict[str, Any]:
        """Readiness and the facts operators look for."""
        s = self.settings
        body: dict[str, Any] = {"status": "loading", "version": __version__,
                                "max_seq_length": s.max_seq_length}
        if self.fatal_error is not None:
            body.update(status="fail", error=str(self.fatal_error))
            return body
        if self.engine is None or not self._ready.is_set():
            return body
        stats = self.engine.stats()
        # A worker that is dead, restarting or cannot open its session is not live: that is
        # warn even when the others are idle-unloaded, and fail once none is left.
        if stats["live"] == 0:
            status = "fail"
        elif stats["live"] < stats["total"]:
            status = "warn"
        elif stats["loaded"] == 0:
            status = "idle"
        else:
            status = "ok"
        assert self.artifacts is not None and self.tuner is not None
        body.update(
            status=status,
            workers={k: stats[k] for k in ("live", "loaded", "total", "busy")},
            queue={"texts": stats["queue_texts"], "tokens": stats["queue_tokens"]},
            model={"name": self.model_name, "variant": self.artifacts.variant,
                   "layout": self.artifacts.layout.value, "source": self.artifacts.source,
                   "backend": plan.runtime_version(self.artifacts, s.execution_provider),
                   "execution_provider": s.execution_provider,
                   "threads_per_worker": s.threads_per_worker},
            tuning=self.tuner.state.as_dict(),
        )
        return body

    def metrics(self) -> tuple[bytes, str]:
        """Prometheus exposition of the server's metrics."""
        self.metrics_registry.update_state(self)
        return self.metrics_registry.render()


# Requests up to this many characters (or token ids) are tokenized on the event loop: at
# ~5-10 us per token (bge-m3's tokenizer here) that blocks it for well under a millisecond,
# less than a round trip through a thread costs a query on a busy machine.
INLINE_TOKENIZE_CHARS = 512


def small(inputs: Inputs, limit: int = INLINE_TOKENIZE_CHARS) -> bool:
    """Whether ``inputs`` hold at most ``limit`` characters (token ids: ids) in all."""
    if isinstance(inputs, str):
        return len(inputs) <= limit
    total = 0
    for item in inputs:
        total += len(item) if isinstance(item, (str, list, tuple)) else 1
        if total > limit:
            return False
    return True


def build_service(settings: Settings) -> Service:
    """The factory ``create_app`` uses."""
    return Service(settings)
