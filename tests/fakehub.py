"""A Hugging Face hub endpoint on 127.0.0.1 for tests: no test touches the network.

``FakeHub(files)`` serves ``/{repo_id}/resolve/{revision}/{filename}`` the way huggingface_hub
expects (HEAD with ``X-Repo-Commit`` / ``ETag`` / ``Content-Length``, then GET), from a dict of
in-memory files; ``failures`` makes a file answer an error, ``delay`` slows a file's body down
(so a download lasts long enough to watch its progress).
"""

from __future__ import annotations

import hashlib
import http.server
import threading
import time
from urllib.parse import unquote


class FakeHub:
    """A Hugging Face ``/resolve/`` endpoint on 127.0.0.1 serving in-memory files."""

    def __init__(self, files: dict[tuple[str, str, str], bytes]):
        self.files = files
        # filename -> (HTTP status, X-Error-Code or None) to answer instead of the file.
        self.failures: dict[str, tuple[int, str | None]] = {}
        self.requests: list[tuple[str, str]] = []
        # filename -> seconds between 1 MiB pieces of its body.
        self.delay: dict[str, float] = {}
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, *, body: bool) -> None:
                hub.requests.append((self.command, self.path))
                repo_id, revision, filename = hub.parse(self.path)
                content = hub.files.get((repo_id, revision, filename))
                if filename in hub.failures:
                    status, code = hub.failures[filename]
                    self.send_response(status)
                    if code is not None:
                        self.send_header("X-Error-Code", code)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if content is None:
                    known = any(r == repo_id and v == revision for r, v, _ in hub.files)
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound" if known else "RepoNotFound")
                    self.send_header("X-Repo-Commit", revision)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", revision)
                self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
                self.send_header("Content-Length", str(len(content)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if body:
                    pause = hub.delay.get(filename, 0.0)
                    for start in range(0, len(content), 1 << 20):
                        self.wfile.write(content[start : start + (1 << 20)])
                        if pause:
                            self.wfile.flush()
                            time.sleep(pause)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @staticmethod
    def parse(path: str) -> tuple[str, str, str]:
        parts = unquote(path.split("?")[0]).lstrip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return "", "", ""
        return f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])

    def downloaded(self) -> list[tuple[str, str]]:
        """(repo_id, filename) of every GET, in order."""
        return [(r, f) for (m, p) in self.requests if m == "GET" for r, _, f in [self.parse(p)]]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
