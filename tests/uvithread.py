"""A uvicorn server on a free 127.0.0.1 port in a thread, for tests that need a real socket."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


@contextmanager
def serving(server: uvicorn.Server) -> Iterator[tuple[int, threading.Thread]]:
    """Run ``server`` on a free port in a thread until it has started; yields (port, thread)
    and stops it (``should_exit``) on the way out."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield port, thread
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
