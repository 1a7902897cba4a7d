"""Prometheus metrics (prometheus-client), one registry per service.

Request-path events are recorded as they happen (chunks, requests); engine counters, queue,
workers, tuning and RSS are read at scrape time by a collector, so they cannot drift.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from bgeserve.tuning import memory

log = logging.getLogger("bgeserve")

if TYPE_CHECKING:
    from bgeserve.engine.scheduler import ChunkStats
    from bgeserve.results import Embeddings, RerankResult

# From 1 ms (a short query's whole request on a fast CPU: with 5 ms first, 218 of 240 requests
# fell in the first bucket and p50/p90 were guesses inside it) to 600 s (the request timeout's
# 300 s default, and past it: a long text on fp32 on 2 cores runs 91 s; QA).
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
            300, 600)
_CHUNK_TEXTS = tuple(2 ** k for k in range(13))  # 1 .. 4096, BGE_M3_MAX_CHUNK's bound
_PROBE_STATES = ("disabled", "running", "complete", "failed", "cache_hit")
_STATUSES = ("loading", "ok", "warn", "idle", "draining", "fail")  # /health's status


class Metrics:
    """The bgeserve metric families."""

    def __init__(self) -> None:
        # Counters and histograms without a ``_created`` series each: it doubled the series
        # and no dashboard reads it (Prometheus derives resets itself).
        disable_created_metrics()
        self.registry = r = CollectorRegistry(auto_describe=True)
        # process_cpu_seconds_total, process_open_fds, process_max_fds,
        # process_start_time_seconds, ...: the custom registry had dropped the defaults.
        ProcessCollector(registry=r)
        self.http_requests = Counter("bgeserve_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        self.http_latency = Histogram("bgeserve_http_request_duration_seconds",
                                      "HTTP request latency", ["route"], buckets=_LATENCY,
                                      registry=r)
        self.embed_latency = Histogram("bgeserve_embed_duration_seconds",
                                       "Embedding latency inside the service (tokenize, queue, "
                                       "inference)", buckets=_LATENCY, registry=r)
        self.inference = Histogram("bgeserve_inference_duration_seconds",
                                   "session.run time per chunk", buckets=_LATENCY, registry=r)
        self.chunk_texts = Histogram("bgeserve_chunk_texts", "Texts per chunk",
                                     buckets=_CHUNK_TEXTS, registry=r)
        self.chunk_tokens = Histogram("bgeserve_chunk_padded_tokens", "Padded tokens per chunk",
                                      buckets=(64, 256, 1024, 2048, 4096, 8192, 16384, 65536),
                                      registry=r)
        self.tokens = Counter("bgeserve_tokens", "Real tokens processed", registry=r)
        self.padding = Counter("bgeserve_padding_tokens", "Padding tokens processed (waste)",
                               registry=r)
        self.texts = Counter("bgeserve_texts", "Texts embedded", registry=r)
        self.truncated = Counter("bgeserve_truncated_texts", "Texts cut to max_seq", registry=r)
        self.timeouts = Counter("bgeserve_deadline_exceeded_requests",
                                "Requests answered 504", registry=r)
        # What an autoscaler reads beside the queue gauges: requests being read, tokenized,
        # queued or run (HTTP middleware counts them; probes and scrapes, GET of /health,
        # /health/deep, /, /ping and /metrics, excluded).
        self.in_flight = Gauge("bgeserve_requests_in_flight", "Requests in progress",
                               registry=r)
        # What usage reports: every text answered, from the cache or repeated in its request
        # too (bgeserve_tokens counts what the model ran, the canary's included).
        self.request_tokens = Counter("bgeserve_request_tokens",
                                      "Tokens of the texts answered (the requests' usage)",
                                      registry=r)
        self.rerank = RerankMetrics(r)
        # Texts of requests dropped before their jobs were queued (the client gone or the
        # deadline passed while they waited to be tokenized or admitted): the schedulers count
        # those dropped after (bgeserve_cancelled_texts_total adds both).
        self.dropped_texts = 0
        self._service: Any = None
        self._bodies: Any = None  # the HTTP layer's body allowance (guards.BodyAllowance)
        r.register(_StateCollector(self))

    def observe_chunk(self, stats: ChunkStats) -> None:
        self.inference.observe(stats.seconds)
        self.chunk_texts.observe(stats.batch)
        self.chunk_tokens.observe(stats.batch * stats.pad_to)
        self.tokens.inc(stats.real_tokens)
        self.padding.inc(stats.batch * stats.pad_to - stats.real_tokens)

    def observe_request(self, result: Embeddings, seconds: float) -> None:
        self.embed_latency.observe(seconds)
        self.texts.inc(len(result))
        self.request_tokens.inc(result.prompt_tokens)
        self.truncated.inc(int(result.truncated.sum()))

    def observe_rerank(self, result: RerankResult, seconds: float) -> None:
        self.rerank.observe(result, seconds)

    def observe_reranker_chunk(self, stats: ChunkStats) -> None:
        self.rerank.inference.observe(stats.seconds)

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        self.count_http(route, status)
        self.http_latency.labels(route).observe(seconds)

    def count_http(self, route: str, status: int) -> None:
        """Count a request without its latency (one the HTTP parser refused: it never ran)."""
        self.http_requests.labels(route, str(status)).inc()

    def deadline_exceeded(self) -> None:
        self.timeouts.inc()

    def dropped_before_queued(self, texts: int) -> None:
        """Count ``texts`` of a request dropped before its job was queued (client gone or
        deadline): the scheduler never saw them (QA: 0 counted for 5 clients gone while their
        30 texts were tokenized)."""
        self.dropped_texts += texts

    def update_state(self, service: Any) -> None:
        self._service = service

    def watch_bodies(self, bodies: Any) -> None:
        """Read the HTTP layer's body allowance (``held``, ``refused``) at scrape time."""
        self._bodies = bodies

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RerankMetrics:
    """Rerank requests by scorer (the reranker's id, or ``bge-m3``): documents (pairs), the
    model inputs they took (windows), cut documents, tokens and latency."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter("bgeserve_rerank_requests", "Rerank requests answered",
                                ["scorer"], registry=r)
        self.pairs = Counter("bgeserve_rerank_pairs", "(query, document) pairs scored",
                             ["scorer"], registry=r)
        self.windows = Counter("bgeserve_rerank_windows",
                               "Model inputs scored (a long document takes several windows)",
                               ["scorer"], registry=r)
        self.truncated = Counter("bgeserve_rerank_truncated_documents",
                                 "Documents not scored whole (cut, or past the windows' cap)",
                                 ["scorer"], registry=r)
        self.tokens = Counter("bgeserve_rerank_tokens", "Tokens fed to the scorer",
                              ["scorer"], registry=r)
        # The cross-encoder's own runs (bge-m3's scores run in bge-m3's chunks, counted there).
        self.inference = Histogram("bgeserve_reranker_inference_duration_seconds",
                                   "session.run time per reranker chunk", buckets=_LATENCY,
                                   registry=r)
        self.latency = Histogram("bgeserve_rerank_duration_seconds",
                                 "Rerank latency inside the service (tokenize, queue, inference)",
                                 ["scorer"], buckets=_LATENCY, registry=r)

    def observe(self, result: RerankResult, seconds: float) -> None:
        scorer = result.model
        self.requests.labels(scorer).inc()
        self.pairs.labels(scorer).inc(len(result))
        self.windows.labels(scorer).inc(int(result.windows.sum()))
        self.truncated.labels(scorer).inc(int(result.truncated.sum()))
        self.tokens.labels(scorer).inc(result.tokens)
        self.latency.labels(scorer).observe(seconds)


class _StateCollector:
    """Gauges and engine counters read at scrape time."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self):
        service = self._metrics._service
        yield GaugeMetricFamily("bgeserve_process_rss_bytes", "Resident memory of the server",
                                value=memory.rss_bytes())
        health = getattr(service, "health", None)
        if callable(health):
            try:  # the whole scrape must not become a 500 for these two gauges
                body = health()
            except Exception:
                log.exception("/metrics: the health status could not be read")
            else:
                yield from _status_families(body)
        bodies = self._metrics._bodies
        if bodies is not None:
            yield GaugeMetricFamily("bgeserve_inflight_body_bytes",
                                    "Bytes of the request bodies in progress and of the "
                                    "answers their clients have not taken yet (at most "
                                    "BGE_M3_MAX_INFLIGHT_MB, or one largest body)",
                                    value=bodies.held)
            yield GaugeMetricFamily("bgeserve_inflight_body_waiting_requests",
                                    "Requests whose body, over half BGE_M3_MAX_INFLIGHT_MB, "
                                    "waits for room before it is read",
                                    value=bodies.waiting_count())
        engine = getattr(service, "engine", None)
        if engine is not None:
            stats = engine.stats()
            workers = GaugeMetricFamily("bgeserve_workers", "Workers by state", labels=["state"])
            for state in ("total", "live", "loaded", "busy"):
                workers.add_metric([state], stats[state])
            yield workers
            yield GaugeMetricFamily("bgeserve_queue_texts", "Texts waiting", value=stats[
                "queue_texts"])
            yield GaugeMetricFamily("bgeserve_queue_tokens", "Tokens waiting",
                                    value=stats["queue_tokens"])
            admission = getattr(service, "admission", None)
            if admission is not None:
                yield GaugeMetricFamily(
                    "bgeserve_queue_limit_tokens",
                    "Tokens the queue takes before 429: BGE_M3_MAX_QUEUE_TOKENS, or what the "
                    "measured drain rate runs in 3/4 of BGE_M3_REQUEST_TIMEOUT_SECS, where fewer "
                    "(tokens of short texts: a long text's count more, for its attention)",
                    value=admission.gate.limit())
            counters = engine.counters
            # 429s decided before tokenizing are the admission's, not the scheduler's; the
            # reranker's engine has its own scheduler (its 429s, drops, splits, restarts are
            # the server's too: these counters answer for every route).
            extra = collections.Counter(rejected=getattr(service, "rejected_at_admission", 0)
                                        + (bodies.refused if bodies is not None else 0),
                                        cancelled_texts=self._metrics.dropped_texts)
            reranking = getattr(getattr(service, "reranking", None), "engine", None)
            if reranking is not None:  # read key by key: its workers may add keys meanwhile
                extra.update({key: reranking.counters.get(key, 0) for key in (
                    "rejected", "cancelled_texts", "oom_splits", "worker_restarts")})
            for name, key, doc in (
                ("bgeserve_rejected_requests", "rejected",
                 ("Requests answered 429 (a full queue, embedding and rerank routes; or the "
                  "request bodies in progress at BGE_M3_MAX_INFLIGHT_MB, any route)")),
                ("bgeserve_cancelled_texts", "cancelled_texts",
                 ("Texts dropped before running (client gone or deadline), queued or still "
                  "waiting to be tokenized or admitted")),
                ("bgeserve_oom_splits", "oom_splits", "Chunks split after an allocation failure"),
                ("bgeserve_worker_restarts", "worker_restarts",
                 ("Worker threads restarted after dying, or sessions reopened after a runtime "
                  "error")),
            ):
                yield CounterMetricFamily(name, doc, value=counters.get(key, 0) + extra.get(key, 0))
            yield from _cache_metrics(engine.cache_stats())
            held = getattr(getattr(service, "admission", None), "outputs", None)
            if held is not None:
                yield GaugeMetricFamily(
                    "bgeserve_colbert_held_bytes",
                    "ColBERT output (float32 bytes) of the requests in progress; at most "
                    "BGE_M3_MAX_COLBERT_MB unless one request alone holds it", value=held.held)
                yield GaugeMetricFamily(
                    "bgeserve_colbert_waiting_requests",
                    "Requests waiting for room for their ColBERT output", value=held.waiting)
        reranker = getattr(getattr(service, "reranking", None), "engine", None)
        if reranker is not None:
            stats = reranker.stats()
            workers = GaugeMetricFamily("bgeserve_reranker_workers", "Reranker workers by state",
                                        labels=["state"])
            for state in ("total", "live", "loaded", "busy"):
                workers.add_metric([state], stats[state])
            yield workers
            yield GaugeMetricFamily("bgeserve_reranker_queue_tokens", "Reranker tokens waiting",
                                    value=stats["queue_tokens"])
            yield GaugeMetricFamily("bgeserve_reranker_queue_texts",
                                    "Reranker (query, document) windows waiting",
                                    value=stats["queue_texts"])
        audit = getattr(service, "audit", None)
        if audit is not None:
            yield from _audit_families(audit)
        tuner = getattr(service, "tuner", None)
        if tuner is not None:
            s = tuner.state
            probe = GaugeMetricFamily("bgeserve_probe_status", "Probe status (1 = current)",
                                      labels=["status"])
            for state in _PROBE_STATES:
                probe.add_metric([state], 1.0 if s.probe_status == state else 0.0)
            yield probe
            # Named for Prometheus' rules (promtool: no "_a_"/"_b_", the unit last): a chunk's
            # workspace is linear x tokens + quadratic x tokens^2 bytes (per text of them).
            yield GaugeMetricFamily("bgeserve_cost_model_linear_bytes",
                                    "Cost model a: workspace bytes per token", value=s.a)
            yield GaugeMetricFamily("bgeserve_cost_model_quadratic_bytes",
                                    "Cost model b: workspace bytes per token squared",
                                    value=s.b)
            yield GaugeMetricFamily("bgeserve_workspace_budget_bytes",
                                    "Per-worker workspace budget", value=s.max_workspace_bytes)
            yield GaugeMetricFamily("bgeserve_model_rss_per_worker_bytes",
                                    "Measured RSS per loaded session",
                                    value=s.model_rss_bytes_per_worker)


def _status_families(body: dict[str, Any]):
    """/health's status as a gauge per state (1: current) and what serves, as an info gauge:
    what an alert on "not ready" or a dashboard's "which variant" reads."""
    status = GaugeMetricFamily("bgeserve_status", "The /health status (1 = current)",
                               labels=["status"])
    for state in _STATUSES:
        status.add_metric([state], 1.0 if body.get("status") == state else 0.0)
    yield status
    model = body.get("model", {})
    labels = {"version": str(body.get("version", "")),
              "variant": str(model.get("variant", "")), "choice": str(model.get("choice", "")),
              "backend": str(model.get("backend", "")),
              "execution_provider": str(model.get("execution_provider", ""))}
    info = GaugeMetricFamily("bgeserve_info", "What serves (its labels; empty while loading)",
                             labels=list(labels))
    info.add_metric(list(labels.values()), 1.0)
    yield info


def _cache_metrics(stats: dict[str, int] | None):
    """The embedding cache's families; with the cache off, zeros (a dashboard or an alert on
    hits reads 0, not "no data")."""
    yield GaugeMetricFamily("bgeserve_cache_capacity_bytes",
                            "Embedding cache limit (BGE_M3_CACHE_MB; 0: off)",
                            value=stats["max_bytes"] if stats else 0)
    if stats is None:
        stats = dict.fromkeys(("hits", "misses", "repeats", "evictions", "bytes", "entries"), 0)
    for name, key, doc in (
        ("bgeserve_cache_hits", "hits", "Texts answered from the embedding cache"),
        ("bgeserve_cache_misses", "misses", "Texts looked up in the embedding cache and run"),
        ("bgeserve_cache_repeats", "repeats",
         "Texts repeating another text of the same request, computed once"),
        ("bgeserve_cache_evictions", "evictions", "Entries evicted to stay within the limit"),
    ):
        yield CounterMetricFamily(name, doc, value=stats[key])
    yield GaugeMetricFamily("bgeserve_cache_bytes", "Bytes held by the embedding cache",
                            value=stats["bytes"])
    yield GaugeMetricFamily("bgeserve_cache_entries", "Texts held by the embedding cache",
                            value=stats["entries"])


def _audit_families(audit: Any) -> Any:
    """Sampled chunks' measured workspace against the cost model (``tuning.audit``)."""
    buckets, total = audit.histogram()
    yield HistogramMetricFamily(
        "bgeserve_workspace_ratio", "Measured / predicted workspace of sampled chunks",
        buckets=buckets, sum_value=total)
    last = audit.last
    yield GaugeMetricFamily("bgeserve_workspace_predicted_bytes",
                            "The cost model's workspace for the last sampled chunk",
                            value=0 if last is None else last.predicted_bytes)
    yield GaugeMetricFamily("bgeserve_workspace_measured_bytes",
                            "Measured peak RSS growth of the last sampled chunk",
                            value=0 if last is None else last.measured_bytes)
    yield CounterMetricFamily("bgeserve_workspace_breaches",
                              "Sampled chunks over their prediction past the tolerance",
                              value=audit.breaches)
