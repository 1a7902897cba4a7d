"""``bgeserve.timings``: a request's model calls summed into TEI's headers (no model)."""

from __future__ import annotations

from types import SimpleNamespace

from bgeserve import timings


def test_calls_inside_a_scope_are_summed_and_outside_one_ignored() -> None:
    """Tokenizing runs from arrival to the job's submission, it waits from there to its first
    chunk, the rest is inference: the parts add up to the call's time, however late the
    caller stamps ``queued``. A job never started (every text from the cache) waited none.
    Outside a request's scope (a library caller) nothing is kept."""
    timings.record(5, 3, 0.0, 1.0, [], 2.0)  # no scope: no error, nothing kept
    spent = timings.Timings()
    with timings.measuring(spent):
        timings.record(10, 4, 100.0, 100.7, [SimpleNamespace(submitted=100.5, started=101.0,
                                                                  room_wait=0.0)],
                       103.0)
        timings.record(2, 1, 200.0, 200.1, [SimpleNamespace(submitted=200.1, started=0.0,
                                                                  room_wait=0.0)],
                       200.2)
    timings.record(5, 3, 0.0, 1.0, [], 2.0)  # after it: not added
    assert (spent.characters, spent.tokens, spent.calls) == (12, 5, 2)
    assert abs(spent.tokenization_s - 0.6) < 1e-9 and abs(spent.queue_s - 0.5) < 1e-9
    assert abs(spent.inference_s - 2.1) < 1e-9
    assert abs(spent.tokenization_s + spent.queue_s + spent.inference_s - 3.2) < 1e-9
    assert timings.active() is False
    headers = dict(spent.headers(3.2567, "cpu"))
    assert headers == {b"x-compute-type": b"cpu", b"x-compute-time": b"3257",
                       b"x-compute-characters": b"12", b"x-compute-tokens": b"5",
                       b"x-total-time": b"3257", b"x-tokenization-time": b"600",
                       b"x-queue-time": b"500", b"x-inference-time": b"2100"}


def test_a_wait_for_room_for_colbert_output_is_queue_time_not_tokenizing() -> None:
    """A request that waited 5 s for room for its ColBERT vectors (behind another being sent)
    said x-tokenization-time 5053 ms: the first job's wait came before its submission, a
    later job's (a rerank's next group) after it; both are queue time, the parts still adding
    up to the call's."""
    spent = timings.Timings()
    with timings.measuring(spent):
        timings.record(10, 4, 100.0, 106.0, [
            SimpleNamespace(submitted=105.5, started=106.0, room_wait=5.0),
            SimpleNamespace(submitted=107.5, started=107.5, room_wait=1.0),
        ], 109.0)
    assert abs(spent.tokenization_s - 0.5) < 1e-9
    assert abs(spent.queue_s - 6.5) < 1e-9
    assert abs(spent.inference_s - 2.0) < 1e-9
