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
    capacity; with the cache off only the capacity, 0."""
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
    assert off["bgeserve_cache_capacity_bytes"] == 0
    assert not any(name.startswith("bgeserve_cache_hits") for name in off)


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
    metrics.update_state(SimpleNamespace(engine=engine, tuner=None, rejected_at_admission=5,
                                         reranking=SimpleNamespace(engine=reranker)))
    got = samples(metrics)
    assert got["bgeserve_rejected_requests_total"] == 4 + 3 + 5
    assert got["bgeserve_cancelled_texts_total"] == 2
    assert got["bgeserve_oom_splits_total"] == 1
