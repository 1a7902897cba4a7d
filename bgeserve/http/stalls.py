"""A client that reads nothing of its answer is dropped: the bound on sending uvicorn lacks.

uvicorn writes an answer into the transport and, once the transport's buffer passes its
high-water mark, waits for the client to read before it writes more; nothing bounds that wait.
A client that stops reading (a stuck consumer, a peer gone without a word behind a NAT: TCP's
zero-window probes keep such a connection open for as long as they are acknowledged) kept what
its answer holds for as long as the connection lived: a whole answer's unsent bytes in the
transport's buffer (up to ~3x the vectors of a large ColBERT answer, outside every budget), a
streamed answer's request scope with its ColBERT and body allowances (``render.STREAM_BYTES``),
which the next requests wait for; and a graceful stop waited for that connection to its end.

``StallBoundHttpTools`` watches a transport whose writing is paused: when what it has not sent
(its own buffer and, on Linux, the socket's send queue) has not shrunk for ``SEND_STALL_S``
(looked at four times in that period: within a quarter of it), the connection is reset (a
warning says so), as nginx's ``send_timeout`` (60 s between two successive writes) does. A slow reader that takes anything in that time goes on: the socket's
queue counts each byte the client acknowledges, where the transport's buffer alone moves only
once a third of the socket's buffer (autotuned to megabytes) is free. The aborted request's handler hears a disconnect; a streamed answer cut
short is logged 499 (``context.py``). A stop cuts the streamed answers still being sent just
before uvicorn's grace ends (``cut_stream``, drain.py): uvicorn cancelled them, a traceback each.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios

from bgeserve.http.headlimits import BoundedHttpTools

SEND_STALL_S = 60.0
LOOKS = 4  # per SEND_STALL_S
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: the close is a reset, the queue dropped


class StallBoundHttpTools(BoundedHttpTools):
    """``BoundedHttpTools`` that resets a connection whose client reads nothing of its answer
    for ``SEND_STALL_S``."""

    _stall_timer: asyncio.TimerHandle | None = None
    _unsent = 0  # what was not sent at the last progress
    _since = 0.0  # loop time of the last progress (or of the pause)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._unsent = self._pending()
            self._since = self.loop.time()
            self._next_look()

    def resume_writing(self) -> None:
        self._unwatch()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unwatch()
        super().connection_lost(exc)

    def cut_stream(self) -> bool:
        """Reset the connection if a streamed (length-less) answer is still being sent on it;
        whether it was. Its handler hears the client leave, and it is logged 499."""
        cycle = self._running or self.cycle
        if cycle is None or not cycle.response_started or cycle.response_complete \
                or not cycle.chunked_encoding or self.transport.is_closing():
            return False
        self._reset()
        return True

    def _pending(self) -> int:
        """Bytes written but not yet taken by the client."""
        pending = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        try:  # the socket's send queue: sent or not, not yet acknowledged (Linux's SIOCOUTQ)
            queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)
            pending += struct.unpack("i", queued)[0]
        except (AttributeError, OSError, ValueError):  # no socket, not Linux: the buffer alone
            pass
        return pending

    def _next_look(self) -> None:
        self._stall_timer = self.loop.call_later(SEND_STALL_S / LOOKS, self._look)

    def _unwatch(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _look(self) -> None:
        self._stall_timer = None
        unsent = self._pending()
        now = self.loop.time()
        if unsent < self._unsent:  # it read something
            self._unsent, self._since = unsent, now
        elif now - self._since >= SEND_STALL_S * (1 - 1e-6):
            self.logger.warning("reset a connection whose client read nothing of its answer "
                                "for %gs (%d bytes unsent)", SEND_STALL_S, unsent)
            self._reset()
            return
        self._next_look()

    def _reset(self) -> None:
        """Abort the connection with a reset, so that the kernel drops its queue at once (an
        orphaned socket kept it, probing the client for minutes)."""
        sock = self.transport.get_extra_info("socket")
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        except (AttributeError, OSError):
            pass
        self.transport.abort()
