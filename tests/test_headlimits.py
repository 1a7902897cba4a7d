"""Request heads on a real uvicorn with ``BoundedHttpTools``: a cap on their size, a limit on
their time, and nothing else changed (large headers within the cap, kept-alive connections,
large bodies); an ``Upgrade`` request served as HTTP/1.1 with its body, the parser's
refusals in the JSON envelope (``upgrades.py``)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import orjson
import pytest
import uvicorn

from bgeserve.http import headlimits
from tests.uvithread import serving


async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(1.5)
    size = 0
    more = True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def running(keep_alive: float = 5) -> Iterator[int]:
    config = uvicorn.Config(app, log_level="critical", lifespan="off",
                            http=headlimits.BoundedHttpTools, ws="none",  # as cli.py runs it
                            timeout_keep_alive=keep_alive)  # type: ignore[arg-type]
    with serving(uvicorn.Server(config)) as (port, _):
        yield port


def read_all(conn: socket.socket, timeout: float = 10) -> bytes:
    conn.settimeout(timeout)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def error(answer: bytes) -> dict:
    return orjson.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


def test_a_head_past_the_cap_is_431_and_closed() -> None:
    """An unfinished header of 4 MiB: refused once the head passes MAX_HEAD_BYTES, the
    connection closed (httptools alone buffered it however large)."""
    with running() as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            for _ in range(64):
                conn.sendall(b"a" * (64 << 10))
        except OSError:  # closed under us, as meant
            pass
        answer = read_all(conn)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert error(answer)["code"] == "headers_too_large"


def test_a_head_that_does_not_complete_in_time_is_408(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head trickled (or never sent) past HEAD_TIMEOUT_S: 408, closed; a kept-alive
    connection's next head gets its own clock from its first byte."""
    monkeypatch.setattr(headlimits, "HEAD_TIMEOUT_S", 0.5)
    with running() as port:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            started = time.monotonic()
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and no end of the head
            answer = read_all(conn)
            assert 0.4 < time.monotonic() - started < 5
        assert answer.startswith(b"HTTP/1.1 408 ") and error(answer)["code"] == "request_timeout"
        with socket.create_connection(("127.0.0.1", port)) as silent:
            assert read_all(silent) == b""  # one that says nothing is closed without a word
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            conn.settimeout(5)
            assert conn.recv(65536).startswith(b"HTTP/1.1 200 ")
            time.sleep(0.8)  # past the head timeout, idle between requests: not a head yet
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_all(conn).startswith(b"HTTP/1.1 200 ")


def test_large_heads_within_the_cap_and_large_bodies_are_served() -> None:
    """No false refusal: 200 KiB of headers, then on the same connection a 5 MiB body (read
    whole, its bytes not counted as head), then a pipelined pair."""
    with running() as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(10)
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (200 << 10) + b"\r\n\r\n")
        assert conn.recv(65536).startswith(b"HTTP/1.1 200 ")
        body = b"x" * (5 << 20)
        conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        got = b""
        while not got.endswith(str(len(body)).encode()):
            got += conn.recv(65536)
        assert got.startswith(b"HTTP/1.1 200 ")
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(conn).count(b"HTTP/1.1 200 ") == 2


def test_bytes_of_the_next_head_never_break_the_answer_in_progress(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stray CRLF after a body, or a pipelined head, arriving while a request is answered
    for longer than the head timeout: its clock starts only once that answer is complete, so
    the client reads its 200 first and whole (a 408 was written ahead of it, then the close
    cut the answer)."""
    monkeypatch.setattr(headlimits, "HEAD_TIMEOUT_S", 0.5)
    with running() as port:
        for extra in (b"\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n"):
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
                time.sleep(0.2)  # a read of its own, while the request is being answered
                conn.sendall(extra)
                answer = read_all(conn)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
            first = answer.split(b"\r\n\r\n", 1)[1]
            assert first.startswith(b"2"), answer[:300]  # the body read: 2 bytes


H2C = (b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
       b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n")


def bodies(answer: bytes) -> list[bytes]:
    """The bodies of the responses in ``answer``, in order (each has a content-length)."""
    out = []
    while answer:
        head, _, rest = answer.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        out.append(rest[:length])
        answer = rest[length:]
    return out


@pytest.mark.parametrize("framing", ["content-length", "chunked", "split"])
def test_an_upgrade_request_is_served_with_its_body(framing: str) -> None:
    """``Upgrade: h2c`` (curl --http2, Java's HttpClient) is ignored and the request answered
    with its whole body (llhttp ended the message at its head: the app got an empty body, a
    valid POST answered 400); the connection closes after it, so the bytes a proxy tunnelling
    on ``Upgrade`` would pass on are never read as requests."""
    body = b"x" * 3000
    if framing == "chunked":
        head = b"Transfer-Encoding: chunked\r\n\r\n"
        payload = b"%x\r\n" % 1000 + body[:1000] + b"\r\n%x\r\n" % 2000 + body[1000:] \
            + b"\r\n0\r\n\r\n"
    else:
        head, payload = b"Content-Length: %d\r\n\r\n" % len(body), body
    first = b"POST /up HTTP/1.1\r\nHost: x\r\n" + H2C + head
    then = b"POST /next HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    with running() as port, socket.create_connection(("127.0.0.1", port)) as conn:
        if framing == "split":  # the head alone, then the body in pieces
            conn.sendall(first)
            time.sleep(0.2)
            for i in range(0, len(body), 700):
                conn.sendall(body[i:i + 700])
                time.sleep(0.05)
            conn.sendall(then)
        else:
            conn.sendall(first + payload + then)
        answer = read_all(conn)
    assert answer.startswith(b"HTTP/1.1 200 ") and b"connection: close" in answer.lower()
    assert bodies(answer) == [b"3000"]


def test_upgrades_without_a_body_are_served_and_many_in_one_read_are_one_answer() -> None:
    """A GET asking for h2c or a WebSocket (no WebSocket route here: ws='none') is answered as
    HTTP/1.1 (it was a plain-text 403 / 400); 400 of them in one read are one answer and a
    close (a recursion per request ended in RecursionError, no answer, a 238 KB log line)."""
    ws = (b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
          b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")
    with running() as port:
        for upgrade, count in ((H2C, 1), (ws, 1), (H2C, 400)):
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall((b"GET /a HTTP/1.1\r\nHost: x\r\n" + upgrade + b"\r\n") * count)
                answer = read_all(conn)
            assert answer.startswith(b"HTTP/1.1 200 ") and bodies(answer) == [b"0"]


def test_an_upgrade_whose_framing_is_refused_is_answered_400() -> None:
    """llhttp checks Transfer-Encoding only past an upgrade's head: the made-up head's refusal
    is the 400 the same request without Upgrade gets (it was an error on the transport, and the
    client got nothing)."""
    with running() as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"POST /up HTTP/1.1\r\nHost: x\r\n" + H2C
                     + b"Transfer-Encoding: gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        answer = read_all(conn)
    assert answer.startswith(b"HTTP/1.1 400 ") and error(answer)["code"] == "invalid_http"


def test_the_parsers_refusals_are_json_and_readable() -> None:
    """Bytes that are not HTTP are 400 ``invalid_http`` and a request target past httptools'
    65,535 bytes is 414, in the envelope (plain text before), and the rest of what the client
    sends is read before the close (a client writing 1 MiB before reading got a reset)."""
    with running() as port:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"zz\r\n" + b"y" * (1 << 20))
            answer = read_all(conn)
        assert answer.startswith(b"HTTP/1.1 400 ")
        assert error(answer)["code"] == "invalid_http"
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"POST /?" + b"a" * 65600 + b" HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 1048576\r\n\r\n" + b"y" * (1 << 20))
            answer = read_all(conn)
        assert answer.startswith(b"HTTP/1.1 414 ")
        assert error(answer)["code"] == "uri_too_long"
        with socket.create_connection(("127.0.0.1", port)) as conn:  # within it: served
            conn.sendall(b"GET /?" + b"a" * 65000 + b" HTTP/1.1\r\nHost: x\r\n"
                         b"Connection: close\r\n\r\n")
            assert read_all(conn).startswith(b"HTTP/1.1 200 ")


def test_a_refused_pipelined_request_is_not_written_into_the_answer_in_progress() -> None:
    """A bad request behind one being answered: that answer goes out whole, then the close
    (the 414 was the answer the first request read)."""
    with running() as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        conn.sendall(b"GET /?" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_all(conn)
    assert answer.startswith(b"HTTP/1.1 200 ") and bodies(answer) == [b"0"]


def test_a_pipelined_head_outlives_the_keep_alive_timer() -> None:
    """A next head begun while the previous answer was being sent gets its own clock
    (HEAD_TIMEOUT_S) from that answer's end: uvicorn's keep-alive timer closed the connection
    under it without a word."""
    with running(keep_alive=0.5) as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n")
        time.sleep(1.5 + 1.5)  # the first answered (1.5 s), then past the keep-alive timer
        conn.sendall(b"Connection: close\r\n\r\n")
        answer = read_all(conn)
    assert answer.count(b"HTTP/1.1 200 ") == 2, answer


def test_a_pipelined_request_with_a_bad_body_leaves_the_answer_before_it_whole() -> None:
    """A malformed chunk in a queued request's body: the request being answered gets its own
    answer, untouched, then the close (the 400 went out first, as its answer)."""
    with running() as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\na"
                     b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        answer = read_all(conn)
    assert answer.startswith(b"HTTP/1.1 200 ") and bodies(answer) == [b"1"], answer


def test_a_bad_body_before_its_handler_reads_is_its_answer_without_a_100_continue() -> None:
    """The request whose own body is malformed is answered 400, and nothing after it: its
    handler, reading later, hears a disconnect (a stray ``100 Continue`` followed the 400)."""
    with running() as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
        answer = read_all(conn)
    assert answer.startswith(b"HTTP/1.1 400 ") and error(answer)["code"] == "invalid_http"
    assert b"100 Continue" not in answer


def test_pipelined_requests_each_get_their_own_scope() -> None:
    """A pipelined request's task was started from inside the previous one's and copied its
    context, its request scope (holds.answering) included: what it handed to that scope (the
    room of its ColBERT output) went to one already closed and was never given back (a QA run
    lost 35,968 bytes of the ColBERT allowance per two pipelined /embed_all requests)."""
    from bgeserve import holds

    released: list[str] = []

    async def scoped(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        with holds.answering():  # as guards.InflightLimit opens it
            path = scope["path"]
            holds.release_when_answered(lambda: released.append(path))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(scoped, log_level="critical", lifespan="off",
                            http=headlimits.BoundedHttpTools, ws="none")
    with serving(uvicorn.Server(config)) as (port, _), \
            socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(conn).count(b"HTTP/1.1 200 ") == 3
    assert released == ["/a", "/b", "/c"]


def test_the_parsers_refusals_are_counted_in_the_metrics() -> None:
    """A head refused before any app saw it (431, 400 invalid_http) had only the protocol's
    warning: now /metrics counts it under the route ``unmatched``."""
    from types import SimpleNamespace

    from bgeserve.service.metrics import Metrics

    metrics = Metrics()

    async def with_service(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":  # as app.py's lifespan hands the service on
            await receive()
            scope["state"]["service"] = SimpleNamespace(metrics_registry=metrics)
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await app(scope, receive, send)

    def counted(status: str) -> float:
        return metrics.http_requests.labels("unmatched", status)._value.get()

    config = uvicorn.Config(with_service, log_level="critical", lifespan="on",
                            http=headlimits.BoundedHttpTools, ws="none")
    with serving(uvicorn.Server(config)) as (port, _):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 << 20))
            assert read_all(conn).startswith(b"HTTP/1.1 431 ")
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHo\x01st: x\r\n\r\n")
            assert read_all(conn).startswith(b"HTTP/1.1 400 ")
    assert (counted("431"), counted("400")) == (1, 1)


def test_a_refused_head_is_one_warning_naming_its_client(
        caplog: pytest.LogCaptureFixture) -> None:
    """A request the parser refuses reaches no app, so it gets no access line: its one line
    says who sent it and what was answered (QA: two warnings, uvicorn's "Invalid HTTP
    request received." and bgeserve's, neither naming the client)."""
    config = uvicorn.Config(app, log_config=None, lifespan="off",
                            http=headlimits.BoundedHttpTools, ws="none")
    with caplog.at_level(logging.WARNING, logger="uvicorn.error"), \
            serving(uvicorn.Server(config)) as (port, _):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GARBAGE x\x00\r\n\r\n")
            answer = read_all(conn)
        assert answer.startswith(b"HTTP/1.1 400 ")
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert lines[0].startswith("refused a request head from 127.0.0.1: 400 "), lines
    assert "not valid HTTP/1.1" in error(answer)["message"]


def test_a_head_of_too_many_header_fields_is_431() -> None:
    """Past MAX_HEADERS fields a head is refused 431 as one past the byte cap is: 200,000
    tiny fields under the 1 MiB cap cost 118 ms each, and one connection sending them kept
    /health at p50 379 ms (QA). A head of MAX_HEADERS fields is served."""
    with running() as port:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            fields = b"".join(b"x-%d: y\r\n" % i for i in range(headlimits.MAX_HEADERS - 2))
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + fields
                         + b"Connection: close\r\n\r\n")
            assert read_all(conn).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(("127.0.0.1", port)) as conn:
            fields = b"".join(b"a%d:b\r\n" % i for i in range(20_000))
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
            answer = read_all(conn)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
    assert error(answer)["code"] == "headers_too_large"
    assert f"more than {headlimits.MAX_HEADERS} header fields" in error(answer)["message"]


def test_refused_heads_log_at_most_ten_lines_then_a_count(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of malformed connections is ten lines, then one saying how many more were
    refused when its window ends (QA: 2,000 lines in 0.9 s for 2,000 TLS hellos on the
    plain port)."""
    budget = headlimits.LogBudget
    monkeypatch.setattr(headlimits, "LogBudget", lambda: budget(lines=10, window_s=3.0))
    config = uvicorn.Config(app, log_config=None, lifespan="off",
                            http=headlimits.BoundedHttpTools, ws="none")
    with caplog.at_level(logging.WARNING, logger="uvicorn.error"), \
            serving(uvicorn.Server(config)) as (port, _):
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(25)]
        for conn in conns:  # all at once: each answer lingers 2 s before its close
            conn.sendall(b"GARBAGE x\x00\r\n\r\n")
        for conn in conns:
            with conn:
                assert read_all(conn).startswith(b"HTTP/1.1 400 ")
        deadline = time.monotonic() + 5
        while not any("more request heads" in r.getMessage() for r in caplog.records) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum(line.startswith("refused a request head from") for line in lines) == 10
    assert "15 more request heads refused in the last 3s, not logged one by one" in lines

