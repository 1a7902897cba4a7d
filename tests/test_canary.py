"""DeepHealth: the canary's comparison and the 200/503 answers (over a fake embed)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bgeserve.errors import EngineFailed, Overloaded
from bgeserve.results import Embeddings
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


@pytest.mark.parametrize("fp32", [True, False])
def test_tolerance_is_named_in_the_answer(fp32: bool) -> None:
    """The 200 says how the canary was compared."""

    async def embed() -> Embeddings:
        return REF

    health = DeepHealth(embed, fp32=fp32)
    health.record(REF)
    assert _check(health, solo=True)[1]["compared"] == ("bitwise" if fp32 else "tolerance")
