"""The variant choice's workload (bgeserve/tuning/synthetic.py): its chunks and its timing,
with a fake clock."""

from __future__ import annotations

import pytest

from bgeserve.tuning.synthetic import (
    MIXED_LENGTHS,
    QUERY_LENGTHS,
    time_workload,
    workload_chunks,
)


def test_workload_chunks_are_queries_alone_then_the_mixed_batch_under_the_budget():
    """Each query runs alone; the mixed texts are packed by length under the chunk budget,
    a text longer than the budget alone; every text appears once."""
    for budget in (256, 1024):
        chunks = workload_chunks(budget)
        assert chunks[:len(QUERY_LENGTHS)] == [(1, n) for n in QUERY_LENGTHS]
        mixed = chunks[len(QUERY_LENGTHS):]
        assert sorted(s for b, s in mixed for _ in range(b)) == sorted(MIXED_LENGTHS)
        assert all(b * s <= budget or b == 1 for b, s in mixed)
    assert (1, 400) in workload_chunks(256) and (3, 160) in workload_chunks(1024)
    # a model holding 100 tokens: the longer texts cut to 100, as the server cuts them
    cut = workload_chunks(1024, max_seq=100)
    assert max(s for _, s in cut) == 100 and (4, 100) in cut
    assert sum(b for b, _ in cut) == len(QUERY_LENGTHS) + len(MIXED_LENGTHS)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_workload_counts_each_chunks_fastest_run_after_a_warm_up():
    """Tokens over the sum of each chunk's fastest timed run; the warm-up's slow first runs
    do not count; padding only where a chunk holds several texts."""
    clock = Clock()
    calls: list[tuple[int, int, bool]] = []
    first: set[tuple[int, int]] = set()

    def run(batch: int, seq: int, padded: bool = True) -> None:
        calls.append((batch, seq, padded))
        cold = (batch, seq) not in first
        first.add((batch, seq))
        clock.now += (10.0 if cold else 1.0) * batch * seq / 1000

    rate, rounds = time_workload(run, 256, rounds=2, clock=clock)
    assert rounds == 2 and rate == pytest.approx(1000.0)  # the warm runs: 1 s per 1,000 tokens
    assert len(calls) == 3 * len(workload_chunks(256))
    assert all(padded == (batch > 1) for batch, _, padded in calls)


def test_a_slow_warm_up_is_the_answer_by_itself():
    """A warm-up round over max_seconds: no timed rounds (that variant is not the fastest)."""
    clock = Clock()

    def run(batch: int, seq: int, padded: bool = True) -> None:
        clock.now += 10.0

    rate, rounds = time_workload(run, 256, rounds=2, max_seconds=30.0, clock=clock)
    assert rounds == 0 and rate > 0
