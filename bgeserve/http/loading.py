"""A model request that arrives while the model loads waits a little for it.

TEI opens its port only once the model is loaded; bgeserve answers while it loads (``/health``
says so, with the step and its progress), and a model request then gets a 503 with
``Retry-After``. Clients that retry a 503 at once and ignore the header (Hugging Face's JS
client: ~50 requests a second, each logged, for the minutes of a first start) are slowed to
one try per hold, and a request that arrives just before the load ends is served instead of
refused. The hold comes before the body is read (after the key check: a request that will be
refused is not kept waiting), so a held request holds no body allowance; a path no POST route
serves (a 404 or 405) is not held either.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class LoadingHold:
    """Before a POST to one of ``paths`` (the routes that take a POST: the model's) runs, wait
    while the service loads (``Service.until_ready``: at most ``service.LOADING_HOLD_S``, no
    wait once it is ready, has failed or is stopping)."""

    def __init__(self, app: ASGIApp, *, paths: frozenset[str]):
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            await scope["state"]["service"].until_ready()
        await self.app(scope, receive, send)
