"""``bgeserve.metrics`` at scrape time over a real Scheduler on the fake forward (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bgeserve.errors import EngineFailed
from bgeserve.results import EmbedOptions
from bgeserve.service.metrics import Metrics
from tests.test_scheduler import POISON, TIMEOUT, Factory, fail_on_poison, job_of, scheduler, text


def samples(metrics: Metrics) -> dict[str, float]:
    body, _ = metrics.render()
    return {s.name: s.value for family in text_string_to_metric_families(body.decode())
            for s in family.samples if not s.labels}


def test_worker_restarts_are_exported_as_a_counter() -> None:
    """Each session reopened after a runtime failure counts in bgeserve_worker_restarts_total."""
    factory = Factory(fail=fail_on_poison(EngineFailed("session.run failed")))
    metrics = Metrics()
    with scheduler(factory) as sched:
        engine = SimpleNamespace(stats=sched.stats, counters=sched.counters,
                                 cache_stats=lambda: None)
        metrics.update_state(SimpleNamespace(engine=engine, tuner=None))
        assert samples(metrics)["bgeserve_worker_restarts_total"] == 0
        for _ in range(2):
            with pytest.raises(EngineFailed):
                sched.submit(job_of([text(POISON)])).result(timeout=TIMEOUT)
        assert samples(metrics)["bgeserve_worker_restarts_total"] == 2
    body, _ = metrics.render()
    assert b"# TYPE bgeserve_worker_restarts_total counter" in body


def test_requests_in_flight_counts_requests_being_served_not_probes() -> None:
    """bgeserve_requests_in_flight is 1 while an embedding request is served, 0 after it;
    /health and /metrics are not counted (scrapes and probes would hold it above 0)."""
    from dataclasses import dataclass, field

    from starlette.testclient import TestClient

    from bgeserve.config import Settings
    from bgeserve.http.app import create_app
    from tests.fakes import FakeService

    @dataclass
    class Counted(FakeService):
        metrics_registry: Metrics = field(default_factory=Metrics)
        seen: list[float] = field(default_factory=list)

        async def embed(self, inputs, options, *, request_id):  # type: ignore[override]
            self.seen.append(self.metrics_registry.in_flight._value.get())
            return await super().embed(inputs, options, request_id=request_id)

        def metrics(self) -> tuple[bytes, str]:
            return self.metrics_registry.render()

    service = Counted()
    with TestClient(create_app(Settings(), lambda _: service)) as client:
        assert client.post("/v1/embeddings", json={"input": "x"}).status_code == 200
        assert client.get("/health").status_code == 200
        assert samples(service.metrics_registry)["bgeserve_requests_in_flight"] == 0
    assert service.seen == [1.0]


def test_the_embedding_cache_is_exported() -> None:
    """Hits, misses, repeats and evictions as counters, bytes and entries as gauges, and the
    capacity; with the cache off every one of them, 0 (QA: they vanished, and a dashboard
    on hits read "no data")."""
    from bgeserve.engine.cache import EmbeddingCache

    cache = EmbeddingCache(1 << 20)
    cache.put(np.array([0, 5, 2]), dense=np.ones(4, np.float32))
    cache.get(np.array([0, 5, 2]), EmbedOptions())
    cache.get(np.array([0, 6, 2]), EmbedOptions())
    cache.count_repeats(3)
    metrics = Metrics()
    with scheduler(Factory()) as sched:
        engine = SimpleNamespace(stats=sched.stats, counters=sched.counters,
                                 cache_stats=cache.stats)
        metrics.update_state(SimpleNamespace(engine=engine, tuner=None))
        got = samples(metrics)
        engine.cache_stats = lambda: None
        off = samples(metrics)
    assert got["bgeserve_cache_hits_total"] == 1
    assert got["bgeserve_cache_misses_total"] == 1
    assert got["bgeserve_cache_repeats_total"] == 3
    assert got["bgeserve_cache_evictions_total"] == 0
    assert got["bgeserve_cache_entries"] == 1
    assert got["bgeserve_cache_bytes"] == cache.bytes > 0
    assert got["bgeserve_cache_capacity_bytes"] == 1 << 20
    cache_families = {name for name in got if name.startswith("bgeserve_cache_")}
    assert len(cache_families) == 7
    assert {name: off[name] for name in cache_families} == dict.fromkeys(cache_families, 0)


def test_the_rerankers_refusals_count_with_bge_m3s() -> None:
    """bgeserve_rejected_requests_total is every 429: the admission's, bge-m3's scheduler's and
    the reranker's scheduler's (its 429s were missing: 290 counted for 327 answered)."""
    from collections import Counter

    stats = {"total": 1, "live": 1, "loaded": 1, "busy": 0, "queue_texts": 0,
             "queue_tokens": 0}
    engine = SimpleNamespace(stats=lambda: stats, counters=Counter(rejected=4, oom_splits=1),
                             cache_stats=lambda: None)
    reranker = SimpleNamespace(stats=lambda: stats,
                               counters=Counter(rejected=3, cancelled_texts=2))
    metrics = Metrics()
    gate = SimpleNamespace(limit=lambda: 7_500)  # the deadline's share (service/admission.py)
    metrics.update_state(SimpleNamespace(engine=engine, tuner=None, rejected_at_admission=5,
                                         reranking=SimpleNamespace(engine=reranker),
                                         admission=SimpleNamespace(gate=gate)))
    got = samples(metrics)
    assert got["bgeserve_queue_limit_tokens"] == 7_500
    assert got["bgeserve_rejected_requests_total"] == 4 + 3 + 5
    assert got["bgeserve_cancelled_texts_total"] == 2
    assert got["bgeserve_oom_splits_total"] == 1


def test_the_health_status_and_what_serves_are_exported() -> None:
    """/health's status as a gauge per state, what serves as an info gauge (QA: no readiness
    or build metric), the process collector's families, no ``_created`` series, and latency
    buckets from 1 ms to 600 s (QA: 218 of 240 requests in the first, 5 ms, bucket; the 300 s
    timeout's requests past the last, 120 s)."""
    body = {"status": "idle", "version": "9.9", "model": {
        "variant": "ov-int8", "choice": "measured", "backend": "openvino 2026.4",
        "execution_provider": "openvino"}}
    metrics = Metrics()
    metrics.update_state(SimpleNamespace(health=lambda: body))
    text = metrics.render()[0].decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    status = {s.labels["status"]: s.value for s in families["bgeserve_status"].samples}
    assert status == {"loading": 0, "ok": 0, "warn": 0, "idle": 1, "draining": 0, "fail": 0}
    (info,) = families["bgeserve_info"].samples
    assert info.value == 1 and info.labels == {
        "version": "9.9", "variant": "ov-int8", "choice": "measured",
        "backend": "openvino 2026.4", "execution_provider": "openvino"}
    assert "process_cpu_seconds" in families and "process_open_fds" in families
    assert "_created" not in text
    metrics.observe_http("/v1/embeddings", 200, 0.0008)
    buckets = [s.labels["le"] for s in metrics.http_latency.collect()[0].samples
               if s.name.endswith("_bucket")]
    assert buckets[0] == "0.001" and buckets[-2:] == ["600.0", "+Inf"]


def test_a_health_status_that_cannot_be_read_leaves_the_rest_of_the_scrape() -> None:
    def broken() -> dict:
        raise RuntimeError("boom")

    metrics = Metrics()
    metrics.update_state(SimpleNamespace(health=broken))
    text = metrics.render()[0].decode()
    assert "bgeserve_process_rss_bytes" in text and "bgeserve_status" not in text
