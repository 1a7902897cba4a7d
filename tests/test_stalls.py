"""A client that reads nothing of its answer, on a real uvicorn with ``StallBoundHttpTools``:
dropped after ``SEND_STALL_S`` whether its answer was sent whole or streamed; a slow reader is
not; the access log calls a streamed answer cut short a 499, not the 200 it started as; a stop
cuts the streams still being sent before uvicorn's grace ends (``DrainingServer``)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import uvicorn
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message

from bgeserve.http import drain, guards, stalls
from bgeserve.http.context import RequestContext
from bgeserve.http.linger import LingeringClose
from tests.uvithread import serving

PIECE = 1 << 20
PIECES = 256
ended: dict[str, int] = {}  # path -> pieces the app rendered, once its answer ended


async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    path = scope["path"]
    if path.startswith("/whole/"):  # /whole/<MiB>
        body = b"x" * (int(path.rsplit("/", 1)[1]) << 20)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return
    rendered = 0
    count, size = (1, 8 * PIECE) if path == "/one" else (PIECES, PIECE)

    def pieces() -> Iterator[bytes]:  # rendered on a thread, as the embedding routes' are
        nonlocal rendered
        for _ in range(count):
            rendered += 1
            yield b"x" * size

    try:
        await StreamingResponse(pieces())(scope, receive, send)
    finally:
        ended[path] = rendered


@contextmanager
def running(loop: str = "auto", logged: bool = False, grace: float | None = None,
            inner: ASGIApp = app, tls: dict[str, str] | None = None,
            ) -> Iterator[uvicorn.Server]:
    """``inner`` (inside ``RequestContext`` if ``logged``) on a ``DrainingServer`` as cli.py
    runs it (``grace``: its timeout_graceful_shutdown; ``tls``: its ssl options)."""
    config = uvicorn.Config(RequestContext(inner) if logged else inner, log_config=None,
                            log_level="warning", lifespan="off", loop=loop,  # type: ignore
                            http=stalls.StallBoundHttpTools, ws="none",
                            timeout_graceful_shutdown=grace,  # type: ignore[arg-type]
                            **(tls or {}))
    server = drain.DrainingServer(config, on_shutdown=lambda: None)
    with serving(server) as (port, thread):
        server.port = port  # type: ignore[attr-defined]
        server.thread = thread  # type: ignore[attr-defined]
        yield server


def connect(server: uvicorn.Server) -> socket.socket:
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)  # fills at once
    conn.connect(("127.0.0.1", server.port))  # type: ignore[attr-defined]
    return conn


def ask(path: str, *extra: str) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\n" + "".join(extra) + "\r\n").encode()


def wait_for(condition, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def unread(server: uvicorn.Server, path: str) -> int:
    """Ask for a stream at ``path`` and read none of it: the pieces the app rendered before
    its answer ended."""
    conn = connect(server)
    try:
        conn.sendall(ask(path))
        assert wait_for(lambda: path in ended, 10), "the stream went on"
    finally:
        conn.close()
    return ended.pop(path)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stalls, "SEND_STALL_S", 0.5)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """uvicorn's ssl options for a self-signed certificate (the openssl CLI makes it)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(d / "k.pem"), "-out",
                    str(d / "c.pem"), "-days", "2", "-subj", "/CN=localhost"],
                   check=True, capture_output=True, timeout=60)
    return {"ssl_certfile": str(d / "c.pem"), "ssl_keyfile": str(d / "k.pem")}


def wrapped(conn: socket.socket) -> socket.socket:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context.wrap_socket(conn)


@pytest.mark.usefixtures("quick")
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "tls"])
def test_a_client_that_reads_nothing_of_a_whole_answer_is_reset(
        caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest, secure: bool) -> None:
    """64 MiB sent whole sat in the transport's buffer for as long as the connection lived;
    now the connection is reset (the kernel drops its queue too) once nothing was taken for
    SEND_STALL_S, with a warning. Under TLS the answer is encrypted whole into the transport
    below, which never paused the HTTP protocol: it was never watched."""
    tls = request.getfixturevalue("certificate") if secure else None
    with caplog.at_level(logging.WARNING), running(tls=tls) as server:
        conn = connect(server)
        try:
            if secure:
                conn = wrapped(conn)
            conn.sendall(ask("/whole/64"))
            assert wait_for(lambda: server.server_state.connections, 5)
            assert wait_for(lambda: not server.server_state.connections, 10), "still open"
            if not secure:  # (ssl reads a reset as an unexpected end: no error to tell)
                conn.settimeout(5)
                with pytest.raises(ConnectionResetError):  # a reset, not an orderly close
                    while conn.recv(1 << 20):
                        pass
        finally:
            conn.close()
    assert any("took nothing of its answer for 0.5s" in r.getMessage() for r in caplog.records)


@pytest.mark.usefixtures("quick")
def test_a_streamed_answer_nobody_reads_stops_being_rendered() -> None:
    """A stalled reader of a streamed answer held its request's scope (its ColBERT and body
    allowances) until its socket closed; now the stream ends after a few pieces."""
    with running() as server:
        assert unread(server, "/stalled") < PIECES // 4


def test_a_slow_reader_is_not_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that takes something in every SEND_STALL_S gets its whole answer, however
    long it takes: what the client acknowledges counts, not only what leaves the transport's
    buffer (that moved only once a third of the socket's megabytes were free: this reader was
    dropped at 3.6 of 12 MiB)."""
    monkeypatch.setattr(stalls, "SEND_STALL_S", 0.3)
    looks = 0
    look = stalls.StallBoundHttpTools._look

    def counted(self: stalls.StallBoundHttpTools) -> None:
        nonlocal looks
        looks += 1
        look(self)

    monkeypatch.setattr(stalls.StallBoundHttpTools, "_look", counted)
    size = 4 << 20
    with running() as server, connect(server) as conn:
        conn.sendall(ask(f"/whole/{size >> 20}"))
        conn.settimeout(5)
        data = b""
        while len(data) < size and (chunk := conn.recv(512 << 10)):
            data += chunk
            time.sleep(0.01)
        assert data.split(b"\r\n\r\n", 1)[0].startswith(b"HTTP/1.1 200")
        assert len(data.split(b"\r\n\r\n", 1)[1]) == size
    assert looks >= 2, "the reader never looked stalled: the test proves nothing"


@pytest.mark.usefixtures("quick")
def test_an_answer_with_a_pipelined_request_behind_it_hears_its_client_leave(
        caplog: pytest.LogCaptureFixture) -> None:
    """uvicorn tells only the newest request parsed that the connection is gone: a streamed
    answer with a pipelined request behind it went on writing into a closed transport (an
    error and a traceback under uvloop, which refuses such writes)."""
    with caplog.at_level(logging.WARNING), running() as server:
        conn = connect(server)
        conn.sendall(ask("/first") + ask("/whole/1"))
        time.sleep(0.3)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()  # a reset
        assert wait_for(lambda: "/first" in ended, 5), "the stream went on"
    assert ended.pop("/first") < PIECES // 4
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def access_lines(records: list[logging.LogRecord]) -> list[tuple[str, int]]:
    return [(r.path, r.status) for r in records  # type: ignore[attr-defined]
            if r.name == "bgeserve.http" and hasattr(r, "status")]


@pytest.mark.usefixtures("quick")
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_stream_cut_while_its_last_message_waits_is_logged_499(
        caplog: pytest.LogCaptureFixture, loop: str) -> None:
    """One 8 MiB piece leaves writing paused, so the stream's last (empty) message waits for
    the client; cut then, uvicorn dropped that message without a word and the app returned as
    if it had been sent: the access line said 200."""
    with caplog.at_level(logging.INFO), running(loop, logged=True) as server:
        unread(server, "/one")
        assert wait_for(lambda: access_lines(caplog.records), 5)
    assert access_lines(caplog.records) == [("/one", 499)]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_stop_cuts_the_streams_still_being_sent_before_its_grace_ends(
        caplog: pytest.LogCaptureFixture, loop: str) -> None:
    """A stream to a reader too slow for the stop's grace (here one that reads nothing, and
    the stall bound at its 60 s) was cancelled by uvicorn: a traceback and a 500. Now it is
    cut CUT_MARGIN_SECS before, logged 499, and the stop ends in its grace."""
    with caplog.at_level(logging.INFO), running(loop, logged=True, grace=1.5) as server:
        conn = connect(server)
        try:
            conn.sendall(ask("/slow-reader"))
            time.sleep(0.5)
            assert stopped_in(server) < 3
        finally:
            conn.close()
    assert ended.pop("/slow-reader") < PIECES // 4
    assert access_lines(caplog.records) == [("/slow-reader", 499)]
    assert_one_reset_no_error(caplog.records)


def stopped_in(server: uvicorn.Server) -> float:
    """Stop ``server`` (as a signal would); the seconds its thread took to end."""
    began = time.monotonic()
    server.should_exit = True
    server.thread.join(10)  # type: ignore[attr-defined]
    assert not server.thread.is_alive()  # type: ignore[attr-defined]
    return time.monotonic() - began


def assert_one_reset_no_error(records: list[logging.LogRecord]) -> None:
    messages = [r.getMessage() for r in records]
    assert any("reset 1 connection(s) still sending" in m for m in messages), messages
    assert not [r.getMessage() for r in records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_stop_cuts_a_whole_answer_its_client_has_not_taken(
        caplog: pytest.LogCaptureFixture, version: str) -> None:
    """An answer handed over whole to a client that reads none of it: the stop closes its
    connection (HTTP/1.0's closes once the answer is written), and a closing transport waits
    for its buffer to drain. The cut skipped closing transports: the stop ran its whole grace
    and uvicorn logged an error (QA). Now it is reset with the streams, in the grace."""
    with caplog.at_level(logging.INFO), running(logged=True, grace=1.5) as server:
        conn = connect(server)
        try:
            conn.sendall(post("/whole/8", version))
            assert wait_for(lambda: access_lines(caplog.records), 5)
            assert stopped_in(server) < 1.4
        finally:
            conn.close()
    assert_one_reset_no_error(caplog.records)


async def answer_at_once(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    """200 before the body is read (as a guard's refusal is): LingeringClose reads the rest."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def test_an_answer_written_whole_stays_the_clients_when_it_leaves_during_the_linger(
        caplog: pytest.LogCaptureFixture) -> None:
    """The client read its whole answer and closed while the rest of its body was read and
    dropped (linger.py): its answer, logged 200, not a 499."""
    inner = LingeringClose(answer_at_once, max_bytes=1 << 20, max_seconds=2)
    with caplog.at_level(logging.INFO), running(logged=True, inner=inner) as server, \
            socket.create_connection(("127.0.0.1", server.port)) as conn:  # type: ignore
        conn.settimeout(5)
        conn.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 10)
        answer = b""
        while not answer.endswith(b"ok"):
            answer += conn.recv(4096)
        conn.close()
        assert wait_for(lambda: access_lines(caplog.records), 5)
    assert access_lines(caplog.records) == [("/early", 200)]


@pytest.mark.usefixtures("quick")
def test_an_answer_whose_head_never_went_out_is_logged_499(
        caplog: pytest.LogCaptureFixture) -> None:
    """A pipelined answer behind one its client stopped reading waits to write its head; the
    reset drops it without a word: it was logged 200."""
    with caplog.at_level(logging.INFO), running(logged=True) as server:
        conn = connect(server)
        try:
            conn.sendall(ask("/whole/64") + ask("/whole/1"))
            assert wait_for(lambda: len(access_lines(caplog.records)) == 2, 10)
        finally:
            conn.close()
    assert access_lines(caplog.records) == [("/whole/64", 200), ("/whole/1", 499)]


class FakeLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.due: list[tuple[float, object]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: object) -> object:
        self.due.append((self.now + delay, callback))
        return object()  # its handle: never cancelled here


class FakeTransport:
    def __init__(self) -> None:
        self.unsent = 1000
        self.aborted_at: float | None = None
        self.loop: FakeLoop | None = None
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def get_extra_info(self, name: str) -> None:
        return None  # no socket: the buffer alone

    def abort(self) -> None:
        assert self.loop is not None
        self.aborted_at = self.loop.now


def post(path: str, version: str = "1.1") -> bytes:
    return f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()


def read_all(conn: socket.socket, size: int) -> bytes:
    conn.settimeout(10)
    data = b""
    while len(data) < size and (chunk := conn.recv(1 << 20)):
        data += chunk
    return data


def read_answer(conn: socket.socket, size: int) -> None:
    """Read one answer whose body is ``size`` bytes, all of it."""
    data = read_all(conn, size)
    while len(data.split(b"\r\n\r\n", 1)[-1]) < size:
        more = conn.recv(1 << 20)
        assert more, "the answer was cut"
        data += more


@pytest.mark.parametrize(("version", "secure"), [("1.1", False), ("1.0", False), ("1.1", True)],
                         ids=["http1.1", "http1.0", "tls"])
def test_an_answer_not_taken_yet_counts_in_the_allowance_of_bodies(
        version: str, secure: bool, request: pytest.FixtureRequest) -> None:
    """An answer handed over whole waits in the transport's buffer for its client: outside
    every allowance, as many as clients stall (QA: 24 non-readers of ColBERT answers took
    the server from 104 to 367 MiB until the stall bound reset them). Now it counts in the
    allowance of bodies in progress until its client takes it (HTTP/1.0's too, whose
    connection closes once it is sent): past the allowance the next request is a 429 at
    once; once read, the room is back."""
    allowance = guards.BodyAllowance(4 << 20)
    tls = request.getfixturevalue("certificate") if secure else None
    with running(inner=guards.InflightLimit(app, allowance=allowance), tls=tls) as server:
        stalled = wrapped(connect(server)) if secure else connect(server)
        try:
            stalled.sendall(post("/whole/8", version))
            assert wait_for(lambda: allowance.held > 4 << 20, 5), allowance.held
            assert allowance.held <= 8 << 20
            with wrapped(connect(server)) if secure else connect(server) as other:
                other.sendall(post("/whole/1"))
                answer = read_all(other, 1)
                while not answer.endswith(b"}"):
                    more = other.recv(1 << 16)
                    assert more, answer
                    answer += more
                assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
                assert b"answers not yet taken" in answer, answer
            read_answer(stalled, 8 << 20)
            assert wait_for(lambda: allowance.held == 0, 5), allowance.held
        finally:
            stalled.close()
        with wrapped(connect(server)) if secure else connect(server) as again:  # room back
            again.sendall(post("/whole/1"))
            assert read_all(again, 1).startswith(b"HTTP/1.1 200")
        assert wait_for(lambda: allowance.held == 0, 5), allowance.held


def test_a_client_that_pipelines_and_reads_holds_what_it_has_not_read() -> None:
    """Thirty 1 MiB answers pipelined on one connection whose client reads as they come:
    each held until the connection drained, the holds summed every answer since (17 MiB
    with 4 MiB ever unsent) and 13 of the 30 were 429s (review). They shrink as it reads."""
    allowance = guards.BodyAllowance(16 << 20)
    with running(inner=guards.InflightLimit(app, allowance=allowance)) as server, \
            connect(server) as conn:
        conn.sendall(post("/whole/1") * 30)
        conn.settimeout(10)
        data = b""
        while data.count(b"HTTP/1.1 ") < 30 or len(data) < 30 << 20:
            chunk = conn.recv(256 << 10)
            assert chunk, data.count(b"HTTP/1.1 ")
            data += chunk
            time.sleep(0.004)
        assert data.count(b"HTTP/1.1 200") == 30, data.count(b"HTTP/1.1 429")
    assert wait_for(lambda: allowance.held == 0, 5), allowance.held


def test_under_tls_an_answer_waits_below_in_sight(certificate: dict[str, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TLS an answer waits encrypted in the transport below the protocol, out of its
    sight: with a small socket send queue nothing looked unsent and a non-reader's 8 MiB were
    not held (review). What the client acknowledged against where the answers end says it."""
    made = stalls.StallBoundHttpTools.connection_made

    def small_queue(self, transport):  # type: ignore[no-untyped-def]
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                      32 << 10)
        made(self, transport)

    monkeypatch.setattr(stalls.StallBoundHttpTools, "connection_made", small_queue)
    allowance = guards.BodyAllowance(64 << 20)
    with running(inner=guards.InflightLimit(app, allowance=allowance),
                 tls=certificate) as server:
        conn = wrapped(connect(server))
        try:
            conn.sendall(post("/whole/8"))
            assert wait_for(lambda: allowance.held > 7 << 20, 5), allowance.held
            read_answer(conn, 8 << 20)
            assert wait_for(lambda: allowance.held == 0, 5), allowance.held
        finally:
            conn.close()


def test_under_tls_an_answer_taken_at_once_is_not_held_on(certificate: dict[str, str]) -> None:
    """A fast TLS client may have acknowledged much of its answer by the time it is handed
    over: where the answer ends counts from what was acknowledged before it was written, or
    the part taken already would stay held for as long as the connection is kept alive."""
    allowance = guards.BodyAllowance(64 << 20)
    with running(inner=guards.InflightLimit(app, allowance=allowance),
                 tls=certificate) as server, \
            wrapped(socket.create_connection(("127.0.0.1", server.port))) as conn:
        for _ in range(3):  # kept alive: each answer's room back while the connection lives
            conn.sendall(post("/whole/2"))
            read_answer(conn, 2 << 20)
            assert wait_for(lambda: allowance.held == 0, 3), allowance.held


def test_a_closing_connection_whose_client_takes_nothing_is_reset() -> None:
    """An answer to HTTP/1.0 (or Connection: close) is followed by the transport's close,
    which waits for its buffer without a bound: with writing never paused (the buffer under
    its high-water mark, the rest in the socket's queue) no watch started, and the answer's
    hold (the room of its ColBERT output too) was kept for as long as the peer kept the
    connection (review). The watch starts on a closing transport too."""
    protocol = object.__new__(stalls.StallBoundHttpTools)
    loop, transport = FakeLoop(), FakeTransport()
    transport.loop, transport.closing = loop, True
    protocol.loop = loop  # type: ignore[assignment]
    protocol.transport = transport  # type: ignore[assignment]
    protocol.logger = logging.getLogger("test")
    protocol.flow = SimpleNamespace(write_paused=False)  # type: ignore[assignment]
    protocol._watch()
    while transport.aborted_at is None and loop.due:
        loop.now, callback = loop.due.pop(0)
        callback()  # type: ignore[operator]
    assert transport.aborted_at is not None, "never watched"
    assert transport.aborted_at <= stalls.SEND_STALL_S * (1 + 1 / stalls.LOOKS)


def test_the_next_request_on_a_connection_sees_what_its_client_took() -> None:
    """A client that read its answer and asks again at once: the previous hold, not looked
    at again yet (every 50 ms), stood in the way of the next request, a 429 for a body that
    fits beside nothing else (review)."""
    allowance = guards.BodyAllowance(3 << 20)
    body = b"x" * (3 << 19)  # 1.5 MiB: with the 2 MiB answer not yet seen taken, over 3 MiB
    head = f"POST /whole/2 HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with running(inner=guards.InflightLimit(app, allowance=allowance)) as server, \
            connect(server) as conn:
        for _ in range(20):
            conn.sendall(head.encode() + body)
            data = read_all(conn, 1)
            assert data.startswith(b"HTTP/1.1 200"), data[:100]
            while len(data.split(b"\r\n\r\n", 1)[-1]) < 2 << 20:
                more = conn.recv(1 << 20)
                assert more, "the answer was cut"
                data += more


@pytest.mark.usefixtures("quick")
def test_an_answer_never_taken_gives_its_room_back_when_its_client_is_reset() -> None:
    """A client that never reads: its answer's room comes back with the reset."""
    allowance = guards.BodyAllowance(64 << 20)
    with running(inner=guards.InflightLimit(app, allowance=allowance)) as server:
        conn = connect(server)
        try:
            conn.sendall(post("/whole/8"))
            assert wait_for(lambda: allowance.held > 4 << 20, 5), allowance.held
            assert wait_for(lambda: not server.server_state.connections, 10), "still open"
            assert allowance.held == 0
        finally:
            conn.close()


def test_the_bound_counts_from_the_last_progress_not_from_fixed_periods() -> None:
    """A reader that takes a little right after writing paused and then nothing is dropped
    SEND_STALL_S after that, within a quarter of it (looked at once a period, it was dropped
    at the end of the second: nearly twice)."""
    protocol = object.__new__(stalls.StallBoundHttpTools)
    loop, transport = FakeLoop(), FakeTransport()
    transport.loop = loop
    protocol.loop = loop  # type: ignore[assignment]
    protocol.transport = transport  # type: ignore[assignment]
    protocol.logger = logging.getLogger("test")
    protocol.flow = SimpleNamespace(write_paused=True)  # type: ignore[assignment]
    protocol._taken, protocol._since = (None, transport.unsent), 0.0
    protocol._next_look()
    progress = loop.now = 1.0
    transport.unsent -= 10  # it read a little, then nothing more
    while transport.aborted_at is None and loop.due:
        loop.now, callback = loop.due.pop(0)
        callback()  # type: ignore[operator]
    stall = stalls.SEND_STALL_S
    assert transport.aborted_at is not None
    assert progress + stall <= transport.aborted_at <= progress + stall * (1 + 1 / stalls.LOOKS)


def run_context(*messages: Message, raises: bool = False) -> list[logging.LogRecord]:
    """RequestContext around an app that sends ``messages`` and returns (or raises)."""
    async def inner(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        for message in messages:
            await send(message)
        if raises:
            raise RuntimeError("broke off")

    async def send(message: Message) -> None:
        pass

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("bgeserve.http")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        scope = {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": []}
        try:
            asyncio.run(RequestContext(inner)(scope, receive, send))
        except RuntimeError:
            assert raises
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return records


START: Message = {"type": "http.response.start", "status": 200, "headers": []}
PIECE_SENT: Message = {"type": "http.response.body", "body": b"[", "more_body": True}
LAST: Message = {"type": "http.response.body", "body": b"]"}


@pytest.mark.parametrize(("messages", "raises", "status", "error"), [
    ((START, PIECE_SENT, LAST), False, 200, None),
    ((START, PIECE_SENT), False, 499, "client_disconnected"),  # the client left mid-stream
    ((START, PIECE_SENT), True, 500, None),  # the app broke off: uvicorn cuts the answer
])
def test_the_access_log_says_whether_a_started_answer_was_finished(
        messages: tuple[Message, ...], raises: bool, status: int, error: str | None) -> None:
    (record,) = run_context(*messages, raises=raises)
    assert (record.status, record.error) == (status, error)  # type: ignore[attr-defined]
    assert record.getMessage().startswith(f"POST /v1/embeddings {status} ")

