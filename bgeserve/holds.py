"""What a request holds until its answer is sent, given back then.

The HTTP layer opens a request's scope around the whole request (``guards.InflightLimit``), so
it ends after the response's last byte was handed to the server; the service hands it what a
request holds past its own return (the room of its ColBERT output, ``service/outputs.py``). A
leaf, as ``logs.request_id_var``: both layers use it, neither through the other.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

# The releases a request's scope runs once its answer is sent (None: not inside one).
_RELEASES: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "bgeserve_releases", default=None)


@contextlib.contextmanager
def answering(kept: list[Callable[[], None]] | None = None) -> Iterator[None]:
    """One request's scope: what is handed to ``release_when_answered`` inside it is released
    at its end (after the response was sent, or the request failed), or, with ``kept``, put
    there for the caller to release (once its client has taken the answer). Inside an open
    scope it adds none: the outer one (the HTTP layer's) outlives the inner
    (``Service.embed``'s)."""
    if _RELEASES.get() is not None:
        yield
        return
    releases: list[Callable[[], None]] = []
    token = _RELEASES.set(releases)
    try:
        yield
    finally:
        _RELEASES.reset(token)
        if kept is not None:
            kept.extend(releases)
        else:
            release_all(releases)


def release_all(releases: list[Callable[[], None]]) -> None:
    """Run ``releases``."""
    for release in releases:
        release()


def in_scope() -> bool:
    """Whether a request's scope is open here (what is held can be handed to it)."""
    return _RELEASES.get() is not None


def release_when_answered(release: Callable[[], None]) -> bool:
    """Hand ``release`` to the request's scope; False outside one (the caller releases)."""
    releases = _RELEASES.get()
    if releases is None:
        return False
    releases.append(release)
    return True
