"""``bgeserve.stopping``: work on a thread its caller gave up on stops at its next check."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bgeserve import stopping


def test_outside_a_stoppable_scope_check_never_raises() -> None:
    stopping.check()


def test_a_thread_started_inside_the_scope_stops_once_its_event_is_set() -> None:
    reached = threading.Event()
    go_on = threading.Event()

    def work() -> str:
        stopping.check()  # not yet set
        reached.set()
        go_on.wait(5)
        stopping.check()  # set meanwhile: raises
        return "finished"

    async def main() -> None:
        with stopping.stoppable() as stop:
            running = asyncio.ensure_future(asyncio.to_thread(work))
        stopping.check()  # the scope ended: this context is as before
        await asyncio.to_thread(reached.wait, 5)
        stop.set()
        go_on.set()
        with pytest.raises(stopping.Stopped):
            await running
        assert await asyncio.to_thread(lambda: stopping.check() or "ok") == "ok"  # others

    asyncio.run(main())
