"""Lingering close: an answer sent before the request body was read still reaches the client.

The guards answer 401, 413 and 429 from the headers alone, before a byte of the body is read
(and a handler may answer 408 or 413 halfway through it). Most clients write their whole body
before they read anything (urllib, requests, httpx, the openai client). If the server then
closes the connection with body bytes still unread, its kernel resets the connection (RST),
and the client's kernel throws away the answer it had already received: the client sees
``ConnectionResetError`` / ``BrokenPipeError``, never the JSON error. (uvicorn closes at once
when the request said ``Connection: close``, as urllib's does; on a keep-alive connection it
reads and discards the rest of the body for as long as the client sends it.)

``LingeringClose`` does what nginx's lingering close does. When a response starts while the
request body has not been read to its end, the response carries ``Connection: close``; its
bytes go out whole, and before the response is marked complete the rest of the request body
is read and thrown away — at most ``max_bytes`` of body in all and ``max_seconds`` — so the
close that follows finds nothing unread and is a clean FIN. Past either bound it stops
reading and the connection closes anyway: a client that keeps sending then gets a reset, as
it would from nginx.

A client that sent ``Expect: 100-continue`` and has not been told to continue has sent no
body and will send none (curl, for bodies over 1 MiB): it gets the answer and the close at
once.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("bgeserve.http")

# nginx: lingering_time 30 s, lingering_timeout 5 s. A refused client gets 5 s in all to
# finish sending what it declared, which at loopback speed is far more than 2x the body limit.
LINGER_SECONDS = 5.0
LINGER_BODY_FACTOR = 2  # bytes read in all, in units of the body limit

_CLOSE = (b"connection", b"close")


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


def _has_body(scope: Scope) -> bool:
    """Whether the request announces a body (RFC 9112 §6.3: Content-Length or chunked)."""
    if _header(scope, b"transfer-encoding") is not None:
        return True
    length = _header(scope, b"content-length")
    return length is not None and length.strip() not in (b"", b"0")


class LingeringClose:
    """ASGI middleware: read and discard the unread rest of a request body after its answer.

    ``max_bytes`` bounds the body read in all (what the app read included); ``max_seconds``
    bounds the time spent discarding after the answer went out.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, max_seconds: float = LINGER_SECONDS):
        self.app = app
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        read = 0
        complete = False
        lingering = False

        async def tracked_receive() -> Message:
            nonlocal read, complete
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                complete = not message.get("more_body", False)
            else:  # http.disconnect: nothing more will come
                complete = True
            return message

        async def lingering_send(message: Message) -> None:
            nonlocal lingering
            if message["type"] == "http.response.start" and not complete:
                lingering = True
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
                message = {**message, "headers": [*headers, _CLOSE]}
            elif (message["type"] == "http.response.body" and lingering
                  and not message.get("more_body", False)):
                await send({**message, "more_body": True})  # the whole answer goes out now
                if read or _header(scope, b"expect") != b"100-continue":
                    await self._discard(receive, read)
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app(scope, tracked_receive, lingering_send)

    async def _discard(self, receive: Receive, read: int) -> None:
        """Read the body to its end, or until a bound; what was read is dropped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_seconds
        while read <= self.max_bytes:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except TimeoutError:
                break
            if message["type"] != "http.request":
                return  # the client went away
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
        log.info("lingering close: stopped reading the request body after %d bytes", read)
