"""DeepHealth: the canary's comparison and the 200/503 answers (over a fake embed)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bgeserve.engine.workers import Running
from bgeserve.errors import EngineFailed, Overloaded
from bgeserve.results import Embeddings
from bgeserve.service import canary
from bgeserve.service.canary import DeepHealth, difference


def _out(dense: list[float], ids: list[int] | None = None,
         weights: list[float] | None = None) -> Embeddings:
    ids = ids or [5, 9]
    weights = weights or [0.25, 0.5]
    return Embeddings(dense=np.array([dense], dtype=np.float32),
                      sparse=[(np.array(ids, np.int64), np.array(weights, np.float32))],
                      colbert=None, n_tokens=np.array([4]), truncated=np.array([False]))


REF = _out([0.6, 0.8])


def test_bitwise_when_exact_else_the_variants_tolerance() -> None:
    """A 1e-7 drift fails the bitwise check, passes fp32's 1e-5; 1e-3 fails fp32 but passes
    a quantized variant's cosine 0.999; a changed sparse id set fails fp32."""
    drift = _out([0.6 + 1e-7, 0.8])
    assert "bitwise" in difference(REF, drift, fp32=True, exact=True)
    assert difference(REF, REF, fp32=True, exact=True) is None
    assert difference(REF, drift, fp32=True, exact=False) is None
    moved = _out([0.601, 0.8])
    assert "> 1e-5" in difference(REF, moved, fp32=True, exact=False)
    assert difference(REF, moved, fp32=False, exact=False) is None
    assert "cosine" in difference(REF, _out([0.8, 0.6]), fp32=False, exact=False)
    assert "sparse" in difference(REF, _out([0.6, 0.8], ids=[5, 10]), fp32=True, exact=False)
    assert "NaN" in difference(REF, _out([np.nan, 0.8]), fp32=False, exact=False)


def _check(health: DeepHealth, **kw: bool) -> tuple[int, dict]:
    return asyncio.run(health.check(**kw))


def test_the_deep_check_answers_200_with_timings_or_503_with_the_reason() -> None:
    """Before a reference: 503; then the same output: 200 (bitwise when solo); a changed one,
    an engine error or a hang past the deadline: 503 naming it."""
    outputs: list[Embeddings] = [REF]

    async def embed() -> Embeddings:
        return outputs[0]

    health = DeepHealth(embed, fp32=True, deadline_s=0.2)
    status, body = _check(health)
    assert status == 503 and "no canary" in body["reason"]
    health.record(REF)
    status, body = _check(health, solo=True)
    assert status == 200 and body["compared"] == "bitwise" and body["ms"] >= 0
    outputs[0] = _out([0.6, 0.800005])
    assert _check(health, solo=True)[0] == 503
    assert _check(health, solo=False)[0] == 200  # packed with others: fp32's tolerance

    async def failing() -> Embeddings:
        raise EngineFailed("session.run failed")

    health.embed = failing
    status, body = _check(health)
    assert status == 503 and "EngineFailed" in body["reason"]

    async def hanging() -> Embeddings:
        await asyncio.sleep(10)
        raise AssertionError("unreachable")

    health.embed = hanging
    status, body = _check(health)
    assert status == 503 and "longer than 0.2s" in body["reason"]
    status, body = _check(health, deadline_s=0.05)
    assert status == 503 and "longer than 0.05s" in body["reason"]


def test_checks_at_once_share_one_canary_run_which_ends_when_none_waits() -> None:
    """Single flight: checks that overlap share one canary (each is a solo job that goes
    before batches, and the route needs no key: a burst of N checks must not queue N); a
    check after it ends gets a fresh run. A check that gives up leaves the run to those still
    waiting; the last one to give up cancels it."""
    runs: list[asyncio.Event] = []
    cancelled: list[int] = []

    async def embed() -> Embeddings:
        release = asyncio.Event()
        runs.append(release)
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.append(len(runs))
            raise
        return REF

    health = DeepHealth(embed, fp32=True, deadline_s=5)
    health.record(REF)

    async def main() -> None:
        checks = [asyncio.ensure_future(health.check()) for _ in range(5)]
        await asyncio.sleep(0.05)
        assert len(runs) == 1  # five checks, one canary
        runs[0].set()
        answers = await asyncio.gather(*checks)
        assert all(status == 200 and body["compared"] == "bitwise" for status, body in answers)
        later = asyncio.ensure_future(health.check())
        await asyncio.sleep(0.05)
        assert len(runs) == 2  # a check after the run ended: a new run
        runs[1].set()
        assert (await later)[0] == 200

        patient = asyncio.ensure_future(health.check(deadline_s=5))
        await asyncio.sleep(0.05)
        status, body = await health.check(deadline_s=0.05)  # gives up first
        assert status == 503 and "longer than 0.05s" in body["reason"]
        assert len(runs) == 3 and not cancelled  # the patient one still waits for run 3
        runs[2].set()
        assert (await patient)[0] == 200

        status, _ = await health.check(deadline_s=0.05)  # alone: its giving up ends the run
        await asyncio.sleep(0)
        assert status == 503 and cancelled == [4]

    asyncio.run(main())


def test_a_full_queue_is_busy_while_it_drains_and_dead_when_it_does_not() -> None:
    """The canary refused by a full queue: 200 "busy" while chunks finish, 503 when none
    finished lately (nothing takes work off the queue)."""
    draining = [True]

    async def refused() -> Embeddings:
        raise Overloaded("queue full", retry_after=3)

    health = DeepHealth(refused, fp32=True, busy=lambda: draining[0])
    health.record(REF)
    status, body = _check(health)
    assert status == 200 and body["status"] == "busy"
    draining[0] = False
    status, body = _check(health)
    assert status == 503 and "no chunk finished" in body["reason"]


def test_a_canary_late_behind_running_chunks_is_busy_and_a_stuck_chunk_fails() -> None:
    """Past its deadline behind chunks still within their expected time: 200 "busy" (a pod
    restarted by liveness under load loses all its work); behind one past it, or none: 503.
    The check hands its own deadline to the judgement (a solo chunk's limit)."""
    running = [True]
    deadlines: list[float] = []

    async def late() -> Embeddings:
        await asyncio.sleep(10)
        raise AssertionError("unreachable")

    def progressing(deadline_s: float) -> bool:
        deadlines.append(deadline_s)
        return running[0]

    health = DeepHealth(late, fp32=True, progressing=progressing, deadline_s=0.05)
    health.record(REF)
    status, body = _check(health)
    assert status == 200 and body["status"] == "busy" and "still running" in body["reason"]
    running[0] = False
    status, body = _check(health)
    assert status == 503 and "longer than 0.05s" in body["reason"]
    assert deadlines == [0.05, 0.05]


def test_a_chunk_is_stuck_after_ten_times_its_expected_time_and_a_minute() -> None:
    """Expected: tokens at each chunk's share of the drain rate, longer texts slower per token
    (attention); at least a minute; an unmeasured rate gives the minute alone. A solo chunk
    (a canary) is stuck past the deadline: a canary hanging alone is not a busy server."""
    assert canary.stuck_after(100, 100.0) == canary.STUCK_FLOOR_S  # 10 x 1.05 s < 60 s
    assert canary.stuck_after(2048, 100.0) == pytest.approx(10 * 20.48 * 2)
    assert canary.stuck_after(8192, 0.0) == canary.STUCK_FLOOR_S
    # The measured 4,773-token int8 text (90.9 s on 2 cores) against a 300 tokens/s rate.
    assert canary.stuck_after(4773, 300.0) > 90.9 * 3
    # 200 tokens/s is both chunks': each at 100 (409.6 s for 2,048 tokens; 204.8 s at 200).
    assert canary.progressing([Running(30.0, 100, False), Running(300.0, 2048, False)],
                              200.0, 5.0)
    assert not canary.progressing([Running(30.0, 100, False), Running(420.0, 2048, False)],
                                  200.0, 5.0)
    assert not canary.progressing([], 100.0, 5.0)
    assert canary.progressing([Running(1.0, 40, True)], 100.0, 5.0)  # the canary just started
    assert not canary.progressing([Running(6.0, 40, True)], 100.0, 5.0)  # a canary hangs


@pytest.mark.parametrize("fp32", [True, False])
def test_tolerance_is_named_in_the_answer(fp32: bool) -> None:
    """The 200 says how the canary was compared."""

    async def embed() -> Embeddings:
        return REF

    health = DeepHealth(embed, fp32=fp32)
    health.record(REF)
    assert _check(health, solo=True)[1]["compared"] == ("bitwise" if fp32 else "tolerance")
