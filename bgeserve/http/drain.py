"""A stop that answers the requests already on their way.

uvicorn's shutdown closes its listening sockets and then, at once, every connection that is
not inside a request. Two kinds of connection lose a request the client had already sent:

- one still in the kernel's accept queue: closing the listening socket resets it;
- one accepted whose request line has not been read yet (the event loop was busy, or the
  client wrote a moment after connecting): uvicorn counts it idle and closes it, and with its
  request unread the kernel answers RST: ``ConnectionResetError`` for a request sent before
  the signal. A 2-core server running ONNX Runtime on both cores lags its loop enough for
  this to happen (the soak's drain burst lost 1 of 53 requests this way in CI).

``DrainingServer`` first lets the loop accept what is queued, then closes the listening
sockets, then gives every connection that has not sent its first request yet up to
``NEW_CONNECTION_GRACE_SECS`` to send it, and only then runs uvicorn's shutdown, which
answers what is in progress (``Connection: close``) and closes the rest. Go's
``http.Server.Shutdown`` treats a new connection the same way (golang/go#22682: idle only
after 5 s without its first request). A keep-alive connection between requests is closed at
once, as everywhere: its client retries on a fresh connection.

A second Ctrl-C (SIGINT while stopping) is uvicorn's forced exit, which leaves the requests
still running to be cancelled with the event loop: each was a plain-text 500 and a traceback.
Here it first calls ``on_force`` (the service answers everything in progress 503 at once),
gives those answers up to ``ANSWER_SECS`` to go out (and the bodies they cut short to be read,
linger.py), and then exits as uvicorn would. A third is uvicorn's forced exit at once.

uvicorn cancels what still runs when its grace ends, each a traceback and a 500 in the log, and
logs an error for connections still sending: a large answer streamed to a slow reader may still
be (a stalled one is dropped only after 60 s, stalls.py). At least ``CUT_MARGIN_SECS`` before
that, the connections still sending are reset instead: a streamed answer's handler hears the
client leave and ends, logged 499.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from bgeserve.http.linger import LINGER_SECONDS

ACCEPT_SECS = 0.05  # the loop's passes that accept the queue before the listeners close
# A client writes its request right after connecting: this covers a starved event loop and
# bounds what a silent connection (a preconnect, a port check) adds to every stop.
NEW_CONNECTION_GRACE_SECS = 2.0
POLL_SECS = 0.01
# After the drain's deadline or a second Ctrl-C: the 503s go out, and the rest of a body they
# cut short is read (linger.py), within this.
ANSWER_SECS = 2.0 + LINGER_SECONDS
CUT_MARGIN_SECS = 1.0  # before uvicorn's grace ends: a cut stream's handler ends within it

log = logging.getLogger("bgeserve.http")

_NO_CYCLE = object()


def awaiting_first_request(connection: object) -> bool:
    """Whether a uvicorn HTTP connection has not had a request's headers yet (its ``cycle``
    is None until then, in both the httptools and the h11 protocol)."""
    return getattr(connection, "cycle", _NO_CYCLE) is None


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with ``on_shutdown`` called first and the new connections' grace;
    a forced exit (a second Ctrl-C) calls ``on_force`` and lets its answers out first."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None],
                 new_connection_grace: float = NEW_CONNECTION_GRACE_SECS,
                 on_force: Callable[[], None] = lambda: None) -> None:
        super().__init__(config)
        self.on_shutdown = on_shutdown
        self.on_force = on_force
        self.new_connection_grace = new_connection_grace
        self._forcing = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGINT or not self.should_exit or self._forcing:
            super().handle_exit(sig, frame)  # a first signal, or a third Ctrl-C: uvicorn's
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving yet (or any more): nothing to answer
            super().handle_exit(sig, frame)
            return
        self._forcing = True
        # A signal handler interrupts the loop anywhere: the work is scheduled, not done here.
        loop.call_soon_threadsafe(lambda: loop.create_task(self._force()))

    async def _force(self) -> None:
        self.on_force()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ANSWER_SECS
        while self.server_state.tasks and loop.time() < deadline:
            await asyncio.sleep(POLL_SECS)
        # All answered: the stop goes on as a first signal's does (the service's stop, whose
        # workers the abort emptied); else uvicorn's forced exit for what still runs.
        if self.server_state.tasks:
            self.force_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_shutdown()
        grace = self.config.timeout_graceful_shutdown
        # uvicorn's grace starts after admit_pending: counted from here, the cut comes earlier.
        cut = None if grace is None else asyncio.get_running_loop().call_later(
            max(0.0, grace - CUT_MARGIN_SECS), self.cut_sending)
        try:
            await self.admit_pending(sockets)
            await super().shutdown(sockets)
        finally:
            if cut is not None:
                cut.cancel()

    def cut_sending(self) -> int:
        """Reset the connections still sending an answer (``cut_sending``); how many."""
        cut = 0
        for connection in list(self.server_state.connections):
            try:
                cut += bool(getattr(connection, "cut_sending", lambda: False)())
            except Exception:  # one connection's failure must not spare the rest
                log.exception("stopping: could not reset a connection still sending")
        if cut:
            log.warning("stopping: reset %d connection(s) still sending an answer at the end "
                        "of the grace", cut)
        return cut

    async def admit_pending(self, sockets: list[socket.socket] | None) -> None:
        await asyncio.sleep(ACCEPT_SECS)
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        loop = asyncio.get_running_loop()
        started = loop.time()
        # At least ACCEPT_SECS more: a connection accepted in the last pass is registered
        # (connection_made) a few loop iterations after its accept.
        while not self.force_exit:
            waiting = False
            for connection in list(self.server_state.connections):
                if awaiting_first_request(connection):
                    waiting = True
                else:  # what uvicorn's shutdown does, as soon as a request came: it is
                    connection.shutdown()  # answered with Connection: close, or closed if done
            waited = loop.time() - started
            if waited >= self.new_connection_grace or (waited >= ACCEPT_SECS and not waiting):
                return
            await asyncio.sleep(POLL_SECS)
