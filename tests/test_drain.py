"""The stop's drain on a real uvicorn: requests already sent when the stop begins are answered."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from bgeserve.http.drain import DrainingServer, awaiting_first_request
from tests.uvithread import serving

REQUEST = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"


async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    if scope["path"] == "/block":  # holds the event loop, as a starved loop would be held
        time.sleep(0.5)  # noqa: ASYNC251 - on purpose
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"8")]})
    await send({"type": "http.response.body", "body": b"answered"})


@contextmanager
def running(grace: float = 2.0) -> Iterator[tuple[DrainingServer, int, threading.Thread, list]]:
    calls: list[str] = []
    config = uvicorn.Config(app, log_level="critical", lifespan="off")
    server = DrainingServer(config, on_shutdown=lambda: calls.append("shutdown"),
                            new_connection_grace=grace)
    with serving(server) as (port, thread):
        yield server, port, thread, calls


def answer(conn: socket.socket) -> bytes:
    conn.settimeout(10)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_a_connection_that_sends_after_the_stop_began_is_answered() -> None:
    # Stock uvicorn closes an accepted connection without a request at once: the request
    # sent a moment later meets a reset.
    with running() as (server, port, thread, calls):
        conn = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.2)  # accepted
        server.should_exit = True
        time.sleep(0.3)  # the stop has begun (uvicorn looks every 0.1 s)
        assert calls == ["shutdown"]
        conn.sendall(REQUEST)
        got = answer(conn)
        conn.close()
        thread.join(10)
        assert not thread.is_alive()
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"answered")  # then closed (EOF)


def test_a_request_queued_while_the_loop_was_busy_is_answered() -> None:
    with running() as (server, port, thread, _):
        busy = socket.create_connection(("127.0.0.1", port))
        busy.sendall(b"GET /block HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)  # the loop is inside /block's 0.5 s
        server.should_exit = True
        late = socket.create_connection(("127.0.0.1", port))  # the kernel's accept queue
        late.sendall(REQUEST)
        got = answer(late), answer(busy)
        late.close()
        busy.close()
        thread.join(10)
    assert all(g.startswith(b"HTTP/1.1 200") and g.endswith(b"answered") for g in got), got


def test_a_silent_connection_holds_the_stop_only_for_the_grace() -> None:
    with running(grace=0.5) as (server, port, thread, _):
        silent = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.2)
        started = time.monotonic()
        server.should_exit = True
        thread.join(10)
        took = time.monotonic() - started
        assert answer(silent) == b""  # closed without an answer: it asked for nothing
        silent.close()
    assert not thread.is_alive()
    assert 0.5 <= took < 2.0, took


def test_awaiting_first_request_reads_the_protocols_cycle() -> None:
    class Conn:
        cycle: object = None

    assert awaiting_first_request(Conn())
    Conn.cycle = object()
    assert not awaiting_first_request(Conn())
    assert not awaiting_first_request(object())  # not an HTTP protocol: never waited for
