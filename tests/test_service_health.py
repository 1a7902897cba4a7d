"""``Service.health`` over the scheduler's worker stats, without a model: the real health code
on a stand-in engine whose ``stats`` come from a table or from a real Scheduler on the fake
forward of test_scheduler (workers that die or cannot open their session).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

import bgeserve.engine.workers as workers_module
from bgeserve.config import Settings
from bgeserve.engine.scheduler import Scheduler
from bgeserve.errors import ModelUnavailable
from bgeserve.service import Service
from tests.test_admission import engine_standin
from tests.test_scheduler import (
    TIMEOUT,
    Factory,
    assert_dense_right,
    config,
    job_of,
    unique_texts,
    wait_until,
)


def ready_service(stats: Any) -> Service:
    """A Service that is past loading, its engine reporting ``stats()``."""
    service = Service(Settings())
    service.engine = SimpleNamespace(  # type: ignore[assignment]
        stats=stats, config=SimpleNamespace(max_colbert_bytes=64 << 20))
    service.artifacts = SimpleNamespace(  # type: ignore[assignment]
        variant="fp32", source="test", runtime="onnxruntime",
        layout=SimpleNamespace(value="bgeserve"))
    service.tuner = SimpleNamespace(state=SimpleNamespace(as_dict=dict))  # type: ignore[assignment]
    service._ready.set()
    return service


@pytest.mark.parametrize(("live", "loaded", "total", "status"), [
    (2, 2, 2, "ok"),
    (2, 1, 2, "ok"),      # a lazily (re)opened session is not a problem
    (2, 0, 2, "idle"),
    (1, 1, 2, "warn"),
    (1, 0, 2, "warn"),    # a broken worker is reported even when the other is idle-unloaded
    (0, 1, 2, "fail"),
    (0, 0, 2, "fail"),
])
def test_status_follows_live_and_loaded_workers(live: int, loaded: int, total: int,
                                                status: str) -> None:
    stats = {"live": live, "loaded": loaded, "total": total, "busy": 0, "queue_texts": 0,
             "queue_tokens": 0}
    body = ready_service(lambda: stats).health()
    assert body["status"] == status
    assert body["workers"] == {"live": live, "loaded": loaded, "total": total, "busy": 0}


def embed_until(sched: Scheduler, done: Any, first_tag: int, can_fail: bool = True,
                can_succeed: bool = True) -> None:
    """Submit one-text jobs (the idle workers take turns) until ``done()``; each must be
    answered, right or with the open error."""
    for tag in range(first_tag, first_tag + 100):
        if done():
            return
        job = job_of(unique_texts(tag, [2]))
        sched.submit(job)
        error = job.future.exception(timeout=TIMEOUT)
        if error is None:
            assert can_succeed
            assert_dense_right(job)
        else:
            assert can_fail and isinstance(error, ModelUnavailable), error
    assert done()


def test_health_warns_then_fails_as_sessions_stop_opening_and_recovers() -> None:
    """Real scheduler, two workers: one session cannot open → warn; none → fail (jobs are
    still answered); the model back → ok."""
    factory = Factory()
    sched = Scheduler(factory, None, config(workers=2, max_chunk=1))
    sched.start(preload=False)
    service = ready_service(sched.stats)
    try:
        assert service.health()["status"] == "idle"
        error = ModelUnavailable("model file vanished")
        factory.broken[1] = error
        embed_until(sched, lambda: sched.stats()["live"] == 1, 1)
        embed_until(sched, lambda: sched.stats()["loaded"] == 1, 200)
        assert sched.stats()["live"] == 1
        assert service.health()["status"] == "warn"

        factory.broken[0] = error
        sched._drop_session(0)  # as the idle unload would: the next chunk must reopen it
        embed_until(sched, lambda: sched.stats()["live"] == 0, 400, can_succeed=False)
        body = service.health()
        assert body["status"] == "fail"
        assert body["workers"]["live"] == 0 and body["workers"]["total"] == 2

        factory.broken.clear()
        embed_until(sched, lambda: sched.stats()["live"] == 2, 600, can_fail=False)
        assert service.health()["status"] == "ok"
    finally:
        sched.stop(timeout=TIMEOUT)


def test_health_reports_a_worker_waiting_to_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the only worker's replacement waits out its backoff, /health says fail; once it
    runs again, the status comes back."""
    monkeypatch.setattr(workers_module, "MIN_RESTART_DELAY_S", 0.5)  # a window to look in
    factory = Factory()
    sched = Scheduler(factory, None, config())
    real = sched._next_chunk
    kills: list[int] = []

    def dies_once(worker: int):
        if not kills:
            kills.append(worker)
            raise RuntimeError("worker bug")
        return real(worker)

    sched._next_chunk = dies_once  # type: ignore[method-assign]
    sched.start(preload=False)
    service = ready_service(sched.stats)
    try:
        assert wait_until(lambda: sched.counters["worker_restarts"] == 1)
        assert service.health()["status"] == "fail"
        assert wait_until(lambda: sched.stats()["live"] == 1)
        assert service.health()["status"] == "idle"
        assert kills == [0]
    finally:
        sched.stop(timeout=TIMEOUT)


def test_a_cancelled_request_holds_its_tokenizing_slot_until_its_thread_ends() -> None:
    """A client that leaves mid-tokenizing cancels its request, but the tokenizer thread runs
    on: the request returns (and so gives back its slot, its reserved room in the queue, and
    the HTTP layer its body allowance) only once the thread is done; it never submits the
    job."""
    import asyncio
    import threading
    import time

    from bgeserve.results import EmbedOptions

    events: list[str] = []
    release = threading.Event()

    def make_job(*args: Any) -> Any:
        events.append("tokenizing")
        release.wait(5)
        time.sleep(0.05)
        events.append("tokenized")
        return SimpleNamespace(deadline=None)

    from bgeserve.service.admission import Admission, DrainMeter

    service = ready_service(dict)
    service.engine = engine_standin(
        queued_tokens=lambda: 0, make_job=make_job,
        tokenizer=SimpleNamespace(min_tokens=lambda texts, stop_above: 3, max_seq=512),
        submit=lambda job: pytest.fail("a cancelled request submitted its job"))
    service.admission = admission = Admission(service.engine, 1000,  # type: ignore[arg-type]
                                              DrainMeter(), slots=2)

    async def main() -> None:
        # Past INLINE_TOKENIZE_CHARS: a request small enough is tokenized on the loop.
        task = asyncio.ensure_future(service.embed(["x" * 1000], EmbedOptions()))
        while not events:
            assert not task.done(), task  # it must reach the tokenizer, not fail before
            await asyncio.sleep(0.01)
        assert admission.gate.reserved == 3  # its lower bound holds room meanwhile
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # still waiting for its thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        events.append("returned")
        assert admission._tokenizing is not None and not admission._tokenizing.locked()
        assert admission.gate.reserved == 0

    asyncio.run(main())
    assert events == ["tokenizing", "tokenized", "returned"]


@pytest.mark.parametrize(("inputs", "on_loop"), [
    ("a query", True), (["q1", "q2"], True), ([[5] * 100], True),
    ("x" * 513, False), (["y" * 300, "z" * 300], False), ([[5] * 600], False),
])
def test_small_requests_are_tokenized_on_the_event_loop(inputs: Any, on_loop: bool) -> None:
    """Up to INLINE_TOKENIZE_CHARS characters (or token ids) a request is tokenized on the
    event loop's own thread, without the round trip through a tokenizer thread; past that, on
    a thread."""
    import asyncio
    import threading

    from bgeserve.results import EmbedOptions

    threads: list[threading.Thread] = []

    def make_job(*args: Any) -> Any:
        threads.append(threading.current_thread())
        return SimpleNamespace(deadline=None)

    async def await_job(job: Any, future: Any = None) -> str:
        return "result"

    from bgeserve.service.admission import Admission, DrainMeter

    service = ready_service(dict)
    service.engine = engine_standin(
        queued_tokens=lambda: 0, make_job=make_job, await_job=await_job,
        submit=lambda job: None,
        tokenizer=SimpleNamespace(min_tokens=lambda texts, stop_above: 3, max_seq=512))
    service.admission = Admission(service.engine, 1000,  # type: ignore[arg-type]
                                  DrainMeter(), slots=2)
    service.metrics_registry = SimpleNamespace(  # type: ignore[assignment]
        observe_request=lambda *a: None)

    async def main() -> None:
        assert await service.embed(inputs, EmbedOptions()) == "result"
        assert (threads == [threading.current_thread()]) is on_loop

    asyncio.run(main())


@pytest.mark.parametrize("bound", [0.0, 5.0])
def test_sigterm_answers_503_only_past_a_nonzero_bound(bound: float) -> None:
    """BGE_M3_SHUTDOWN_TIMEOUT_SECS: queued texts run at once either way; past a bound what
    waits is aborted with 503; 0 means no bound (as 0 means none for the other timeouts)."""
    import asyncio
    import dataclasses

    flushed: list[bool] = []
    service = ready_service(dict)
    service.settings = dataclasses.replace(service.settings, shutdown_timeout_secs=bound)
    service.engine = SimpleNamespace(flush=lambda: flushed.append(True))  # type: ignore[assignment]

    async def main() -> None:
        service.begin_shutdown()
        assert (service._abort_timer is None) == (bound == 0)
        if service._abort_timer is not None:
            service._abort_timer.cancel()

    asyncio.run(main())
    assert flushed == [True]


def test_sigterm_flushes_and_aborts_the_rerankers_queue_too() -> None:
    """A rerank request still queued when the bound runs out gets the same JSON 503 as an
    embedding request: the reranker's engine is flushed and aborted with bge-m3's (it was
    left queued, and the HTTP server's own grace then cancelled it: a plain-text 500)."""
    import asyncio
    import dataclasses

    from bgeserve.errors import NotReady

    calls: list[tuple[str, str]] = []

    def engine(name: str) -> Any:
        def abort(error: Exception) -> int:
            assert isinstance(error, NotReady)
            calls.append((name, "abort"))
            return 1
        return SimpleNamespace(flush=lambda: calls.append((name, "flush")), abort=abort)

    service = ready_service(dict)
    service.settings = dataclasses.replace(service.settings, shutdown_timeout_secs=0.01)
    service.engine = engine("m3")
    service.reranking.reranker = SimpleNamespace(engine=engine("reranker"))  # type: ignore

    async def main() -> None:
        service.begin_shutdown()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert sorted(calls) == [("m3", "abort"), ("m3", "flush"),
                             ("reranker", "abort"), ("reranker", "flush")]


def test_health_says_draining_with_503_once_sigterm_came() -> None:
    """After SIGTERM (begin_shutdown) /health reports ``draining``, which the HTTP layer
    answers 503: a readiness probe takes the replica out while its requests finish."""
    import asyncio

    from bgeserve.http.handlers import HEALTHY

    service = ready_service(lambda: {"live": 1, "loaded": 1, "total": 1, "busy": 0,
                                     "queue_texts": 0, "queue_tokens": 0})
    assert service.health()["status"] == "ok"
    service.engine.flush = lambda: None  # type: ignore[union-attr]

    async def main() -> None:
        service.begin_shutdown()
        if service._abort_timer is not None:
            service._abort_timer.cancel()

    asyncio.run(main())
    assert service.health()["status"] == "draining"
    assert "draining" not in HEALTHY


def test_a_start_stopped_before_it_loads_loads_nothing(tiny_export) -> None:
    """SIGTERM during the preparation (or the variant choice): the start ends there, instead
    of loading a graph after "shutdown complete" (2.2 GB inside a container's stop grace)."""
    service = Service(Settings(model_path=tiny_export, variant="fp32", heartbeat_secs=0))
    service._stopping.set()
    service._load()
    assert service.engine is None and service.fatal_error is None


def test_deep_health_does_not_load_sessions_unloaded_while_idle() -> None:
    """Sessions unloaded after BGE_M3_IDLE_TIMEOUT_SECS answer /health/deep 200 ``idle``
    without running the canary: a liveness probe loading them again every period kept them
    loaded for good. A session dropped after a runtime failure (to be reopened) is not idle:
    the canary runs, and says whether the path works."""
    class Canary:
        ran = 0

        async def check(self, **_: Any) -> tuple[int, dict]:
            Canary.ran += 1
            return 200, {"status": "ok"}

    service = ready_service(lambda: {"live": 2, "loaded": 0, "total": 2, "idle_unloaded": 2})
    service.deep = Canary()  # type: ignore[assignment]
    status, body = asyncio.run(service.deep_health())
    assert (status, body["status"], Canary.ran) == (200, "idle", 0)
    for loaded, idle in ((0, 0), (1, 1)):  # dropped after a failure; one idle, one loaded
        stats = {"live": 2, "loaded": loaded, "total": 2, "idle_unloaded": idle}
        service.engine.stats = lambda stats=stats: stats  # type: ignore[union-attr]
        assert asyncio.run(service.deep_health()) == (200, {"status": "ok"})
    assert Canary.ran == 2

