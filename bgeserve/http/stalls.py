"""A client that reads nothing of its answer is dropped: the bound on sending uvicorn lacks.

uvicorn writes an answer into the transport and, once the transport's buffer passes its
high-water mark, waits for the client to read before it writes more; nothing bounds that wait.
A client that stops reading (a stuck consumer, a peer gone without a word behind a NAT: TCP's
zero-window probes keep such a connection open for as long as they are acknowledged) kept what
its answer holds for as long as the connection lived: a whole answer's unsent bytes in the
transport's buffer (up to ~3x the vectors of a large ColBERT answer, outside every budget), a
streamed answer's request scope with its ColBERT and body allowances (``render.STREAM_BYTES``),
which the next requests wait for; and a graceful stop waited for that connection to its end.

``StallBoundHttpTools`` watches a connection while its writing is paused, and after an answer
that left bytes unsent (under TLS the whole answer is encrypted into a transport below this
one, which never pauses this protocol). When the client has taken nothing for ``SEND_STALL_S``
(looked at four times in that period: within a quarter of it), the connection is reset (a
warning says so), as nginx's ``send_timeout`` (60 s between two successive writes) does. Taken
means, on Linux, bytes the client acknowledged (``TCP_INFO``'s ``bytes_acked``), else what is
unsent shrinking: the transport's buffer and the socket's send queue (``SIOCOUTQ``). A slow
reader that takes anything in that time goes on. The reset request's handler hears a
disconnect; a streamed answer cut short is logged 499 (``context.py``). A stop resets the
connections still sending at least ``drain.CUT_MARGIN_SECS`` before uvicorn's grace ends
(``cut_sending``): uvicorn cancelled those streams, a traceback each.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import socket
import struct
import termios
from collections.abc import Callable
from typing import TYPE_CHECKING

from bgeserve.http.context import HOLD_UNTIL_TAKEN
from bgeserve.http.headlimits import BoundedHttpTools

if TYPE_CHECKING:
    from uvicorn._types import ASGI3Application
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

SEND_STALL_S = 60.0
# ``hold_until_taken``: what may stay unsent (the transport's buffer and the socket's queue)
# and still count as taken (asyncio's default high-water mark: an answer of that size was
# never more to hold), and how often a connection with more is looked at again.
TAKEN_SLACK = 64 << 10
TAKEN_LOOK_S = 0.05
LOOKS = 4  # per SEND_STALL_S
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: the close is a reset, the queue dropped
# struct tcp_info (linux/tcp.h): the u64 tcpi_bytes_acked at byte 120 (Linux 4.1 and later).
_ACKED = struct.Struct("Q")
_ACKED_AT = 120


class StallBoundHttpTools(BoundedHttpTools):
    """``BoundedHttpTools`` that resets a connection whose client takes nothing of its answer
    for ``SEND_STALL_S``."""

    _stall_timer: asyncio.TimerHandle | None = None
    _taken: tuple[int | None, int] = (None, 0)  # (bytes acknowledged, unsent) at the last look
    _since = 0.0  # loop time of the last progress (or of the watch's start)
    # Answers handed over and not yet taken, oldest first: [give_back(n), bytes still held].
    _holds: list[list]
    _holds_timer: asyncio.TimerHandle | None = None
    _tls = False
    _lost = False
    # TLS: the count of acknowledged bytes (TCP_INFO) at which all that was written is taken.
    _taken_at = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._holds = []
        self._tls = transport.get_extra_info("sslcontext") is not None
        super().connection_made(transport)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        # Under TLS, where its answer will start in the stream: what was acknowledged before
        # any of it was written (read when it is handed over, a fast client's part of it).
        acked = self._acked() if self._tls else None
        if self._holds:  # what the client took since the last look: not in the next one's way
            self._settle(self._outstanding())
        cycle.scope["state"][HOLD_UNTIL_TAKEN] = functools.partial(self.hold_until_taken,
                                                                   acked_before=acked)
        super()._start_asgi_task(cycle, app)

    def hold_until_taken(self, answer: int, give_back: Callable[[int], None],
                         acked_before: int | None = None) -> int:
        """Of an answer of ``answer`` bytes just handed over, the bytes its client has not
        taken yet (0 where the connection holds at most ``TAKEN_SLACK`` unsent): given back
        through ``give_back(n)`` (later, never in this call) as the client takes them, the
        rest when the connection ends. An answer handed over whole waits here for its client
        (``guards.InflightLimit`` counts it in the allowance of bodies in progress; a stalled
        reader is reset after ``SEND_STALL_S``)."""
        if acked_before is not None:  # TLS: the answer ends this many bytes on in the stream
            self._taken_at = max(self._taken_at, acked_before) + answer
        outstanding = self._outstanding()
        self._settle(outstanding)
        if outstanding <= TAKEN_SLACK:
            return 0
        held = min(answer, outstanding - sum(h[1] for h in self._holds))
        if held <= 0:
            return 0
        self._holds.append([give_back, held])
        if self._holds_timer is None:
            self._holds_timer = self.loop.call_later(TAKEN_LOOK_S, self._look_taken)
        return held

    def _outstanding(self) -> int:
        """Bytes written that the client has not taken. Under TLS the transport below this
        one, where an answer waits encrypted, is out of sight: what the client acknowledged
        against where the answers end says it (without ``TCP_INFO``, the unsent alone)."""
        unsent = self._unsent()
        if self._tls:
            acked = self._acked()
            if acked is not None:
                unsent = max(unsent, self._taken_at - acked)
        return unsent

    def _look_taken(self) -> None:
        self._holds_timer = None
        self._settle(self._outstanding())
        if self._holds:
            self._holds_timer = self.loop.call_later(TAKEN_LOOK_S, self._look_taken)

    def _settle(self, outstanding: int) -> None:
        """Give back what the holds hold past ``outstanding``, oldest first (sent first, taken
        first); all of it at ``TAKEN_SLACK`` or under. A client that pipelines and reads
        holds what it has not read, not every answer since the connection last drained."""
        excess = sum(h[1] for h in self._holds) - (outstanding if outstanding > TAKEN_SLACK
                                                    else 0)
        while excess > 0 and self._holds:
            hold = self._holds[0]
            cut = min(hold[1], excess)
            hold[1] -= cut
            excess -= cut
            if not hold[1]:
                self._holds.pop(0)
            hold[0](cut)

    def _give_all_back(self) -> None:
        if self._holds_timer is not None:
            self._holds_timer.cancel()
            self._holds_timer = None
        holds, self._holds = self._holds, []
        for give_back, held in holds:
            give_back(held)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Under TLS nothing paused this protocol, however much waits (a watch that runs
        # already goes on: no look needed per answer).
        if self._stall_timer is None and self._unsent():
            self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._unwatch()
        self._give_all_back()  # nothing it held is in this process any more
        super().connection_lost(exc)

    def cut_sending(self) -> bool:
        """Reset the connection if it is still sending: a streamed (length-less) answer in
        progress, or bytes of an answer not yet taken; whether it was. A streamed answer's
        handler hears the client leave, and it is logged 499. A closing transport too: the
        stop closed it (or HTTP/1.0 did) with an answer its client has not taken, and a close
        waits for the buffer to drain without a bound (QA: the stop ran its whole grace)."""
        cycle = self._running or self.cycle
        streaming = cycle is not None and cycle.response_started \
            and not cycle.response_complete and bool(cycle.chunked_encoding)
        if not streaming and not self._unsent():
            return False
        self._reset()
        return True

    def _watch(self) -> None:
        # Not "unless closing": an answer to HTTP/1.0 or Connection: close is followed by the
        # transport's close, which waits for its buffer to drain without a bound (review).
        if self._stall_timer is None and not self._lost:
            self._taken = self._progress()
            self._since = self.loop.time()
            self._next_look()

    def _unwatch(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _next_look(self) -> None:
        self._stall_timer = self.loop.call_later(SEND_STALL_S / LOOKS, self._look)

    def _look(self) -> None:
        self._stall_timer = None
        acked, unsent = taken = self._progress()
        if not unsent and not self.flow.write_paused:  # all sent: nothing to watch
            return
        now = self.loop.time()
        last_acked, last_unsent = self._taken
        if (acked is not None and last_acked is not None and acked > last_acked) \
                or unsent < last_unsent:  # it took something
            self._since = now
        elif now - self._since >= SEND_STALL_S * (1 - 1e-6):
            self.logger.warning("reset a connection whose client took nothing of its answer "
                                "for %gs (%d bytes unsent)", SEND_STALL_S, unsent)
            self._reset()
            return
        self._taken = taken
        self._next_look()

    def _socket(self) -> socket.socket | None:
        return self.transport.get_extra_info("socket")

    def _unsent(self) -> int:
        """Bytes written but not yet taken by the client: the transport's buffer and the
        socket's send queue (sent or not, not acknowledged; Linux's SIOCOUTQ)."""
        unsent = self.transport.get_write_buffer_size()
        try:
            queued = fcntl.ioctl(self._socket().fileno(), termios.TIOCOUTQ,  # type: ignore
                                 b"\0" * 4)
            unsent += struct.unpack("i", queued)[0]
        except (AttributeError, OSError, ValueError):  # no socket, not Linux: the buffer alone
            pass
        return unsent

    def _progress(self) -> tuple[int | None, int]:
        """(bytes the client acknowledged so far, None where unknown; ``_unsent()``)."""
        return self._acked(), self._unsent()

    def _acked(self) -> int | None:
        """Bytes the client acknowledged on this connection (``TCP_INFO``); None where
        unknown (not Linux, no socket)."""
        try:
            info = self._socket().getsockopt(  # type: ignore[union-attr]
                socket.IPPROTO_TCP, socket.TCP_INFO, _ACKED_AT + _ACKED.size)
        except (AttributeError, OSError, ValueError, TypeError):
            return None
        return _ACKED.unpack_from(info, _ACKED_AT)[0] if len(info) >= _ACKED_AT + _ACKED.size \
            else None

    def _reset(self) -> None:
        """Abort the connection with a reset, so that the kernel drops its queue at once (an
        orphaned socket kept it, probing the client for minutes)."""
        try:
            self._socket().setsockopt(  # type: ignore[union-attr]
                socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        except (AttributeError, OSError, ValueError, TypeError):
            pass
        self.transport.abort()
