"""The server's composition root: settings → artifacts → engine → tuning; request use-cases.

``Service.start`` returns at once and loads in the background, so ``/health`` says
``loading`` until the sessions are up; a fatal start-up error (model missing, memory floor)
is kept in ``fatal_error`` and ``on_fatal`` is called so the CLI can exit non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
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
from bgeserve.progress import Progress
from bgeserve.results import Embeddings, EmbedOptions, ModelInfo, RerankOptions, RerankResult, Token
from bgeserve.runtime import gpu
from bgeserve.service import choice, plan, reranking, tokens
from bgeserve.service import info as service_info
from bgeserve.service.metrics import Metrics
from bgeserve.service.preparation import Preparation
from bgeserve.tuning import cache, memory
from bgeserve.tuning.budget import measure_model_cost, split_available
from bgeserve.tuning.child import ChildProbe
from bgeserve.tuning.probe import LocalProbe, ProbeSource
from bgeserve.tuning.synthetic import chunk_timing_run, synthetic_run
from bgeserve.tuning.tuner import Tuner, UnmeasuredFloor

log = logging.getLogger("bgeserve.service")


def probe_source(engine: Engine, spec: dict[str, Any], *, in_process: bool) -> ProbeSource:
    """Where the probe measures (``Tuner.state.probe_mode``): a child process that loads its
    own copy of the model as ``spec`` says (beside the serving server), or, ``in_process``,
    the serving engine's own session before it serves (where a second copy does not fit: no
    extra weights, and the workers' own workspace budget, since nothing else runs)."""
    if not in_process:
        return ChildProbe(spec)
    run, close = synthetic_run(engine.open_forward, engine.tokenizer.vocab_size)
    return LocalProbe(run, chunk_run=chunk_timing_run(run), close=close,
                      pin_heap=memory.PROBE_MMAP_THRESHOLD)


class Service:
    """What the HTTP layer calls: embed, health, metrics, token strings."""

    model_name = "bge-m3"

    def __init__(self, settings: Settings, on_fatal: Callable[[BaseException], None] | None = None):
        self.settings = settings
        # Start-up steps (download, prepare, load) for the log and /health.
        self.progress = Progress(bars=sys.stderr.isatty())
        self.preparation = Preparation(self.progress)
        self.metrics_registry = Metrics()
        self.engine: Engine | None = None
        self.tuner: Tuner | None = None
        self.reranking = reranking.Reranking(self.metrics_registry)
        self.artifacts: ModelArtifacts | None = None
        self.choice = choice.Decision(settings)
        self.fatal_error: BaseException | None = None
        self.on_fatal = on_fatal
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._draining = False  # SIGTERM came: /health says draining (503)
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
            s = self.settings = self.preparation.apply(s, cache_dir)
            # Neither BGE_M3_EP nor BGE_M3_MODEL set: the fastest variant measured here (cached).
            self.choice = choice.decide(s, cache_dir, stop=self._stopping)
            s = self.settings = self.choice.settings
            self.progress.step("loading the model")
            self.artifacts = artifacts = resolve(model_path=s.model_path, variant=s.variant,
                                                 cache_dir=cache_dir, offline=s.offline,
                                                 progress=self.progress.bars,
                                                 report=self.progress.transfer)
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
            if reranking.configured(s):  # beside bge-m3: the free memory is split first
                resident = self.reranking.load(s, cache_dir)
                source = tuner.state.memory_source
                ours, theirs = split_available(tuner.state.available_bytes,
                                               (model_cost * s.workers, resident),
                                               s.rerank_memory_share)
                tuner.share(ours, f"{source}, shared with the reranker")
                self.reranking.tune(theirs, f"{source}, shared with bge-m3")
            parts = plan.probe_parts(s, artifacts)
            fingerprint = cache.fingerprint(parts)
            spec = {"model_path": str(s.model_path) if s.model_path else None,
                    "variant": s.variant, "cache_dir": str(cache_dir),
                    "provider": s.execution_provider, "threads": s.threads_per_worker,
                    "max_seq": s.max_seq_length}
            try:
                cost = tuner.initial(model_cost, fingerprint)
                first = tuner.state.probe_mode == "in_process"
            except UnmeasuredFloor as exc:
                # The conservative estimate is far above what shapes really cost (2.5x for
                # bge-m3 int8 at 8,192 tokens): measure before refusing.
                log.warning("%s. Measuring with the probe before deciding", exc.message.split(
                    ". ")[0])
                first = True
            if first:  # on the serving session, before anything is served
                tuner.measure_first(probe_source(engine, spec, in_process=True), model_cost,
                                    fingerprint, parts)
                cost = tuner.initial(model_cost, fingerprint)  # refuses if still too short
            self.engine = engine
            self.progress.done()
            self._ready.set()
            log.info("ready: probe %s, c=%.0f a=%.0f b=%.2f, %d MiB workspace per worker, texts "
                     "up to %d tokens fit", tuner.state.probe_status, cost.c, cost.a, cost.b,
                     cost.max_workspace_bytes >> 20, cost.max_seq())
            if tuner.state.probe_status == "running":  # then the reranker's: one at a time
                tuner.start_probe(probe_source(engine, spec, in_process=False), model_cost,
                                  fingerprint, parts, on_done=self.reranking.start_probe)
            else:
                self.reranking.start_probe()
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
        self._draining = True
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
        await asyncio.to_thread(self.reranking.close, self.settings.shutdown_timeout_secs or None)
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

    async def rerank(self, query: str, documents: list[str], options: RerankOptions, *,
                     request_id: str = "") -> RerankResult:
        """Score ``documents`` against ``query``: the reranker's, or bge-m3's own scores."""
        return await self.reranking.rerank(self._engine(), query, documents, options,
                                           self.settings.request_timeout_secs or None,
                                           request_id)

    def rerank_model_ids(self) -> tuple[str, ...]:
        """The ids ``model`` may name for the reranker (none when none is loaded)."""
        return self.reranking.model_ids

    def dense_width(self) -> int:
        """The loaded model's vector width (1,024 for bge-m3)."""
        return self._engine().width

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings for token ids (sparse_format=tokens)."""
        return self._engine().tokenizer.id_to_token(ids)

    # -- TEI's text tools: bgeserve/service/tokens.py and info.py -------------------------------
    async def tokenize(self, texts: Sequence[str],
                       add_special_tokens: bool = True) -> list[list[Token]]:
        """Every token of each text with UTF-8 byte offsets (TEI's ``/tokenize``)."""
        return await tokens.tokenize(self._engine(), texts, add_special_tokens)

    async def decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = True) -> list[str]:
        """The text of each id sequence (TEI's ``/decode``)."""
        return await tokens.decode(self._engine(), sequences, skip_special_tokens)

    async def truncate_left(self, texts: Sequence[str]) -> list[Any]:
        """Token ids of each text cut from the left past max_seq (then ``embed`` them)."""
        return await tokens.truncate_left(self._engine(), texts)

    def info(self) -> ModelInfo:
        """The served model and its limits (TEI's ``GET /info``)."""
        return service_info.model_info(self)

    def health(self) -> dict[str, Any]:
        """Readiness and the facts operators look for."""
        s = self.settings
        body: dict[str, Any] = {"status": "loading", "version": __version__,
                                "max_seq_length": s.max_seq_length}
        if self.fatal_error is not None:
            body.update(status="fail", error=str(self.fatal_error),
                        prepare=self.preparation.status)
            return body
        if self.engine is None or not self._ready.is_set():
            body.update(self.progress.snapshot())  # step, progress
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
        if self._draining:  # out of the load balancer while in-flight requests finish
            status = "draining"
        assert self.artifacts is not None and self.tuner is not None
        body.update(
            status=status,
            workers={k: stats[k] for k in ("live", "loaded", "total", "busy")},
            queue={"texts": stats["queue_texts"], "tokens": stats["queue_tokens"]},
            model={"name": self.model_name, "variant": self.artifacts.variant,
                   "choice": s.variant_choice, "candidates": {
                       v: round(r, 1) for v, r in self.choice.candidates.items()},
                   "layout": self.artifacts.layout.value, "source": self.artifacts.source,
                   "backend": plan.runtime_version(self.artifacts, s.execution_provider),
                   "execution_provider": s.execution_provider,
                   "threads_per_worker": s.threads_per_worker,
                   "prepare": self.preparation.status},
            tuning=self.tuner.state.as_dict(),
        )
        rerank = self.reranking.health()
        if rerank is not None:
            body["reranker"] = rerank
            if status == "ok" and rerank["status"] in ("warn", "fail"):
                body["status"] = "warn"
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
