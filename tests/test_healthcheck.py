"""``healthcheck.sh`` against live HTTP servers: 200 passes; 503, a dead port, a hang fail."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.serverproc import free_port

SCRIPT = Path(__file__).resolve().parent.parent / "healthcheck.sh"


@contextmanager
def health_server(status: int, host: str = "127.0.0.1", delay: float = 0.0,
                  family: int = socket.AF_INET) -> Iterator[tuple[int, list[str]]]:
    """A tiny HTTP server answering ``status`` on every GET; yields (port, paths requested)."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            time.sleep(delay)
            body = b'{"status": "ok"}' if status == 200 else b'{"status": "loading"}'
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True

    server = Server((host, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def check(bind: str, *, path: str, timeout: str = "3") -> subprocess.CompletedProcess:
    """Run the script with BGE_M3_BIND=bind and the given PATH."""
    env = {"BGE_M3_BIND": bind, "HEALTHCHECK_TIMEOUT": timeout, "PATH": path}
    return subprocess.run(["/bin/sh", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=30, check=False)


@pytest.fixture(params=["curl", "python3"])
def client_path(request, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The PATH to run under: the usual one (curl), or one holding only python3 (fallback)."""
    if request.param == "curl":
        if shutil.which("curl") is None:
            pytest.skip("curl is not installed here")
        return os.environ["PATH"]
    bare = tmp_path_factory.mktemp("python-only")
    (bare / "python3").symlink_to(sys.executable)
    return str(bare)


def test_200_is_healthy(client_path: str):
    """HTTP 200 on /health → exit 0; the script asks for /health."""
    with health_server(200) as (port, seen):
        result = check(f"127.0.0.1:{port}", path=client_path)
    assert result.returncode == 0, result.stderr
    assert seen == ["/health"]


def test_503_is_unhealthy(client_path: str):
    """HTTP 503 (loading or failed) → exit 1, saying what it got."""
    with health_server(503) as (port, _):
        result = check(f"127.0.0.1:{port}", path=client_path)
    assert result.returncode == 1
    assert "503" in result.stderr


def test_a_dead_port_is_unhealthy(client_path: str):
    """Nothing listening → exit 1."""
    result = check(f"127.0.0.1:{free_port()}", path=client_path)
    assert result.returncode == 1


def test_a_hanging_server_is_unhealthy_within_the_timeout(client_path: str):
    """A server slower than HEALTHCHECK_TIMEOUT → exit 1 after about that long."""
    with health_server(200, delay=3.0) as (port, _):
        started = time.monotonic()
        result = check(f"127.0.0.1:{port}", path=client_path, timeout="0.5")
    assert result.returncode == 1
    assert time.monotonic() - started < 2.5


def test_a_wildcard_bind_is_polled_on_loopback(client_path: str):
    """BGE_M3_BIND=0.0.0.0:PORT means the server is reached on 127.0.0.1."""
    with health_server(200) as (port, _):
        assert check(f"0.0.0.0:{port}", path=client_path).returncode == 0


def test_an_ipv6_wildcard_bind_is_polled_on_ipv6_loopback(client_path: str):
    """BGE_M3_BIND=[::]:PORT means the server is reached on [::1]."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with health_server(200, host="::1", family=socket.AF_INET6) as (port, _):
        assert check(f"[::]:{port}", path=client_path).returncode == 0


def test_the_script_is_executable():
    """The image runs it directly (HEALTHCHECK CMD), so it must carry the executable bit."""
    assert os.access(SCRIPT, os.X_OK)
    assert SCRIPT.read_text().startswith("#!/bin/sh\n")
