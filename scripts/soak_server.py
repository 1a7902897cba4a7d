"""The ``bgeserve serve`` process a soak drives: start, wait for ready, RSS, signal, restart.

Its output goes to one log file (appended across restarts), so no pipe can fill up during a
30-minute run; ``log_text`` reads it back.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEY = "soak-key"
READY_TIMEOUT = 300.0  # a full-size model loads in well under this


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ``python -m bgeserve serve`` with SIGHUP's default restored first (no preexec_fn: this
# process has threads).
SERVE_HUNG_UP_BY_DEFAULT = (
    "import runpy, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    "sys.argv = ['bgeserve', 'serve']; runpy.run_module('bgeserve', run_name='__main__')")


class SoakServer:
    """One server at a time on a fixed port; ``start`` again after ``stop`` to restart."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("BGE_M3_")}
        base.update({"HF_HUB_OFFLINE": "1", "BGE_M3_LOG_FORMAT": "json",
                     "BGE_M3_BIND": f"127.0.0.1:{self.port}", "BGE_M3_API_KEY": KEY,
                     "BGE_M3_DISABLE_AUTO_BUDGET": "1", "BGE_M3_SHUTDOWN_TIMEOUT_SECS": "20",
                     "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        base.update(env)
        base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")]))
        self.env = base
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def start(self) -> None:
        """Start the server and wait until /health answers 200 (raises with the log tail)."""
        with open(self.log_path, "ab") as log:
            # SIGHUP at its default: the soak's SIGHUP restart expects the documented drain
            # and exit, and a server started with hangups ignored (the soak run under nohup)
            # keeps ignoring them.
            self.proc = subprocess.Popen([sys.executable, "-c", SERVE_HUNG_UP_BY_DEFAULT],
                                         cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode} before ready:\n"
                                   f"{self.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"not ready within {READY_TIMEOUT:.0f}s:\n{self.log_text()[-4000:]}")

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Send ``sig`` and wait for the exit (SIGKILL past ``timeout``); the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def rss(self) -> int:
        """The server's resident set size in bytes (0 when it is not running)."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""
