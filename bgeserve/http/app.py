"""``create_app(settings)``: the Starlette application, its routes and its middleware.

Routes are a list of data. Percent-encoded colons (``/v1/embeddings%3Aboth``) need no alias:
ASGI servers put the decoded path in ``scope["path"]``, which is what the router matches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from bgeserve.config import Settings
from bgeserve.http import guards, handlers, linger
from bgeserve.http.context import RequestContext
from bgeserve.http.errors import EXCEPTION_HANDLERS
from bgeserve.http.guards import BearerAuth, BodyLimit, InflightLimit
from bgeserve.http.linger import LingeringClose
from bgeserve.http.schemas import BOTH, DENSE, SPARSE

if TYPE_CHECKING:
    from bgeserve.service import Service

ServiceFactory = Callable[[Settings], "Service"]

BUILTIN_MODEL_IDS = ("bge-m3", "BAAI/bge-m3")
# Request bodies in progress when BGE_M3_MAX_INFLIGHT_MB is unset; `bgeserve serve` sets it
# from the memory it has (cli.py).
DEFAULT_INFLIGHT_MB = 256

routes = [
    Route("/v1/embeddings", handlers.embed_endpoint(DENSE), methods=["POST"], name="dense"),
    Route("/v1/sparse-embeddings", handlers.embed_endpoint(SPARSE), methods=["POST"],
          name="sparse"),
    Route("/v1/embeddings:both", handlers.embed_endpoint(BOTH), methods=["POST"], name="both"),
    Route("/v1/models", handlers.models, methods=["GET"]),
    Route("/health", handlers.health, methods=["GET"]),
    Route("/health/deep", handlers.deep_health, methods=["GET"]),
    Route("/metrics", handlers.metrics, methods=["GET"]),
    Route("/openapi.json", handlers.openapi, methods=["GET"]),
]


def _default_factory(settings: Settings) -> Service:
    # Imported lazily so that the HTTP layer can be built (and tested) without the engine stack.
    from bgeserve.service import build_service

    return build_service(settings)


def model_ids(model_name: str, settings: Settings) -> tuple[str, ...]:
    """Names accepted in ``model``: the service's, the built-in aliases, configured aliases."""
    names = (model_name, *BUILTIN_MODEL_IDS, *settings.model_aliases)
    return tuple(dict.fromkeys(names))


def create_app(settings: Settings, service_factory: ServiceFactory | None = None) -> Starlette:
    """The bgeserve ASGI app; the lifespan builds, starts and stops the service."""
    factory = service_factory or _default_factory

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        service = factory(settings)
        await service.start()
        try:
            yield {
                "service": service,
                "settings": settings,
                "model_ids": model_ids(service.model_name, settings),
            }
        finally:
            await service.stop()

    open_paths = {"/health", "/health/deep"}  # probes, which carry no key
    if not settings.metrics_auth:
        open_paths.add("/metrics")
    middleware = [
        Middleware(RequestContext),
        # Outside the guards: an answer they send before the body is read still reaches
        # clients that write the whole body first (linger.py).
        Middleware(LingeringClose, max_bytes=linger.LINGER_BODY_FACTOR * settings.max_body_bytes,
                   max_seconds=linger.LINGER_SECONDS),
        Middleware(BearerAuth, keys=settings.api_keys, open_paths=frozenset(open_paths)),
        Middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                   idle_timeout=guards.BODY_IDLE_TIMEOUT_S),
        # Never below one largest body: a lone one goes in anyway, and would then fill it.
        Middleware(InflightLimit, max_bytes=max(
            (settings.max_inflight_mb or DEFAULT_INFLIGHT_MB) << 20, settings.max_body_bytes)),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    # `/v1/embeddings/` is an unknown route (404 in the envelope), not a 307 to a URL built
    # from the Host header: behind a TLS proxy that would point clients at plain http.
    app.router.redirect_slashes = False
    return app
