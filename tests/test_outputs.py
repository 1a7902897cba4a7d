"""The ColBERT output of the requests in progress, held within one allowance (service/outputs.py):
the waiting rules alone, then through a server on the tiny model."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from bgeserve.holds import answering, release_when_answered
from bgeserve.service.outputs import OutputAllowance
from tests.test_admission import engine_standin
from tests.test_service import TEXTS, base_env, metric_samples, serving, wait_health


def _run(coro):
    return asyncio.run(coro)


def test_a_request_alone_always_fits_and_the_next_waits_for_room() -> None:
    async def main() -> list[str]:
        room = OutputAllowance(100)
        order: list[str] = []
        await room.acquire(250)  # over the allowance, but alone
        assert room.held == 250

        async def take(name: str, size: int) -> None:
            await room.acquire(size)
            order.append(name)

        small = asyncio.create_task(take("small", 10))
        await asyncio.sleep(0)
        assert room.waiting == 1 and not order  # even 10 bytes wait: 250 are over 100 already
        room.release(250)
        await small
        assert room.held == 10 and room.waiting == 0
        return order

    assert _run(main()) == ["small"]


def test_waiters_are_let_in_first_come_first_served() -> None:
    async def main() -> None:
        room = OutputAllowance(100)
        await room.acquire(60)
        big = asyncio.create_task(room.acquire(90))
        await asyncio.sleep(0)
        # 30 would fit beside the 60 held, but "big" came first: no overtaking it for ever
        late = asyncio.create_task(room.acquire(30))
        await asyncio.sleep(0)
        assert room.waiting == 2 and not big.done() and not late.done()
        room.release(60)
        await big
        await asyncio.sleep(0)
        assert not late.done() and room.held == 90  # 90 + 30 > 100
        room.release(90)
        await late
        assert room.held == 30 and room.waiting == 0

    _run(main())


def test_a_waiter_that_leaves_lets_the_next_in_and_holds_nothing() -> None:
    async def main() -> None:
        room = OutputAllowance(100)
        await room.acquire(80)
        first = asyncio.create_task(room.acquire(50))
        await asyncio.sleep(0)
        second = asyncio.create_task(room.acquire(20))
        await asyncio.sleep(0)
        assert not second.done()  # behind "first"
        first.cancel()  # its deadline, or its client gone
        await asyncio.gather(first, return_exceptions=True)
        await second  # 80 + 20 fit once "first" is gone
        assert room.held == 100 and room.waiting == 0

    _run(main())


def test_a_grant_that_races_a_cancel_is_given_back() -> None:
    async def main() -> None:
        room = OutputAllowance(100)
        await room.acquire(100)
        waiter = asyncio.create_task(room.acquire(50))
        await asyncio.sleep(0)
        room.release(100)  # grants the waiter ...
        waiter.cancel()  # ... which is cancelled before it runs again
        await asyncio.gather(waiter, return_exceptions=True)
        assert waiter.cancelled() and room.held == 0 and room.waiting == 0

    _run(main())


def test_the_outer_scope_releases_once_it_ends() -> None:
    released: list[int] = []
    assert not release_when_answered(lambda: released.append(0))  # no scope: the caller's
    with answering():
        with answering():  # Service.embed's, inside the HTTP layer's
            assert release_when_answered(lambda: released.append(1))
        assert released == []  # the response is not sent yet
    assert released == [1]
    with pytest.raises(ValueError), answering():
        release_when_answered(lambda: released.append(2))
        raise ValueError("a failed request releases too")
    assert released == [1, 2]


# -- through a server ----------------------------------------------------------------------------

COLBERT = {"input": TEXTS, "outputs": ["dense", "colbert"]}  # for /v1/embeddings:both


def _held(client) -> tuple[float, float]:
    samples = metric_samples(client.get("/metrics").text)
    return samples[("bgeserve_colbert_held_bytes", ())], samples[
        ("bgeserve_colbert_waiting_requests", ())]


def _post_until_it_waits(client, path: str, body: dict
                         ) -> tuple[threading.Thread, list[httpx.Response]]:
    """POST ``body`` on a thread and return once it waits for ColBERT room: the thread and
    the list its answer lands in."""
    answered: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: answered.append(client.post(path, json=body)))
    waiter.start()
    deadline = time.monotonic() + 20
    while _held(client)[1] != 1:
        assert time.monotonic() < deadline, f"the request to {path} never waited"
        time.sleep(0.02)
    return waiter, answered


@pytest.mark.slow
def test_a_colbert_request_waits_for_the_room_others_hold(tiny_export: Path,
                                                          tmp_path: Path) -> None:
    """While another request's vectors hold the whole allowance, a ColBERT request waits (a
    dense one does not), then is answered once that room is given back; nothing stays held."""
    env = base_env(tiny_export, tmp_path, BGE_M3_MAX_COLBERT_MB="1")
    with serving(env) as (client, service):
        wait_health(client)
        assert _held(client) == (0, 0)
        room = service.admission.outputs
        assert room is not None and room.max_bytes == 1 << 20
        client.portal.call(room.acquire, room.max_bytes)  # a request in progress holds it all
        waiter, answered = _post_until_it_waits(client, "/v1/embeddings:both", COLBERT)
        assert client.post("/v1/embeddings", json={"input": TEXTS}).status_code == 200
        assert not answered
        client.portal.call(room.release, room.max_bytes)
        waiter.join(20)
        assert answered and answered[0].status_code == 200
        assert len(answered[0].json()["data"][0]["colbert"]) > 0
        assert _held(client) == (0, 0)


@pytest.mark.slow
def test_a_deadline_ends_the_wait_and_holds_nothing(tiny_export: Path, tmp_path: Path) -> None:
    env = base_env(tiny_export, tmp_path, BGE_M3_MAX_COLBERT_MB="1",
                   BGE_M3_REQUEST_TIMEOUT_SECS="1.5")
    with serving(env) as (client, service):
        wait_health(client)
        room = service.admission.outputs
        client.portal.call(room.acquire, room.max_bytes)
        r = client.post("/v1/embeddings:both", json=COLBERT)
        assert r.status_code == 504, r.text
        assert _held(client) == (room.max_bytes, 0)  # only what the test holds
        client.portal.call(room.release, room.max_bytes)
        assert client.post("/v1/embeddings:both", json=COLBERT).status_code == 200
        assert _held(client) == (0, 0)


@pytest.mark.slow
def test_bge_m3_colbert_rerank_takes_its_room_from_the_same_allowance(tiny_export: Path,
                                                                      tmp_path: Path) -> None:
    """bge-m3's own ColBERT scores hold their groups' vectors within the allowance the
    embedding routes share: behind a holder of all of it they wait (a dense rerank does not),
    then are answered as before, and give it all back once scored."""
    env = base_env(tiny_export, tmp_path, BGE_M3_MAX_COLBERT_MB="1")
    body = {"model": "bge-m3", "query": TEXTS[0], "documents": TEXTS[1:] * 5, "mode": "colbert"}
    with serving(env) as (client, service):
        wait_health(client)
        want = client.post("/v1/rerank", json=body)
        assert want.status_code == 200, want.text
        assert _held(client) == (0, 0)
        room = service.admission.outputs
        client.portal.call(room.acquire, room.max_bytes)
        waiter, answered = _post_until_it_waits(client, "/v1/rerank", body)
        dense = client.post("/v1/rerank", json={**body, "mode": "dense"})
        assert dense.status_code == 200 and not answered
        client.portal.call(room.release, room.max_bytes)
        waiter.join(20)
        assert answered and answered[0].status_code == 200, answered
        assert answered[0].json()["results"] == want.json()["results"]
        assert _held(client) == (0, 0)


@pytest.mark.slow
def test_a_colbert_rerank_holds_each_group_with_the_query_then_nothing(tiny_export: Path,
                                                                       tmp_path: Path) -> None:
    """Through the service's path: the first group's room (it holds the query), then each later
    group's with the query's (its vectors are kept to the end); the same scores as the library;
    nothing held after, nor after a later group is refused by the queue (a 429). The queue's
    gate holds the later groups' tokens from the first group on (judged whole, room kept for
    them) until each is queued, and nothing once the request ended."""
    from dataclasses import replace

    import numpy as np

    from bgeserve.engine import Engine, m3rerank
    from bgeserve.errors import Overloaded
    from bgeserve.results import RerankOptions
    from bgeserve.service.admission import Admission, DrainMeter
    from bgeserve.service.metrics import Metrics
    from bgeserve.service.reranking import Reranking

    query, docs = TEXTS[0], TEXTS[1:] * 4
    options = RerankOptions(mode="colbert")
    with Engine(tiny_export, "fp32", cache_dir=tmp_path, offline=True) as engine:
        plan, _ = m3rerank.make_jobs(engine, query, docs, options)
        longest = max(engine.colbert_bytes([x]) for x in plan.inputs)
        engine.config = replace(engine.config, max_colbert_bytes=4 * longest)  # groups of 2 x
        plan, jobs = m3rerank.make_jobs(engine, query, docs, options)
        assert len(jobs) >= 3
        q = engine.colbert_bytes(plan.inputs[:1])
        want = [engine.colbert_bytes(jobs[0].ids)] + [engine.colbert_bytes(j.ids) + q
                                                       for j in jobs[1:]]
        room = OutputAllowance(1 << 30)
        sizes: list[int] = []
        take = room.acquire

        async def acquire(size: int) -> None:
            sizes.append(size)
            await take(size)

        room.acquire = acquire  # type: ignore[method-assign]
        admission = Admission(engine, 1 << 30, DrainMeter(), slots=1, outputs=room)
        held: list[int] = []
        hold = admission.gate.hold_later

        def hold_later(later):
            held.append(sum(map(len, (ids for job in later for ids in job.ids))))
            hold(later)

        admission.gate.hold_later = hold_later  # type: ignore[method-assign]
        reranking = Reranking(Metrics())
        try:
            got = _run(reranking._m3(engine, admission, query, docs, options, None, "r1", []))
            assert sizes == want and room.held == 0 and room.waiting == 0
            assert held == [sum(map(len, (ids for job in jobs[1:] for ids in job.ids)))]
            assert admission.gate.room() == 1 << 30
            np.testing.assert_allclose(got.scores, engine.rerank(query, docs, mode="colbert").scores,
                                       atol=1e-6)
            queued = admission.queue
            calls: list[object] = []

            def refuse_the_second(job, *args, **kwargs):
                calls.append(job)
                if len(calls) > 1:
                    raise Overloaded("queue full", retry_after=1.0)
                return queued(job, *args, **kwargs)

            admission.queue = refuse_the_second  # type: ignore[method-assign]
            with pytest.raises(Overloaded):
                _run(reranking._m3(engine, admission, query, docs, options, None, "r2", []))
            assert len(calls) == 2
            assert room.held == 0 and room.waiting == 0
            assert admission.gate.room() == 1 << 30  # the groups never queued: not held
        finally:
            admission.close()


def test_a_holding_gives_back_one_group_before_taking_the_next() -> None:
    """A request taking room group after group never waits on the room it holds itself: a
    second group that would not fit beside the first gets in once the first is given back."""
    from bgeserve.service.outputs import Holding

    async def main() -> None:
        room = OutputAllowance(100)
        holding = Holding(room)
        await holding.take(80)
        await asyncio.wait_for(holding.take(70), 1)  # 80 + 70 > 100: the 80 went back first
        assert room.held == 70 and holding.size == 70
        holding.give_back()
        holding.give_back()  # once only
        assert room.held == 0 and holding.size == 0

    _run(main())


def test_an_abort_answers_those_waiting_for_room_and_every_later_one() -> None:
    """A shutdown's time is up: a request waiting behind a holder whose answer is slow to send
    gets the error now (it waited past the HTTP server's grace: a plain-text 500)."""
    async def main() -> None:
        room = OutputAllowance(100)
        await room.acquire(80)
        waiters = [asyncio.create_task(room.acquire(50)) for _ in range(2)]
        await asyncio.sleep(0)
        error = RuntimeError("shutting down")
        assert room.abort(error) == 2
        results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 1)
        assert all(result is error for result in results)
        assert room.held == 80 and room.waiting == 0  # the holder's answer is still sent
        with pytest.raises(RuntimeError):
            await room.acquire(1)  # fits, but the server is stopping
        room.release(80)
        assert room.held == 0

    _run(main())


def _colbert_admission(room: OutputAllowance):
    from types import SimpleNamespace

    from bgeserve.service.admission import Admission, DrainMeter

    engine = engine_standin(
        queued_tokens=lambda: 0, submit=lambda job: "future",
        make_job=lambda *args: SimpleNamespace(ids=[[0, 5, 6, 2]]),
        colbert_bytes=lambda ids: 40,
        tokenizer=SimpleNamespace(min_tokens=lambda texts, stop_above: 4, max_seq=512))
    return Admission(engine, 1000, DrainMeter(), slots=1,  # type: ignore[arg-type]
                     outputs=room)


def test_admission_outside_a_scope_fails_before_it_holds_anything() -> None:
    """Nothing would release a hold taken outside a request's scope: the room would stay
    taken for ever and every later ColBERT request wait for its deadline."""
    from bgeserve.results import EmbedOptions

    room = OutputAllowance(100)
    admission = _colbert_admission(room)

    async def submit() -> object:
        return await admission.submit(["a b"], EmbedOptions(colbert=True), "r", 0.0)

    with pytest.raises(RuntimeError, match="answering"):
        _run(submit())
    assert room.held == 0 and admission.gate.reserved == 0

    async def in_scope() -> int:
        with answering():
            await submit()
            return room.held

    assert _run(in_scope()) == 40 and room.held == 0  # held until the scope ended
    admission.close()


def test_an_admission_abort_reaches_the_colbert_waiters() -> None:
    from bgeserve.errors import NotReady
    from bgeserve.results import EmbedOptions

    room = OutputAllowance(50)
    admission = _colbert_admission(room)

    async def main() -> None:
        await room.acquire(30)  # another request's vectors, being sent

        async def submit() -> object:
            with answering():
                return await admission.submit(["a b"], EmbedOptions(colbert=True), "r", 0.0)

        task = asyncio.ensure_future(submit())
        while room.waiting == 0:
            assert not task.done(), task
            await asyncio.sleep(0.01)
        error = NotReady("shutting down")
        assert admission.abort(error) == 1
        with pytest.raises(NotReady):
            await asyncio.wait_for(task, 1)
        assert room.held == 30 and admission.gate.reserved == 0

    _run(main())
    admission.close()
