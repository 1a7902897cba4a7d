"""AdmissionGate and DrainMeter: the cheap admission before tokenizing, and Retry-After."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from bgeserve.errors import Overloaded
from bgeserve.service.admission import (
    MAX_RETRY_AFTER_S,
    QUEUE_DEADLINE_SHARE,
    AdmissionGate,
    DrainMeter,
)


def engine_standin(**fields: Any) -> Any:
    """An engine as admission reads it: nothing queued, waiting or running, no run cost,
    unless ``fields`` say otherwise."""
    from types import SimpleNamespace

    return SimpleNamespace(**{"queued_tokens": lambda: 0, "queued_squares": lambda: 0,
                              "run_cost": None, "running": list, "waiting": lambda job: 1,
                              **fields})


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_drain_rate_is_tokens_per_second_of_running() -> None:
    """Tokens of the chunks in the window over the time they ran: idle gaps between them do
    not count, and once the window has passed the last rate stays (the queue is idle, not
    infinitely slow)."""
    clock = Clock()
    meter = DrainMeter(window=10.0, clock=clock)
    assert meter.rate() == 0.0
    meter.record(1000, 0.5)
    assert meter.rate() == pytest.approx(2000.0)
    clock.t += 2  # 1.5 s idle, then another chunk of 0.5 s
    meter.record(1000, 0.5)
    assert meter.rate() == pytest.approx(2000.0)
    clock.t += 30
    assert meter.rate() == pytest.approx(2000.0)
    meter.record(600, 1.0)
    assert meter.rate() == pytest.approx(600.0)


def test_a_canarys_chunk_is_the_rate_only_until_work_was_measured() -> None:
    """The canary (a solo chunk: one short text, mostly a run's fixed cost) gives the rate at
    start-up, and once work was measured never replaces it: /health/deep every 20 s made an
    idle server's rate its own, and the next burst was refused for it."""
    clock = Clock()
    meter = DrainMeter(window=10.0, clock=clock)
    meter.record(40, 0.1, solo=True)  # the start-up canary: 400 tokens/s
    assert meter.rate() == pytest.approx(400.0)
    clock.t += 1
    meter.record(1000, 0.5)  # work, in the same window as the canary
    assert meter.rate() == pytest.approx(1040 / 0.6)
    clock.t += 60  # idle; liveness probes' canaries come and go
    meter.record(40, 0.1, solo=True)
    clock.t += 20
    meter.record(40, 0.1, solo=True)
    assert meter.rate() == pytest.approx(1040 / 0.6)  # the work's, not the canary's


def test_runs_of_workers_at_once_count_their_time_once() -> None:
    """Two workers each running 1,000 tokens in the same second drain 2,000 tokens/s; a third
    chunk overlapping the second half of theirs adds only its own new half second."""
    clock = Clock()
    meter = DrainMeter(clock=clock)
    meter.record(1000, 1.0)
    meter.record(1000, 1.0)
    assert meter.rate() == pytest.approx(2000.0)
    clock.t += 0.5
    meter.record(1000, 1.0)  # ran [t-0.5 .. t+0.5] of the others' [t-1 .. t]
    assert meter.rate() == pytest.approx(3000.0 / 1.5)


def test_the_rate_reads_the_newest_chunks_only() -> None:
    """Past MAX_EVENTS chunks in the window (a GPU's), the oldest leave the rate: 600 slow
    chunks then MAX_EVENTS fast ones, one after another, read the fast ones' rate."""
    from bgeserve.service.admission import MAX_EVENTS

    clock = Clock()
    meter = DrainMeter(clock=clock)
    for seconds in [0.01] * 600 + [0.001] * MAX_EVENTS:  # one token each: 100, then 1,000/s
        clock.t += seconds
        meter.record(1, seconds)
    assert meter.rate() == pytest.approx(1000.0)


def test_a_burst_after_an_idle_spell_reads_its_own_speed() -> None:
    """The first chunk of a flood after an idle spell: its tokens over its own run time, not
    over a second of wall clock, so Retry-After says how long the queue really takes (it said
    22-60 s for a queue that drained in 0.2 s)."""
    clock = Clock()
    drain = DrainMeter(clock=clock)
    drain.record(900, 0.01)  # one small chunk of a fast backend, long after the last
    gate = AdmissionGate(20_000, lambda: 20_000, drain)
    assert drain.rate() == pytest.approx(90_000.0)
    assert gate.retry_after(40_000) == 1.0


def _gate(max_tokens: int = 20_000, queued: int = 0, rate: float = 0.0) -> AdmissionGate:
    clock = Clock()
    drain = DrainMeter(clock=clock)
    if rate:
        drain.record(int(rate), 1.0)  # one chunk of `rate` tokens ran for 1 s
    state = {"queued": queued}
    gate = AdmissionGate(max_tokens, lambda: state["queued"], drain)
    gate.state = state  # type: ignore[attr-defined]
    return gate


def test_an_empty_queue_admits_any_request() -> None:
    """Nothing queued or reserved: even a request over the whole queue goes in (alone)."""
    gate = _gate()
    gate.reserve(50_000)
    assert gate.reserved == 50_000
    gate.release(50_000)
    assert gate.reserved == 0


def test_requests_being_tokenized_count_against_the_room() -> None:
    """The second of two simultaneous 15,000-token requests is refused while the first is
    still being tokenized, with no token of its own computed yet; once the first is queued
    (its reservation released, its tokens in the queue) the picture is the same."""
    gate = _gate()
    gate.reserve(15_000)
    with pytest.raises(Overloaded, match="BGE_M3_MAX_QUEUE_TOKENS"):
        gate.reserve(15_000)
    gate.reserve(5_000)  # what is left still fits
    assert gate.room() == 0 and gate.full() is not None  # now nothing fits, no bound needed
    gate.release(5_000)
    gate.release(15_000)
    gate.state["queued"] = 15_000  # type: ignore[attr-defined]
    with pytest.raises(Overloaded):
        gate.reserve(15_000)
    assert gate.reserved == 0 and gate.full() is None


def test_retry_after_comes_from_the_drain_rate() -> None:
    """Needed room over the measured tokens/s, rounded up, at least 1 s, at most 60 s; 1 s
    before any chunk finished."""
    assert _gate(rate=0).retry_after(10_000) == 1.0
    gate = _gate(queued=20_000, rate=4_000)
    assert gate.retry_after(10_000) == 3.0  # 2.5 s rounded up
    assert gate.retry_after(1) == 1.0
    assert gate.retry_after(10**9) == MAX_RETRY_AFTER_S
    with pytest.raises(Overloaded) as caught:
        gate.reserve(6_000)
    assert caught.value.retry_after == 2.0  # 6,000 tokens must drain at 4,000/s


def test_admission_refuses_before_tokenizing_what_cannot_fit() -> None:
    """A request whose lower bound of tokens cannot fit beside what is queued is refused (429,
    counted) before it is tokenized; token ids count as their length; one that may fit is
    tokenized and submitted; with no room at all no bound is computed."""
    import asyncio
    from types import SimpleNamespace

    from bgeserve.results import EmbedOptions
    from bgeserve.service.admission import Admission

    state = {"queued": 900, "bounds": 0, "tokenized": 0}

    def min_tokens(texts: list[str], stop_above: int) -> int:
        state["bounds"] += 1
        return sum(len(t.split()) + 2 for t in texts)

    def make_job(inputs: object, options: object, request_id: str, arrived: float) -> object:
        state["tokenized"] += 1
        return SimpleNamespace(ids=[[0, 5, 2]])

    engine = engine_standin(
        queued_tokens=lambda: state["queued"], make_job=make_job, submit=lambda job: "future",
        tokenizer=SimpleNamespace(min_tokens=min_tokens, max_seq=512))
    admission = Admission(engine, 1000, DrainMeter(), slots=2)  # type: ignore[arg-type]

    async def submit(inputs: list) -> object:
        return await admission.submit(inputs, EmbedOptions(), "r", 0.0)

    with pytest.raises(Overloaded, match="BGE_M3_MAX_QUEUE_TOKENS"):
        asyncio.run(submit(["word " * 200]))
    with pytest.raises(Overloaded):
        asyncio.run(submit([[5] * 200]))  # token ids: their count is the bound
    assert state["tokenized"] == 0 and admission.refused == 2
    _, future = asyncio.run(submit(["a b"]))  # may fit: on to the exact check
    assert future == "future" and state["tokenized"] == 1 and admission.gate.reserved == 0
    state["queued"], bounds = 1000, state["bounds"]
    assert admission.refuse_now() is not None  # no room whatever the size: no bound walked
    with pytest.raises(Overloaded):
        asyncio.run(submit(["a"]))
    assert state["bounds"] == bounds and admission.refused == 4
    admission.close()


def test_the_queue_holds_at_most_a_share_of_the_deadlines_work() -> None:
    """With a deadline (BGE_M3_REQUEST_TIMEOUT_SECS) the queue takes at most what the measured
    drain rate runs in ``QUEUE_DEADLINE_SHARE`` of it: its requests take turns, so past the
    deadline's worth of work they all finish late together (client QA: 64 requests of 0.31 s
    under a 10 s deadline, 1 answered and 63 504s after 10 s of work). Before a rate was
    measured, or with no deadline, BGE_M3_MAX_QUEUE_TOKENS alone; a request alone always goes
    in; the exact tokens are checked too once known (the bound counts words)."""
    clock = Clock()
    drain = DrainMeter(clock=clock)
    state = {"queued": 0}
    gate = AdmissionGate(1_000_000, lambda: state["queued"], drain, deadline_s=10.0)
    assert gate.limit() == 1_000_000  # nothing measured yet
    drain.record(1000, 1.0)  # 1,000 tokens a second of running
    assert gate.limit() == int(1000 * 10 * QUEUE_DEADLINE_SHARE) == 7500
    gate.reserve(20_000)  # alone: let in, whatever it takes
    gate.release(20_000)
    state["queued"] = 5_000
    gate.reserve(2_000)  # 7,000 of 7,500
    with pytest.raises(Overloaded, match="BGE_M3_REQUEST_TIMEOUT_SECS=10") as refused:
        gate.reserve(1_000)
    assert "~7.0s of work are queued" in refused.value.message
    assert refused.value.retry_after == 1.0  # 500 short at 1,000 tokens/s
    with pytest.raises(Overloaded, match="7.5s of it"):
        gate.check_in_time(4_000, 2_000, squares=0)  # the 2,000 reserved are 4,000 tokens: 9,000
    gate.check_in_time(2_400, 2_000, squares=0)  # 7,400: in
    gate.release(2_000)
    state["queued"] = 0
    gate.check_in_time(50_000, 0, squares=0)  # alone
    assert AdmissionGate(1_000_000, lambda: 5_000, drain).limit() == 1_000_000  # no deadline
    # Its own deadline's time left, not the whole deadline: it waited 6 s of its 10 for a
    # tokenizing slot, so 3 s of work fit beside it, not 7.5 (review).
    state["queued"] = 2_000
    gate.check_in_time(1_000, 0, left_s=4.0, squares=0)  # 3,000 of 3,000
    with pytest.raises(Overloaded, match="~2.0s of work are queued") as refused:
        gate.check_in_time(1_001, 0, left_s=4.0, squares=0)
    assert "the ~1.0s free" in refused.value.message  # of the 3 s its time left allows
    gate.check_in_time(0, 0, left_s=0.0, squares=0)  # nothing to queue (the cache answered it all)


def test_a_long_texts_tokens_count_for_their_attention() -> None:
    """Under the deadline's share a text of n tokens is n x (1 + n / A) tokens' worth of work,
    A the length at which attention costs as much as the rest (the probe's run cost, else
    DEFAULT_ATTENTION_TOKENS), in the drain rate and in the queue alike. Counted in plain
    tokens, a rate read off short texts admitted a burst of long ones several times over
    what ran in time (full-size ONNX Runtime int8: 771 tokens/s on a 512-token text, 313 on a
    4,096-token one)."""
    clock = Clock()
    drain = DrainMeter(clock=clock)
    drain.record(1000, 1.0, squares=10 * 100 * 100)  # ten texts of 100 tokens in 1 s
    assert drain.rate() == pytest.approx(1000.0)
    assert drain.work_rate(1000.0) == pytest.approx(1100.0)  # each token 1.1 tokens' worth
    state = {"queued": 100, "squares": 100 * 100}  # one 100-token text waits: 110
    gate = AdmissionGate(1_000_000, lambda: state["queued"], drain, deadline_s=10.0,
                         queued_squares=lambda: state["squares"], attention=lambda: 1000.0)
    budget = 1100.0 * 10 * QUEUE_DEADLINE_SHARE  # 8,250 tokens' worth in 7.5 s
    assert gate.room() == math.floor(budget - 110)
    # Two texts of 2,000 tokens: 4,000 tokens, 12,000 tokens' worth (2,000 x 3 each). In
    # plain tokens they fitted (4,100 of 7,500).
    with pytest.raises(Overloaded, match="~0.1s of work are queued") as refused:
        gate.check_in_time(4_000, 0, squares=2 * 2_000**2)
    assert "takes at most 7.5s" in refused.value.message
    # Past the whole share by itself: it goes in alone, once the 110 held drained.
    assert "let in only when nothing else is queued" in refused.value.message
    assert refused.value.retry_after == 1.0
    gate._kept_until = 0.0  # the queue kept for it meanwhile: its own test, below
    gate.check_in_time(2_000, 0, squares=2_000**2)  # one: 6,000 + 110, in
    # Queued, a long text holds its work's room: 6,110 of 8,250, so a bound of 2,200 tokens
    # does not fit, where 2,100 of 1,000,000 plain tokens would have.
    state.update(queued=2_100, squares=100 * 100 + 2_000**2)
    assert gate.room() == math.floor(budget - 6_110)
    with pytest.raises(Overloaded, match="BGE_M3_REQUEST_TIMEOUT_SECS=10"):
        gate.reserve(2_200)
    gate.reserve(2_000)
    assert gate.limit() == 2_100 + 2_000 + math.floor(budget - 8_110)
    gate.release(2_000)
    state.update(queued=0, squares=0)
    gate.check_in_time(8_000, 0, squares=8_000**2)  # alone: in, whatever it takes
    # Let in alone, it holds more than the share: the queue takes no more, and says so
    # (0 more, not a negative limit: review).
    state.update(queued=8_000, squares=8_000**2)
    assert gate.room() < 0 and gate.limit() == 8_000


def test_retry_soon_where_the_rate_was_measured_on_shorter_texts_than_queued() -> None:
    """Before chunks of the long texts queued have run, their work's rate is a guess off short
    runs (mostly a run's fixed cost): the share's 429 says so, and Retry-After no later than
    UNMEASURED_CHUNKS of their chunks at the probe's speed, at least UNMEASURED_RETRY_S
    (queries behind one ingestion request were told 40 s where it ran in 15-19 s). Once the
    rate was measured on texts as long (within LONGEST_MEMORY_S), or without a probe's speed,
    the Retry-After is the drain's."""
    from bgeserve.service.admission import LONGEST_MEMORY_S, UNMEASURED_RETRY_S

    def refused(lengths: list[int], idle_s: float = 0.0, queries: int = 0,
                needed: int = 10, chunk_s: float | None = 0.1) -> Overloaded:
        clock = Clock()
        drain = DrainMeter(clock=clock)
        for n in lengths:
            clock.t += 0.1
            drain.record(n, n * 1e-4, squares=n * n)  # 10,000 tokens' worth a second
        clock.t += idle_s
        for _ in range(queries):  # after the window, only queries: the same rate
            clock.t += 0.1
            drain.record(40, 40 * 1e-4, squares=40 * 40)
        asked: list[float] = []

        def chunk_seconds(length: float) -> float | None:
            asked.append(length)
            return chunk_s

        gate = AdmissionGate(10_000_000, lambda: 400_000, drain, deadline_s=10.0,
                             queued_squares=lambda: 200 * 2_000**2, attention=lambda: 1e9,
                             chunk_seconds=chunk_seconds)
        with pytest.raises(Overloaded) as caught:
            gate.reserve(needed)
        assert asked in ([], [2_000.0])  # the mean length of what is held
        return caught.value

    guess = refused([40] * 20)
    assert guess.retry_after == UNMEASURED_RETRY_S
    assert "a guess: that rate was measured on shorter texts than those queued, whose " \
        "chunks take ~0.1s each at the speed the start-up probe measured" in guess.message
    assert refused([40] * 20, chunk_s=6.2).retry_after == 13.0  # two chunks of them
    assert refused([40] * 20, chunk_s=100.0).retry_after == 33.0  # the drain's, if sooner
    unknown = refused([40] * 20, chunk_s=None)  # no probe's speed: the drain's
    assert unknown.retry_after == 33.0 and "a guess" not in unknown.message
    measured = refused([40] * 20 + [2_000])
    assert measured.retry_after == 32.0  # ~40 s of work held, 7.5 s of it the share
    assert "a guess" not in measured.message
    # One chunk as long after many short ones: the rate is still mostly theirs (its texts'
    # length weighted by run time, 217 here, where 2,000 is queued).
    assert refused([40] * 20 + [501]).retry_after == 2.0
    assert refused([40] * 20 + [1_000] * 2).retry_after == 2.0  # 726
    assert refused([40] * 20 + [1_500] * 2).retry_after > 20  # 1,193 of 2,000: measured
    # A chunk of them 30 s ago, queries since: measured (a long chunk outlasts the window);
    # and one as long 20 s after it counts for 60 s from its own time (QA).
    assert refused([2_000], idle_s=30.0, queries=20).retry_after > 30
    assert refused([2_000], idle_s=LONGEST_MEMORY_S + 1, queries=20).retry_after == 2.0
    clock = Clock()
    drain = DrainMeter(clock=clock)
    drain.record(2_000, 0.2, squares=2_000**2)
    clock.t += 20
    drain.record(1_900, 0.19, squares=1_900**2)
    for _ in range(45):  # queries, one a second
        clock.t += 1
        drain.record(40, 4e-3, squares=40 * 40)
    assert drain.longest() == 1_900.0  # measured 45 s ago
    clock.t += 30  # the windows that held it are over 60 s old
    drain.record(40, 4e-3, squares=40 * 40)
    assert drain.longest() == pytest.approx(40.0)
    # One let in only alone keeps the queue by its Retry-After: not a guess's (a keep of 2 s
    # ended before the queue drained; review).
    alone = refused([40] * 20, needed=100_000)
    assert "let in only when nothing else is queued" in alone.message
    assert "a guess" not in alone.message and alone.retry_after > 30


def test_a_chunk_of_long_texts_takes_what_the_probe_measured() -> None:
    """``chunk_seconds``: one chunk of texts of a length at the probe's run cost, as many a
    chunk as the budget holds (one where a text is longer); None before the probe."""
    from types import SimpleNamespace

    from bgeserve.service.admission import chunk_seconds
    from bgeserve.tuning.runcost import RunCost

    cost = RunCost(0.0131, per_token=0.845e-3, per_pair=0.34e-6, attention=2000.0)
    engine = SimpleNamespace(run_cost=cost, max_chunk_tokens=4096)
    # Two texts of 2,000 tokens: 0.0131 + 0.845e-3 x 2 x 2,000 x (1 + 2,000 / 2,000).
    assert chunk_seconds(engine, 2_000.0) == pytest.approx(0.0131 + 0.845e-3 * 8_000)
    assert chunk_seconds(engine, 8_000.0) == pytest.approx(0.0131 + 0.845e-3 * 40_000)
    assert chunk_seconds(SimpleNamespace(run_cost=None, max_chunk_tokens=4096), 2_000.0) is None


class Tracked:
    """A job as the gate tracks it: its deadline (monotonic), hashed by identity."""

    def __init__(self, in_s: float | None) -> None:
        import time

        self.deadline = None if in_s is None else time.monotonic() + in_s


def test_no_admission_makes_a_request_admitted_before_late() -> None:
    """Requests take turns, so one admitted later delays one admitted before: the queue holds
    at most what runs before the deadline of any request admitted and not yet answered, while
    it is still in reach and has texts waiting; once answered, or with its last chunk running,
    its deadline no longer counts (QA: ingestion requests of ~30 s each admitted one beside
    another as the queue drained, and those admitted first ended in 504s). Bound by it, the
    Retry-After is when it is answered (the room stays while the queue drains: review)."""
    from concurrent.futures import Future

    drain = DrainMeter()
    drain.record(1000, 1.0)  # 1,000 tokens a second: the own share is 75,000 of 100 s
    state = {"queued": 20_000}
    waiting: dict[object, int] = {}
    gate = AdmissionGate(10**7, lambda: state["queued"], drain, deadline_s=100.0,
                         waiting=lambda job: waiting.get(job, 0))
    first, answered = Tracked(30.0), Future()  # admitted before, 30 s left: 30,000 of work
    waiting[first] = 3
    gate.track(first, answered)  # type: ignore[arg-type]
    assert 9_900 < gate.room() <= 10_000  # (its 30 s run on while the test does)
    gate.check_in_time(9_000, 0, squares=0)  # 29,000: it still ends in time
    with pytest.raises(Overloaded, match="deadline of a request admitted before") as refused:
        gate.check_in_time(15_000, 0, squares=0)  # 35,000 of its 30,000; not 75,000
    assert "takes at most 30.0s of it" in refused.value.message
    assert refused.value.retry_after == 20.0  # when what is held has drained: 20,000
    with pytest.raises(Overloaded, match="admitted before"):
        gate.reserve(10_001)
    late = Tracked(10.0)  # out of reach already (20,000 > 10,000): not protected
    waiting[late] = 1
    gate.track(late, Future())  # type: ignore[arg-type]
    assert 9_900 < gate.room() <= 10_000
    waiting[first] = 0  # its last chunk runs: nothing admitted now can delay it
    assert gate.room() == 75_000 - 20_000
    waiting[first] = 3
    answered.set_result(None)  # answered: its deadline no longer counts
    assert gate.room() == 55_000
    gate.check_in_time(15_000, 0, squares=0)
    untimed = Tracked(None)  # no deadline: nothing to protect
    waiting[untimed] = 1
    gate.track(untimed, Future())  # type: ignore[arg-type]
    assert gate.room() == 55_000


def test_the_queue_is_kept_for_a_request_that_goes_in_only_alone() -> None:
    """A request past the deadline's whole share by itself goes in only when nothing else is
    queued: under steady small traffic it never did (QA: 35-36 refusals in 40 s, each
    Retry-After 1 s, beside hundreds of small requests answered). Refused, the queue is kept
    for it: until its Retry-After and a grace, any other request is refused, even to an
    empty queue, told to come back when it is no longer kept; the request it was kept for
    goes in to the empty queue and frees it; one that does not come back is not waited for."""
    import time

    from bgeserve.service.admission import KEPT_GRACE_S

    drain = DrainMeter(clock=Clock())
    drain.record(1000, 1.0)
    state = {"queued": 3_000, "squares": 0}
    gate = AdmissionGate(10**6, lambda: state["queued"], drain, deadline_s=60.0,
                         queued_squares=lambda: state["squares"], attention=lambda: 2048.0)
    big = {"tokens": 16_384, "squares": 2 * 8192**2}  # 81,920 of the share's 45,000
    with pytest.raises(Overloaded, match="kept for it until then") as alone:
        gate.check_in_time(big["tokens"], 0, squares=big["squares"])
    assert alone.value.retry_after == 3.0  # the 3,000 held drained
    with pytest.raises(Overloaded, match="kept for a request too large to share it") as kept:
        gate.check_in_time(100, 0, squares=0)
    assert kept.value.retry_after == 5.0  # when no longer kept: its 3 s and the grace
    state["queued"] = 0  # drained: still kept, for it
    with pytest.raises(Overloaded, match="kept for a request too large"):
        gate.check_in_time(100, 0, squares=0)
    # Back, its lower bound past the room: others' reservations (requests the keep refuses
    # once tokenized) do not make it wait (review).
    gate.reserve(100)
    gate.reserve(50_000)
    gate.release(50_100)
    gate.check_in_time(big["tokens"], 0, squares=big["squares"])  # alone, in
    state.update(queued=big["tokens"], squares=big["squares"])
    with pytest.raises(Overloaded, match="more than the"):  # its work bounds the next
        gate.check_in_time(100, 0, squares=0)
    state.update(queued=3_000, squares=0)
    # Another, at once: not kept for (as long again as the last keep lasted, at least the
    # grace, other traffic has its turn).
    with pytest.raises(Overloaded, match="nothing else is queued, and may") as again:
        gate.check_in_time(big["tokens"], 0, squares=big["squares"])
    assert "kept" not in again.value.message
    gate.check_in_time(100, 0, squares=0)
    gate._no_keep_before = 0.0  # (the grace over)
    with pytest.raises(Overloaded, match="kept for it until then"):
        gate.check_in_time(big["tokens"], 0, squares=big["squares"])
    gate._kept_until = time.monotonic() - 0.001  # its Retry-After and grace over
    gate.check_in_time(100, 0, squares=0)
    # One that does not come back, its client splitting the request as told: the queue is
    # kept only for the grace once it was seen empty, not for the whole Retry-After (review:
    # an idle server refused everything for up to a minute).
    gate._no_keep_before = 0.0
    with pytest.raises(Overloaded, match="kept for it until then") as kept_again:
        gate.check_in_time(big["tokens"], 0, squares=big["squares"])
    assert kept_again.value.retry_after == 3.0
    state["queued"] = 0
    with pytest.raises(Overloaded, match="kept for a request too large") as empty:
        gate.check_in_time(100, 0, squares=0)  # seen empty now: kept for the grace
    assert empty.value.retry_after == KEPT_GRACE_S
    gate._kept_empty = time.monotonic() - KEPT_GRACE_S
    gate.check_in_time(100, 0, squares=0)


def test_a_kept_queue_is_empty_only_with_nothing_running_and_others_reservations_aside() -> None:
    """The keep's grace starts when nothing is queued nor running (a chunk in progress is part
    of the Retry-After it was told: counted from the queue alone, the keep ended while a 15 s
    chunk ran); while kept, others' reservations refuse it neither in full() nor in reserve()
    (review); and full(), which asks for no request of a size, never begins a keep."""
    import time

    from bgeserve.engine.workers import Running

    drain = DrainMeter(clock=Clock())
    drain.record(1000, 1.0)
    state: dict[str, Any] = {"queued": 3_000, "running": []}
    gate = AdmissionGate(10**6, lambda: state["queued"], drain, deadline_s=60.0,
                         attention=lambda: 2048.0, running=lambda: state["running"])
    with pytest.raises(Overloaded, match="kept for it until then"):
        gate.check_in_time(16_384, 0, squares=2 * 8192**2)
    state.update(queued=0, running=[Running(1.0, 15_000, False, 0)])
    assert gate._keeping(time.monotonic()) and gate._kept_empty is None
    state["running"] = [Running(0.1, 20, True, 0)]  # the canary's is not work
    assert gate._keeping(time.monotonic()) and gate._kept_empty is not None
    for _ in range(5):
        gate.reserve(10_000)  # requests the keep will refuse once tokenized
    assert gate.full() is None
    gate.reserve(50_000)  # the one it is kept for, back: its bound past the room
    gate.release(100_000)
    fresh = AdmissionGate(10**6, lambda: 10, DrainMeter(clock=Clock()), deadline_s=0.5)
    fresh.drain.record(1, 1.0)  # 1 a second: a share under one token
    assert fresh.full() is not None and not fresh._kept_until


def test_a_retry_after_is_never_past_the_deadlines_of_what_is_held() -> None:
    """What is held leaves the queue by its requests' deadlines at the latest, whatever the
    rate says of it: behind one request of ~30 s of work under a 3 s deadline, let in alone,
    queries were told Retry-After 29-30 s (QA: an openai client's query took 15 s for a
    server free again after 3 s). With no deadline known, the rate's estimate stands."""
    from concurrent.futures import Future

    drain = DrainMeter()
    drain.record(1000, 1.0)  # 1,000 a second: the share is 2,250 of a 3 s deadline
    state = {"queued": 30_000}
    gate = AdmissionGate(10**7, lambda: state["queued"], drain, deadline_s=3.0)
    with pytest.raises(Overloaded, match="more than the") as unknown:
        gate.check_in_time(100, 0, squares=0)
    assert unknown.value.retry_after == 28.0  # 30,100 - 2,250 at 1,000 a second, up
    big = Tracked(2.2)  # the request holding it all: 2.2 s left to its deadline
    gate.track(big, Future())  # type: ignore[arg-type]
    with pytest.raises(Overloaded) as refused:
        gate.check_in_time(100, 0, squares=0)
    assert refused.value.retry_after == 3.0
    with pytest.raises(Overloaded, match="let in only when nothing else is queued") as alone:
        gate.check_in_time(5_000, 0, squares=0)  # past the whole share by itself
    assert alone.value.retry_after == 3.0  # not the 30 s the rate drains it in
    # Its own reservation is not another request being tokenized (review: with one, the
    # bound was a whole deadline, 31 s here).
    state["queued"] = 0
    longer = AdmissionGate(10**7, lambda: state["queued"], drain, deadline_s=40.0)
    longer.track(big, Future())  # type: ignore[arg-type]
    longer.reserve(100)
    state["queued"] = 60_000
    with pytest.raises(Overloaded) as reserved:
        longer.check_in_time(100, 100, squares=0)
    assert reserved.value.retry_after == 3.0


def test_a_chunk_running_past_its_deadline_bounds_the_retry_after_too() -> None:
    """A chunk in progress runs to its end, its request's deadline past (review: Retry-After
    1 for the ~15 s an 8k-token chunk of a 3 s request still ran): counted for what the rate
    says is left of it, at most a deadline (the rate's estimate of a long chunk read off short
    ones was 1,204 s for a request cut at 3 s: Retry-After 20 s, the server free in 3)."""
    from concurrent.futures import Future

    from bgeserve.engine.workers import Running

    drain = DrainMeter()
    drain.record(1000, 1.0)
    chunk = [Running(3.0, 18_000, False, 0)]
    gate = AdmissionGate(10**7, lambda: 30_000, drain, deadline_s=20.0,
                         running=lambda: chunk)
    gate.track(Tracked(-0.5), Future())  # type: ignore[arg-type]
    with pytest.raises(Overloaded) as refused:
        gate.check_in_time(100, 0, squares=0)
    assert refused.value.retry_after == 15.0  # 18,000 of work, 3 s of it run
    chunk[0] = Running(3.0, 1_000_000, False, 0)  # the rate says ~1,000 s left: a deadline
    with pytest.raises(Overloaded) as capped:
        gate.check_in_time(100, 0, squares=0)
    assert capped.value.retry_after == 20.0


def test_the_chunks_in_progress_hold_what_they_still_have_to_run() -> None:
    """A text leaves the queue when its chunk starts: its work still counts against the
    deadline's share, less what ran of it (at the measured rate shared among the chunks in
    progress); the canary's does not count; a request with nothing queued or reserved beside
    it still goes in (a chunk in progress does not make it wait: under steady traffic
    something nearly always runs)."""
    from bgeserve.engine.workers import Running

    clock = Clock()
    drain = DrainMeter(clock=clock)
    drain.record(1000, 1.0)  # 1,000 a second: the share is 7,500
    state = {"queued": 1_000, "running": [Running(2.0, 4_000, False, 0),
                                           Running(0.5, 20, True, 400)]}
    gate = AdmissionGate(1_000_000, lambda: state["queued"], drain, deadline_s=10.0,
                         running=lambda: state["running"])
    assert gate.room() == 7_500 - 1_000 - (4_000 - 2_000)  # 2 s of 4 ran; the canary's not
    with pytest.raises(Overloaded, match="~3.0s of work are queued"):
        gate.check_in_time(4_501, 0, squares=0)
    gate.check_in_time(4_500, 0, squares=0)
    state["queued"] = 0
    gate.check_in_time(20_000, 0, squares=0)  # alone in the queue, beside a chunk running


def test_a_queued_jobs_deadline_is_protected_until_it_is_answered() -> None:
    """Admission.queue hands the gate each job's deadline with its future."""
    from concurrent.futures import Future

    from bgeserve.service.admission import Admission

    answered: Future = Future()
    state = {"queued": 0}
    engine = engine_standin(
        queued_tokens=lambda: state["queued"], submit=lambda job: answered)
    drain = DrainMeter()
    drain.record(1000, 1.0)
    admission = Admission(engine, 10**6, drain, slots=2,  # type: ignore[arg-type]
                          deadline_s=100.0)
    job = Tracked(20.0)
    job.ids, job.pending = [[0] * 500], lambda: [0]  # type: ignore[attr-defined]
    assert admission.queue(job) is answered  # type: ignore[arg-type]
    state["queued"] = 500
    assert admission.gate.room() <= 20_000 - 500  # ~20 s left to its deadline, not 75
    answered.set_result(None)
    assert admission.gate.room() == 75_000 - 500
    admission.close()


def group(in_s: float | None, *lengths: int) -> Any:
    """A job of texts of ``lengths`` tokens, its deadline in ``in_s`` seconds."""
    job = Tracked(in_s)
    job.ids = [[0] * n for n in lengths]  # type: ignore[attr-defined]
    job.pending = lambda: list(range(len(lengths)))  # type: ignore[attr-defined]
    return job


def test_a_requests_later_groups_are_held_for_until_queued() -> None:
    """A ColBERT rerank's groups are queued one after another, each once the one before was
    scored: between them nothing of the request waited in the queue, others were admitted
    into its time, and its next group, let in unchecked, ran late among them (review). Held
    for, they count as queued work (their attention too) and against BGE_M3_MAX_QUEUE_TOKENS,
    their deadline is protected, a request beside them is not "alone"; each leaves the hold
    when queued, the rest when the request ends."""
    drain = DrainMeter()
    drain.record(1000, 1.0)  # 1,000 work a second: the own share is 75,000 of 100 s
    gate = AdmissionGate(100_000, lambda: 0, drain, deadline_s=100.0,
                         attention=lambda: 1000.0)
    second, third = group(60.0, 2_000, 2_000), group(60.0, 1_000)
    gate.hold_later([second, third])  # 5,000 tokens; work 5,000 + 9,000,000 / 1,000
    held = 5_000 + 9_000
    assert gate.room() == pytest.approx(60_000 - held, abs=100)  # ~60 s left: 60,000
    assert gate.limit() == pytest.approx(5_000 + 60_000 - held, abs=100)
    with pytest.raises(Overloaded, match="admitted before"):
        gate.check_in_time(50_000, 0, squares=0)  # not alone: its groups are to come
    gate.queued_later(second)
    assert gate.room() == pytest.approx(60_000 - 2_000, abs=100)
    gate.drop_later([second, third])
    assert gate.room() == 75_000
    gate.check_in_time(50_000, 0, squares=0)
    # Under BGE_M3_MAX_QUEUE_TOKENS alone (no deadline): their tokens are room taken.
    tokens = AdmissionGate(10_000, lambda: 0, DrainMeter())
    tokens.hold_later([group(None, 4_000)])
    assert tokens.room() == 6_000
    with pytest.raises(Overloaded, match="BGE_M3_MAX_QUEUE_TOKENS"):
        tokens.reserve(6_001)


def test_a_request_queued_in_groups_is_judged_whole() -> None:
    """Admission.queue checks a request's first job with its later ones (``rest``): a rerank
    whose whole does not fit the deadline's share is a 429 at once, not a 504 half way; one
    that fits has its later groups held until each is queued (``later=True``)."""
    from concurrent.futures import Future

    from bgeserve.service.admission import Admission
    from bgeserve.tuning.runcost import RunCost

    state = {"queued": 1_000}  # something queued: no request goes in "alone"
    engine = engine_standin(queued_tokens=lambda: state["queued"],
                            submit=lambda job: Future(),  # attention left out: tokens count
                            run_cost=RunCost(0.0, per_token=1e-3, attention=1e12))
    drain = DrainMeter()
    drain.record(1000, 1.0)
    admission = Admission(engine, 10**6, drain, slots=2,  # type: ignore[arg-type]
                          deadline_s=10.0)  # 7,500 of work in its share; 1,000 held
    first = group(10.0, 3_000)
    with pytest.raises(Overloaded, match="this request needs ~7.0s"):
        admission.queue(first, rest=[group(10.0, 2_000), group(10.0, 2_000)])
    assert admission.gate.room() == 6_500  # nothing held for a refused request
    later = [group(10.0, 1_000), group(10.0, 1_000)]
    admission.queue(first, rest=later)  # 5,000 of work: fits
    assert admission.gate.room() <= 6_500 - 2_000
    admission.queue(later[0], later=True)
    state["queued"] += 1_000
    admission.gate.drop_later(later)
    assert admission.gate.room() == 6_500 - 1_000
    admission.close()


def test_work_past_the_share_is_told_so_where_the_token_bound_is_lower() -> None:
    """A request whose tokens fit BGE_M3_MAX_QUEUE_TOKENS' room but whose work does not fit
    the deadline's share is told the share is what it misses, with the share's Retry-After
    (review: it was told the token queue was full, Retry-After 60 s from mixed units); after a
    wait for a tokenizing slot, its Retry-After is that of a retry with its whole deadline."""
    drain = DrainMeter(clock=Clock())
    drain.record(1000, 1.0)
    # 30,000 tokens queued of 35,000: 5,000 tokens of room, 15,000 of the 45,000 share's.
    gate = AdmissionGate(35_000, lambda: 30_000, drain, deadline_s=60.0,
                         attention=lambda: 2048.0)
    # One text of 4,900 tokens: 4,900 + 4,900² / 2,048 = 16,623 tokens' worth.
    with pytest.raises(Overloaded, match="takes at most 45.0s") as refused:
        gate.check_in_time(4_900, 0, squares=4_900**2)
    assert "this request needs ~16.6s" in refused.value.message
    assert "BGE_M3_MAX_QUEUE_TOKENS" not in refused.value.message
    assert refused.value.retry_after == 2.0  # 16,623 - 15,000 at 1,000 a second, up
    with pytest.raises(Overloaded, match="takes at most 15.0s") as refused:
        gate.check_in_time(4_900, 0, left_s=20.0, squares=4_900**2)
    assert refused.value.retry_after == 2.0  # not from the 0 its 20 s left have


def test_a_request_past_the_whole_share_by_itself_is_told_so() -> None:
    """A request whose own work is past the deadline's whole share goes in only alone: told
    so (send less a request, or raise the timeout), its Retry-After when what is held now has
    drained (QA: such requests were told to retry in 29-60 s, as if room for them would
    come)."""
    drain = DrainMeter(clock=Clock())
    drain.record(1000, 1.0)
    gate = AdmissionGate(10**6, lambda: 3_000, drain, deadline_s=60.0,
                         attention=lambda: 2048.0)
    # Two texts of 8,192 tokens: 81,920 tokens' worth, against a share of 45,000.
    with pytest.raises(Overloaded, match="let in only when nothing else is queued") as refused:
        gate.check_in_time(16_384, 0, squares=2 * 8192**2)
    assert "send fewer or shorter texts a request" in refused.value.message
    assert refused.value.retry_after == 3.0  # the 3,000 held, at 1,000 a second
    # Nothing queued: it goes in, whoever else is being tokenized (their own check comes
    # after; counting their reservations, such a request never got in under steady traffic).
    alone = AdmissionGate(10**6, lambda: 0, drain, deadline_s=60.0, attention=lambda: 2048.0)
    alone.reserve(5_000)  # another request, being tokenized
    alone.check_in_time(16_384, 0, squares=2 * 8192**2)


def test_the_attention_length_is_the_measured_run_costs() -> None:
    """A = per_token / per_pair of the probe's run cost, at least MIN_ATTENTION_TOKENS; without
    one, or without an attention term in it, DEFAULT_ATTENTION_TOKENS."""
    from dataclasses import replace
    from types import SimpleNamespace

    from bgeserve.service.admission import (
        DEFAULT_ATTENTION_TOKENS,
        MIN_ATTENTION_TOKENS,
        MIN_LONG_ATTENTION_TOKENS,
        attention_tokens,
    )
    from bgeserve.tuning.runcost import RunCost

    def engine(cost: RunCost | None) -> Any:
        return SimpleNamespace(run_cost=cost)

    # The fit of full-size OpenVINO int8 on a 2-core Zen 4 (docs/benchmarks.md): ~2,485.
    measured = attention_tokens(engine(RunCost(0.0131, per_token=0.845e-3, per_pair=0.34e-6)))
    assert measured == pytest.approx(2485.3, abs=0.1)
    assert attention_tokens(engine(None)) == DEFAULT_ATTENTION_TOKENS
    assert attention_tokens(engine(RunCost(0.01, per_token=1e-3))) == DEFAULT_ATTENTION_TOKENS
    # A fit's noise, not a model: a 10-token A would price every text ~tens of times over.
    noisy = RunCost(0.01, per_token=1e-3, per_pair=1e-4)
    assert attention_tokens(engine(noisy)) == MIN_ATTENTION_TOKENS
    # Read off the long runs, it is measured where it counts: it stands, below the fit's floor
    # too (the tiny test model's 20-200), down to a disturbed start's.
    long = RunCost(0.01, per_token=1e-3, per_pair=1e-7, attention=40.0)
    assert attention_tokens(engine(long)) == 40.0
    assert attention_tokens(engine(replace(long, attention=2.0))) == MIN_LONG_ATTENTION_TOKENS
    assert attention_tokens(engine(replace(noisy, attention=3000.0))) == 3000.0


def test_a_504_says_how_far_the_request_got_and_why_it_was_late() -> None:
    """The 504's detail: texts done of those to run, their work at the measured drain rate,
    and whether the request alone is too much for the deadline (send less) or waited behind
    others' (retry later); before tokenizing, that it waited to be admitted."""
    from types import SimpleNamespace

    from bgeserve.service.admission import where_late

    drain = DrainMeter(clock=Clock())
    # Not yet queued: behind others, or its own tokenizing (QA: a lone 24 MB request was
    # told only "behind other requests").
    unqueued = where_late([], drain, 2048.0, 10.0)
    assert "still being tokenized and admitted" in unqueued
    assert "behind other requests" in unqueued and "too large to tokenize" in unqueued

    def job(*lengths: int, remaining: int) -> Any:
        ids = [[0] * n for n in lengths]
        return SimpleNamespace(ids=ids, remaining=remaining,
                               pending=lambda: list(range(len(ids))))

    big = job(8192, 8192, 100, remaining=2)
    assert where_late([big], drain, 2048.0, 10.0) == (
        "1 of the 3 texts it had to run were done")  # no rate measured: no more to say
    drain.record(1000, 1.0)
    # 16,484 tokens, 16,484 + (2 x 8,192² + 100²) / 2,048 = 82,025 tokens' worth: ~82 s.
    said = where_late([big], drain, 2048.0, 10.0)
    assert said.startswith("1 of the 3 texts it had to run were done; their 16484 tokens are "
                           "~82.0s of work")
    assert "too much for one request" in said and "BGE_M3_REQUEST_TIMEOUT_SECS" in said
    small = where_late([job(100, 100, remaining=2)], drain, 2048.0, 10.0)
    assert "~0.2s of work" in small and "waited behind other requests' work" in small
    folded = job(100, 100, 100, remaining=1)
    folded.pending = lambda: [0]  # the others repeat it
    assert where_late([folded], drain, 2048.0, 10.0).startswith(
        "0 of the 1 texts it had to run were done (of its 3: the others repeat them")
    # A rerank's groups of windows: their texts together.
    assert where_late([big, job(100, 100, remaining=2)], drain, 2048.0, 10.0).startswith(
        "1 of the 5 texts it had to run were done; their 16684 tokens")


def test_the_exact_tokens_are_held_to_the_deadlines_share_after_tokenizing() -> None:
    """Admission: a request whose lower bound fits but whose ids do not is refused after
    tokenizing (429, counted), nothing queued; a ColBERT rerank's later groups (``later``)
    are not refused for it: their request was admitted already."""
    import asyncio
    from types import SimpleNamespace

    from bgeserve.results import EmbedOptions
    from bgeserve.service.admission import Admission
    from bgeserve.tuning.runcost import RunCost

    submitted: list[object] = []

    def job(*texts: int, todo: list[int] | None = None) -> SimpleNamespace:
        ids = [[0] * n for n in texts]
        return SimpleNamespace(ids=ids, deadline=None,
                               pending=lambda: list(range(len(ids))) if todo is None else todo)

    made = [job(3_000)]
    # Attention negligible at these lengths (A = 10**6 tokens: a 3,000-token text's work is
    # 3,009 tokens' worth); the test below counts it.
    engine = engine_standin(
        run_cost=RunCost(0.0, per_token=1e-3, per_pair=1e-9),
        queued_tokens=lambda: 5_000, submit=lambda job: submitted.append(job) or "future",
        make_job=lambda inputs, options, request_id, arrived: made[0],
        tokenizer=SimpleNamespace(min_tokens=lambda texts, stop_above: 4, max_seq=8192))
    drain = DrainMeter(clock=Clock())
    drain.record(1000, 1.0)
    admission = Admission(engine, 10**6, drain, slots=2,  # type: ignore[arg-type]
                          deadline_s=10.0)
    with pytest.raises(Overloaded, match="BGE_M3_REQUEST_TIMEOUT_SECS"):
        asyncio.run(admission.submit(["a b"], EmbedOptions(), "r", 0.0))
    assert submitted == [] and admission.refused == 1 and admission.gate.reserved == 0
    later = job(3_000)
    assert admission.queue(later, later=True) == "future" and submitted == [later]
    # What it queues counts, not what the cache answered or a repeat runs for (review: a
    # request the cache answered whole was a 429 behind a burst).
    cached, repeated = job(3_000, 3_000, todo=[]), job(2_000, 2_000, 2_000, todo=[0])
    for made[0] in (cached, repeated):  # 0 and 2,000 tokens to queue: 7,000 fits
        asyncio.run(admission.submit(["a b"], EmbedOptions(), "r", 0.0))
    assert submitted == [later, cached, repeated] and admission.refused == 1
    admission.close()


def test_an_abort_answers_those_waiting_to_tokenize_and_tokenizing_at_once() -> None:
    """A shutdown's time is up: requests waiting for a tokenizing slot behind big ones get
    its error now, and so does every later request (they were left waiting until the HTTP
    server's grace cancelled them: plain-text 500s), and so do those being tokenized, at
    their next group of texts (they went on past that grace: QA, a request of 1.2M tokens)."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from bgeserve import stopping
    from bgeserve.errors import NotReady
    from bgeserve.results import EmbedOptions
    from bgeserve.service.admission import Admission

    release = threading.Event()

    def make_job(inputs: object, options: object, request_id: str, arrived: float) -> object:
        while not release.wait(0.01):  # a big request's tokenizing, a group at a time
            stopping.check()
        return SimpleNamespace(ids=[[0, 5, 2]])

    engine = engine_standin(
        queued_tokens=lambda: 0, make_job=make_job, submit=lambda job: "future",
        tokenizer=SimpleNamespace(min_tokens=lambda texts, stop_above: 3, max_seq=512))
    admission = Admission(engine, 10**9, DrainMeter(), slots=2)  # type: ignore[arg-type]
    big = ["word " * 200]  # past what is tokenized on the loop

    async def main() -> list[object]:
        tasks = [asyncio.ensure_future(admission.submit(big, EmbedOptions(), f"r{i}", 0.0))
                 for i in range(6)]
        await asyncio.sleep(0.2)  # two tokenize, four wait for a slot
        error = NotReady("shutting down")
        assert admission.abort(error) == 6
        answered = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 1)
        assert all(result is error for result in answered)
        with pytest.raises(NotReady):
            await admission.submit(["a"], EmbedOptions(), "late", 0.0)

    asyncio.run(main())
    assert admission.gate.reserved == 0
    release.set()
    admission.close()


def test_a_request_cancelled_while_its_bound_is_walked_releases_its_reservation() -> None:
    """A big request's bound is walked on the admission thread; a client that leaves then
    (the handler cancelled) must not leave its reservation behind: each one shrank the
    queue's room for good until every request was a 429 on an empty queue."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from bgeserve.results import EmbedOptions
    from bgeserve.service.admission import Admission

    walking, release = threading.Event(), threading.Event()

    def min_tokens(texts: list[str], stop_above: int) -> int:
        walking.set()
        release.wait(10)  # the walk outlives the client
        return 700

    engine = engine_standin(
        queued_tokens=lambda: 0, make_job=lambda *a: SimpleNamespace(ids=[[0, 5, 2]]),
        submit=lambda job: "future",
        tokenizer=SimpleNamespace(min_tokens=min_tokens, max_seq=512))
    admission = Admission(engine, 1000, DrainMeter(), slots=2)  # type: ignore[arg-type]
    big = ["word " * 60_000]  # past what is bounded on the loop

    async def main() -> None:
        task = asyncio.ensure_future(admission.submit(big, EmbedOptions(), "r", 0.0))
        await asyncio.to_thread(walking.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()  # cancelled again (a shutdown): still released once the walk ends
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):  # the walk's end reaches the loop: its reservation is released
            if admission.gate.reserved == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert admission.gate.reserved == 0
    admission.close()


def test_rerank_admission_refuses_before_tokenizing_with_its_own_drain_rate() -> None:
    """The cross-encoder's requests: a lower bound of their rows' tokens that cannot fit
    beside what its queue holds is refused (429, counted) before any pair is built, with a
    Retry-After from the reranker's drain rate (it was always 1 s, for a queue that took 55 s
    to drain); one that may fit is built and queued; the queue's exact refusal gets the drain
    rate's Retry-After too; nothing stays reserved."""
    import asyncio
    from types import SimpleNamespace

    from bgeserve.results import RerankOptions
    from bgeserve.service.admission import PairAdmission

    clock = Clock()
    drain = DrainMeter(clock=clock)
    drain.record(100, 1.0)  # 100 tokens per second of running
    state = {"queued": 900, "built": 0, "full": False}

    def min_tokens(query: str, documents: list[str], options: object,
                   stop_above: int | None = None) -> int:
        return sum(4 + len(query.split()) + len(d.split()) for d in documents)

    def make_job(query: str, documents: list[str], options: object, request_id: str,
                 arrived: float) -> tuple[str, object]:
        state["built"] += 1
        return "plan", SimpleNamespace(ids=[[0] * 150])

    def submit(job: object) -> str:
        if state["full"]:
            raise Overloaded("queue full; retry shortly", retry_after=1.0)
        return "future"

    engine = engine_standin(
        queued_tokens=lambda: state["queued"], submit=submit)
    reranker = SimpleNamespace(engine=engine, min_tokens=min_tokens, make_job=make_job)
    admission = PairAdmission(reranker, 1000, drain, slots=2)  # type: ignore[arg-type]

    def rerank(documents: list[str]) -> object:
        return asyncio.run(admission.submit("a query", documents, RerankOptions(), "r", 0.0))

    with pytest.raises(Overloaded, match="BGE_M3_MAX_QUEUE_TOKENS") as refused:
        rerank(["word " * 60] * 5)  # at least 5 x 66 tokens, 100 free
    assert refused.value.retry_after == 3  # 230 tokens short at 100 tokens/s
    assert state["built"] == 0 and admission.refused == 1 and admission.gate.reserved == 0
    assert rerank(["one document"]) == ("plan", SimpleNamespace(ids=[[0] * 150]), "future")
    state["full"] = True  # the exact check: 150 tokens, 100 free
    with pytest.raises(Overloaded) as refused:
        rerank(["one document"])
    assert refused.value.retry_after == 1 and state["built"] == 2
    state["queued"] = 1000 - 50
    with pytest.raises(Overloaded) as refused:
        rerank(["one"] * 10)  # 70 tokens at least: 20 short
    assert refused.value.retry_after == 1
    drain.record(1, 99.0)  # the rate falls to ~1 token/s: the wait grows with it
    with pytest.raises(Overloaded) as refused:
        rerank(["one"] * 10)
    assert refused.value.retry_after == 20
    assert admission.refused == 3 and admission.gate.reserved == 0
    admission.close()


def test_a_later_group_refused_by_the_queue_gets_the_drain_rates_retry_after() -> None:
    """bge-m3's ColBERT scores queue a big request's later groups of windows one after
    another (``m3rerank.arun_jobs``' ``submit``, the service's ``Admission.queue``): the
    queue's refusal of one carries bge-m3's drain-rate Retry-After (the scheduler's was 1 s),
    after the groups before it ran once each."""
    import asyncio
    from types import SimpleNamespace

    from bgeserve.engine import m3rerank
    from bgeserve.results import Embeddings, RerankOptions
    from bgeserve.service.admission import Admission

    clock = Clock()
    drain = DrainMeter(clock=clock)
    drain.record(100, 1.0)  # 100 tokens per second of running
    awaited: list[object] = []

    def submit(job: object) -> str:  # the scheduler's own check: 400 tokens, 100 free
        raise Overloaded("queue full; retry shortly", retry_after=1.0)

    async def await_job(job: object, future: object) -> Embeddings:
        awaited.append((job, future))
        n = np.array([3, 300])  # the query and a window, scored before the next group queues
        return Embeddings(np.eye(2, 4, dtype=np.float32), None, None, n, np.zeros(2, bool))

    engine = engine_standin(
        queued_tokens=lambda: 900, submit=submit, await_job=await_job)
    admission = Admission(engine, 1000, drain, slots=2)  # type: ignore[arg-type]
    first, later = SimpleNamespace(ids=[[0] * 300]), SimpleNamespace(ids=[[0] * 400])
    with pytest.raises(Overloaded) as refused:
        asyncio.run(m3rerank.arun_jobs(engine, None, [first, later],  # type: ignore[arg-type]
                                       RerankOptions(mode="dense"), "first's future",
                                       submit=admission.queue))
    assert refused.value.retry_after == 3  # 300 tokens short at 100 tokens/s
    assert awaited == [(first, "first's future")] and admission.gate.reserved == 0
    admission.close()


def test_a_big_request_after_close_is_told_the_server_is_stopping() -> None:
    """The admission thread is gone once the server stops: a big request still arriving gets
    a 503 NotReady naming the shutdown (it was a RuntimeError, a 500)."""
    import asyncio
    from types import SimpleNamespace

    from bgeserve.errors import NotReady
    from bgeserve.results import EmbedOptions
    from bgeserve.service.admission import Admission

    engine = engine_standin(
        queued_tokens=lambda: 0, make_job=lambda *a: SimpleNamespace(ids=[[0, 5, 2]]),
        submit=lambda job: "future",
        tokenizer=SimpleNamespace(min_tokens=lambda texts, stop_above: 3, max_seq=512))
    admission = Admission(engine, 1000, DrainMeter(), slots=2)  # type: ignore[arg-type]
    admission.close()
    with pytest.raises(NotReady, match="shutting down"):
        asyncio.run(admission.submit(["word " * 60_000], EmbedOptions(), "r", 0.0))
    assert admission.gate.reserved == 0


def test_rerank_requests_tokenize_in_slots_and_are_answered_by_an_abort() -> None:
    """Rerank requests (either scorer) tokenize in the admission's slots like embeddings: a
    flood does not tokenize all at once on the default executor; a shutdown's abort answers
    those waiting for a slot and the one tokenizing."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from bgeserve import stopping
    from bgeserve.errors import NotReady
    from bgeserve.results import RerankOptions
    from bgeserve.service.admission import PairAdmission

    release, inside = threading.Event(), []

    def make_job(*args: object) -> tuple[str, object]:
        inside.append(1)
        while not release.wait(0.01):
            stopping.check()
        return "plan", SimpleNamespace(ids=[[0, 5, 2]])

    engine = engine_standin(
        queued_tokens=lambda: 0, submit=lambda job: "future")
    reranker = SimpleNamespace(engine=engine, make_job=make_job,
                               min_tokens=lambda *a, stop_above=None: 7)
    admission = PairAdmission(reranker, 10**6, DrainMeter(), slots=1)  # type: ignore[arg-type]

    async def main() -> None:
        tasks = [asyncio.ensure_future(admission.submit("q", ["d"], RerankOptions(), f"r{i}",
                                                        0.0)) for i in range(3)]
        await asyncio.sleep(0.2)
        assert len(inside) == 1  # one slot: the others wait
        error = NotReady("shutting down")
        assert admission.abort(error) == 3  # two waiting, one tokenizing
        answered = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 1)
        assert all(result is error for result in answered)

    asyncio.run(main())
    assert admission.gate.reserved == 0 and len(inside) == 1
    release.set()
    admission.close()


# -- a flood against a live server ------------------------------------------------------------
def _flood(port: int, bodies: list[bytes], server_pid: int) -> tuple[list[tuple[int, float,
                                                                         str | None]], float]:
    """Send every request at once from one thread (so the client's own scheduling does not
    show in the figures): all connected first, each request written whole, each answer timed
    from the moment its request was fully written (its arrival) to the last byte read. The
    answers (status, ms, Retry-After), and the server's event-loop CPU (its main thread) spent
    until the last 429 was read."""
    import selectors
    import socket
    import time

    def loop_cpu() -> float:  # ns on the CPU (schedstat's first field: not 10 ms ticks)
        with open(f"/proc/{server_pid}/task/{server_pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9

    requests = [b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nConnection: close\r\n" + f"Content-Length: {len(b)}\r\n\r\n".encode() + b
                for b in bodies]
    socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in requests]
    sel = selectors.DefaultSelector()
    state = []
    for sock, req in zip(socks, requests, strict=True):
        sock.setblocking(False)
        st = {"out": memoryview(req), "in": b"", "sent": 0.0, "done": 0.0}
        state.append(st)
        sel.register(sock, selectors.EVENT_WRITE | selectors.EVENT_READ, st)
    cpu_start, refused_cpu, left = loop_cpu(), 0.0, len(socks)
    deadline = time.monotonic() + 120
    while left and time.monotonic() < deadline:
        for key, events in sel.select(1):
            sock, st = key.fileobj, key.data
            if events & selectors.EVENT_WRITE and st["out"]:
                st["out"] = st["out"][sock.send(st["out"]):]
                if not st["out"]:
                    st["sent"] = time.monotonic()
                    sel.modify(sock, selectors.EVENT_READ, st)
            if events & selectors.EVENT_READ:
                data = sock.recv(1 << 16)
                st["in"] += data
                head, sep, rest = st["in"].partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                if data and not (sep and length is not None and len(rest) >= length):
                    continue
                st["done"] = time.monotonic()
                sel.unregister(sock)
                sock.close()
                left -= 1
                if st["in"][9:12] == b"429":
                    refused_cpu = loop_cpu() - cpu_start
    out = []
    for st in state:
        head = st["in"].partition(b"\r\n\r\n")[0].decode("latin-1").lower()
        retry = next((line.split(":")[1].strip() for line in head.split("\r\n")
                      if line.startswith("retry-after:")), None)
        out.append((int(head[9:12]), 1000 * (st["done"] - st["sent"]), retry))
    return out, 1000 * refused_cpu


FLOODS = 5
REFUSAL_MS = 100.0  # issue 22: every 429 within 100 ms of its request's arrival
LOOP_SHARE = 0.7  # below it, the machine's other work decided the wall time


@pytest.mark.slow
def test_a_flood_is_refused_at_once(tiny_export, tmp_path) -> None:
    """One worker, a 20,000-token queue, 48 simultaneous requests of 8 texts of ~12k
    characters (~7,000 tokens each): the queue takes what fits, and every other request is
    refused while the admitted one still runs, without waiting for it or for the others'
    tokenizing; Retry-After comes from the measured drain rate.

    Every 429 within 100 ms of its request's arrival, and before the admitted request's answer,
    in at least one of up to five floods on the warm server (docs/reliability.md §3: 43-98 ms on a quiet 2-core machine). Where
    the loop had the CPU less than 70 % of a flood's time (a machine busy with other work,
    whose share of a core says nothing of the server), the loop's own CPU until the last 429
    stands for it: under 100 ms too. A server whose refusals wait for tokenizing, or cost the
    loop twice as much, misses both in every flood.
    """
    import http.client
    import json
    import random

    from tests.serverproc import ServerProc
    from tests.test_server_live import START_TIMEOUT, server_env

    # One ORT thread: the other core is the HTTP loop's while the admitted request runs.
    env = server_env(tiny_export, tmp_path, BGE_M3_MAX_QUEUE_TOKENS="20000",
                     BGE_M3_WORKERS="1", BGE_M3_INTRA_THREADS="1", BGE_M3_MAX_SEQ_LENGTH="8192")
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit",
             "sed", "do", "eiusmod"]
    rng = random.Random(0)
    bodies = [json.dumps({"input": [" ".join(rng.choices(words, k=2200))[:12_000]
                                    for _ in range(8)]}).encode() for _ in range(48)]
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        warm = http.client.HTTPConnection("127.0.0.1", proc.port, timeout=60)  # a served one
        warm.request("POST", "/v1/embeddings", body=b'{"input": "warm up"}',
                     headers={"Content-Type": "application/json"})
        assert warm.getresponse().status == 200
        warm.close()
        assert proc.proc is not None
        floods = []  # (slowest 429, the loop's CPU until then, its share of that time)
        for _ in range(FLOODS):
            floods.append(_check_flood(*_flood(proc.port, bodies, proc.proc.pid)))
            if _in_time(*floods[-1]):
                break
    assert any(_in_time(*flood) for flood in floods), floods


def _in_time(slowest: float, loop_ms: float, share: float, before_answer: bool) -> bool:
    return before_answer and (slowest < REFUSAL_MS
                              or (share < LOOP_SHARE and loop_ms < REFUSAL_MS))


def _check_flood(results: list[tuple[int, float, str | None]],
                 loop_ms: float) -> tuple[float, float, float, bool]:
    """One flood's structure (the admitted request answered, Retry-After from the drain
    rate); its slowest 429 in ms, the loop's CPU until then, its share of that time, and
    whether every 429 came before the admitted request's answer."""
    statuses = sorted(s for s, _, _ in results)
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses, statuses
    refused = sorted(ms for s, ms, _ in results if s == 429)
    slowest = refused[-1]
    share = loop_ms / slowest if slowest else 1.0
    print(f"{statuses.count(200)} x 200, {len(refused)} x 429; 429 after arrival: median "
          f"{refused[len(refused) // 2]:.0f} ms, max {slowest:.0f} ms; the loop's CPU until "
          f"the last: {loop_ms:.0f} ms ({share:.0%} of that time)")
    answered = min(ms for s, ms, _ in results if s == 200)
    assert all(ra is not None and 1 <= int(ra) <= 60 for s, _, ra in results if s == 429)
    # None waited for the admitted request: a miss of this flood, as a late 429 is (on this
    # 2-core VM the tiny model's answer can come within ~100 ms too: 1 in 3 runs failed here
    # before any change, on this assertion alone).
    return slowest, loop_ms, share, slowest < answered


def test_a_tokenizing_thread_given_up_on_twice_keeps_its_slot_until_it_stops() -> None:
    """The deadline cancels a request being tokenized, then its client goes: the thread is
    told to stop (bgeserve.stopping) and its slot stays taken until it has, its ``Stopped``
    retrieved (review: the second cancel gave the slot back with the thread running, and
    asyncio logged "exception was never retrieved")."""
    import asyncio
    import threading

    from bgeserve import stopping
    from bgeserve.service.admission import Admission

    admission = Admission(engine_standin(), 1000, DrainMeter(), slots=1)  # type: ignore[arg-type]
    inside, release = threading.Event(), threading.Event()
    stopped: list[bool] = []

    def work() -> str:
        inside.set()
        release.wait(5)
        try:
            stopping.check()
        except stopping.Stopped:
            stopped.append(True)
            raise
        return "tokenized"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        unretrieved: list[dict] = []
        loop.set_exception_handler(lambda _, context: unretrieved.append(context))
        task = asyncio.ensure_future(admission.on_thread(work))
        await asyncio.to_thread(inside.wait, 5)
        task.cancel()  # the deadline
        await asyncio.sleep(0.05)
        task.cancel()  # the client gone
        await asyncio.sleep(0.05)
        assert not task.done()  # still waiting for its thread
        assert admission._tokenizing is not None and admission._tokenizing.locked()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stopped == [True]
        assert not admission._tokenizing.locked()  # given back once the thread stopped
        import gc
        gc.collect()
        await asyncio.sleep(0)
        assert unretrieved == []

    asyncio.run(main())
