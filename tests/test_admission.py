"""AdmissionGate and DrainMeter: the cheap admission before tokenizing, and Retry-After."""

from __future__ import annotations

import pytest

from bgeserve.errors import Overloaded
from bgeserve.service.admission import MAX_RETRY_AFTER_S, AdmissionGate, DrainMeter


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_drain_rate_is_tokens_finished_per_second_in_the_window() -> None:
    """Two chunks 2 s apart: their tokens over the 2 s; a lone burst counts over 1 s at least;
    once the window has passed, the last rate stays (the queue is idle, not infinitely slow)."""
    clock = Clock()
    meter = DrainMeter(window=10.0, clock=clock)
    assert meter.rate() == 0.0
    meter.record(1000)
    assert meter.rate() == 1000.0  # one chunk just now: over the 1 s floor
    clock.t += 2
    meter.record(1000)
    assert meter.rate() == pytest.approx(1000.0)
    clock.t += 30
    assert meter.rate() == pytest.approx(1000.0)
    meter.record(600)
    assert meter.rate() == pytest.approx(600.0)


def _gate(max_tokens: int = 20_000, queued: int = 0, rate: float = 0.0) -> AdmissionGate:
    clock = Clock()
    drain = DrainMeter(clock=clock)
    if rate:
        drain.record(int(rate))  # one chunk finished now: `rate` tokens over the 1 s floor
    state = {"queued": queued}
    gate = AdmissionGate(max_tokens, lambda: state["queued"], drain)
    gate.state = state  # type: ignore[attr-defined]
    return gate


def test_an_empty_queue_admits_any_request() -> None:
    """Nothing queued or reserved: even a request over the whole queue goes in (alone)."""
    gate = _gate()
    with gate.reserve(50_000):
        assert gate.reserved == 50_000
    assert gate.reserved == 0


def test_requests_being_tokenized_count_against_the_room() -> None:
    """The second of two simultaneous 15,000-token requests is refused while the first is
    still being tokenized, with no token of its own computed yet; once the first is queued
    (its reservation released, its tokens in the queue) the picture is the same."""
    gate = _gate()
    with gate.reserve(15_000):
        with pytest.raises(Overloaded, match="BGE_M3_MAX_QUEUE_TOKENS"), gate.reserve(15_000):
            pass
        with gate.reserve(5_000):  # what is left still fits
            assert gate.room() == 0
            assert gate.full() is not None  # now nothing fits: refused without a bound
    gate.state["queued"] = 15_000  # type: ignore[attr-defined]
    with pytest.raises(Overloaded), gate.reserve(15_000):
        pass
    assert gate.reserved == 0


def test_a_refusal_does_not_leak_its_reservation() -> None:
    """An error inside the reserved block (a tokenizer error, a refusal by the exact check)
    gives the room back."""
    gate = _gate()
    with pytest.raises(ValueError), gate.reserve(19_000):
        raise ValueError("tokenizer failed")
    assert gate.reserved == 0 and gate.room() == 20_000


def test_retry_after_comes_from_the_drain_rate() -> None:
    """Needed room over the measured tokens/s, rounded up, at least 1 s, at most 60 s; 1 s
    before any chunk finished."""
    assert _gate(rate=0).retry_after(10_000) == 1.0
    gate = _gate(queued=20_000, rate=4_000)
    assert gate.retry_after(10_000) == 3.0  # 2.5 s rounded up
    assert gate.retry_after(1) == 1.0
    assert gate.retry_after(10**9) == MAX_RETRY_AFTER_S
    with pytest.raises(Overloaded) as caught, gate.reserve(6_000):
        pass
    assert caught.value.retry_after == 2.0  # 6,000 tokens must drain at 4,000/s
