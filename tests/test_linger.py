"""Lingering close: an answer sent before the body was read reaches the client, and the
reading that makes it so is bounded.

Against a live ``bgeserve serve`` with urllib, httpx and the openai client (which write their
whole body before they read), and against the app under an in-thread uvicorn for the bounds.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bgeserve.config import Settings
from bgeserve.http import guards
from tests.fakes import FakeService
from tests.serverproc import ServerProc
from tests.test_http_server import running
from tests.test_server_live import START_TIMEOUT, server_env

KEY = "sk-linger"
MIB = 2**20


def _post_urllib(url: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _post_httpx(url: str, body: bytes, key: str | None = KEY, **headers: str) -> httpx.Response:
    sent = {"Content-Type": "application/json", **headers}
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    return httpx.post(url, content=body, headers=sent, timeout=30)


def _text_body(size: int) -> bytes:
    return b'{"input": "' + b"x" * size + b'"}'


@pytest.fixture(scope="module")
def live(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """A live server with a key, the default 32 MiB body limit and 32 MiB of bodies at once."""
    env = server_env(tiny_export, tmp_path_factory.mktemp("linger-cache"),
                     BGE_M3_API_KEY=KEY, BGE_M3_MAX_INFLIGHT_MB="32")
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        yield proc


@pytest.mark.slow
def test_a_40_mib_post_gets_the_413_with_every_client(live: ServerProc) -> None:
    """urllib (Connection: close), httpx and the openai client each read the JSON 413 for a
    40 MiB body over the 32 MiB limit, instead of a connection reset."""
    url = f"{live.url}/v1/embeddings"
    body = _text_body(40 * MIB)
    status, error = _post_urllib(url, body)
    assert status == 413 and error["error"]["code"] == "payload_too_large", error
    for headers in ({}, {"Connection": "close"}):
        r = _post_httpx(url, body, **headers)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert r.headers["connection"] == "close" and r.headers["x-request-id"]
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(model="bge-m3", input="x" * (40 * MIB))
    assert caught.value.status_code == 413
    assert caught.value.body["code"] == "payload_too_large"  # type: ignore[index]


@pytest.mark.slow
def test_an_unauthorized_large_post_gets_the_401(live: ServerProc) -> None:
    """A 20 MiB body with a wrong or missing key: 401 in the envelope, for every client."""
    url = f"{live.url}/v1/embeddings"
    body = _text_body(20 * MIB)
    for key in ("wrong", None):
        status, error = _post_urllib(url, body, key=key)
        assert status == 401 and error["error"]["code"] == "invalid_api_key", error
        r = _post_httpx(url, body, key=key, Connection="close")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        client.embeddings.create(model="bge-m3", input="x" * (20 * MIB))


@pytest.mark.slow
def test_a_429_for_bodies_in_progress_is_readable(live: ServerProc) -> None:
    """While a stalled request's 30 MiB that arrived hold most of the 32 MiB allowance, a
    4 MiB POST is refused 429 before its body is read, and urllib, httpx and openai all read
    the 429 (and Retry-After). (Its declared 32 MiB alone hold nothing: bytes count as they
    arrive.)"""
    url = f"{live.url}/v1/embeddings"
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as stalled:
        stalled.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\n"
                        + f"Authorization: Bearer {KEY}\r\n".encode()
                        + f"Content-Length: {32 * MIB}\r\n\r\n".encode() + b'{"input": "'
                        + b"a" * (30 * MIB))
        deadline = time.monotonic() + 20  # until the server has read them
        while _inflight(live) < 30 * MIB and time.monotonic() < deadline:
            time.sleep(0.05)
        body = _text_body(4 * MIB)
        status, error = _post_urllib(url, body)
        assert status == 429 and error["error"]["code"] == "overloaded", error
        r = _post_httpx(url, body, Connection="close")
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0,
                               timeout=30)
        with pytest.raises(openai.RateLimitError):
            client.embeddings.create(model="bge-m3", input="x" * (4 * MIB))


def _inflight(proc: ServerProc) -> float:
    text = httpx.get(f"{proc.url}/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("bgeserve_inflight_body_bytes "))


# -- the bounds, against the app over a fake service ------------------------------------------
@pytest.fixture
def small_limit() -> Iterator[tuple[str, int]]:
    """The app with a 1 MiB body limit (so lingering reads at most 2 MiB) and a key."""
    settings = Settings(api_keys=(KEY,), max_body_bytes=MIB)
    with running(settings, FakeService(settings=settings)) as address:
        yield address


def _raw_post(address: tuple[str, int], head: str) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    sock.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 f"\r\n{head}\r\n".encode())
    return sock


def _read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            more = sock.recv(65536)
        except ConnectionResetError:
            break
        if not more:
            break
        data += more
    return data


def test_an_endless_upload_is_cut_off_after_twice_the_limit(small_limit: tuple[str, int]):
    """A chunked body that never ends, past a 1 MiB limit: the 413 goes out, the server reads
    on to about 2 MiB and closes, instead of reading (and the client sending) forever."""
    sock = _raw_post(small_limit, f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n")
    chunk = b"%x\r\n" % (64 * 1024) + b" " * (64 * 1024) + b"\r\n"
    sent = 0
    started = time.monotonic()
    try:
        while sent < 64 * MIB and time.monotonic() - started < 20:
            sock.sendall(chunk)
            sent += 64 * 1024
    except OSError:
        pass  # closed by the server: what should happen
    took = time.monotonic() - started
    sock.close()
    # 2 MiB read, plus what the two kernels' socket buffers held when it stopped reading.
    assert sent < 2 * MIB + 16 * MIB, f"{sent / MIB:.0f} MiB went out before the close"
    assert took < 10, f"the close came after {took:.1f}s"


def test_a_trickling_body_is_cut_off_after_the_linger_time(monkeypatch: pytest.MonkeyPatch):
    """After an early 413 the server discards at most LINGER_SECONDS; a client still sending
    (slowly) then finds the connection closed."""
    from bgeserve.http import linger

    monkeypatch.setattr(linger, "LINGER_SECONDS", 0.5)
    settings = Settings(max_body_bytes=MIB)
    with running(settings, FakeService(settings=settings)) as address:
        sock = _raw_post(address, f"Content-Length: {2 * MIB - 1}\r\n")
        started = time.monotonic()
        closed_after = None
        try:
            while time.monotonic() - started < 10:
                sock.sendall(b" " * 1024)
                time.sleep(0.02)
        except OSError:
            closed_after = time.monotonic() - started
        sock.close()
    assert closed_after is not None and closed_after < 3, closed_after


def test_a_stalled_body_that_resumes_reads_its_408(monkeypatch: pytest.MonkeyPatch):
    """urllib sending a 24 MiB body that stalls past the idle timeout and then resumes reads
    the 408 in the envelope once it has sent it all, instead of failing mid-send."""
    monkeypatch.setattr(guards, "BODY_IDLE_TIMEOUT_S", 0.3)
    settings = Settings()
    size = 24 * MIB
    piece = b" " * MIB

    def body() -> Iterator[bytes]:
        yield b'{"input": "'
        time.sleep(1.0)  # the 408 goes out meanwhile
        for _ in range(size // MIB):
            yield piece
        yield b'"}'

    with running(settings, FakeService(settings=settings)) as (host, port):
        request = urllib.request.Request(
            f"http://{host}:{port}/v1/embeddings", data=body(),
            headers={"Content-Type": "application/json",
                     "Content-Length": str(size + len(b'{"input": ""}'))})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 408
    assert json.loads(caught.value.read())["error"]["code"] == "request_timeout"


def test_expect_100_continue_is_answered_and_closed_at_once(small_limit: tuple[str, int]):
    """A client waiting for 100 Continue (curl, over 1 MiB) has sent no body and sends none
    after a refusal: it gets the 401 and the close without the server lingering."""
    sock = _raw_post(small_limit, "Authorization: Bearer wrong\r\nExpect: 100-continue\r\n"
                                  f"Content-Length: {40 * MIB}\r\n")
    started = time.monotonic()
    answer = _read_all(sock)
    took = time.monotonic() - started
    sock.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"connection: close" in answer.lower()
    assert took < 2, f"the close came after {took:.1f}s"


def test_answers_after_the_whole_body_keep_the_connection(small_limit: tuple[str, int]):
    """Only an answer sent before the body was read closes the connection: two requests on
    one keep-alive connection both succeed, and a 400 after a full read keeps it open."""
    host, port = small_limit
    with httpx.Client(base_url=f"http://{host}:{port}", timeout=10,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        first = client.post("/v1/embeddings", json={"input": "a"})
        bad = client.post("/v1/embeddings", json={"input": []})
        second = client.post("/v1/embeddings", json={"input": "b"})
    assert (first.status_code, bad.status_code, second.status_code) == (200, 400, 200)
    for r in (first, bad, second):
        assert r.headers.get("connection") != "close"


def test_a_refusal_of_a_get_needs_no_lingering(small_limit: tuple[str, int]):
    """A request without a body (GET) is answered as before: no Connection: close."""
    host, port = small_limit
    r = httpx.get(f"http://{host}:{port}/v1/models", timeout=10)
    assert r.status_code == 401 and r.headers.get("connection") != "close"


def test_concurrent_refusals_do_not_block_other_requests(small_limit: tuple[str, int]):
    """While a refused upload is being discarded, other requests are served at once."""
    host, port = small_limit
    sock = _raw_post(small_limit, "Authorization: Bearer wrong\r\n"
                                  f"Content-Length: {MIB}\r\n")
    feeding = threading.Event()

    def feed() -> None:
        try:
            for _ in range(40):
                sock.sendall(b" " * 8192)
                time.sleep(0.02)
        except OSError:
            pass
        feeding.set()

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    started = time.monotonic()
    r = httpx.post(f"http://{host}:{port}/v1/embeddings", json={"input": "c"}, timeout=10,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and time.monotonic() - started < 1.0
    thread.join(10)
    sock.close()
