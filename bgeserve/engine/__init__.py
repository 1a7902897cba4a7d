"""``Engine``: bge-m3 embeddings in-process — the Python API and the server's core.

tokenize once (no padding) → admission against the memory budget → the scheduler packs texts
from every caller into length-sorted chunks under the cost model → ``session.run`` on a worker
thread → heads → results in input order. The sync ``embed`` and async ``aembed`` share one
queue, so concurrent callers are batched together.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from queue import SimpleQueue  # not ``import queue``: the package's engine/queue.py shadows it
from typing import NoReturn, Self

import numpy as np

from bgeserve import runtime
from bgeserve.engine import cache as cache_rules
from bgeserve.engine.cache import EmbeddingCache
from bgeserve.engine.forward import forward_factory
from bgeserve.engine.inputs import Inputs, normalize_inputs, rerank_inputs
from bgeserve.engine.jobs import Job, answer
from bgeserve.engine.names import SettingNames
from bgeserve.engine.scheduler import ChunkStats, Scheduler, SchedulerConfig
from bgeserve.engine.tokenizer import Encoded, Tokenizer
from bgeserve.engine.workers import Running
from bgeserve.errors import BgeServeError, NotReady, TooLarge
from bgeserve.model import dims
from bgeserve.model.artifacts import ModelArtifacts, resolve
from bgeserve.results import Embeddings, EmbedOptions, RerankOptions, RerankResult
from bgeserve.runtime.session import SessionConfig
from bgeserve.tuning import memory
from bgeserve.tuning.audit import WorkspaceAudit
from bgeserve.tuning.budget import budget
from bgeserve.tuning.costmodel import CostModel, conservative_coefficients
from bgeserve.tuning.runcost import RunCost

__all__ = ["Engine", "EngineConfig", "Inputs", "normalize_inputs"]
log = logging.getLogger("bgeserve.engine")


def check_model_path(model_path: str | Path | None) -> None:
    """Refuse an empty path: it read as None, the hub's model, so ``Engine(os.getenv("DIR",
    ""))`` would download gigabytes into the Hugging Face cache (QA)."""
    if model_path is not None and not str(model_path).strip():
        raise ValueError("model_path is empty: give the folder of an export or snapshot, or "
                         "None for the hub's model")


_RELEASES: SimpleQueue[Scheduler] = SimpleQueue()
_releaser: threading.Thread | None = None


def release(scheduler: Scheduler) -> None:
    """A collected engine's scheduler, handed to the releaser thread (weakref.finalize). Only
    a put here: a collection runs wherever an allocation happens, any lock held (starting a
    thread from it could wait on one its own thread holds), maybe on one of that scheduler's
    workers (which cannot join itself). SimpleQueue.put is safe in a weakref callback."""
    _RELEASES.put(scheduler)


def _release_forever() -> None:
    while True:
        scheduler = _RELEASES.get()
        if scheduler.forked():  # a copy inherited by a forked child: its threads are not here
            continue
        try:
            scheduler.stop()
        except Exception:  # one failing must not end the thread that stops the others
            log.exception("releasing a collected engine's sessions failed")


def _start_releaser() -> None:
    """The thread that stops the schedulers of collected engines: started with the first
    engine of a process (a forked child starts its own)."""
    global _releaser
    if _releaser is None or not _releaser.is_alive():
        _releaser = threading.Thread(target=_release_forever, name="bgeserve-release",
                                     daemon=True)
        _releaser.start()


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model files (plain values, no env reads)."""

    max_seq: int = 8192
    session: SessionConfig = field(default_factory=SessionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    request_timeout_s: float | None = None
    # ColBERT vectors are (tokens - 1) x hidden float32 per text: 256 texts of 8,192 tokens are
    # 8 GiB before any JSON, outside every memory budget. A request past this is refused.
    max_colbert_bytes: int | None = 512 << 20
    # Embeddings of texts seen before (engine/cache.py; 0 = none). Used only where a cached
    # vector equals a fresh one (``cache.applies``: not for int8 unless texts run alone).
    cache_bytes: int = 128 << 20
    # The longest text tokenized whole (None: any). A longer one is embedded only where
    # truncation makes its leading words enough (Tokenizer.encode); else it is TooLarge.
    max_text_chars: int | None = None
    # What errors tell the caller to change (the server: its environment variables).
    names: SettingNames = field(default_factory=SettingNames)


class Engine:
    """bge-m3 dense / sparse / ColBERT embeddings from an ONNX model.

    ``Engine(model_path=..., variant=...)`` opens a local export or hub snapshot (None: the
    hub's, through huggingface_hub into the Hugging Face cache). Use it as a context manager,
    or call ``close()``; one dropped without either releases its model when it is collected.
    One process's Engine serves that process only: create one in each (after a fork too).
    """

    def __init__(self, model_path: str | Path | None = None, variant: str = "fp32", *,
                 config: EngineConfig | None = None, artifacts: ModelArtifacts | None = None,
                 cache_dir: str | Path | None = None, offline: bool = False,
                 cost_model: CostModel | None = None, auto_budget: bool = True,
                 start: bool = True,
                 on_chunk: Callable[[ChunkStats], None] | None = None):
        if artifacts is None:
            cache = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "bgeserve"
            check_model_path(model_path)
            artifacts = resolve(model_path=Path(model_path) if model_path is not None else None,
                                variant=variant, cache_dir=cache, offline=offline)
        self.artifacts = artifacts
        self.width = dims.width(artifacts)  # dense and ColBERT vectors' floats
        if config is None:
            # No config given: chunk as the server does, by the runtime's measured best.
            config = EngineConfig()
            rt = runtime.get(runtime.kind_of(artifacts, config.session.provider))
            config = replace(config, scheduler=replace(
                config.scheduler, max_chunk_tokens=rt.chunk_tokens, pad_multiple=rt.pad_multiple))
        config = replace(config, max_seq=dims.clamp_max_seq(config.max_seq, artifacts))
        if config.scheduler.pad_cap is None:  # rounding never pads a chunk past max_seq
            config = replace(config, scheduler=replace(config.scheduler, pad_cap=config.max_seq))
        self.config = config
        self.tokenizer = Tokenizer.load(artifacts.tokenizer_path, self.config.max_seq,
                                        self.config.max_text_chars,
                                        self.config.names.max_text_chars)
        self.open_forward = forward_factory(artifacts, self.config.session)
        # A plain Engine (no server, no probe) still never runs a chunk past the memory it has:
        # conservative coefficients under a budget measured at start (see tuning / the probe).
        self._auto_budget = auto_budget and cost_model is None
        self._scheduler = Scheduler(self.open_forward, cost_model, self.config.scheduler,
                                    on_chunk=on_chunk)
        # Dropped without close(): its threads hold the scheduler, not the engine, so the
        # engine is collected while its sessions (a full-size model's ~1.8 GiB) stayed loaded
        # for good (QA: 30 dropped engines, 31 threads). Not at exit: _end_runs_at_exit is.
        _start_releaser()
        self._release = weakref.finalize(self, release, self._scheduler)
        self._release.atexit = False
        self.cache = self._make_cache(artifacts, self.config)
        self._started = False
        self._closed = False
        if start:
            self.start()

    def __reduce__(self) -> NoReturn:
        # A pickled Engine would be its sessions and threads: refused with what to do instead
        # (a spawned Process given one failed on "Can't pickle local object", QA).
        raise TypeError("an Engine holds loaded sessions and worker threads and cannot be "
                        "pickled: create an Engine in each process (pass it the model path)")

    @staticmethod
    def _make_cache(artifacts: ModelArtifacts, config: EngineConfig) -> EmbeddingCache | None:
        sched = config.scheduler
        if config.cache_bytes <= 0:
            return None
        if not cache_rules.applies(artifacts.variant, sched.max_chunk, sched.pad_multiple):
            log.info("embedding cache off: %s results move with their batch-mates (set %s to "
                     "run texts alone and cache them)", artifacts.variant, config.names.max_chunk)
            return None
        # One cache never answers for another model: its files, variant and layout name it.
        namespace = f"{artifacts.identity()}|{artifacts.variant}|{artifacts.layout.value}"
        return EmbeddingCache(config.cache_bytes, namespace)

    @property
    def reserved_bytes(self) -> int:
        """Memory held outside the workspace budget: the embedding cache's limit."""
        return self.cache.max_bytes if self.cache is not None else 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Load every worker's session and start the workers."""
        if self._closed:  # its scheduler has stopped for good: no half-working restart
            raise NotReady("this Engine was closed; create a new one")
        if not self._started:
            if self._auto_budget:
                available = memory.detect_available_memory()
                before = memory.rss_bytes()
            self._scheduler.start(preload=True)
            self._started = True
            if self._auto_budget:
                self._auto_budget = False
                workers = self.config.scheduler.workers
                model_cost = max(0, memory.rss_bytes() - before) // workers
                a, b = conservative_coefficients(**dims.model_dims(self.artifacts))
                free = available.available_bytes - self.reserved_bytes
                self.set_cost_model(CostModel(a, b, budget(free, workers, model_cost)))

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued work (bounded by ``timeout``; None: all of it) and release the
        sessions."""
        self._closed = True
        self._release.detach()
        if self._started:
            self._scheduler.stop(timeout)
            self._started = False
        if self.cache is not None:  # its vectors serve nobody now (QA: ~100 MiB kept)
            self.cache.clear()

    def unload(self) -> None:
        """Release every worker's session now (their memory back to the OS); the next chunk
        opens them again, as after an idle unload."""
        self._scheduler.unload()

    def flush(self) -> None:
        """Run what is queued at once, without waiting out the batch window."""
        self._scheduler.flush()

    def abort(self, error: BgeServeError) -> int:
        """Answer every waiting job with ``error`` and take no more work (see Scheduler.abort)."""
        return self._scheduler.abort(error)

    def __enter__(self) -> Self:
        if self._closed:
            raise NotReady("this Engine was closed; create a new one")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory ----------------------------------------------------------------------------
    @property
    def cost_model(self) -> CostModel | None:
        """The cost model chunks are packed under (None: no memory limit is applied)."""
        cost = self._scheduler.packer.cost
        return cost if isinstance(cost, CostModel) or cost is None else None

    def set_cost_model(self, cost: CostModel | None) -> None:
        """Swap the cost model (atomic: the next chunk uses it)."""
        self._scheduler.packer.set_cost(cost)

    def set_audit(self, audit: WorkspaceAudit | None) -> None:
        """Measure sampled chunks against the cost model (``tuning.audit``) from now on."""
        self._scheduler.audit = audit

    def set_max_chunk_tokens(self, tokens: int) -> None:
        """Change the padded tokens per run (the probe's timing may choose another budget)."""
        self._scheduler.packer.set_chunk_tokens(tokens)

    def set_run_cost(self, cost: RunCost | None) -> None:
        """Pad chunks only where it costs less than a run (the probe measures the cost)."""
        self._scheduler.packer.set_run_cost(cost)

    @property
    def run_cost(self) -> RunCost | None:
        """What the packer takes a run to cost (None: it pads up to ``min_fill``)."""
        return self._scheduler.packer.rules.run_cost

    @property
    def max_chunk_tokens(self) -> int | None:
        """Padded tokens per run now (the configured value until the tuner chooses another)."""
        return self._scheduler.packer.rules.max_tokens

    # -- embedding -------------------------------------------------------------------------
    def encode_inputs(self, inputs: Inputs) -> Encoded:
        """Tokenize strings, or validate and wrap token-id lists."""
        texts, ids = normalize_inputs(inputs)
        return self.tokenizer.encode(texts) if texts is not None else self.tokenizer.from_ids(
            ids or [])

    def colbert_bytes(self, ids: Sequence[np.ndarray]) -> int:
        """The float32 size of the ColBERT vectors of texts tokenized as ``ids`` (one per
        token after the first)."""
        return (sum(len(x) for x in ids) - len(ids)) * self.width * 4

    def admit(self, encoded: Encoded, truncate: bool, colbert: bool = False) -> None:
        """Refuse texts over ``max_seq`` (when not truncating) or over the memory budget, and
        ColBERT output over ``max_colbert_bytes``."""
        limit = self.config.max_colbert_bytes
        if colbert and limit is not None:
            size = self.colbert_bytes(encoded.ids)
            rows = size // (self.width * 4)
            if size > limit:
                raise TooLarge(
                    f"the ColBERT output of this request would be {size / 2**20:.0f} MiB "
                    f"({rows} token vectors of {self.width} floats), over the "
                    f"{limit / 2**20:.0f} MiB allowed ({self.config.names.max_colbert}); send "
                    "fewer or shorter texts per request", param="outputs")
        if not truncate and encoded.truncated.any():
            i = int(np.argmax(encoded.truncated))
            raise TooLarge(
                f"input[{i}] has more than the {self.config.max_seq} tokens allowed "
                f"({self.config.names.max_seq}); send truncate=true "
                "or split the text", param=f"input[{i}]", code="too_many_tokens")
        cost, names = self.cost_model, self.config.names
        if cost is None:
            return
        for i, n in enumerate(encoded.lengths):
            if not cost.fits(1, int(n)):
                raise TooLarge(
                    f"input[{i}] has {int(n)} tokens, needing ~{cost.cost(1, int(n)) / 2**20:.0f}"
                    f" MiB of workspace; the budget per worker is "
                    f"{cost.max_workspace_bytes / 2**20:.0f} MiB (longest text that fits: "
                    f"{cost.max_seq()} tokens). Lower {names.max_seq}, reduce "
                    f"{names.workers}, or {names.more_memory}", param=f"input[{i}]")

    def make_job(self, inputs: Inputs, options: EmbedOptions, request_id: str = "",
                 arrived: float | None = None, *, solo: bool = False,
                 timed: bool = True) -> Job:
        """Tokenize and admit ``inputs``; the returned job is ready to submit. Its deadline
        (``request_timeout_s``) counts from ``arrived`` (monotonic; default now), so the time
        spent tokenizing counts too; ``timed=False``: none (the server's own start-up and
        canary jobs). ``solo``: its texts run in chunks of their own."""
        start = time.monotonic() if arrived is None else arrived
        self._scheduler.check_process()  # before the cache's lock, which a fork may have held
        encoded = self.encode_inputs(inputs)
        self.admit(encoded, options.truncate, options.colbert)
        timeout = self.config.request_timeout_s if timed else None
        deadline = start + timeout if timeout else None
        job = Job(encoded.ids, encoded.truncated, options, deadline, request_id, solo=solo)
        if options.dense and not encoded.ids:  # no chunk will size it: (0, width), not None
            job.dense = np.empty((0, self.width), dtype=np.float32)
        if not solo:  # a canary (solo) must run, never be a hit
            # Without a cache too: a repeat run in another chunk (other batch-mates) came back
            # apart, by ~0.0165 on int8, which has no cache by default.
            job.reuse(self.cache)
        return job

    def submit(self, job: Job) -> Future:
        """Queue a job; returns its concurrent future (already answered when the cache held
        every text)."""
        if not self._started:
            raise NotReady("this Engine was closed; create a new one" if self._closed else
                           "the engine is not started; call start()")
        if job.ids and job.remaining == 0:  # nothing to run: never touches the queue
            job.done = True
            answer(job.future, result=job.result())
            return job.future
        return self._scheduler.submit(job)

    def embed(self, inputs: Inputs, dense: bool = True, sparse: bool = False,
              colbert: bool = False, truncate: bool = True) -> Embeddings:
        """Embed ``inputs`` (blocking). See ``Embeddings`` for the result fields."""
        job = self.make_job(inputs, EmbedOptions(dense, sparse, colbert, truncate))
        future = self.submit(job)
        try:
            return future.result()
        except BaseException:
            self._scheduler.cancel(job)
            raise

    async def aembed(self, inputs: Inputs, dense: bool = True, sparse: bool = False,
                     colbert: bool = False, truncate: bool = True,
                     request_id: str = "") -> Embeddings:
        """Async ``embed``: tokenization off the event loop; cancellation drops queued texts."""
        options = EmbedOptions(dense, sparse, colbert, truncate)
        job = await asyncio.to_thread(self.make_job, inputs, options, request_id)
        return await self.await_job(job)

    def cancel(self, job: Job) -> None:
        """Drop a job's texts that have not started (its caller gave up)."""
        self._scheduler.cancel(job)

    def rerank(self, query: str, documents: list[str], *, mode: str = "hybrid",
               weights: tuple[float, float, float] = (0.4, 0.2, 0.4),
               long_documents: str = "max") -> RerankResult:
        """bge-m3's own relevance scores of ``documents`` for ``query`` (blocking): ``mode``
        dense | sparse | colbert | sparse+dense | hybrid, combined with ``weights`` [dense,
        sparse, colbert] as FlagEmbedding's compute_score does, the query embedded once
        (``engine/m3rerank.py``). A cross-encoder is ``bgeserve.Reranker``."""
        from bgeserve.engine.m3rerank import rerank_m3

        return rerank_m3(self, query, rerank_inputs(query, documents), RerankOptions(
            mode=mode, weights=weights, long_documents=long_documents))

    async def arerank(self, query: str, documents: list[str], *, mode: str = "hybrid",
                      weights: tuple[float, float, float] = (0.4, 0.2, 0.4),
                      long_documents: str = "max") -> RerankResult:
        """Async ``rerank``."""
        from bgeserve.engine.m3rerank import arerank_m3

        return await arerank_m3(self, query, rerank_inputs(query, documents), RerankOptions(
            mode=mode, weights=weights, long_documents=long_documents))

    async def await_job(self, job: Job, future: Future | None = None) -> Embeddings:
        """Submit ``job`` (unless ``future``, its submission, is given) and wait for it; a
        cancelled waiter drops the job's pending texts."""
        future = self.submit(job) if future is None else future
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._scheduler.cancel(job)
            raise

    # -- state -----------------------------------------------------------------------------
    def queued_tokens(self) -> int:
        """Tokens waiting in the queue now (cheap: no lock, no other counts)."""
        return self._scheduler.queued_tokens()

    def waiting(self, job: Job) -> int:
        """How many of ``job``'s texts wait in the queue now (not running, not done)."""
        return self._scheduler.waiting(job)

    def queued_squares(self) -> int:
        """The sum of the waiting texts' lengths squared (as cheap as ``queued_tokens``)."""
        return self._scheduler.queued_squares()

    def stats(self) -> dict[str, int]:
        """Workers (total / live / loaded / busy) and the queue (texts, tokens)."""
        return self._scheduler.stats()

    def running(self) -> list[Running]:
        """Each chunk in progress: seconds it has run so far, its tokens, whether solo."""
        return self._scheduler.running()

    @property
    def counters(self):
        """Scheduler counters: rejected, cancelled_texts, deadline_exceeded, oom_splits."""
        return self._scheduler.counters

    def cache_stats(self) -> dict[str, int] | None:
        """The embedding cache's counters and size (``EmbeddingCache.stats``); None when
        there is no cache."""
        return None if self.cache is None else self.cache.stats()
