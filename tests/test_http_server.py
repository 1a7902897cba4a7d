"""The app behind a real uvicorn on 127.0.0.1: the official OpenAI client, raw sockets, abuse."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import openai
import pytest
import uvicorn

from bgeserve.config import Settings
from bgeserve.http.app import create_app
from tests.fakes import FakeService
from tests.uvithread import serving

KEY = "sk-test-key"
MIB = 2**20


@contextmanager
def running(settings: Settings, fake: FakeService) -> Iterator[tuple[str, int]]:
    """uvicorn serving the app on a free port in a thread; yields (host, port)."""
    config = uvicorn.Config(create_app(settings, lambda _: fake), log_level="critical")
    with serving(uvicorn.Server(config)) as (port, _):
        yield "127.0.0.1", port


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int, FakeService]]:
    settings = Settings(api_keys=(KEY,), max_body_bytes=MIB, max_text_chars=100_000)
    fake = FakeService(settings=settings, delay=0.01)
    with running(settings, fake) as (host, port):
        yield host, port, fake


@pytest.fixture
def client(server: tuple[str, int, FakeService]) -> openai.OpenAI:
    host, port, _ = server
    url = f"http://{host}:{port}/v1"
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=10)


TEXTS = ["the quick brown fox", "jumps over", "the lazy dog"]


@pytest.mark.parametrize("encoding", [None, "float", "base64"])
def test_openai_client(client: openai.OpenAI, encoding: str | None) -> None:
    """The official client (base64 unless told otherwise) gets exactly the service's vectors."""
    kwargs = {} if encoding is None else {"encoding_format": encoding}
    create = client.embeddings.with_raw_response.create
    raw = create(model="bge-m3", input=TEXTS, **kwargs)  # type: ignore[arg-type]
    sent = json.loads(raw.http_request.content)
    assert sent["encoding_format"] == (encoding or "base64")
    response = raw.parse()
    assert response.model == "bge-m3" and response.usage.prompt_tokens > 0
    for text, item in zip(TEXTS, response.data, strict=True):
        vector = item.embedding
        if isinstance(vector, str):  # an explicit base64 request is handed back undecoded
            vector = np.frombuffer(base64.b64decode(vector), dtype="<f4")
        got = np.asarray(vector, dtype=np.float32)
        np.testing.assert_array_equal(got, FakeService.expected_dense(text))


def test_openai_client_dimensions_and_errors(client: openai.OpenAI) -> None:
    """dimensions=1024 works; other dimensions, unknown models and bad keys raise typed errors."""
    r = client.embeddings.create(model="bge-m3", input="x", dimensions=1024)
    assert len(r.data[0].embedding) == 1024
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model="bge-m3", input="x", dimensions=256)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-large", input="x")
    bad = client.with_options(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.embeddings.create(model="bge-m3", input="x")


@pytest.mark.parametrize(
    "path", ["/v1/embeddings:both", "/v1/embeddings%3Aboth", "/v1/embeddings%3aboth"]
)
def test_percent_encoded_colon_on_the_wire(server: tuple[str, int, FakeService], path: str) -> None:
    """uvicorn decodes the path, so every spelling of :both reaches the same route."""
    host, port, _ = server
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("POST", path, body=b'{"input": "x"}',
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.status == 200 and b"sparse_values" in response.read()
    conn.close()


def _chunked_upload(host: str, port: int, total: int) -> tuple[bytes, int]:
    """POST ``total`` bytes chunked; returns the response head and how many bytes got out."""
    sock = socket.create_connection((host, port), timeout=10)
    sock.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\n".encode()
        + b"Transfer-Encoding: chunked\r\n\r\n"
    )
    sent = 0
    head = b""

    def read() -> None:
        nonlocal head
        while b"\r\n\r\n" not in head:
            data = sock.recv(4096)
            if not data:
                return
            head += data

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    chunk = b"%x\r\n" % (64 * 1024) + b" " * (64 * 1024) + b"\r\n"
    try:
        while sent < total and reader.is_alive():
            sock.sendall(chunk)
            sent += 64 * 1024
    except OSError:
        pass  # the server closed the connection: that is the point
    reader.join(10)
    sock.close()
    return head, sent


def test_streaming_body_cut_off(server: tuple[str, int, FakeService]) -> None:
    """A 40 MiB chunked upload is answered with 413 long before it has all been sent."""
    host, port, _ = server
    head, sent = _chunked_upload(host, port, 40 * MIB)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"x-request-id" in head.lower()
    assert sent < 20 * MIB


def test_hostile_requests_do_not_disturb_good_ones(server: tuple[str, int, FakeService]) -> None:
    """Malformed, oversized, deep and stalled requests run beside good ones, which all succeed."""
    host, port, _ = server
    base = f"http://{host}:{port}"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    stalled = socket.create_connection((host, port), timeout=10)  # declares 1000 bytes, sends 4
    stalled.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n".encode()
        + b'{"in'
    )

    hostile_bodies = [
        b'{"input": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        b'{"input": "\xff\xfe\xfd"}',
        b'{"truncate": false, "input": "' + b"x" * 900_000 + b'"}',
        b'{"input": [' + b"[1]," * 200_000 + b"[1]]}",
        b"\x00" * 1000,
        b'{"input": ["a", 1, null]}',
    ]

    def hostile(i: int) -> int:
        if i % 7 == 6:
            return _chunked_upload(host, port, 40 * MIB)[0].startswith(b"HTTP/1.1 413") and 413
        with httpx.Client(base_url=base, timeout=10) as c:
            return c.post("/v1/embeddings", content=hostile_bodies[i % 6], headers=auth).status_code

    def good(i: int) -> bool:
        text = f"good request number {i}"
        with httpx.Client(base_url=base, timeout=10) as c:
            r = c.post("/v1/embeddings", json={"input": [text]}, headers=auth)
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["data"][0]["embedding"], dtype=np.float32)
        return bool(np.array_equal(got, FakeService.expected_dense(text)))

    with ThreadPoolExecutor(max_workers=8) as pool:
        bad = [pool.submit(hostile, i) for i in range(14)]
        ok = [pool.submit(good, i) for i in range(24)]
        assert all(f.result() for f in ok)
        statuses = [f.result() for f in bad]
    stalled.close()
    assert all(400 <= s < 500 for s in statuses), statuses
