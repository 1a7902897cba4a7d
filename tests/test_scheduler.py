"""Tests for bgeserve.scheduler: cross-request batching, failures and lifecycle, on a fake forward.

The fake forward's outputs are deterministic functions of each row's real token ids, so every
result can be checked text by text; it records the shape and rows of every call, and can be
held on an event (to let jobs pile up in the queue) or made to fail for chosen chunks.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest

import bgeserve.engine.workers as workers_module
from bgeserve.engine.heads import ChunkOutputs, sparse_vector
from bgeserve.engine.jobs import Job
from bgeserve.engine.scheduler import ChunkStats, Scheduler, SchedulerConfig
from bgeserve.errors import (
    BgeServeError,
    DeadlineExceeded,
    EngineFailed,
    ModelUnavailable,
    NotReady,
    OutOfMemory,
    Overloaded,
    TooLarge,
)
from bgeserve.results import EmbedOptions
from bgeserve.tuning.runcost import RunCost
from tests.fakes import FitsCost

HIDDEN = 8
TIMEOUT = 5.0  # no wait in this file may block longer: a hang fails, never stalls the suite
POISON = 999  # a token id the fake can be told to fail on


# ------------------------------------------------------------------------------------ fakes
def dense_of(ids) -> np.ndarray:
    """The unit dense vector the fake gives a text: a function of its real token ids only."""
    v = np.random.default_rng([int(x) for x in ids]).standard_normal(HIDDEN)
    return (v / np.linalg.norm(v)).astype(np.float32)


def weights_of(ids) -> np.ndarray:
    """The fake's per-position sparse weights: some zero, varying along repeated ids."""
    ids = np.asarray(ids)
    return (((ids * 31 + np.arange(len(ids))) % 5) / 4.0).astype(np.float32)


def colbert_of(ids) -> np.ndarray:
    """The fake's ColBERT rows for positions 1..n-1 of a text."""
    return np.stack([dense_of([int(t), p]) for p, t in enumerate(ids)][1:]) if len(ids) > 1 \
        else np.zeros((0, HIDDEN), np.float32)


@dataclass
class Call:
    """One recorded ``run``: the padded shape, each row's real ids, and the heads asked for."""

    shape: tuple[int, int]
    rows: list[tuple[int, ...]]
    flags: tuple[bool, bool, bool]
    forward: FakeForward


class FakeForward:
    """Stand-in for ``bgeserve.forward.Forward``.

    ``poisoned``: every ``run`` fails with EngineFailed (a session the runtime left unusable);
    ``close_error``: raised by ``close`` (after recording the close).
    """

    def __init__(self, factory: Factory, worker: int):
        self.factory = factory
        self.worker = worker
        self.closed = False
        self.poisoned = False
        self.close_error: BaseException | None = None

    def run(self, input_ids, attention_mask, *, dense, sparse, colbert) -> ChunkOutputs:
        f = self.factory
        assert input_ids.dtype == np.int64 and attention_mask.dtype == np.int64
        rows = [tuple(int(t) for t in r[m == 1]) for r, m in zip(input_ids, attention_mask)]
        assert all(np.all(r[m == 0] == 1) for r, m in zip(input_ids, attention_mask)), "pad = 1"
        with f.lock:
            f.calls.append(Call(input_ids.shape, rows, (dense, sparse, colbert), self))
        f.entered.set()
        if f.gate is not None:
            assert f.gate.wait(TIMEOUT), "the test never released the gate"
        if self.poisoned:
            raise EngineFailed("session poisoned")
        if f.fail is not None:
            f.fail(rows)
        b, length = input_ids.shape
        out_dense = np.stack([dense_of(r) for r in rows]) if dense else None
        out_sparse = None
        if sparse:
            out_sparse = np.zeros((b, length), np.float32)
            for i, r in enumerate(rows):
                out_sparse[i, : len(r)] = weights_of(r)
        out_colbert = None
        if colbert:
            out_colbert = np.zeros((b, length - 1, HIDDEN), np.float32)
            for i, r in enumerate(rows):
                out_colbert[i, : len(r) - 1] = colbert_of(r)
        return ChunkOutputs(out_dense, out_sparse, out_colbert)

    def close(self) -> None:
        self.closed = True
        self.factory.closed.set()
        if self.close_error is not None:
            raise self.close_error


@dataclass
class Factory:
    """``open_forward(worker)`` for the scheduler: counts opens, can be made to fail, records
    calls.

    ``gate``: when set, every ``run`` waits on it; ``entered`` is set when a run starts;
    ``closed`` when a forward is closed.
    ``fail``: called with each chunk's rows; whatever it raises, ``run`` raises.
    ``open_error``: raised by the next open (then cleared).
    ``broken``: worker -> error raised by every open for that worker (until removed).
    """

    gate: threading.Event | None = None
    fail: Callable[[list[tuple[int, ...]]], None] | None = None
    open_error: BaseException | None = None
    broken: dict[int, BaseException] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    forwards: list[FakeForward] = field(default_factory=list)
    entered: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, worker: int = 0) -> FakeForward:
        if self.open_error is not None:
            error, self.open_error = self.open_error, None
            raise error
        if worker in self.broken:
            raise self.broken[worker]
        fwd = FakeForward(self, worker)
        self.forwards.append(fwd)
        return fwd

    def rows_run(self) -> set[tuple[int, ...]]:
        return {r for c in self.calls for r in c.rows}


def text(*content: int) -> np.ndarray:
    """A tokenized text: ``<s> content </s>`` as int64."""
    return np.array([0, *content, 2], dtype=np.int64)


def job_of(texts: list[np.ndarray], options: EmbedOptions | None = None, **kw) -> Job:
    return Job(list(texts), np.zeros(len(texts), dtype=bool), options or EmbedOptions(), **kw)


def unique_texts(tag: int, lengths: list[int]) -> list[np.ndarray]:
    """Texts whose content ids (tag*1000 + …) identify the job they belong to."""
    return [text(*(tag * 1000 + 10 * i + k for k in range(n))) for i, n in enumerate(lengths)]


def owner(row: tuple[int, ...]) -> int:
    return row[1] // 1000


def assert_dense_right(job: Job) -> None:
    result = job.future.result(timeout=TIMEOUT)
    assert result.dense is not None and result.dense.shape == (len(job.ids), HIDDEN)
    for i, ids in enumerate(job.ids):
        np.testing.assert_array_equal(result.dense[i], dense_of(ids))
    np.testing.assert_array_equal(result.n_tokens, [len(x) for x in job.ids])


def config(**kw) -> SchedulerConfig:
    kw.setdefault("min_fill", 0.0)
    return SchedulerConfig(**kw)


@contextmanager
def scheduler(factory: Factory | None = None, fits=lambda b, s: True, preload: bool = True,
              on_chunk=None, **kw) -> Iterator[Scheduler]:
    """A started scheduler over ``factory``; stopped (briefly) on exit, the gate released."""
    factory = factory or Factory()
    sched = Scheduler(factory, FitsCost(fits), config(**kw), on_chunk)
    sched.start(preload=preload)
    try:
        yield sched
    finally:
        if factory.gate is not None:
            factory.gate.set()
        sched.stop(timeout=TIMEOUT)


@contextmanager
def held(sched: Scheduler, factory: Factory) -> Iterator[Job]:
    """Occupy the (single) worker with a blocker job until the block exits.

    Whatever is submitted inside the block waits in the queue; on exit the worker is released.
    """
    factory.gate = threading.Event()
    factory.entered.clear()
    blocker = job_of([text(7)])
    sched.submit(blocker)
    assert factory.entered.wait(TIMEOUT)
    try:
        yield blocker
    finally:
        factory.gate.set()
    assert_dense_right(blocker)


def wait_until(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


# ------------------------------------------------------------------------------ results
def test_results_come_back_in_input_order():
    """Texts run sorted by length, but each text's own vector lands in its input slot."""
    lengths = [9, 1, 5, 3, 7, 2, 2, 8]
    factory = Factory()
    with scheduler(factory, max_chunk=3) as sched:
        job = job_of(unique_texts(1, lengths))
        job.truncated[2] = True
        sched.submit(job)
        assert_dense_right(job)
        result = job.future.result(timeout=TIMEOUT)
    np.testing.assert_array_equal(result.truncated, [i == 2 for i in range(len(lengths))])
    assert result.prompt_tokens == sum(n + 2 for n in lengths)
    assert result.sparse is None and result.colbert is None
    assert sorted(len(c.rows) for c in factory.calls) == [2, 3, 3]


def test_rows_within_a_chunk_are_sorted_by_length_and_padded_to_the_longest():
    """Each call is padded to its own longest text, rows shortest first; the chunk holding
    the oldest text (input 0, the longest here) runs first."""
    factory = Factory()
    with scheduler(factory, max_chunk=2) as sched:
        job = job_of(unique_texts(1, [6, 1, 3, 2]))
        sched.submit(job)
        assert_dense_right(job)
    assert [c.shape for c in factory.calls] == [(2, 8), (2, 4)]
    assert [[len(r) for r in c.rows] for c in factory.calls] == [[5, 8], [3, 4]]


def test_chunks_are_rounded_to_the_pad_multiple_but_not_past_the_cap_or_the_budget():
    """pad_multiple rounds each run's length up (results unchanged: the padding is masked);
    pad_cap stops it at max_seq; a budget that admits the chunk only unrounded gets it
    unrounded, never refused."""
    factory = Factory()
    with scheduler(factory, max_chunk=1, pad_multiple=8, pad_cap=20) as sched:
        job = job_of(unique_texts(1, [3, 8, 9, 18]))  # 5, 10, 11, 20 tokens with CLS/EOS
        sched.submit(job)
        assert_dense_right(job)
    assert sorted(c.shape[1] for c in factory.calls) == [8, 16, 16, 20]
    factory = Factory()
    with scheduler(factory, fits=lambda b, s: b * s <= 11, max_chunk=1,
                   pad_multiple=8) as sched:
        job = job_of(unique_texts(2, [3, 9]))  # 5 -> 8 fits; 11 -> 16 does not: stays 11
        sched.submit(job)
        assert_dense_right(job)
    assert sorted(c.shape[1] for c in factory.calls) == [8, 11]


def test_an_empty_job_is_answered_at_once():
    """A job without texts resolves immediately with zero results; nothing runs."""
    factory = Factory()
    with scheduler(factory) as sched:
        job = job_of([])
        result = sched.submit(job).result(timeout=TIMEOUT)
    assert len(result) == 0 and factory.calls == []


def test_on_chunk_reports_every_run():
    """The on_chunk hook gets the worker, batch, padded length, real tokens and their texts'
    lengths squared (summed: what admission prices attention by) of each run."""
    seen: list[ChunkStats] = []
    with scheduler(on_chunk=seen.append, max_chunk=8) as sched:
        job = job_of(unique_texts(1, [1, 3]))
        sched.submit(job).result(timeout=TIMEOUT)
        sched.submit(job_of(unique_texts(2, [2]), solo=True)).result(timeout=TIMEOUT)
    assert len(seen) == 2 and seen[1].solo  # the canary's (the drain rate weighs it less)
    assert (seen[0].worker, seen[0].batch, seen[0].pad_to, seen[0].real_tokens) == (0, 2, 5, 8)
    assert seen[0].squares == 3 * 3 + 5 * 5 and not seen[0].solo
    assert seen[0].seconds >= 0


# ----------------------------------------------------------------------------- batching
def test_concurrent_jobs_are_coalesced_into_one_chunk():
    """Jobs that queue while the worker is busy share the next session.run."""
    factory = Factory()
    with scheduler(factory, max_chunk=64) as sched:
        with held(sched, factory):
            jobs = [job_of(unique_texts(tag, [2, 3])) for tag in (1, 2, 3)]
            for job in jobs:
                sched.submit(job)
        for job in jobs:
            assert_dense_right(job)
    assert len(factory.calls) == 2
    assert {owner(r) for r in factory.calls[1].rows} == {1, 2, 3}


def test_without_cross_request_batching_jobs_never_share_a_chunk():
    """cross_request=False packs only within the oldest job."""
    factory = Factory()
    with scheduler(factory, max_chunk=64, cross_request=False) as sched:
        with held(sched, factory):
            jobs = [job_of(unique_texts(tag, [2, 3, 2])) for tag in (1, 2, 3)]
            for job in jobs:
                sched.submit(job)
        for job in jobs:
            assert_dense_right(job)
    owners = [{owner(r) for r in c.rows} for c in factory.calls[1:]]
    assert owners == [{1}, {2}, {3}]
    assert all(len(c.rows) == 3 for c in factory.calls[1:])


def test_requests_take_turns_text_by_text_in_input_order():
    """With one text per chunk, the waiting requests alternate (the one served longest ago
    goes next; a new one counts as served before every one waiting, oldest first), each in
    its own input order."""
    factory = Factory()
    with scheduler(factory, max_chunk=1) as sched:
        with held(sched, factory):
            first = job_of(unique_texts(1, [5, 1, 3]))
            second = job_of(unique_texts(2, [1, 4]))
            sched.submit(first)
            sched.submit(second)
        assert_dense_right(first)
        assert_dense_right(second)
    order = [c.rows[0] for c in factory.calls[1:]]
    a, b = ([tuple(int(t) for t in x) for x in job.ids] for job in (first, second))
    assert order == [a[0], b[0], a[1], b[1], a[2]]


def test_a_query_behind_a_big_batch_waits_for_one_chunk_not_the_batch():
    """Ingestion and queries share the server: a one-text request that arrives behind 40
    queued texts of another runs in the next chunk."""
    factory = Factory(fail=lambda rows: time.sleep(0.02))  # 20 ms per chunk: 0.8 s of bulk
    with scheduler(factory, max_chunk=1) as sched:
        with held(sched, factory):
            bulk = job_of(unique_texts(1, [8] * 40))
            sched.submit(bulk)
        assert wait_until(lambda: len(factory.calls) >= 3)  # the bulk is running
        query = job_of(unique_texts(2, [3]))
        before = len(factory.calls)
        sched.submit(query)
        assert_dense_right(query)
        ran_before = next(i for i, c in enumerate(factory.calls) if owner(c.rows[0]) == 2)
        assert_dense_right(bulk)
    # The chunk running at submit ends, then the query's: at most one more chunk of the bulk
    # (its run may have started while the query was being submitted).
    assert ran_before <= before + 1, f"submitted after {before} chunks, ran at {ran_before}"
    assert len(factory.calls) == 42


def test_the_oldest_text_is_always_in_the_next_chunk():
    """A long old text is not starved by a stream of short newer ones."""
    factory = Factory()
    with scheduler(factory, max_chunk=2) as sched:
        with held(sched, factory):
            old = job_of(unique_texts(1, [40]))
            sched.submit(old)
            newer = [job_of(unique_texts(tag, [1])) for tag in range(2, 8)]
            for job in newer:
                sched.submit(job)
        for job in [old, *newer]:
            assert_dense_right(job)
    assert any(owner(r) == 1 for r in factory.calls[1].rows)


def test_batch_delay_lets_a_second_job_join_the_first_chunk():
    """With batch_delay_s, a job submitted shortly after another shares its session.run."""
    factory = Factory()
    with scheduler(factory, max_chunk=64, batch_delay_s=0.3) as sched:
        a, b = job_of(unique_texts(1, [2])), job_of(unique_texts(2, [3]))
        sched.submit(a)
        time.sleep(0.02)
        sched.submit(b)
        assert_dense_right(a)
        assert_dense_right(b)
    assert len(factory.calls) == 1
    assert {owner(r) for r in factory.calls[0].rows} == {1, 2}


def test_a_solo_job_does_not_wait_out_the_batch_window():
    """The canary (solo: a chunk of its own) runs at once under a 30 s window; a batchable
    job queued beside it still waits for the window (until flushed)."""
    factory = Factory()
    with scheduler(factory, max_chunk=64, batch_delay_s=30.0) as sched:
        user = job_of(unique_texts(1, [3]))
        sched.submit(user)
        canary = job_of(unique_texts(2, [4]), solo=True)
        sched.submit(canary)
        assert_dense_right(canary)  # within TIMEOUT, far below the 30 s window
        time.sleep(0.05)
        assert not user.future.done()
        sched.flush()
        assert_dense_right(user)
    assert [{owner(r) for r in call.rows} for call in factory.calls] == [{2}, {1}]


@pytest.mark.parametrize(("caps", "lengths"), [
    ({"max_chunk": 4}, [2, 3, 2, 3, 2, 3]),  # a full chunk's texts, and two more
    ({"max_chunk": 64, "max_chunk_tokens": 8}, [5, 5]),  # a full chunk's tokens: two chunks
])
def test_a_full_chunk_does_not_wait_out_the_batch_window(caps: dict, lengths: list[int]):
    """Under a 30 s window, texts that fill a chunk run at once, and the rest of their
    request after them (the window has nothing left to gather for them: QA, 200 short texts
    waited out a 2 s window as one text did); fewer, arriving later, still wait (until
    flushed)."""
    factory = Factory()
    with scheduler(factory, batch_delay_s=30.0, **caps) as sched:
        full = job_of(unique_texts(1, lengths))
        sched.submit(full)
        assert_dense_right(full)  # within TIMEOUT, far below the 30 s window
        few = job_of(unique_texts(2, lengths[:1]))
        sched.submit(few)
        time.sleep(0.05)
        assert not few.future.done()
        sched.flush()
        assert_dense_right(few)


def test_running_reports_each_chunk_in_progress_with_its_tokens():
    """What /health/deep weighs a late canary against: (seconds so far, tokens) per busy
    worker, nothing once the chunk is answered."""
    factory = Factory(gate=threading.Event())
    with scheduler(factory, max_chunk=64) as sched:
        assert sched.running() == []
        job = job_of(unique_texts(1, [3, 4]))
        sched.submit(job)
        assert factory.entered.wait(TIMEOUT)
        time.sleep(0.05)
        [(seconds, tokens, solo, squares)] = sched.running()
        assert tokens == 5 + 6 and 0.05 <= seconds < TIMEOUT and not solo
        assert squares == 5 * 5 + 6 * 6
        assert factory.gate is not None
        factory.gate.set()
        assert_dense_right(job)
        deadline = time.monotonic() + TIMEOUT
        while sched.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sched.running() == []


def test_the_memory_budget_limits_the_chunk():
    """Texts that together would exceed ``fits`` go to separate runs."""
    factory = Factory()
    with scheduler(factory, fits=lambda b, s: b * s <= 10, max_chunk=64) as sched:
        job = job_of(unique_texts(1, [3, 3, 3, 3]))
        sched.submit(job)
        assert_dense_right(job)
    assert all(b * s <= 10 for b, s in (c.shape for c in factory.calls))


def test_two_workers_run_chunks_side_by_side():
    """Each worker owns its own session (opened for its index) and runs beside the other."""
    factory = Factory(gate=threading.Event())
    with scheduler(factory, workers=2, max_chunk=1) as sched:
        assert [f.worker for f in factory.forwards] == [0, 1]
        jobs = [job_of(unique_texts(tag, [2])) for tag in (1, 2)]
        for job in jobs:
            sched.submit(job)
        assert wait_until(lambda: len(factory.calls) == 2)
        assert sched.stats()["busy"] == 2
        factory.gate.set()
        for job in jobs:
            assert_dense_right(job)
    assert {c.forward for c in factory.calls} == set(factory.forwards)


def test_one_big_job_runs_on_every_idle_worker():
    """One submit wakes one worker; it passes the rest on, so a single large request (the
    library's ``embed(list)``) runs its chunks on both workers at once, not on the first only."""
    factory = Factory(gate=threading.Event())
    with scheduler(factory, workers=2, max_chunk=1) as sched:
        job = job_of(unique_texts(3, [2, 2, 2, 2]))
        sched.submit(job)
        assert wait_until(lambda: len(factory.calls) == 2)
        assert sched.stats()["busy"] == 2
        assert {c.forward for c in factory.calls} == set(factory.forwards)
        factory.gate.set()
        assert_dense_right(job)


def test_a_chunk_runs_at_a_shape_its_session_has_run_where_that_is_cheaper():
    """With a measured run cost whose new shapes cost 37 ms (OpenVINO's, ~37 tokens here), a
    17-token text pads to the 22 tokens its session ran before, rightly answered; a reopened
    session has run nothing, so the same text then runs as it is."""
    factory = Factory()
    with scheduler(factory, pad_cap=512) as sched:
        sched.packer.set_run_cost(RunCost(fixed=0.01, per_token=0.001, new_shape=0.037))
        for tag, n in ((1, 20), (2, 15)):
            job = job_of(unique_texts(tag, [n]))
            sched.submit(job)
            assert_dense_right(job)
        assert [c.shape for c in factory.calls] == [(1, 22), (1, 22)]
        sched.unload()
        job = job_of(unique_texts(3, [15]))
        sched.submit(job)
        assert_dense_right(job)
        assert factory.calls[-1].shape == (1, 17)
        assert factory.calls[-1].forward is not factory.calls[0].forward


def test_a_session_that_has_met_few_shapes_batches_more():
    """Texts of 100 and 120 tokens: padding the first by 20 costs more than a run (10 ms) but
    less than a run and a new shape (47 ms). The session that has run both counts runs them
    apart; a reopened one, which has run nothing, runs them together."""
    factory = Factory()
    with scheduler(factory, pad_cap=512) as sched:
        sched.packer.set_run_cost(RunCost(fixed=0.01, per_token=0.001, new_shape=0.037))
        for tag, lengths in ((1, [98]), (2, [118]), (3, [98, 118])):
            job = job_of(unique_texts(tag, lengths))
            sched.submit(job)
            assert_dense_right(job)
        sched.unload()
        job = job_of(unique_texts(4, [98, 118]))
        sched.submit(job)
        assert_dense_right(job)
    assert [c.shape for c in factory.calls] == [(1, 100), (1, 120), (1, 100), (1, 120), (2, 120)]


def test_a_solo_jobs_chunk_is_never_lengthened():
    """The canary is checked bit for bit against its first run alone: its chunk runs as
    packed even where a known shape would be cheaper than a new one."""
    factory = Factory()
    with scheduler(factory, pad_cap=512) as sched:
        sched.packer.set_run_cost(RunCost(fixed=0.01, per_token=0.001, new_shape=0.037))
        for job in (job_of(unique_texts(1, [20])), job_of(unique_texts(2, [15]), solo=True)):
            sched.submit(job)
            assert_dense_right(job)
        assert [c.shape for c in factory.calls] == [(1, 22), (1, 17)]


def test_a_lengthened_chunk_that_runs_out_of_memory_runs_again_as_packed():
    """The padding taken to reuse a shape may be what did not fit: the chunk runs again at its
    own length, rather than being refused as too large."""
    factory = Factory()

    def fail(rows) -> None:
        if factory.calls[-1].shape == (1, 22) and owner(rows[0]) == 2:
            raise OutOfMemory("no room")

    with scheduler(factory, pad_cap=512) as sched:
        sched.packer.set_run_cost(RunCost(fixed=0.01, per_token=0.001, new_shape=0.037))
        first = job_of(unique_texts(1, [20]))
        sched.submit(first)
        assert_dense_right(first)
        factory.fail = fail
        job = job_of(unique_texts(2, [15]))
        sched.submit(job)
        assert_dense_right(job)
        assert [c.shape for c in factory.calls] == [(1, 22), (1, 22), (1, 17)]


# ----------------------------------------------------------------------- sparse, colbert
def test_sparse_and_colbert_are_delivered_per_text():
    """Sparse entries are sparse_vector of the text's ids and weights; colbert has n-1 rows."""
    factory = Factory()
    with scheduler(factory, max_chunk=2) as sched:
        texts = [text(5, 9, 5, 4, 9, 11), text(3, 8), text(), text(6, 6, 6, 6)]
        job = job_of(texts, EmbedOptions(dense=False, sparse=True, colbert=True))
        result = sched.submit(job).result(timeout=TIMEOUT)
    assert result.dense is None
    assert all(c.flags == (False, True, True) for c in factory.calls)
    for ids, (idx, w), rows in zip(texts, result.sparse, result.colbert):
        want_idx, want_w = sparse_vector(ids, weights_of(ids))
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(w, want_w)
        assert idx.dtype == np.int64 and w.dtype == np.float32
        assert np.all(np.diff(idx) > 0) and np.all(w > 0)
        assert not set(idx.tolist()) & {0, 1, 2, 3}
        assert rows.shape == (len(ids) - 1, HIDDEN)
        np.testing.assert_array_equal(rows, colbert_of(ids))


def test_jobs_asking_for_different_heads_share_a_chunk():
    """One run computes the union of the heads; each job gets only what it asked for."""
    factory = Factory()
    with scheduler(factory, max_chunk=64) as sched:
        with held(sched, factory):
            dense_job = job_of(unique_texts(1, [2]))
            sparse_job = job_of(unique_texts(2, [3]), EmbedOptions(dense=False, sparse=True))
            sched.submit(dense_job)
            sched.submit(sparse_job)
        assert_dense_right(dense_job)
        got = sparse_job.future.result(timeout=TIMEOUT)
    assert factory.calls[1].flags == (True, True, False)
    assert len(factory.calls[1].rows) == 2
    assert dense_job.future.result().sparse is None
    assert got.dense is None and got.colbert is None
    ids = sparse_job.ids[0]
    np.testing.assert_array_equal(got.sparse[0][0], sparse_vector(ids, weights_of(ids))[0])


# --------------------------------------------------------------------- deadline, cancel
def test_a_job_past_its_deadline_while_queued_fails_without_running():
    """An expired queued job gets DeadlineExceeded and its texts never reach the session."""
    factory = Factory()
    with scheduler(factory) as sched:
        with held(sched, factory):
            late = job_of(unique_texts(1, [2, 3]), deadline=time.monotonic() - 1.0)
            fine = job_of(unique_texts(2, [2]), deadline=time.monotonic() + 60.0)
            sched.submit(late)
            sched.submit(fine)
        with pytest.raises(DeadlineExceeded):
            late.future.result(timeout=TIMEOUT)
        assert_dense_right(fine)
        assert sched.counters["deadline_exceeded"] == 1
        # Its texts were dropped before running: counted as a gone client's are (QA).
        assert sched.counters["cancelled_texts"] == 2
    assert not any(owner(r) == 1 for r in factory.rows_run())
    assert sched.stats()["queue_tokens"] == 0


def test_cancel_drops_texts_not_yet_started():
    """cancel() removes a queued job's texts: they never run and are counted."""
    factory = Factory()
    with scheduler(factory) as sched:
        with held(sched, factory):
            doomed = job_of(unique_texts(1, [2, 3, 4]))
            kept = job_of(unique_texts(2, [2]))
            sched.submit(doomed)
            sched.submit(kept)
            sched.cancel(doomed)
            assert sched.stats()["queue_texts"] == 1
            assert sched.stats()["queue_tokens"] == 4
        assert doomed.future.cancelled()
        assert_dense_right(kept)
        assert sched.counters["cancelled_texts"] == 3
    assert not any(owner(r) == 1 for r in factory.rows_run())


def test_cancel_with_an_error_answers_with_that_error():
    """cancel(job, error) sets the job's future to that error."""
    factory = Factory()
    with scheduler(factory) as sched:
        with held(sched, factory):
            job = job_of(unique_texts(1, [2]))
            sched.submit(job)
            error = DeadlineExceeded("client gave up")
            sched.cancel(job, error)
        assert job.future.exception(timeout=TIMEOUT) is error


def test_cancelling_a_running_job_discards_its_results_only():
    """A job cancelled mid-run is not answered twice; its chunk-mates still get results."""
    factory = Factory(gate=threading.Event())
    with scheduler(factory, max_chunk=64, batch_delay_s=0.2) as sched:
        a, b = job_of(unique_texts(1, [2])), job_of(unique_texts(2, [2]))
        sched.submit(a)
        sched.submit(b)
        assert factory.entered.wait(TIMEOUT)
        sched.cancel(a)
        factory.gate.set()
        assert_dense_right(b)
        assert a.future.cancelled()
        assert sched.counters["cancelled_texts"] == 0
    assert len(factory.calls) == 1 and len(factory.calls[0].rows) == 2


def test_cancel_after_completion_is_a_no_op():
    """Cancelling a finished job leaves its result alone."""
    with scheduler() as sched:
        job = job_of(unique_texts(1, [2]))
        sched.submit(job).result(timeout=TIMEOUT)
        sched.cancel(job, EngineFailed("late"))
        assert_dense_right(job)
        assert sched.counters["cancelled_texts"] == 0


# ---------------------------------------------------------------------------- failures
def fail_on_poison(error: BaseException):
    def fail(rows):
        if any(POISON in r for r in rows):
            raise error
    return fail


def test_a_failed_chunk_fails_every_job_in_it_and_only_those():
    """EngineFailed from session.run fans out to every job of that chunk; others succeed."""
    factory = Factory()
    error = EngineFailed("session.run failed")
    with scheduler(factory, max_chunk=2) as sched:
        with held(sched, factory):
            factory.fail = fail_on_poison(error)
            a = job_of([text(1001, 1002)])
            b = job_of([text(2001, POISON)])
            c = job_of([text(3001, 3002)])
            d = job_of([text(4001, 4002)])
            for job in (a, b, c, d):
                sched.submit(job)
        assert a.future.exception(timeout=TIMEOUT) is error
        assert b.future.exception(timeout=TIMEOUT) is error
        assert_dense_right(c)
        assert_dense_right(d)
    assert [len(call.rows) for call in factory.calls[1:]] == [2, 2]


def test_a_failed_jobs_other_texts_are_not_run():
    """Once a job has failed, its texts still queued are dropped instead of computed."""
    factory = Factory(fail=fail_on_poison(EngineFailed("bad chunk")))
    with scheduler(factory, max_chunk=1) as sched:
        with held(sched, factory):
            job = job_of([text(POISON), text(1001), text(1002, 1003)])
            other = job_of(unique_texts(2, [1]))
            sched.submit(job)
            sched.submit(other)
        with pytest.raises(EngineFailed):
            job.future.result(timeout=TIMEOUT)
        assert_dense_right(other)
    assert not any(owner(r) == 1 for r in factory.rows_run())
    assert sched.stats()["queue_tokens"] == 0


def test_a_worker_survives_an_unexpected_exception():
    """A non-bgeserve exception fails that chunk's jobs with EngineFailed; serving goes on."""
    factory = Factory(fail=fail_on_poison(RuntimeError("boom")))
    with scheduler(factory) as sched:
        bad = job_of([text(POISON)])
        with pytest.raises(EngineFailed, match="boom"):
            sched.submit(bad).result(timeout=TIMEOUT)
        good = job_of(unique_texts(1, [3]))
        sched.submit(good)
        assert_dense_right(good)
        assert sched.stats()["live"] == 1


def test_out_of_memory_splits_the_chunk_and_retries():
    """OutOfMemory for a multi-text chunk halves it until it runs; results stay right."""
    def fail(rows):
        if len(rows) > 1:
            raise OutOfMemory("arena")

    factory = Factory(fail=fail)
    with scheduler(factory, max_chunk=64) as sched:
        job = job_of(unique_texts(1, [2, 5, 3, 4, 1]))
        sched.submit(job)
        assert_dense_right(job)
        assert sched.counters["oom_splits"] > 0
    assert sorted(len(c.rows) for c in factory.calls if len(c.rows) == 1) == [1] * 5


def test_a_single_text_out_of_memory_is_too_large_for_its_job_only():
    """A text that runs out of memory alone fails its job with TooLarge naming the input."""
    def fail(rows):
        if any(len(r) > 20 for r in rows):
            raise OutOfMemory("cannot allocate 9 GiB")

    factory = Factory()
    with scheduler(factory, max_chunk=64) as sched:
        with held(sched, factory):
            factory.fail = fail
            big = job_of(unique_texts(1, [2, 30]))
            small = job_of(unique_texts(2, [3, 4]))
            sched.submit(big)
            sched.submit(small)
        error = big.future.exception(timeout=TIMEOUT)
        assert_dense_right(small)
    assert isinstance(error, TooLarge)
    assert error.param == "input[1]"
    assert "cannot allocate 9 GiB" in error.message and "{exc}" not in error.message


def test_the_scheduler_tells_an_idle_unload_from_a_dropped_session():
    """``idle_unloaded`` counts sessions unloaded for idleness (/health/deep then answers
    "idle" without loading them), not one dropped after a runtime failure (a chunk reopens
    it, and the canary must run); a session opening again clears it."""
    factory = Factory()
    with scheduler(factory, idle_timeout_s=0.3) as sched:
        assert wait_until(lambda: sched.stats()["idle_unloaded"] == 1)
        assert sched.stats()["loaded"] == 0
        job = job_of(unique_texts(1, [2]))
        sched.submit(job)
        assert_dense_right(job)
        assert sched.stats()["idle_unloaded"] == 0
        sched._reopen_later(0, "a test failure")
        assert sched.stats()["loaded"] == 0 and sched.stats()["idle_unloaded"] == 0


def test_the_canary_does_not_keep_an_idle_session_loaded():
    """Solo chunks (the /health/deep canary) are not work: a probe every period shorter than
    BGE_M3_IDLE_TIMEOUT_SECS kept the sessions loaded for good after one request; the idle
    timer runs from the last real chunk's end."""
    factory = Factory()
    with scheduler(factory, idle_timeout_s=0.4) as sched:
        job = job_of(unique_texts(1, [2]))
        sched.submit(job)
        assert_dense_right(job)
        began = time.monotonic()
        while not factory.closed.is_set() and time.monotonic() - began < 3.0:
            canary = job_of(unique_texts(2, [2]), solo=True)
            sched.submit(canary)
            assert_dense_right(canary)
            time.sleep(0.1)
        assert factory.closed.is_set(), "the canaries kept the session loaded"
        assert time.monotonic() - began >= 0.3


def test_a_failed_reload_fails_the_chunk_and_the_next_job_retries():
    """ModelUnavailable from open_forward fails that chunk's jobs; the next job loads again."""
    factory = Factory()
    with scheduler(factory, idle_timeout_s=0.05) as sched:
        assert factory.closed.wait(TIMEOUT)
        assert sched.stats()["loaded"] == 0
        factory.open_error = ModelUnavailable("model file vanished")
        first = job_of(unique_texts(1, [2]))
        with pytest.raises(ModelUnavailable, match="vanished"):
            sched.submit(first).result(timeout=TIMEOUT)
        second = job_of(unique_texts(2, [2]))
        sched.submit(second)
        assert_dense_right(second)
    assert len(factory.forwards) == 2


def test_an_unexpected_load_error_becomes_engine_failed():
    """A foreign exception from open_forward fails the chunk with EngineFailed, not a hang."""
    factory = Factory(open_error=OSError("disk on fire"))
    with scheduler(factory, preload=False) as sched:
        with pytest.raises(EngineFailed, match="disk on fire"):
            sched.submit(job_of(unique_texts(1, [2]))).result(timeout=TIMEOUT)
        job = job_of(unique_texts(2, [2]))
        sched.submit(job)
        assert_dense_right(job)


# --------------------------------------------------------------------------- admission
def test_a_full_queue_refuses_with_overloaded():
    """Beyond max_queue_tokens waiting, submit raises Overloaded with a retry hint."""
    factory = Factory()
    with scheduler(factory, max_queue_tokens=10) as sched:
        with held(sched, factory):
            queued = job_of([text(*range(100, 104))])  # 6 tokens
            sched.submit(queued)
            with pytest.raises(Overloaded) as info:
                sched.submit(job_of([text(*range(200, 203))]))  # 5 more: 11 > 10
            assert info.value.retry_after > 0
            assert "limit 10, EngineConfig(scheduler=SchedulerConfig(max_queue_tokens=...))" \
                in info.value.message
            exact = job_of([text(*range(300, 302))])  # 4 more: exactly 10
            sched.submit(exact)
        assert_dense_right(queued)
        assert_dense_right(exact)
        assert sched.counters["rejected"] == 1


def test_check_room_refuses_a_bound_that_cannot_fit_without_queueing_anything():
    """check_room: the same rule as submit, for a lower bound of a request's tokens."""
    factory = Factory()
    with scheduler(factory, max_queue_tokens=10) as sched:
        sched.check_room(1000)  # an empty queue takes anything
        assert sched.room() == 10
        with held(sched, factory):
            queued = job_of([text(*range(100, 104))])  # 6 tokens
            sched.submit(queued)
            assert sched.room() == 4
            sched.check_room(4)
            with pytest.raises(Overloaded):
                sched.check_room(5)
            assert sched.stats()["queue_tokens"] == 6
        assert_dense_right(queued)
        assert sched.counters["rejected"] == 1


def test_an_oversized_job_is_accepted_when_the_queue_is_empty():
    """A single job larger than max_queue_tokens still runs if nothing else waits."""
    with scheduler(max_queue_tokens=5) as sched:
        job = job_of(unique_texts(1, [10, 12]))
        sched.submit(job)
        assert_dense_right(job)


# --------------------------------------------------------------------------- lifecycle
def test_flush_runs_queued_texts_without_waiting_out_the_batch_window():
    factory = Factory()
    with scheduler(factory, batch_delay_s=30.0) as sched:
        job = job_of(unique_texts(1, [3, 4]))
        sched.submit(job)
        time.sleep(0.05)
        assert not job.future.done()  # held for the 30 s window
        sched.flush()
        assert_dense_right(job)


def test_abort_answers_queued_and_running_jobs_at_once_and_takes_no_more():
    """A running chunk's job and the queued ones get the error now; the running chunk's late
    results are dropped; later submits are refused."""
    factory = Factory(gate=threading.Event())
    with scheduler(factory, max_chunk=1) as sched:
        running = job_of([text(7)])
        sched.submit(running)
        assert factory.entered.wait(TIMEOUT)
        queued = [job_of([text(100 + i)]) for i in range(3)]
        for job in queued:
            sched.submit(job)
        assert sched.abort(NotReady("shutting down")) == 4
        for job in [running, *queued]:
            with pytest.raises(NotReady):
                job.future.result(timeout=TIMEOUT)
        assert sched.stats()["queue_texts"] == 0
        with pytest.raises(NotReady):
            sched.submit(job_of([text(5)]))
        factory.gate.set()
        assert wait_until(lambda: sched.stats()["busy"] == 0)
    assert len(factory.calls) == 1  # the queued texts never ran


def test_idle_sessions_are_unloaded_and_reloaded_on_demand(monkeypatch):
    """After idle_timeout_s the session is closed and the heap trimmed (the freed weights go
    back to the OS); the next job opens a new one and succeeds."""
    trims: list[bool] = []
    monkeypatch.setattr(workers_module.memory, "trim_heap", lambda: trims.append(True))
    factory = Factory()
    with scheduler(factory, idle_timeout_s=0.05) as sched:
        first = job_of(unique_texts(1, [2]))
        sched.submit(first)
        assert_dense_right(first)
        # Polled: the session may also have gone idle before the first job came.
        assert wait_until(lambda: sched.stats()["loaded"] == 0
                          and all(f.closed for f in factory.forwards))
        assert trims
        opened = len(factory.forwards)
        second = job_of(unique_texts(2, [3]))
        sched.submit(second)
        assert_dense_right(second)
        assert len(factory.forwards) == opened + 1
        assert factory.forwards[-1].worker == 0
        assert factory.calls[-1].forward is factory.forwards[-1]


def test_without_preload_the_first_job_loads_the_session():
    """start(preload=False) opens nothing until work arrives."""
    factory = Factory()
    with scheduler(factory, preload=False) as sched:
        assert sched.stats()["loaded"] == 0 and sched.stats()["live"] == 1
        job = job_of(unique_texts(1, [2]))
        sched.submit(job)
        assert_dense_right(job)
        assert sched.stats()["loaded"] == 1


def test_stop_finishes_queued_work_then_refuses_new_jobs():
    """stop() drains the queue, closes the session, and later submits raise NotReady."""
    factory = Factory()
    sched = Scheduler(factory, None, config(max_chunk=1))
    sched.start()
    with held(sched, factory):
        jobs = [job_of(unique_texts(tag, [2, 3])) for tag in (1, 2)]
        for job in jobs:
            sched.submit(job)
        threading.Timer(0.05, factory.gate.set).start()
        sched.stop(timeout=TIMEOUT)
    for job in jobs:
        assert_dense_right(job)
    assert sched.stats() == {"total": 1, "live": 0, "loaded": 0, "idle_unloaded": 0, "busy": 0,
                             "queue_texts": 0, "queue_tokens": 0}
    assert factory.forwards[0].closed
    with pytest.raises(NotReady):
        sched.submit(job_of(unique_texts(3, [2])))


def test_stop_fails_what_it_could_not_finish_in_time():
    """Work still queued when stop's timeout runs out gets NotReady; the running chunk finishes."""
    factory = Factory()
    sched = Scheduler(factory, None, config())
    sched.start()
    with held(sched, factory) as blocker:
        queued = job_of(unique_texts(1, [2]))
        sched.submit(queued)
        sched.stop(timeout=0.05)
        with pytest.raises(NotReady):
            queued.future.result(timeout=TIMEOUT)
    blocker.future.result(timeout=TIMEOUT)
    assert wait_until(lambda: sched.stats()["live"] == 0)
    assert not any(owner(r) == 1 for r in factory.rows_run())


def test_stats_report_the_queue():
    """stats() counts workers, loaded sessions, busy workers and the waiting texts and tokens."""
    factory = Factory()
    with scheduler(factory) as sched, held(sched, factory):
        sched.submit(job_of(unique_texts(1, [2, 3])))
        assert sched.stats() == {"total": 1, "live": 1, "loaded": 1, "idle_unloaded": 0,
                                 "busy": 1, "queue_texts": 2, "queue_tokens": 9}


# ------------------------------------------------------------------------------- chaos
def test_every_job_gets_exactly_one_answer_under_random_faults():
    """Random jobs, sizes and faults over two workers: every future resolves, correct or
    failed with a bgeserve error, and none is answered twice."""
    rng = random.Random(1234)

    def fail(rows):
        roll = rng.random()
        if roll < 0.1:
            raise OutOfMemory("oom")
        if roll < 0.15:
            raise EngineFailed("flaky")
        if roll < 0.2:
            raise RuntimeError("bug")

    factory = Factory(fail=fail)
    answers: list[int] = []
    with scheduler(factory, workers=2, max_chunk=8, fits=lambda b, s: b * s <= 200) as sched:
        jobs = []
        for tag in range(1, 60):
            job = job_of(unique_texts(tag, [rng.randint(0, 30) for _ in range(rng.randint(1, 6))]))
            job.future.add_done_callback(lambda f, tag=tag: answers.append(tag))
            if rng.random() < 0.1:
                job.deadline = time.monotonic() - 1
            jobs.append(job)
            sched.submit(job)
            if rng.random() < 0.1:
                sched.cancel(job)
        for job in jobs:
            if job.future.cancelled():
                continue
            error = job.future.exception(timeout=TIMEOUT)
            if error is None:
                assert_dense_right(job)
            else:
                assert isinstance(error, BgeServeError)
        assert sched.stats()["queue_texts"] == 0 and sched.stats()["queue_tokens"] == 0
    assert sorted(answers) == list(range(1, 60))


def test_cancel_counts_only_the_cancelled_jobs_texts():
    """cancelled_texts counts the cancelled job's dropped texts, and other jobs' expired ones
    once (by their expiry, not again by the cancel's purge)."""
    factory = Factory()
    with scheduler(factory) as sched:
        with held(sched, factory):
            late = job_of(unique_texts(1, [2, 3]), deadline=time.monotonic() - 1.0)
            doomed = job_of(unique_texts(2, [2, 3, 4]))
            sched.submit(late)
            sched.submit(doomed)
            sched.cancel(doomed)
        with pytest.raises(DeadlineExceeded):
            late.future.result(timeout=TIMEOUT)
        assert sched.counters["cancelled_texts"] == 3 + 2
        assert sched.counters["deadline_exceeded"] == 1


# ------------------------------------------------------------------------- supervision
def answers_of(job: Job) -> list[object]:
    """Every answer the job's future gets (a future can be resolved once; this shows it)."""
    seen: list[object] = []
    job.future.add_done_callback(lambda f: seen.append(f.exception() or f.result()))
    return seen


def kill_next_chunk(sched: Scheduler, times: int = 1, take: bool = True) -> list[int]:
    """Make the worker loop die in ``_next_chunk`` (outside a chunk's error handling) the next
    ``times`` calls; with ``take``, after the chunk was taken off the queue. Returns a list
    that grows by one per kill."""
    real = sched._next_chunk
    kills: list[int] = []

    def dying(worker: int):
        if len(kills) >= times:
            return real(worker)
        chunk = real(worker) if take else None
        if take and not isinstance(chunk, list):
            return chunk
        kills.append(worker)
        raise RuntimeError("worker bug outside the chunk")

    sched._next_chunk = dying  # type: ignore[method-assign]
    return kills


def started(factory: Factory, patch: Callable[[Scheduler], object] = lambda s: None,
            **kw) -> Scheduler:
    """A scheduler patched by ``patch`` before its worker threads start."""
    sched = Scheduler(factory, None, config(**kw))
    patch(sched)
    sched.start()
    return sched


def test_a_worker_killed_outside_a_chunk_is_restarted_and_the_next_job_succeeds():
    """The dying worker's chunk is failed once with EngineFailed; a new thread with a fresh
    session takes over and serves the next job."""
    factory = Factory()
    kills: list[list[int]] = []
    sched = started(factory, lambda s: kills.append(kill_next_chunk(s)))
    try:
        first_thread = sched._threads[0]
        victim = job_of(unique_texts(1, [2, 3]))
        seen = answers_of(victim)
        sched.submit(victim)
        error = victim.future.exception(timeout=TIMEOUT)
        assert isinstance(error, EngineFailed) and error.code == "engine_failed"
        assert "died" in error.message
        assert kills == [[0]]
        assert wait_until(lambda: sched.stats()["live"] == 1)
        assert sched._threads[0] is not first_thread
        assert sched.counters["worker_restarts"] == 1
        assert factory.forwards[0].closed  # the dead worker's session is not reused
        after = job_of(unique_texts(2, [4]))
        sched.submit(after)
        assert_dense_right(after)
        assert factory.calls[-1].forward is factory.forwards[-1] is not factory.forwards[0]
        assert seen == [error]
        assert not any(owner(r) == 1 for r in factory.rows_run())
    finally:
        sched.stop(timeout=TIMEOUT)


def test_a_worker_that_keeps_dying_backs_off_and_is_not_live():
    """A crash loop restarts with a growing delay (no spinning); meanwhile the worker is not
    live; stop() interrupts the backoff and answers what waits."""
    factory = Factory()
    sched = started(factory, lambda s: kill_next_chunk(s, times=10**6, take=False))
    try:
        assert wait_until(lambda: sched.counters["worker_restarts"] >= 3)
        # 3 deaths take 0.1 + 0.2 s of backoff; the 4th waits 0.4 s more, the 5th 0.8 s.
        time.sleep(0.3)
        assert sched.counters["worker_restarts"] <= 4
        assert wait_until(lambda: sched.stats()["live"] == 0)
        waiting = job_of(unique_texts(1, [2]))
        sched.submit(waiting)
    finally:
        began = time.monotonic()
        sched.stop(timeout=TIMEOUT)
    assert time.monotonic() - began < 1.0
    assert isinstance(waiting.future.exception(timeout=TIMEOUT), NotReady)
    assert factory.calls == []


def test_a_poisoned_session_is_reopened_for_the_next_chunk():
    """After session.run fails with EngineFailed the session is closed; the next job runs on a
    freshly opened one instead of failing forever."""
    factory = Factory()
    with scheduler(factory) as sched:
        factory.forwards[0].poisoned = True
        bad = job_of(unique_texts(1, [2]))
        with pytest.raises(EngineFailed, match="poisoned"):
            sched.submit(bad).result(timeout=TIMEOUT)
        assert factory.forwards[0].closed
        assert sched.counters["worker_restarts"] == 1
        good = job_of(unique_texts(2, [3]))
        sched.submit(good)
        assert_dense_right(good)
        assert len(factory.forwards) == 2
        assert factory.calls[-1].forward is factory.forwards[1]
        assert sched.stats()["live"] == 1 and sched.stats()["loaded"] == 1


def test_input_errors_do_not_reopen_the_session():
    """Only runtime failures (EngineFailed) reopen: a TooLarge from run keeps the session."""
    factory = Factory(fail=fail_on_poison(TooLarge("too long")))
    with scheduler(factory) as sched:
        with pytest.raises(TooLarge):
            sched.submit(job_of([text(POISON)])).result(timeout=TIMEOUT)
        job = job_of(unique_texts(1, [2]))
        sched.submit(job)
        assert_dense_right(job)
        assert len(factory.forwards) == 1 and not factory.forwards[0].closed
        assert sched.counters["worker_restarts"] == 0


def test_after_a_runtime_failure_an_oom_splits_other_half_runs_on_a_fresh_session():
    """OOM splits a chunk; its first half poisons the session; the second half reopens."""
    factory = Factory()

    def fail(rows):
        if len(rows) > 1:
            raise OutOfMemory("arena")
        if owner(rows[0]) == 1:
            factory.forwards[-1].poisoned = True
            raise EngineFailed("device lost")

    with scheduler(factory, max_chunk=64, batch_delay_s=0.2) as sched:
        factory.fail = fail
        a, b = job_of(unique_texts(1, [2])), job_of(unique_texts(2, [3]))
        sched.submit(a)
        sched.submit(b)
        with pytest.raises(EngineFailed, match="device lost"):
            a.future.result(timeout=TIMEOUT)
        assert_dense_right(b)
    assert len(factory.forwards) == 2
    assert factory.calls[-1].forward is factory.forwards[1]


def test_a_session_that_fails_to_close_does_not_kill_the_worker():
    """An error from close() on idle unload is logged; the worker lives and reloads."""
    factory = Factory()
    with scheduler(factory, idle_timeout_s=0.05) as sched:
        factory.forwards[0].close_error = RuntimeError("close failed")
        assert factory.closed.wait(TIMEOUT)
        assert wait_until(lambda: sched.stats()["loaded"] == 0)
        assert sched.stats()["live"] == 1
        job = job_of(unique_texts(1, [2]))
        sched.submit(job)
        assert_dense_right(job)
        assert sched.counters["worker_restarts"] == 0


def test_workers_whose_session_cannot_open_are_not_live_until_it_opens():
    """Open failures answer the chunk and take the worker out of ``live``; one broken worker
    leaves the other serving; all broken: every job still gets an answer; healed: live again."""
    factory = Factory(broken={1: ModelUnavailable("model file vanished")})
    with scheduler(factory, workers=2, preload=False, max_chunk=1) as sched:
        factory.gate = threading.Event()
        jobs = [job_of(unique_texts(tag, [2])) for tag in (1, 2)]
        for job in jobs:
            sched.submit(job)  # worker 0 blocks on the gate, so worker 1 gets one
        assert wait_until(lambda: sched.stats()["live"] == 1)
        factory.gate.set()
        errors = [job.future.exception(timeout=TIMEOUT) for job in jobs]
        assert any(isinstance(e, ModelUnavailable) for e in errors)
        assert sched.stats()["loaded"] <= 1

        factory.broken[0] = ModelUnavailable("model file vanished")
        sched._drop_session(0)  # as idle unload would
        for tag in range(3, 100):
            if sched.stats()["live"] == 0:
                break
            with pytest.raises(ModelUnavailable):
                sched.submit(job_of(unique_texts(tag, [2]))).result(timeout=TIMEOUT)
        assert sched.stats()["live"] == 0 and sched.stats()["loaded"] == 0

        factory.broken.clear()
        for tag in range(100, 200):
            if sched.stats()["live"] == 2:
                break
            job = job_of(unique_texts(tag, [2]))
            sched.submit(job)
            assert_dense_right(job)
        assert sched.stats()["live"] == 2


def test_when_no_worker_can_be_restarted_waiting_jobs_are_answered():
    """If a dead worker cannot be replaced and none is left, queued jobs get NotReady at once,
    new ones are refused, and stats show no live worker."""
    factory = Factory()
    sched = started(factory, lambda s: kill_next_chunk(s), batch_delay_s=0.2, max_chunk=1)
    try:
        def no_thread(w: int, delay: float) -> None:
            raise RuntimeError("can't start new thread")

        sched._spawn = no_thread  # type: ignore[method-assign]
        held_job, queued = job_of(unique_texts(1, [2])), job_of(unique_texts(2, [2]))
        sched.submit(held_job)
        sched.submit(queued)
        assert isinstance(held_job.future.exception(timeout=TIMEOUT), EngineFailed)
        assert isinstance(queued.future.exception(timeout=TIMEOUT), NotReady)
        assert wait_until(lambda: not sched._threads[0].is_alive())
        assert sched.stats()["live"] == 0
        with pytest.raises(NotReady, match="no worker"):
            sched.submit(job_of(unique_texts(3, [2])))
    finally:
        sched.stop(timeout=TIMEOUT)


def test_a_future_cancelled_by_its_caller_does_not_cost_its_chunk_mates_their_answer():
    """asyncio's wrap_future cancels the job's future when the awaiting task is cancelled;
    resolving it then must not raise in the worker and skip the other jobs of the chunk."""
    factory = Factory(gate=threading.Event())
    with scheduler(factory, max_chunk=64, batch_delay_s=0.2) as sched:
        a, b = job_of(unique_texts(1, [2])), job_of(unique_texts(2, [3]))  # a's row comes first
        sched.submit(a)
        sched.submit(b)
        assert factory.entered.wait(TIMEOUT)
        assert a.future.cancel()
        factory.gate.set()
        assert_dense_right(b)
        assert sched.counters["worker_restarts"] == 0
