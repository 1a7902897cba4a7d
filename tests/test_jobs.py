"""``engine/jobs.py`` with an embedding cache (``Job.reuse``), over a real Scheduler on the fake
forward of test_scheduler: repeats computed once, cached texts never queued (no model)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bgeserve.engine.cache import EmbeddingCache
from bgeserve.engine.heads import sparse_vector
from bgeserve.errors import InvalidInput
from bgeserve.results import EmbedOptions
from tests.test_scheduler import (
    TIMEOUT,
    Factory,
    colbert_of,
    dense_of,
    held,
    job_of,
    scheduler,
    text,
    weights_of,
)

ALL = EmbedOptions(dense=True, sparse=True, colbert=True)


def reused(texts, cache: EmbeddingCache, options: EmbedOptions | None = None):
    job = job_of(texts, options)
    job.reuse(cache)
    return job


def assert_all_right(result, texts) -> None:
    """Every output of every text is what the fake computes for its ids."""
    for i, ids in enumerate(texts):
        np.testing.assert_array_equal(result.dense[i], dense_of(ids))
        want_ids, want_w = sparse_vector(ids, weights_of(ids))
        np.testing.assert_array_equal(result.sparse[i][0], want_ids)
        np.testing.assert_array_equal(result.sparse[i][1], want_w)
        np.testing.assert_array_equal(result.colbert[i], colbert_of(ids))


def test_a_text_repeated_within_a_job_runs_once_and_every_copy_is_answered() -> None:
    """[a, b, a, c, b]: the forward sees a, b and c once each; all five slots get results,
    and the repeats are counted."""
    a, b, c = text(5, 6), text(7), text(8, 9, 10)
    texts = [a, b, a, c, b]
    factory = Factory()
    cache = EmbeddingCache(1 << 20)
    with scheduler(factory) as sched:
        job = reused(texts, cache, ALL)
        assert job.pending() == [0, 1, 3] and job.remaining == 3
        result = sched.submit(job).result(timeout=TIMEOUT)
    assert sorted(factory.rows_run()) == sorted({tuple(x) for x in (a, b, c)})
    assert sum(len(call.rows) for call in factory.calls) == 3
    assert_all_right(result, texts)
    assert cache.stats()["repeats"] == 2
    result.colbert[0][:] = 0  # each slot is its own copy
    assert np.array_equal(result.colbert[2], colbert_of(a))


def test_cached_texts_never_reach_the_queue_and_come_back_bitwise() -> None:
    """After one job ran [a, b], a job of [b, a] has nothing to run: it is answered at submit,
    no chunk runs, and its vectors equal the first job's bit for bit."""
    a, b = text(5, 6), text(7)
    factory = Factory()
    cache = EmbeddingCache(1 << 20)
    with scheduler(factory) as sched:
        first = sched.submit(reused([a, b], cache, ALL)).result(timeout=TIMEOUT)
        runs = len(factory.calls)
        again = reused([b, a], cache, ALL)
        assert again.remaining == 0 and again.pending() == []
        second = sched.submit(again).result(timeout=0)
        assert sched.stats()["queue_texts"] == 0
    assert len(factory.calls) == runs
    assert np.array_equal(second.dense, first.dense[::-1])
    assert np.array_equal(second.colbert[1], first.colbert[0])
    assert_all_right(second, [b, a])
    assert cache.hits == 2


def test_only_the_texts_not_cached_run() -> None:
    """[a, d, a] after [a]: only d runs; both copies of a come from the cache."""
    a, d = text(5, 6), text(11, 12)
    factory = Factory()
    cache = EmbeddingCache(1 << 20)
    with scheduler(factory) as sched:
        sched.submit(reused([a], cache, ALL)).result(timeout=TIMEOUT)
        factory.calls.clear()
        result = sched.submit(reused([a, d, a], cache, ALL)).result(timeout=TIMEOUT)
    assert factory.rows_run() == {tuple(d)}
    assert_all_right(result, [a, d, a])


def test_a_text_cached_without_an_output_asked_for_runs_again() -> None:
    """Cached with dense only, a dense + sparse request for the same text runs it; after
    that, dense + sparse is a hit."""
    a = text(5, 6)
    both = EmbedOptions(dense=True, sparse=True)
    factory = Factory()
    cache = EmbeddingCache(1 << 20)
    with scheduler(factory) as sched:
        sched.submit(reused([a], cache)).result(timeout=TIMEOUT)
        assert reused([a], cache).remaining == 0
        assert reused([a], cache, both).remaining == 1
        sched.submit(reused([a], cache, both)).result(timeout=TIMEOUT)
        assert reused([a], cache, both).remaining == 0
    assert len(factory.calls) == 2


def test_without_reuse_every_text_runs() -> None:
    """A job that was not given a cache queues every text, repeats included (the old path)."""
    a = text(5, 6)
    factory = Factory()
    with scheduler(factory) as sched:
        job = job_of([a, a, a])
        assert job.pending() == [0, 1, 2]
        sched.submit(job).result(timeout=TIMEOUT)
    assert sum(len(call.rows) for call in factory.calls) == 3


def test_a_text_sent_by_two_requests_into_one_chunk_runs_once() -> None:
    """Two jobs queued together with the same text (neither could hit: it was not cached yet)
    share one row of their chunk; both are answered with it, and it counts as one run."""
    a, other = text(5, 6), text(8)
    factory = Factory()
    cache = EmbeddingCache(1 << 20)
    with scheduler(factory) as sched, held(sched, factory):
        factory.calls.clear()
        first = sched.submit(reused([a], cache, ALL))
        second = sched.submit(reused([other, a], cache, EmbedOptions(dense=True)))
    results = first.result(timeout=TIMEOUT), second.result(timeout=TIMEOUT)
    assert [len(call.rows) for call in factory.calls] == [2]
    assert factory.calls[0].flags == (True, True, True)
    assert_all_right(results[0], [a])
    np.testing.assert_array_equal(results[1].dense[1], results[0].dense[0])
    assert cache.stats()["misses"] == 2 and cache.stats()["hits"] == 1


def test_a_text_cached_while_it_waited_is_answered_without_running() -> None:
    """A job queued while the same text runs for another job (a miss then) finds it cached
    when its own chunk comes up: it is answered without a second run."""
    a = text(5, 6)
    factory = Factory(gate=threading.Event())
    cache = EmbeddingCache(1 << 20)
    with scheduler(factory) as sched:
        first = sched.submit(reused([a], cache, ALL))
        assert factory.entered.wait(TIMEOUT)
        second = sched.submit(reused([a], cache, ALL))
        factory.gate.set()
        results = first.result(timeout=TIMEOUT), second.result(timeout=TIMEOUT)
    assert len(factory.calls) == 1
    assert_all_right(results[1], [a])
    assert np.array_equal(results[1].colbert[0], results[0].colbert[0])
    assert cache.stats()["misses"] == 1 and cache.stats()["hits"] == 1


def test_embed_options_refuse_no_output_and_flags_that_are_not_booleans() -> None:
    """Misuse is bgeserve's InvalidInput, as every other (it was a bare ValueError); a flag
    that is no boolean ("yes", 1) is refused rather than read as True."""
    with pytest.raises(InvalidInput, match="at least one of dense, sparse, colbert"):
        EmbedOptions(dense=False)
    for flags in ({"dense": "yes"}, {"sparse": 1}, {"truncate": None}):
        with pytest.raises(InvalidInput, match="must be True or False") as info:
            EmbedOptions(**flags)  # type: ignore[arg-type]
        assert info.value.param == next(iter(flags))
    assert EmbedOptions(dense=np.bool_(True), sparse=np.bool_(False)).dense
