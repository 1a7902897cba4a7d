"""Run ``python -m bgeserve serve`` as a subprocess on a free 127.0.0.1 port, for live tests.

``ServerProc(env)`` starts the server with the given ``BGE_M3_*`` variables on top of a clean
environment (any ``BGE_M3_*`` of the caller's own environment is dropped), drains its stdout and
stderr on threads (so the pipes never fill), and can wait for ``/health``. ``stop()`` sends
SIGTERM, waits a bounded time, then SIGKILLs; use it as a context manager so every server a
test starts is stopped, whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProc:
    """One ``bgeserve serve`` process; ``url`` is its base URL."""

    def __init__(self, env: Mapping[str, str], *, port: int | None = None,
                 verify: ssl.SSLContext | bool | None = None) -> None:
        self.port = port or free_port()
        # verify: the server speaks HTTPS (BGE_M3_TLS_*); httpx's verify for polling it.
        self.verify = True if verify is None else verify
        self.url = f"{'http' if verify is None else 'https'}://127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("BGE_M3_")}
        base.update({"HF_HUB_OFFLINE": "1", "BGE_M3_LOG_FORMAT": "json",
                     "BGE_M3_BIND": f"127.0.0.1:{self.port}", "PYTHONUNBUFFERED": "1",
                     "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
        base.update(env)
        # The repository root first on the path, so ``-m bgeserve`` is this checkout.
        base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")]))
        self.env = base
        self.proc: subprocess.Popen[bytes] | None = None
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Self:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bgeserve", "serve"], cwd=REPO, env=self.env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for stream, sink in ((self.proc.stdout, self._stdout), (self.proc.stderr, self._stderr)):
            t = threading.Thread(target=self._drain, args=(stream, sink), daemon=True)
            t.start()
            self._readers.append(t)
        return self

    def _drain(self, stream: Any, sink: list[str]) -> None:
        for raw in iter(stream.readline, b""):
            with self._lock:
                sink.append(raw.decode("utf-8", "replace").rstrip("\n"))
        stream.close()

    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def returncode(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit; raises ``subprocess.TimeoutExpired``."""
        assert self.proc is not None
        rc = self.proc.wait(timeout)
        for t in self._readers:
            t.join(5)
        return rc

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for t in self._readers:
            t.join(5)
        return self.proc.returncode

    # -- readiness -------------------------------------------------------------------------
    def health(self, timeout: float = 5.0) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=timeout, verify=self.verify)

    def wait_health(self, status: int | None = 200, timeout: float = 30.0,
                    body_status: str | None = None) -> dict[str, Any]:
        """Poll ``/health`` until it answers ``status`` (and ``body_status``); its JSON body.

        Fails at once (with the server's output) if the process exits meanwhile.
        """
        deadline = time.monotonic() + timeout
        last: str = "no answer"
        while time.monotonic() < deadline:
            if self.returncode is not None:
                raise AssertionError(f"server exited with {self.returncode} before /health was "
                                     f"ready:\n{self.output()}")
            try:
                r = self.health(timeout=2.0)
            except httpx.TransportError as exc:
                last = repr(exc)
            else:
                body = r.json()
                last = f"{r.status_code} {body}"
                if (status is None or r.status_code == status) and (
                        body_status is None or body.get("status") == body_status):
                    return body
            time.sleep(0.05)
        raise AssertionError(f"/health not ready within {timeout}s (last: {last}):\n"
                             f"{self.output()}")

    # -- output ----------------------------------------------------------------------------
    @property
    def stdout_lines(self) -> list[str]:
        with self._lock:
            return list(self._stdout)

    @property
    def stderr_lines(self) -> list[str]:
        with self._lock:
            return list(self._stderr)

    def output(self, tail: int = 60) -> str:
        """The last lines of stdout and stderr, for assertion messages."""
        return "\n".join(["--- stdout ---", *self.stdout_lines[-tail:], "--- stderr ---",
                          *self.stderr_lines[-tail:]])

    def json_logs(self) -> list[dict[str, Any]]:
        """Every stdout line that is a JSON object (the JSON log records)."""
        out = []
        for line in self.stdout_lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out
