"""``bgeserve.metrics`` at scrape time over a real Scheduler on the fake forward (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bgeserve.errors import EngineFailed
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
        engine = SimpleNamespace(stats=sched.stats, counters=sched.counters)
        metrics.update_state(SimpleNamespace(engine=engine, tuner=None))
        assert samples(metrics)["bgeserve_worker_restarts_total"] == 0
        for _ in range(2):
            with pytest.raises(EngineFailed):
                sched.submit(job_of([text(POISON)])).result(timeout=TIMEOUT)
        assert samples(metrics)["bgeserve_worker_restarts_total"] == 2
    body, _ = metrics.render()
    assert b"# TYPE bgeserve_worker_restarts_total counter" in body
