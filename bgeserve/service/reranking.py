"""The reranker beside bge-m3 in one server, and the rerank use-case.

With BGE_M3_RERANK_MODEL_PATH (or BGE_M3_RERANK=1) a cross-encoder loads on an ``Engine`` of
its own: its own sessions and workers, its own tuner (a probe fit cached under its own
fingerprint), its own budget. The two budgets share the machine: each model keeps its weights
and what both leave free is split (BGE_M3_RERANK_MEMORY_SHARE, ``budget.split_available``)
before either tuner decides, so together they never plan past the memory the process has.

A request names its scorer in ``model``: the reranker's id (the default when one is loaded) →
the cross-encoder; ``bge-m3`` (the default otherwise) → bge-m3's own scores (``m3rerank``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

from bgeserve import runtime, timings
from bgeserve.config import Settings
from bgeserve.engine import ChunkStats, Engine, m3rerank
from bgeserve.engine.jobs import Job
from bgeserve.engine.reranker import Reranker
from bgeserve.errors import ConfigError, DeadlineExceeded, InvalidInput
from bgeserve.model.rerank_artifacts import RERANK_MODEL_ID, RERANK_MODEL_IDS, resolve_reranker
from bgeserve.results import EmbedOptions, RerankOptions, RerankResult
from bgeserve.service import info, outputs, plan
from bgeserve.service.admission import (
    Admission,
    DrainMeter,
    PairAdmission,
    attention_tokens,
    where_late,
)
from bgeserve.service.metrics import Metrics
from bgeserve.service.probing import probe_source
from bgeserve.tuning import cache
from bgeserve.tuning.budget import measure_model_cost
from bgeserve.tuning.tuner import DoesNotFit, Tuner, UnmeasuredFloor

log = logging.getLogger("bgeserve.rerank")
PRIMING_PAIR = [0, 5, 2, 2, 6, 2]  # <s> a </s></s> b </s>: one tiny row primes the sessions
PROBE_CACHE_DIR = "reranker"  # under BGE_M3_CACHE_DIR
M3_ONLY = frozenset({"mode", "weights"})  # what only bge-m3's own scores read


def configured(settings: Settings) -> bool:
    """Whether a reranker is to be loaded beside bge-m3."""
    return settings.rerank_model_path is not None or settings.rerank


def reranker_settings(settings: Settings) -> Settings:
    """bge-m3's resolved settings as the reranker's engine takes them: its model, variant,
    pair length and workers; the CPU's ONNX Runtime unless its variant is OpenVINO's bf16."""
    s = settings
    provider = s.execution_provider
    if s.rerank_variant == "bf16":
        provider = "openvino"
    elif provider == "openvino":
        provider = "cpu"
    return dataclasses.replace(s, model_path=s.rerank_model_path, variant=s.rerank_variant,
                               max_seq_length=s.rerank_max_length,
                               workers=s.rerank_workers or s.workers,
                               execution_provider=provider, variant_choice="pinned")


class Reranking:
    """The reranker's engine, tuner and requests (``reranker`` None: bge-m3 scores alone)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.reranker: Reranker | None = None
        self.tuner: Tuner | None = None
        self.settings: Settings | None = None
        self.model_cost = 0
        # The reranker's own drain rate (its Retry-After) and admission before tokenizing.
        self.drain = DrainMeter()
        self.admission: PairAdmission | None = None
        self._probe: tuple[dict[str, Any], str, dict[str, Any]] | None = None

    @property
    def engine(self) -> Engine | None:
        return self.reranker.engine if self.reranker is not None else None

    @property
    def model_ids(self) -> tuple[str, ...]:
        """The ids ``model`` may name to get the cross-encoder (none when not loaded)."""
        if self.reranker is None:
            return ()
        aliases = self.settings.rerank_model_aliases if self.settings is not None else ()
        return tuple(dict.fromkeys((*RERANK_MODEL_IDS, *aliases)))

    # -- start-up --------------------------------------------------------------------------
    def load(self, settings: Settings, cache_dir: Path) -> int:
        """Open the reranker and load its sessions; returns its resident bytes (all workers).
        ``settings``: bge-m3's, resolved."""
        s = reranker_settings(settings)
        artifacts = resolve_reranker(model_path=s.model_path, variant=s.variant,
                                     cache_dir=cache_dir, offline=s.offline)
        serving = plan.for_model(s, artifacts, cache_dir)
        self.settings = s = serving.settings
        log.info("reranker: %s (%s layout, variant %s, %s), pairs up to %d tokens",
                 artifacts.source, artifacts.layout.value, artifacts.variant,
                 runtime.get(serving.runtime).version(), s.max_seq_length)
        engine = Engine(artifacts=artifacts, config=serving.engine, start=False,
                        auto_budget=False, on_chunk=self._on_chunk)
        # Its fit in a cache folder of its own, beside bge-m3's (each file's newest record is
        # the one an operator reads first).
        (cache_dir / PROBE_CACHE_DIR).mkdir(exist_ok=True)
        tuning = dataclasses.replace(serving.tuning, cache_dir=cache_dir / PROBE_CACHE_DIR,
                                     length_variable="BGE_M3_RERANK_MAX_LENGTH",
                                     workers_variable="BGE_M3_RERANK_WORKERS")
        self.tuner = Tuner(tuning, apply=engine.set_cost_model,
                           apply_chunk_tokens=engine.set_max_chunk_tokens,
                           apply_run_cost=engine.set_run_cost)
        self.reranker = Reranker(engine=engine, model_id=RERANK_MODEL_ID)
        self.admission = PairAdmission(self.reranker, s.max_queue_tokens, self.drain,
                                       slots=info.tokenizing_slots(),
                                       deadline_s=s.request_timeout_secs or None)

        def load() -> None:
            engine.start()
            # Solo and untimed, as bge-m3's canary: no batch window to wait out, no deadline.
            engine.submit(engine.make_job([PRIMING_PAIR], EmbedOptions(dense=True),
                                          "rerank-prime", solo=True, timed=False)).result()

        model_bytes = sum(p.stat().st_size for p in (artifacts.onnx_path,
                                                      *artifacts.external_data))
        self.model_cost = measure_model_cost(
            load, s.workers, model_bytes, copies=runtime.weight_copies(serving.runtime, s.workers))
        parts = {**plan.probe_parts(s, artifacts), "kind": "reranker"}
        spec = {"model_path": str(s.model_path) if s.model_path else None, "reranker": True,
                "variant": s.variant, "cache_dir": str(cache_dir),
                "provider": s.execution_provider, "threads": s.threads_per_worker,
                "max_seq": s.max_seq_length}
        self._probe = (spec, cache.fingerprint(parts), parts)
        return self.model_cost * s.workers

    def tune(self, available: int, source: str) -> None:
        """Choose the reranker's cost model within its part of the memory; like bge-m3's, an
        estimate that refuses is measured first, on its serving sessions."""
        assert self.tuner is not None and self.engine is not None and self._probe is not None
        spec, fingerprint, parts = self._probe
        self.tuner.share(available, source)
        try:
            try:
                cost = self.tuner.initial(self.model_cost, fingerprint, parts)
            except UnmeasuredFloor as exc:
                # On the serving sessions, as bge-m3's is when a second copy does not fit: a
                # probe child loading its own copy beside both models ran out of the room it
                # was measuring (full-size int8 pair in a 4 GiB cgroup: refused at start).
                log.warning("reranker: %s. Measuring on its serving sessions before deciding",
                            exc.message.split(". ")[0])
                self.tuner.measure_first(probe_source(self.engine, spec, in_process=True),
                                         self.model_cost, fingerprint, parts)
                cost = self.tuner.initial(self.model_cost, fingerprint, parts)
        except DoesNotFit as exc:
            # The reranker's own refusal: no reason to serve bge-m3 in another variant (the
            # service does that for a DoesNotFit of bge-m3's).
            raise ConfigError(exc.message, param=exc.param) from None
        log.info("reranker ready: probe %s, %d MiB workspace per worker, windows up to %d "
                 "tokens fit", self.tuner.state.probe_status, cost.max_workspace_bytes >> 20,
                 cost.max_seq())

    def start_probe(self) -> None:
        """The reranker's background probe, when its tuner wants one (after bge-m3's: one
        probe process at a time)."""
        if self.tuner is not None and self._probe is not None:
            spec, fingerprint, parts = self._probe
            self.tuner.start_probe(spec, self.model_cost, fingerprint, parts)

    def close(self, timeout: float | None) -> None:
        if self.tuner is not None:
            self.tuner.stop()
        if self.reranker is not None:
            self.reranker.close(timeout)
        if self.admission is not None:
            self.admission.close()

    def _on_chunk(self, stats: ChunkStats) -> None:
        self.drain.record(stats.real_tokens, stats.seconds, stats.squares, stats.solo)
        self.metrics.observe_reranker_chunk(stats)

    @property
    def refused(self) -> int:
        """429s decided by the reranker's admission (its scheduler counts its own)."""
        return 0 if self.admission is None else self.admission.refused

    # -- requests --------------------------------------------------------------------------
    def cross_encoder(self, model: str | None) -> bool:
        """Whether ``model`` (None: the default) is scored by the cross-encoder."""
        if self.reranker is None:
            return False
        return model is None or model in self.model_ids

    async def rerank(self, m3: Engine, m3_admission: Admission, query: str,
                     documents: list[str], options: RerankOptions, timeout: float | None,
                     request_id: str = "") -> RerankResult:
        """Score ``documents`` against ``query`` with the scorer ``options.model`` names
        (bge-m3's own scores queue on ``m3`` through ``m3_admission``)."""
        started = time.perf_counter()
        if self.cross_encoder(options.model):
            ignored = sorted(options.given & M3_ONLY)
            if ignored:  # it was dropped without a word
                raise InvalidInput(
                    f"{ignored[0]} applies to bge-m3's own scores; this request is scored by "
                    f"the cross-encoder {RERANK_MODEL_ID}. Send \"model\": \"bge-m3\" to use "
                    f"{ignored[0]}, or leave it out", param=ignored[0])
        made: list[Job] = []  # its jobs once tokenized: what a 504 says of its progress
        cross = self.cross_encoder(options.model)
        try:
            if cross:
                result = await self._cross(query, documents, options, timeout, request_id,
                                           made)
            else:
                result = await self._m3(m3, m3_admission, query, documents, options, timeout,
                                        request_id, made)
        except asyncio.CancelledError:  # the client gone
            if not made:  # as Service.embed: its documents never reached a scheduler
                self.metrics.dropped_before_queued(len(documents))
            raise
        except (TimeoutError, DeadlineExceeded):  # our timer, or the scheduler's expiry:
            self.metrics.deadline_exceeded()  # counted once either way, as Service.embed
            if not made:
                self.metrics.dropped_before_queued(len(documents))
            where = ""
            if timeout is not None:  # as Service.embed's: where the request was
                if cross:
                    assert self.reranker is not None
                    drain, engine = self.drain, self.reranker.engine
                else:
                    drain, engine = m3_admission.gate.drain, m3
                where = f": {where_late(made, drain, attention_tokens(engine), timeout)}"
            raise DeadlineExceeded(f"the request did not finish within "
                                   f"BGE_M3_REQUEST_TIMEOUT_SECS={timeout:g}s{where}") from None
        self.metrics.observe_rerank(result, time.perf_counter() - started)
        return result

    async def _m3(self, m3: Engine, admission: Admission, query: str, documents: list[str],
                  options: RerankOptions, timeout: float | None,
                  request_id: str, made: list[Job]) -> RerankResult:
        """bge-m3's own scores, admitted like its embeddings: a lower bound of the texts'
        tokens before tokenizing (``m3rerank.min_tokens``), Retry-After from its drain rate;
        its jobs go to ``made`` once made."""
        m3rerank.check_options(options)  # a bad mode is a 400 whatever the queue holds
        arrived = time.monotonic()
        # Its ColBERT vectors, one group of windows at a time (scored, then dropped), are held
        # within the allowance the embedding routes' share: the group's and the query's.
        holding = None
        if admission.outputs is not None and m3rerank.needs(options.mode)[2]:
            holding = outputs.Holding(admission.outputs)
        query_bytes = 0  # the first group holds the query; later ones keep its vectors

        async def hold(job: Job) -> None:
            assert holding is not None
            job.room_wait = await holding.take(m3.colbert_bytes(job.ids) + query_bytes)

        before = None if holding is None else hold
        try:
            async with asyncio.timeout(timeout):  # not wait_for: see _cross
                plan_, jobs, first = await admission.submit_jobs(
                    len(query) + sum(map(len, documents)),
                    lambda room: m3rerank.min_tokens(m3.tokenizer, query, documents,
                                                     m3.config.max_seq, options,
                                                     stop_above=room),
                    functools.partial(m3rerank.make_jobs, m3, query, documents, options,
                                      request_id, arrived), before=before)
                made.extend(jobs)
                query_bytes = m3.colbert_bytes(plan_.inputs[:1])
                queued = time.monotonic()
                later = functools.partial(admission.queue, later=True)  # admitted already
                result = await m3rerank.arun_jobs(m3, plan_, jobs, options, first,
                                                  submit=later, before=before)
                if timings.active():
                    timings.record(len(query) + sum(map(len, documents)), result.tokens,
                                   arrived, queued, jobs, time.monotonic())
                return result
        finally:
            admission.gate.drop_later(made)
            if holding is not None:
                holding.give_back()

    async def _cross(self, query: str, documents: list[str], options: RerankOptions,
                     timeout: float | None, request_id: str, made: list[Job]) -> RerankResult:
        reranker, admission = self.reranker, self.admission
        assert reranker is not None and admission is not None
        arrived = time.monotonic()
        # Around the admission too, as Service.embed. Not wait_for: its task may be cancelled
        # before it starts (no time left after tokenizing), and the job, queued already,
        # would stay queued until it expired.
        async with asyncio.timeout(timeout):
            plan_, job, future = await admission.submit(query, documents, options, request_id,
                                                        arrived)
            made.append(job)
            queued = time.monotonic()
            embedded = await reranker.engine.await_job(job, future)
        result = reranker.finish(plan_, embedded, options)
        if timings.active():
            timings.record(len(query) + sum(map(len, documents)), result.tokens, arrived,
                           queued, [job], time.monotonic())
        return result

    def health(self) -> dict[str, Any] | None:
        """The reranker's part of ``/health`` (None when there is none)."""
        if self.reranker is None or self.tuner is None or self.settings is None:
            return None
        engine, s = self.reranker.engine, self.settings
        stats = engine.stats()
        if stats["live"] == 0:
            status = "fail"
        elif stats["live"] < stats["total"]:
            status = "warn"
        else:
            status = "ok" if stats["loaded"] else "idle"
        artifacts = engine.artifacts
        return {"status": status, "name": RERANK_MODEL_ID, "variant": artifacts.variant,
                "layout": artifacts.layout.value, "source": artifacts.source,
                "backend": plan.runtime_version(artifacts, s.execution_provider),
                "max_length": s.max_seq_length,
                "workers": {k: stats[k] for k in ("live", "loaded", "total", "busy")},
                "queue": {"texts": stats["queue_texts"], "tokens": stats["queue_tokens"]},
                "tuning": self.tuner.state.as_dict()}
