"""Tests for bgeserve.pending: the queue's bookkeeping without threads or a model."""

from __future__ import annotations

import itertools

import numpy as np

from bgeserve.engine import queue as pending
from bgeserve.engine.binpack import plan
from bgeserve.engine.jobs import Job
from bgeserve.engine.queue import PendingQueue
from bgeserve.results import EmbedOptions


def job(*lengths: int, deadline: float | None = None) -> Job:
    return Job([np.arange(n) for n in lengths], np.zeros(len(lengths), bool), EmbedOptions(),
               deadline=deadline)


def pack(max_chunk: int):
    return lambda lengths, until=None: plan(lengths, fits=lambda b, s: True,
                                            max_chunk=max_chunk, until=until)


def test_add_counts_texts_and_tokens():
    q = PendingQueue()
    q.add(job(3, 5), now=1.0)
    q.add(job(7), now=2.0)
    assert len(q) == 3 and q.tokens == 15 and q.oldest_arrival() == 1.0
    assert q.squares == 9 + 25 + 49
    assert [(p.index, p.length) for p in q] == [(0, 3), (1, 5), (0, 7)]


def test_take_always_holds_the_oldest_text_as_the_packer_groups_it():
    q = PendingQueue()
    old, new = job(100), job(10, 11, 99, 101)
    q.add(old, 0.0)
    q.add(new, 1.0)
    # Sorted 10 11 99 | 100 101 in chunks of three: the oldest (100) runs first, with 101.
    picked = q.take(pack(max_chunk=3))
    assert [p.job for p in picked] == [old, new]
    assert [p.length for p in picked] == [100, 101]
    assert len(q) == 3 and q.tokens == 120
    assert [p.length for p in q.take(pack(3))] == [10, 11, 99]
    assert len(q) == 0 and q.tokens == 0


def test_take_without_cross_request_batching_keeps_to_the_oldest_job():
    q = PendingQueue()
    a, b = job(10), job(10, 10)
    q.add(a, 0.0)
    q.add(b, 1.0)
    picked = q.take(pack(8), cross_request=False)
    assert [p.job for p in picked] == [a]
    assert [p.job for p in q.take(pack(8), cross_request=True)] == [b, b]


def test_take_packs_only_a_window_of_the_oldest(monkeypatch):
    monkeypatch.setattr(pending, "WINDOW", 4)
    q = PendingQueue()
    q.add(job(*[5] * 10), 0.0)
    seen: list[int] = []

    def spy(lengths, until=None):
        seen.append(len(lengths))
        return pack(64)(lengths, until)

    assert len(q.take(spy)) == 4
    assert seen == [4] and len(q) == 6 and q.tokens == 30


def test_purge_expires_late_jobs_and_drops_finished_ones():
    q = PendingQueue()
    late, done, live = job(2, 3, deadline=5.0), job(4), job(6, deadline=50.0)
    for j in (late, done, live):
        q.add(j, 0.0)
    done.done = True
    expired: list[Job] = []

    def expire(j: Job) -> None:
        expired.append(j)
        j.done = True

    assert q.purge(now=10.0, expire=expire) == 3
    assert expired == [late]
    assert [p.job for p in q] == [live] and q.tokens == 6


def test_drain_empties_the_queue():
    q = PendingQueue()
    j = job(1, 2)
    q.add(j, 0.0)
    assert [p.index for p in q.drain()] == [0, 1]
    assert len(q) == 0 and q.tokens == 0 and q.squares == 0


def test_requests_take_turns_and_the_anchor_joins_the_window_from_past_it(monkeypatch):
    """A job served longer ago goes before one served since; a new job's text past the
    packing window still anchors the next chunk."""
    monkeypatch.setattr(pending, "WINDOW", 4)
    q = PendingQueue()
    bulk, query = job(*[5] * 10), job(7)
    q.add(bulk, 0.0)
    assert [p.job for p in q.take(pack(1))] == [bulk]  # bulk had its turn
    q.add(query, 1.0)  # arrives behind nine bulk texts, outside the window of four
    picked = q.take(pack(1))
    assert [(p.job, p.length) for p in picked] == [(query, 7)]
    assert [p.job for p in q.take(pack(1))] == [bulk]
    assert len(q) == 8 and q.tokens == 40


def test_take_solo_takes_the_solo_piece_alone_and_counts_it_out_everywhere():
    """The canary's piece comes out alone past older pieces; the solo count follows every
    way a piece leaves (take_solo, take, purge, drain): a count left behind would make
    take_solo look for a piece that is not there (an AssertionError naming the bug)."""
    def solo_job(n: int) -> Job:
        j = job(n)
        j.solo = True
        return j

    q = PendingQueue()
    assert q.take_solo(pack(8)) is None
    first, canary = job(4, 6), solo_job(9)
    q.add(first, 0.0)
    q.add(canary, 1.0)
    taken = q.take_solo(pack(8))
    assert taken is not None and [p.job for p in taken] == [canary] and taken.pad_to == 9
    assert len(q) == 2 and q.tokens == 10 and q.take_solo(pack(8)) is None
    q.add(again := solo_job(3), 2.0)
    assert [p.job for p in q.take(pack(8))] == [first, first]  # the older job's turn
    assert [p.job for p in q.take(pack(8))] == [again] and q.take_solo(pack(8)) is None
    q.add(late := solo_job(2), 3.0)
    late.done = True
    q.purge(4.0, lambda j: None)
    assert q.take_solo(pack(8)) is None
    q.add(solo_job(2), 5.0)
    q.drain()
    assert q.take_solo(pack(8)) is None and q.tokens == 0


class OneDeque:
    """The queue as it was first written, one deque of every piece (each chunk walked the
    whole of it three times), with the turns as they are now: the oracle for the queue held
    job by job."""

    def __init__(self) -> None:
        self.pieces: list[tuple[Job, int, int]] = []  # (job, index, length), arrival order
        self.turn = 0
        self.served: dict[int, int] = {}

    def add(self, j: Job) -> None:
        self.pieces += [(j, i, len(j.ids[i])) for i in j.pending()]
        waiting = len({id(p[0]) for p in self.pieces if p[0] is not j})
        self.served[id(j)] = self.turn - max(pending.NEW_LEAD, waiting)

    def purge(self, now: float) -> None:
        self.pieces = [p for p in self.pieces if not p[0].done
                       and not (p[0].deadline is not None and now > p[0].deadline)]

    def take(self, max_chunk: int) -> list[tuple[Job, int]]:
        order: list[Job] = []
        for j, _, _ in self.pieces:
            if j not in order:
                order.append(j)
        if any(j.solo for j in order):
            first = next(p for p in self.pieces if p[0].solo)
            self.pieces.remove(first)
            self.turn += 1
            self.served[id(first[0])] = self.turn
            return [first[:2]]
        best = min(order, key=lambda j: (self.served[id(j)], order.index(j)))
        jobs = [j for j in order if not j.solo]
        share = max(1, pending.WINDOW // len(jobs))
        heads = [[p for p in self.pieces if p[0] is j] for j in jobs]
        window = [p for h in heads for p in h[:share]][:pending.WINDOW]
        window += [p for h in heads for p in h[share:]][:pending.WINDOW - len(window)]
        anchor = next(p for p in self.pieces if p[0] is best)
        if anchor not in window:
            window.insert(0, anchor)
        chunk = next(c for c in pack(max_chunk)([p[2] for p in window])
                     if window.index(anchor) in c.indices)
        picked = [window[i] for i in chunk.indices]
        self.pieces = [p for p in self.pieces if p not in picked]
        self.turn += 1
        for p in picked:
            self.served[id(p[0])] = self.turn
        return [p[:2] for p in picked]


def test_the_queue_held_job_by_job_takes_what_one_deque_took(monkeypatch):
    """Random arrivals, cancels, deadlines, solo jobs and takes, with a window smaller than
    the queue: every chunk, count, token total and sum of lengths squared (what admission
    counts attention's work by) as the single deque gave them."""
    monkeypatch.setattr(pending, "WINDOW", 16)
    rng = np.random.default_rng(7)
    expired: list[Job] = []

    def expire(j: Job) -> None:
        expired.append(j)
        j.done = True

    for _ in range(40):
        q, oracle, jobs, now = PendingQueue(), OneDeque(), [], 0.0
        max_chunk = int(rng.integers(1, 6))
        for _ in range(60):
            now += 1.0
            roll = rng.random()
            if roll < 0.3 or not len(q):
                j = job(*rng.integers(1, 40, int(rng.integers(1, 12))).tolist(),
                        deadline=now + float(rng.integers(1, 30)) if rng.random() < 0.3
                        else None)
                j.solo = bool(rng.random() < 0.1)
                jobs.append(j)
                q.add(j, now)
                oracle.add(j)
            elif roll < 0.4:
                jobs[int(rng.integers(len(jobs)))].done = True  # cancelled or failed
            else:
                expired.clear()
                q.purge(now, expire)
                oracle.purge(now)
                assert all(j.deadline is not None and j.deadline < now for j in expired)
                if not len(q):
                    continue
                solo = q.take_solo(pack(max_chunk))
                taken = solo if solo is not None else q.take(pack(max_chunk))
                assert [(p.job, p.index) for p in taken] == oracle.take(max_chunk)
            assert [(p.job, p.index) for p in q] == [p[:2] for p in oracle.pieces]
            assert len(q) == len(oracle.pieces)
            assert q.tokens == sum(p[2] for p in oracle.pieces)
            assert q.squares == sum(p[2] ** 2 for p in oracle.pieces)


def by_256_tokens(lengths, until=None):  # the CPU's chunks: each 300-token text alone
    return plan(lengths, fits=lambda b, s: True, max_chunk=64, max_tokens=256, until=until)


def test_a_request_served_gets_its_turn_under_a_stream_of_new_ones():
    """Four query clients that send again as soon as they are answered, beside a 500-text
    ingestion request: a request never served went ahead of every request served, and the
    ingestion request had 1 of 1,000 chunks. Now it waits at most for the requests waiting
    when it was last served (4) and those arriving within NEW_LEAD chunks after (the lead
    here: no more requests wait), and a query still goes ahead of it."""
    q = PendingQueue()
    bulk = job(*[300] * 2000)
    for j in [bulk] + [job(10) for _ in range(4)]:
        q.add(j, 0.0)
    bulk_chunks: list[int] = []
    for chunk in range(1, 1001):
        taken = q.take(by_256_tokens)
        if any(p.job is bulk for p in taken):
            bulk_chunks.append(chunk)
        for p in taken:
            if p.job is not bulk:
                q.add(job(10), 0.0)
    gaps = [b - a for a, b in itertools.pairwise([0, *bulk_chunks])]
    assert max(gaps) <= 4 + pending.NEW_LEAD, gaps
    assert len(bulk_chunks) >= 1000 // (4 + pending.NEW_LEAD) - 1, len(bulk_chunks)
    while len(q) > q.waiting(bulk):  # the queries answered, their clients gone
        assert not any(p.job is bulk for p in q.take(by_256_tokens))
    assert [p.job for p in q.take(by_256_tokens)] == [bulk]
    q.add(query := job(10), 0.0)  # arrives while an ingestion chunk runs: it goes next
    assert [p.job for p in q.take(by_256_tokens)] == [query]


def test_a_query_behind_many_ingestion_requests_in_turns_waits_about_one_chunk():
    """Forty ingestion requests taking turns: a query that came counted as served 8 turns
    before, and waited behind every request not served since, 32 chunks (review). Its lead is
    at least the requests waiting."""
    q = PendingQueue()
    ingestion = [job(*[300] * 50) for _ in range(40)]
    for j in ingestion:
        q.add(j, 0.0)
    for _ in range(100):  # each has had its turns
        q.take(by_256_tokens)
    q.add(query := job(10), 1.0)
    firsts = [q.take(by_256_tokens)[0].job for _ in range(2)]
    assert query in firsts


def test_queries_behind_a_large_request_share_a_chunk():
    """The window was the first WINDOW texts in arrival order: queries behind a large
    request lay past it, and each ran alone, a run each. Each job's first texts are in it."""
    q = PendingQueue()
    bulk = job(*[300] * (3 * pending.WINDOW))
    q.add(bulk, 0.0)
    assert [p.job for p in q.take(by_256_tokens)] == [bulk]
    queries = [job(10) for _ in range(4)]
    for j in queries:
        q.add(j, 1.0)
    assert [p.job for p in q.take(by_256_tokens)] == queries
