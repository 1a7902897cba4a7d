"""The server's composition root: settings → artifacts → engine → tuning; request use-cases.

``Service.start`` returns at once and loads in the background, so ``/health`` says
``loading`` until the sessions are up; a fatal start-up error (model missing, memory floor)
is kept in ``fatal_error`` and ``on_fatal`` is called so the CLI can exit non-zero.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from bgeserve import holds, runtime, timings
from bgeserve.config import Settings
from bgeserve.engine import ChunkStats, Engine, Inputs
from bgeserve.engine.tokenizer import Encoded
from bgeserve.errors import BgeServeError, DeadlineExceeded, NotReady, Overloaded
from bgeserve.model.artifacts import ModelArtifacts, resolve, validate_cache_dir
from bgeserve.progress import Progress, on_terminal
from bgeserve.results import Embeddings, EmbedOptions, ModelInfo, RerankOptions, RerankResult, Token
from bgeserve.runtime import gpu
from bgeserve.service import canary, choice, health, outputs, plan, reranking, tokens
from bgeserve.service import info as service_info
from bgeserve.service.admission import Admission, DrainMeter, attention_tokens, where_late
from bgeserve.service.metrics import Metrics
from bgeserve.service.preparation import Preparation
from bgeserve.service.probing import probe_source
from bgeserve.tuning import cache, memory
from bgeserve.tuning.audit import AuditSample, WorkspaceAudit
from bgeserve.tuning.budget import measure_model_cost, split_available
from bgeserve.tuning.tuner import DoesNotFit, Tuner, UnmeasuredFloor

if TYPE_CHECKING:
    from bgeserve.engine.jobs import Job

log = logging.getLogger("bgeserve.service")
T = TypeVar("T")
# Retry-After on a 503 while the model loads: clients that honour it (the openai client, up to
# 60 s) poll again soon rather than after their own backoff or never.
LOADING_RETRY_S = 2.0
# How long a model request that arrives while the model loads waits for it before its 503
# (``until_ready``): served if the load ends meanwhile, and a client that retries a 503 at once
# (Hugging Face's JS client: ~50 requests a second, Retry-After ignored) polls no faster than
# one that honours Retry-After.
LOADING_HOLD_S = 2.0


class Service:
    """What the HTTP layer calls: embed, health, metrics, token strings."""

    model_name = "bge-m3"

    def __init__(self, settings: Settings, on_fatal: Callable[[BaseException], None] | None = None):
        self.settings = settings
        # Start-up steps (download, prepare, load) for the log and /health.
        self.progress = Progress(bars=on_terminal())
        self.preparation = Preparation(self.progress)
        self.metrics_registry = Metrics()
        self.engine: Engine | None = None
        self.tuner: Tuner | None = None
        self.reranking = reranking.Reranking(self.metrics_registry)
        self.artifacts: ModelArtifacts | None = None
        self.choice = choice.Decision(settings)
        # The next measured variant to load, when the chosen one did not fit (``_load``), and
        # each refusal so far (the chosen one's advice is said if none fits).
        self._fallback: choice.Decision | None = None
        self._refusals: list[tuple[str, DoesNotFit]] = []
        self.fatal_error: BaseException | None = None
        self.on_fatal = on_fatal
        self._ready = threading.Event()
        # Set on the event loop when loading ends (ready or failed) or a stop begins: what
        # requests held while loading wait for (``until_ready``).
        self._settled: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        # SIGTERM came: /health says draining (503), seen only by a request already on an open
        # connection (the listener closes at once: docs/deployment.md, "Stopping a pod").
        self._draining = False
        self._loader: threading.Thread | None = None
        self._abort_timer: asyncio.TimerHandle | None = None
        # Reliability (issue 22): admission before tokenizing with Retry-After from the drain
        # rate (admission.py), chunks measured against the cost model (tuning/audit.py), the
        # canary of /health/deep (canary.py). Wired in _load once the engine exists.
        self.drain = DrainMeter()
        self.audit = WorkspaceAudit()
        self.admission: Admission | None = None
        self.deep: canary.DeepHealth | None = None
        self._reprobe: Callable[[], bool] = lambda: False

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Begin loading in the background; returns at once."""
        self._loop, self._settled = asyncio.get_running_loop(), asyncio.Event()
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
        # Once more for each measured variant the memory could not take (``_load_once``): out
        # of the handler that refused, so the refused attempt's engine is gone before the next
        # one loads (its memory would read as the next one's).
        try:
            while self._load_once():
                pass
        finally:
            self._settle()

    def _settle(self) -> None:
        """Wake the requests held while loading (from any thread)."""
        loop, settled = self._loop, self._settled
        if loop is None or settled is None:
            return  # load_blocking: nothing is held
        try:
            loop.call_soon_threadsafe(settled.set)
        except RuntimeError:  # the loop closed first: nothing waits any more
            pass

    async def until_ready(self, seconds: float | None = None) -> None:
        """While the model loads, wait up to ``seconds`` (``LOADING_HOLD_S``) for the load to
        end or a stop to begin; returns at once otherwise. The caller goes on either way."""
        settled = self._settled
        if settled is None or settled.is_set():
            return
        try:
            await asyncio.wait_for(settled.wait(), LOADING_HOLD_S if seconds is None else seconds)
        except TimeoutError:
            pass

    def _load_once(self) -> bool:
        """One attempt at the start: True where the chosen variant did not fit the memory and
        the next measured one is to be loaded (``_fallback``)."""
        engine: Engine | None = None
        try:
            # Runtime, provider and variant decided, GPUs counted (a no-op if the CLI did it).
            s = self.settings = plan.resolve(self.settings)
            cache_dir = validate_cache_dir(  # a local model runs without a cache (warning)
                s.cache_dir, required=s.model_path is None or s.execution_provider == "tensorrt")
            if self._fallback is None:
                s = self.settings = self.preparation.apply(s, cache_dir)
                # Neither BGE_M3_EP nor BGE_M3_MODEL set: the fastest variant measured here
                # (cached).
                self.choice = choice.decide(s, cache_dir, stop=self._stopping,
                                            on_step=self.progress.step)
            else:  # the measured choice did not fit the memory: the next fastest (_load's end)
                self.choice, self._fallback = self._fallback, None
            s = self.settings = self.choice.settings
            if self._stopping.is_set():  # stopped mid-preparation (or choice): loading a graph
                log.info("start-up stopped: the server is shutting down")  # only delays exit
                return False
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
                            on_chunk=self._on_chunk)
            chunks = serving.engine.scheduler
            log.info("chunks: up to %d texts and %s padded tokens per run, lengths rounded up "
                     "to a multiple of %d, cross-request batching %s", chunks.max_chunk,
                     chunks.max_chunk_tokens or "unlimited", chunks.pad_multiple,
                     "on" if chunks.cross_request else "off")
            self.tuner = tuner = Tuner(serving.tuning, apply=engine.set_cost_model,
                                       apply_chunk_tokens=engine.set_max_chunk_tokens,
                                       apply_run_cost=engine.set_run_cost)
            tuner.detect_memory()

            deep = canary.DeepHealth(lambda: engine.await_job(canary.canary_job(
                engine, "health-deep")), fp32=artifacts.variant == "fp32", busy=self.drain.recent,
                progressing=lambda deadline_s: canary.progressing(
                    engine.running(), self.drain.rate(), deadline_s))

            def load() -> None:
                engine.start()
                # The canary primes every output (no request deadline, no batch window to
                # wait past it) and is what /health/deep compares with.
                ready = canary.prime(engine)
                assert ready.dense is not None
                engine.width = int(ready.dense.shape[1])  # what the graph gives is the truth
                deep.record(ready)

            model_bytes = sum(p.stat().st_size for p in (artifacts.onnx_path,
                                                          *artifacts.external_data))
            copies = runtime.weight_copies(serving.runtime, s.workers)
            resident = int(model_bytes * copies
                           * runtime.get(serving.runtime).resident_factor(artifacts.variant))
            tuner.check_room(resident, model_bytes * copies, lambda: choice.smaller_variants(
                s, artifacts.variant, resident // copies))
            model_cost = measure_model_cost(
                load, s.workers, model_bytes, copies=copies)
            if s.rerank_model_aliases and not reranking.configured(s):
                log.warning("BGE_M3_RERANK_MODEL_ALIASES names a reranker, but none is loaded "
                            "(BGE_M3_RERANK_MODEL_PATH / BGE_M3_RERANK unset): requests naming "
                            "%s get a 404", ", ".join(s.rerank_model_aliases))
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
                cost = tuner.initial(model_cost, fingerprint, parts)
                first = tuner.state.probe_mode == "in_process"
            except UnmeasuredFloor as exc:
                # The conservative estimate is far above what shapes really cost (2.5x for
                # bge-m3 int8 at 8,192 tokens): measure before refusing.
                log.warning("%s. Measuring with the probe before deciding", exc.message.split(
                    ". ")[0])
                first = True
            if first:  # on the serving session, before anything is served
                # Minutes at full size: /health said "loading the model", progress 0.
                self.progress.step("measuring what texts cost in memory (the probe, on "
                                   "the serving session, before serving)")
                tuner.measure_first(probe_source(engine, spec, in_process=True), model_cost,
                                    fingerprint, parts)
                cost = tuner.initial(model_cost, fingerprint, parts)  # refuses if still too short
            self.audit = WorkspaceAudit(self._predict, on_breach=self._on_breach)
            engine.set_audit(self.audit)
            self._reprobe = lambda: tuner.reprobe(probe_source(engine, spec, in_process=False),
                                                  model_cost, fingerprint, parts)
            colbert = engine.config.max_colbert_bytes
            self.admission = Admission(
                engine, s.max_queue_tokens, self.drain, slots=service_info.tokenizing_slots(),
                outputs=None if colbert is None else outputs.OutputAllowance(colbert),
                deadline_s=s.request_timeout_secs or None)
            self.deep = deep
            self.engine = engine
            self.progress.done()
            choice.keep(self.choice, cache_dir)  # a fallback that serves: the next start's
            # What the start made (modules, sessions' metadata, the tokenizer) lives as long as
            # the process: out of the collector's sight, a full collection walks only what was
            # made since. On the tiny model the first burst of requests after a start ran one
            # of 39 ms on the event loop (docs/reliability.md §3).
            gc.collect()
            gc.freeze()
            self._ready.set()
            self._settle()
            # The memory's bound, said beside the configured one: "texts up to 274988 tokens
            # fit" read as the cap on a server that cuts texts at 8,192.
            log.info("ready: probe %s, c=%.0f a=%.0f b=%.2f, %d MiB workspace per worker: the "
                     "memory fits one text of up to %d tokens; texts are cut at %d "
                     "(BGE_M3_MAX_SEQ_LENGTH)", tuner.state.probe_status, cost.c, cost.a, cost.b,
                     cost.max_workspace_bytes >> 20, cost.max_seq(), engine.config.max_seq)
            if tuner.state.probe_status == "running":  # then the reranker's: one at a time
                tuner.start_probe(probe_source(engine, spec, in_process=False), model_cost,
                                  fingerprint, parts, on_done=self.reranking.start_probe)
            else:
                self.reranking.start_probe()
        except BaseException as exc:  # start-up failures are reported, not raised on a thread
            if engine is not None and self.engine is None:
                # Sessions may be loaded (e.g. the memory floor refused after loading): release
                # them and their worker threads; stop() only closes a published engine.
                engine.close(5.0)
            # A measured choice that does not fit here (the fastest in a 2.5 GiB container was
            # bf16, which OpenVINO holds in more memory than int8): the next fastest measured,
            # kept for the next start too, not a refusal at every start.
            if isinstance(exc, DoesNotFit) and not self._stopping.is_set():
                self._refusals.append((self.settings.variant, exc))
                self._fallback = choice.without(self.choice, self.settings.variant, exc.message)
                if self._fallback is not None:
                    self.reranking.close(5.0)  # loaded again beside the next one
                    return True
                exc = _first_refusal(self._refusals)
            log.error("start-up failed: %s", exc, exc_info=not isinstance(exc, BgeServeError))
            self.fatal_error = exc
            if self.on_fatal is not None:
                self.on_fatal(exc)
        return False

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
            fields["workspace_audit"] = self.audit.summary()
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
        self._settle()
        for engine in self._engines():
            engine.flush()
        if self.settings.shutdown_timeout_secs:  # 0: no bound, everything is finished
            loop = asyncio.get_running_loop()
            self._abort_timer = loop.call_later(self.settings.shutdown_timeout_secs,
                                                self._abort_waiting)

    def _engines(self) -> list[Engine]:
        """bge-m3's engine and the reranker's, those that exist."""
        return [e for e in (self.engine, self.reranking.engine) if e is not None]

    def stop_now(self) -> None:
        """A second Ctrl-C: whatever is still in progress is answered 503 now."""
        self._draining = True
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        self._abort_waiting(forced=True)

    def _abort_waiting(self, forced: bool = False) -> None:
        # The reranker's too: a rerank request still queued when the HTTP server's own grace
        # ran out was cancelled, a plain-text 500 instead of this JSON 503.
        why = ("was stopped at once (a second Ctrl-C) before this request finished" if forced else
               "is shutting down and this request did not finish within "
               "BGE_M3_SHUTDOWN_TIMEOUT_SECS")
        error = NotReady(f"the server {why}; retry (another instance will answer)")
        answered = sum(engine.abort(error) for engine in self._engines())
        for admission in (self.admission, self.reranking.admission):  # and those still
            if admission is not None:  # waiting to tokenize
                answered += admission.abort(error)
        if answered:
            log.warning("shutdown: %d requests were still waiting %s and were answered 503",
                        answered, "at the forced stop" if forced else
                        f"after {self.settings.shutdown_timeout_secs:g}s")

    async def stop(self) -> None:
        """Drain in-flight work (bounded by BGE_M3_SHUTDOWN_TIMEOUT_SECS) and unload."""
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        self._stopping.set()
        self._settle()
        # A preparation still running (stopped mid-start) lives in processes of its own.
        await asyncio.to_thread(self.preparation.stop)
        if self.tuner is not None:
            self.tuner.stop()
        await asyncio.to_thread(self.reranking.close, self.settings.shutdown_timeout_secs or None)
        if self.admission is not None:
            self.admission.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close,
                                    self.settings.shutdown_timeout_secs or None)

    # -- use-cases -------------------------------------------------------------------------
    def _engine(self) -> Engine:
        if self.engine is None or not self._ready.is_set():
            if self.fatal_error is not None:
                raise NotReady(f"the model failed to load: {self.fatal_error}")
            raise NotReady("the model is still loading; retry shortly",
                           retry_after=LOADING_RETRY_S)
        return self.engine

    async def embed(self, inputs: Inputs, options: EmbedOptions, *,
                    request_id: str = "", left: bool = False) -> Embeddings:
        """Embed one request's inputs (texts or token ids) in input order; ``left``: texts
        over max_seq cut from the left first (TEI's ``truncation_direction: left``), inside
        the request's deadline."""
        engine = self._engine()
        admission = self.admission
        assert admission is not None
        started = time.perf_counter()
        arrived = time.monotonic()  # the deadline counts tokenizing too (job.deadline)

        characters = 0  # only counted for a request whose answer says it (timings)
        if timings.active():
            characters = (len(inputs) if isinstance(inputs, str)
                          else sum(len(x) for x in inputs if isinstance(x, str)))

        made: list[Job] = []  # its job, once tokenized: what a 504 says of its progress

        async def run() -> Embeddings:
            nonlocal inputs
            cut = None
            if left:
                cut = await self.truncate_left(cast(Sequence[str], inputs))
                inputs = cast(Inputs, cut.ids)  # int64 arrays: sequences of ids
            job, future = await admission.submit(inputs, options, request_id, arrived)
            made.append(job)
            queued = time.monotonic()
            result = await engine.await_job(job, future)
            if cut is not None:  # the ids ran whole: the texts they were cut from say it
                result.truncated |= cut.truncated
            if timings.active():
                timings.record(characters, result.prompt_tokens, arrived, queued, [job],
                               time.monotonic())
            return result

        # Around the admission too: a request waiting for a tokenizing slot behind big ones
        # got its 504 only once tokenized (20 requests of 23 MiB against a 2 s deadline:
        # 3.4-24 s). One being tokenized stops at its next group of texts and answers when its
        # thread ends (bgeserve.stopping; its memory stays accounted until then:
        # Admission.on_thread).
        # Its ColBERT output's room is held until the answer is sent: the HTTP layer's scope
        # (guards.InflightLimit) outlives this one; a library caller's ends here.
        def late(timeout: float) -> str:
            return where_late(made, self.drain, attention_tokens(engine), timeout)

        try:
            with holds.answering():
                result = await self._within_deadline(run(), late)
        except (asyncio.CancelledError, DeadlineExceeded):
            if not made:  # its texts never reached the scheduler, which counts the others
                self.metrics_registry.dropped_before_queued(
                    1 if isinstance(inputs, str) else len(inputs))
            raise
        self.metrics_registry.observe_request(result, time.perf_counter() - started)
        return result

    async def rerank(self, query: str, documents: list[str], options: RerankOptions, *,
                     request_id: str = "") -> RerankResult:
        """Score ``documents`` against ``query``: the reranker's, or bge-m3's own scores."""
        engine = self._engine()
        assert self.admission is not None
        return await self.reranking.rerank(engine, self.admission, query, documents, options,
                                           self.settings.request_timeout_secs or None,
                                           request_id)

    @property
    def compute_type(self) -> str:
        """What runs the model, as TEI's ``x-compute-type`` header says it: cpu or gpu."""
        return "gpu" if runtime.on_gpu(self.settings.execution_provider) else "cpu"

    def rerank_model_ids(self) -> tuple[str, ...]:
        """The ids ``model`` may name for the reranker (none when none is loaded)."""
        return self.reranking.model_ids

    async def deep_health(self, deadline_s: float | None = None) -> tuple[int, dict[str, Any]]:
        """``GET /health/deep``: the canary through queue, session and heads (canary.py)."""
        if self.deep is None or not self._ready.is_set():
            return 503, {"status": "fail" if self.fatal_error else "loading",
                         "reason": str(self.fatal_error or "the model is still loading")}
        stats = self.engine.stats() if self.engine is not None else None
        if stats is not None and stats.get("idle_unloaded") == stats["total"]:
            # Unloaded after BGE_M3_IDLE_TIMEOUT_SECS: a probe loading it again every period
            # kept it loaded for good (a liveness probe is the documented use).
            return 200, {"status": "idle", "reason": "the sessions are unloaded while idle "
                         "(BGE_M3_IDLE_TIMEOUT_SECS); the next request loads them"}
        return await self.deep.check(deadline_s=deadline_s)

    def refuse_now(self) -> Overloaded | None:
        """The 429 when the queue has no room whatever a request holds (O(1): the HTTP layer
        asks before reading the body); None otherwise, and before the model is loaded."""
        return None if self.admission is None else self.admission.refuse_now()

    @property
    def rejected_at_admission(self) -> int:
        """429s decided before tokenizing, bge-m3's and the reranker's (their schedulers
        count the others)."""
        return (0 if self.admission is None else self.admission.refused) + self.reranking.refused

    def _on_chunk(self, stats: ChunkStats) -> None:
        self.metrics_registry.observe_chunk(stats)
        self.drain.record(stats.real_tokens, stats.seconds, stats.squares, stats.solo)

    def _predict(self, batch: int, seq: int) -> float | None:
        cost = None if self.engine is None else self.engine.cost_model
        return None if cost is None else cost.cost(batch, seq)

    def _on_breach(self, sample: AuditSample) -> None:
        if not self._reprobe():
            log.info("no re-probe: the cost model is pinned, or a probe is running already")

    def dense_width(self) -> int:
        """The loaded model's vector width (1,024 for bge-m3)."""
        return self._engine().width

    def vocab_size(self) -> int:
        """The loaded tokenizer's vocabulary size: token ids are below it."""
        return self._engine().tokenizer.vocab_size

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings for token ids (sparse_format=tokens)."""
        return self._engine().tokenizer.id_to_token(ids)

    # -- TEI's text tools: bgeserve/service/tokens.py and info.py -------------------------------
    async def tokenize(self, texts: Sequence[str],
                       add_special_tokens: bool = True) -> Sequence[Sequence[Token]]:
        """Every token of each text with UTF-8 byte offsets (TEI's ``/tokenize``)."""
        return await self._within_deadline(tokens.tokenize(
            self._engine(), texts, add_special_tokens, self._tokenizing))

    async def decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = True) -> list[str]:
        """The text of each id sequence (TEI's ``/decode``)."""
        return await self._within_deadline(tokens.decode(
            self._engine(), sequences, skip_special_tokens, self._tokenizing))

    async def truncate_left(self, texts: Sequence[str]) -> Encoded:
        """Token ids of each text cut from the left past max_seq, and which were (then
        ``embed`` them)."""
        return await tokens.truncate_left(self._engine(), texts, self._tokenizing)

    async def _within_deadline(self, work: Awaitable[T],
                               late: Callable[[float], str] | None = None) -> T:
        """``work`` bounded by BGE_M3_REQUEST_TIMEOUT_SECS, a 504 counted once past it (embed;
        /tokenize and /decode, which wait for a tokenizing slot too), saying ``late(timeout)``
        (where the request was). Not wait_for: its task would submit an embedding's job one
        loop iteration later."""
        timeout = self.settings.request_timeout_secs or None
        try:
            async with asyncio.timeout(timeout):
                return await work
        except (TimeoutError, DeadlineExceeded):  # our timer, or the scheduler's expiry
            self.metrics_registry.deadline_exceeded()
            where = "" if late is None or timeout is None else f": {late(timeout)}"
            raise DeadlineExceeded(
                f"the request did not finish within BGE_M3_REQUEST_TIMEOUT_SECS={timeout:g}s"
                f"{where}") from None

    async def _tokenizing(self, work: Callable[[], Any]) -> Any:
        """``work`` on a thread in one of the admission's tokenizing slots."""
        assert self.admission is not None
        return await self.admission.on_thread(work)

    def info(self) -> ModelInfo:
        """The served model and its limits (TEI's ``GET /info``)."""
        return service_info.model_info(self)

    def reranker_info(self) -> ModelInfo:
        """What rerank requests are scored with, and its limits (``GET /reranker/info``)."""
        return service_info.reranker_info(self)

    def health(self) -> dict[str, Any]:
        """Readiness and the facts operators look for (``service/health.py``)."""
        return health.report(self)

    def metrics(self) -> tuple[bytes, str]:
        """Prometheus exposition of the server's metrics."""
        self.metrics_registry.update_state(self)
        return self.metrics_registry.render()


def build_service(settings: Settings) -> Service:
    """The factory ``create_app`` uses."""
    return Service(settings)


def _first_refusal(refusals: list[tuple[str, DoesNotFit]]) -> DoesNotFit:
    """The chosen variant's refusal, saying which others were tried and why they did not fit
    either (its advice may name them)."""
    first = refusals[0][1]
    if len(refusals) == 1:
        return first
    tried = "; ".join(f"{variant}: {exc.message.split('. ')[0]}" for variant, exc in refusals[1:])
    return DoesNotFit(f"{first.message}. Tried too, and did not fit either: {tried}",
                      param=first.param)
