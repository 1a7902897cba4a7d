"""Reaching the hub: a DNS pre-check that fails fast offline, and the progress of a download.

Without a network huggingface_hub retries for ~40 s before giving up; a host that does not
resolve says the same thing at once. The check is skipped where it could be wrong: an IP or
``localhost`` endpoint, and a proxy for it (the proxy resolves the host, not this machine).

huggingface_hub < 1.0 has no per-call progress hook, so the progress of a download is read from
the ``.incomplete`` file it grows in the cache's ``blobs/`` directory (every version writes one).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

__all__ = ["resolves", "watch_download"]

DNS_TIMEOUT_S = 5.0
POLL_S = 1.0


def resolves(url: str, timeout: float | None = None) -> tuple[bool, str]:
    """(whether ``url``'s host resolves within ``timeout`` s (default DNS_TIMEOUT_S), the
    host); True when unchecked."""
    timeout = DNS_TIMEOUT_S if timeout is None else timeout
    host = urlparse(url).hostname or ""
    if not host or host == "localhost" or _is_ip(host) or _proxied(url, host):
        return True, host
    answer: list[bool] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, 443, proto=socket.IPPROTO_TCP)
            answer.append(True)
        except OSError:  # socket.gaierror and friends: no such host, no resolver
            answer.append(False)

    # getaddrinfo has no timeout of its own; a resolver that cannot be reached can block it
    # for the whole retry schedule of resolv.conf.
    thread = threading.Thread(target=lookup, name="bgeserve-dns-check", daemon=True)
    thread.start()
    thread.join(timeout)
    return (answer[0] if answer else False), host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _proxied(url: str, host: str) -> bool:
    scheme = urlparse(url).scheme or "https"
    return scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(host)


@contextmanager
def watch_download(blobs: Path, name: str, total: Callable[[], int | None],
                   report: Callable[[str, int, int | None], None],
                   poll: float | None = None) -> Iterator[None]:
    """While inside, call ``report(name, bytes_done, bytes_total)`` every ``poll`` seconds from
    the size of the ``.incomplete`` files under ``blobs``; ``total`` is asked once, on the
    watcher's thread (it may make a request)."""
    poll = POLL_S if poll is None else poll
    stop = threading.Event()
    size: list[int | None] = []

    def run() -> None:
        try:
            size.append(total())
        except Exception:  # noqa: BLE001 - the size is only for the log line
            size.append(None)
        while not stop.wait(poll):
            done = sum(p.stat().st_size for p in _incomplete(blobs))
            if done:
                report(name, done, size[0])

    thread = threading.Thread(target=run, name="bgeserve-download-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(poll + 1.0)
    if size and size[0] is not None:
        report(name, size[0], size[0])


def _incomplete(blobs: Path) -> list[Path]:
    try:
        return [p for p in blobs.iterdir() if p.name.endswith(".incomplete") and p.is_file()]
    except OSError:
        return []
