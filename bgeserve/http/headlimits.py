"""Bounds on a request's head (request line and headers) that uvicorn's httptools protocol lacks.

uvicorn's h11 protocol refuses an incomplete head past 16 KiB (``h11_max_incomplete_event_size``);
its httptools protocol, the one bgeserve runs (C parsing: a flood's bodies read through h11 kept
429s past 100 ms, docs/reliability.md §3), buffers a head however large, for however long. A QA
run (2026-12-06) grew a server from 132 to 455 MiB with four connections each sending 64 MiB of
an unfinished header, past both body limits, and connections that never finished their head
stayed open for as long as it watched (76 s).

``BoundedHttpTools`` counts the bytes that arrive while a head is incomplete: past
``MAX_HEAD_BYTES`` the connection is answered 431 and closed; a head not complete
``HEAD_TIMEOUT_S`` after the connection opened (or after its first byte, on a kept-alive
connection) is answered 408 and closed, as nginx's ``client_header_timeout`` does (a
connection that sent nothing at all is closed without a word). Both answers are the JSON
envelope, written here: no request exists yet for the app to answer. As ``linger.py`` does for
bodies, what the client still sends is then read and dropped for up to ``LINGER_S`` (at most
``LINGER_BYTES``) before the close, so that a client writing its whole request before reading
gets the answer rather than a reset.

The next head's bytes may arrive while the previous request is still being answered (a
pipelined request, a stray CRLF after a body): they are counted, but its clock starts only
when that response is complete, and a head past the cap then writes nothing into the answer in
progress: the connection is marked to close after it, and what arrives is dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import TYPE_CHECKING

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from bgeserve.http.context import ANSWER_CUT, count_refused
from bgeserve.http.upgrades import PlainHttpTools

if TYPE_CHECKING:
    from uvicorn._types import ASGI3Application

# The bytes of one read may hold a head and the start of its body (asyncio and uvloop read up
# to 256 KiB at a time), all counted until the head completes: the cap leaves room for that.
MAX_HEAD_BYTES = 1 << 20
HEAD_TIMEOUT_S = 30.0  # nginx's client_header_timeout is 60 s; Apache's reqtimeout 20-40 s
LINGER_S = 2.0
LINGER_BYTES = 16 << 20
MAX_URL_BYTES = 0xFFFF  # httptools.parse_url takes no more (a 16-bit length)
# Header fields of one request. Each costs a Python call in the parser and a pass in every
# middleware that looks one up: 200,000 tiny ones under the byte cap took 118 ms, and one
# connection sending such heads kept /health at p50 379 ms and embeddings at 1 a second,
# before any key was checked (QA). hyper (TEI's) takes 100; browsers send ~20.
MAX_HEADERS = 256


class LogBudget:
    """At most ``lines`` warnings a ``window_s``; the rest are counted, and the count is
    logged when the window ends (QA: 2,000 TLS hellos sent to the plain port wrote 2,000
    warnings in 0.9 s; nginx logs these at info). One per server (its ``app_state``)."""

    def __init__(self, lines: int = 10, window_s: float = 10.0) -> None:
        self.lines, self.window_s = lines, window_s
        self.started = -window_s
        self.used = self.skipped = 0

    def take(self, now: float) -> bool:
        """Whether a line may be logged now (else it is counted)."""
        if now - self.started >= self.window_s:
            self.started, self.used = now, 0
        if self.used >= self.lines:
            self.skipped += 1
            return False
        self.used += 1
        return True

    def ends_in(self, now: float) -> float:
        return max(0.0, self.started + self.window_s - now)

    def flush(self, logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Log how many lines were not (called when the window ends)."""
        if self.skipped:
            logger.warning("%d more request heads refused in the last %gs, not logged one by "
                           "one", self.skipped, self.window_s)
            self.skipped = 0


REFUSAL_LOG = "bgeserve.refused_heads"  # the server's LogBudget, in its app_state


def _answer(status: int, reason: str, code: str, message: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                   "code": code, "param": None}})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class BoundedHttpTools(PlainHttpTools):
    """uvicorn's httptools protocol (upgrades served as HTTP/1.1, ``upgrades.py``) with a size
    cap and a time limit on each request head."""

    _in_head = True
    _head_bytes = 0
    _head_begun = False  # the parser has the start of a request line (bytes of the same read
    # as the previous message are not counted in _head_bytes)
    _head_timer: asyncio.TimerHandle | None = None
    _dropping = False  # refused: what still arrives is read and dropped until the close
    # The request being answered (uvicorn's ``cycle`` is the newest one parsed).
    _running: RequestResponseCycle | None = None
    _too_many_headers = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._context = contextvars.copy_context()
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        running = self._running
        if running is not None and not running.response_complete and (
                not running.response_started or running.chunked_encoding
                or running.expected_content_length > 0):
            # Its answer, or a part of it, was not written: uvicorn drops what the app sends
            # now without a word. The access log's 499 (context.py). One written whole and
            # lingering (linger.py reads the rest of the body) was the client's.
            running.scope["state"][ANSWER_CUT] = True
        super().connection_lost(exc)
        if running is not None and running is not self.cycle and not running.response_complete:
            # uvicorn tells the newest request parsed only: the one being answered, with a
            # pipelined one parsed behind it, went on rendering into a closed transport.
            running.disconnected = True
            running.message_event.set()

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            self._head_bytes += len(data)
            if self._head_bytes > LINGER_BYTES:
                self.transport.close()
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, "Request Header Fields Too Large", "headers_too_large",
                             f"the request line and headers passed {MAX_HEAD_BYTES} bytes",
                             self.cycle)
                return
            if self._head_timer is None and not self._answering():
                self._start_timer()  # a kept-alive connection's next request began
        super().data_received(data)

    def on_message_begin(self) -> None:
        self._head_begun = True
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= MAX_HEADERS and not self._framing_head:
            self._too_many_headers = True  # the parser stops here; send_400_response answers
            raise httptools.HttpParserError("too many header fields")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_begun = False
        self._stop_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # What follows is the next request's head; its clock starts with its first byte once
        # this response is complete (until then uvicorn's keep-alive timeout governs the idle
        # connection).
        self._in_head = True
        self._head_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._in_head and self._began() and self._head_timer is None \
                and not self.transport.is_closing():
            # The next head began while this was being answered: its own clock governs, not
            # uvicorn's keep-alive timer for an idle connection (BGE_M3_KEEP_ALIVE_SECS; at
            # uvicorn's 5 s it closed the connection under a pipelined head without a word).
            self._unset_keepalive_if_required()
            self._start_timer()

    def send_400_response(self, msg: str) -> None:
        # The parser's refusals (bytes that are not HTTP: a malformed chunk, a control
        # character in a header; a URL past httptools' 65,535 bytes) were a plain-text 400
        # without a request id, closed at once (a client still sending got a reset) and
        # written into a pipelined answer in progress: here they are a refused head's.
        cycle = self.cycle
        in_body = (cycle is not None and not cycle.response_complete
                   and not cycle.response_started and cycle.more_body)
        after: RequestResponseCycle | None = cycle
        if in_body and cycle is self._running:  # the body being read is at fault: this is
            # its request's answer, and its handler hears a disconnect (what it sends is
            # dropped; no 100 Continue after it)
            cycle.waiting_for_100_continue = False
            cycle.disconnected = True
            cycle.message_event.set()
            after = None
        elif in_body:  # a pipelined request's body: it never runs, and the connection
            after = self._running  # closes after the answer in progress, untouched
        if self._too_many_headers:
            self._too_many_headers = False
            self._refuse(431, "Request Header Fields Too Large", "headers_too_large",
                         f"the request has more than {MAX_HEADERS} header fields", after)
        elif len(self.url) > MAX_URL_BYTES:
            self._refuse(414, "URI Too Long", "uri_too_long",
                         f"the request target is {len(self.url)} bytes, past {MAX_URL_BYTES}",
                         after)
        else:
            self._refuse(400, "Bad Request", "invalid_http", msg, after)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        self._running = cycle
        # Each request starts from the connection's context. A pipelined one is started from
        # inside the previous one's task (its answer's last send), whose context asyncio
        # copied: that request's scope (holds.answering) with it, so the room of the next
        # one's ColBERT output was handed to a scope already closed and never given back.
        self._context.run(super()._start_asgi_task, cycle, app)

    def _began(self) -> bool:
        """Whether the next request's head has begun."""
        return bool(self._head_bytes) or self._head_begun

    def _answering(self) -> bool:
        """Whether a response is in progress on this connection."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _start_head(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._start_timer()

    def _start_timer(self) -> None:
        self._stop_timer()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self._answering():
            return
        if not self._began():  # it never said a word: nothing to answer
            self._in_head = False
            self.transport.close()
            return
        self._refuse(408, "Request Timeout", "request_timeout",
                     f"the request line and headers did not arrive within {HEAD_TIMEOUT_S:g}s",
                     self.cycle)

    def _refuse(self, status: int, reason: str, code: str, message: str,
                after: RequestResponseCycle | None) -> None:
        """Answer ``status`` and close, or, while ``after`` is being answered, close once it
        is (None: answer now)."""
        self._stop_timer()
        self._in_head = False
        self._dropping = True
        self.flow.resume_reading()  # what arrives is read (and dropped) until the close
        if self.transport.is_closing():
            return
        # The only line such a request gets (no access line: no request reached the app), so
        # it names the client, for an operator to tell who sends malformed or stalled heads.
        client = self.client[0] if self.client else "?"
        budget = self.app_state.setdefault(REFUSAL_LOG, LogBudget())
        now = self.loop.time()
        if budget.take(now):
            self.logger.warning("refused a request head from %s: %d %s", client, status,
                                message)
        elif budget.skipped == 1:  # the window's first not logged: its count comes at its end
            self.loop.call_later(budget.ends_in(now), budget.flush, self.logger)
        count_refused(self.app_state, status)
        if after is not None and not after.response_complete:
            # Never into the answer in progress: uvicorn closes the connection after it.
            after.keep_alive = False
            return
        self.transport.write(_answer(status, reason, code, message))
        self.loop.call_later(LINGER_S, self.transport.close)
