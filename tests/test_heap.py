"""The heap a large request freed goes back to the OS when it ends (``http.heap``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from bgeserve.http import guards
from bgeserve.http.heap import TRIM_AFTER_BYTES, HeapTrim


def test_a_large_requests_end_trims_the_heap_on_a_thread_at_most_once_a_period() -> None:
    """A small body's end trims nothing; a large one's trims on a thread (not the event
    loop's); another within the period is trimmed when it is over (the last of a burst too),
    and ends while one is pending add nothing."""
    threads: list[str] = []

    def trim() -> None:
        threads.append(threading.current_thread().name)

    async def main() -> HeapTrim:
        heap = HeapTrim(trim, every_s=0.2)
        heap.after(TRIM_AFTER_BYTES - 1)
        await asyncio.sleep(0.05)
        assert threads == []
        heap.after(TRIM_AFTER_BYTES)
        await asyncio.sleep(0.05)
        assert len(threads) == 1 and threads[0] != threading.current_thread().name
        heap.after(5 * TRIM_AFTER_BYTES)  # within the period: later, once
        heap.after(5 * TRIM_AFTER_BYTES)
        await asyncio.sleep(0.05)
        assert len(threads) == 1
        await asyncio.sleep(0.25)
        assert len(threads) == 2
        return heap

    assert asyncio.run(main()).trims == 2


def test_an_end_with_no_loop_running_leaves_the_next_one_to_run() -> None:
    """Within the period the trim is put off on the running loop; with none (a request's
    task closed by the collector) nothing is raised and later ends still trim (review)."""
    calls: list[int] = []
    heap = HeapTrim(lambda: calls.append(1), every_s=60.0)
    heap._last = heap.clock()  # one just ran
    heap.after(TRIM_AFTER_BYTES)  # no loop: not put off, not stuck
    heap._last = -60.0

    async def main() -> None:
        heap.after(TRIM_AFTER_BYTES)
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert calls == [1]


def test_a_failed_trim_leaves_the_next_one_to_run() -> None:
    calls: list[int] = []

    def trim() -> None:
        calls.append(1)
        raise OSError("no")

    async def main() -> None:
        heap = HeapTrim(trim, every_s=0.0)
        heap.after(TRIM_AFTER_BYTES)
        await asyncio.sleep(0.05)
        heap.after(TRIM_AFTER_BYTES)
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert calls == [1, 1]


def test_the_bodies_allowance_trims_after_a_request_with_its_bytes() -> None:
    """InflightLimit hands the heap trim what the request's body held, once it ended."""
    ended: list[int] = []

    class Recording(HeapTrim):
        def after(self, body_bytes: int) -> None:
            ended.append(body_bytes)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = guards.InflightLimit(app, allowance=guards.BodyAllowance(1 << 30),
                                 heap=Recording())
    chunks = iter([b"x" * 3000, b"y" * 2000, None])

    async def receive() -> dict:
        chunk = next(chunks)
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": [],
             "state": {}}
    asyncio.run(guard(scope, receive, send))
    assert ended == [5000]


def test_the_heap_is_released_of_the_cyclic_garbage_first() -> None:
    """A request cut at its deadline leaves its ids in reference cycles (its exceptions'
    tracebacks): only a collection frees them, and a trim gives back nothing still allocated
    (QA: idle RSS 97 -> 226 -> 349 -> 498 MiB over three such requests, OOM-killed under a
    500 MiB cap). ``release_heap``, HeapTrim's default, collects first."""
    import gc
    import inspect
    import weakref

    from bgeserve.malloc import release_heap

    assert inspect.signature(HeapTrim).parameters["trim"].default is release_heap

    class Held:
        pass

    held = Held()
    held.cycle = held  # type: ignore[attr-defined]
    alive = weakref.ref(held)
    del held
    gc.disable()  # no collection but release_heap's own
    try:
        assert alive() is not None
        release_heap()
        assert alive() is None
    finally:
        gc.enable()
