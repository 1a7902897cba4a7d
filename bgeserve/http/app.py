"""``create_app(settings)``: the Starlette application, its routes and its middleware.

Routes are a list of data. Percent-encoded colons (``/v1/embeddings%3Aboth``) need no alias:
ASGI servers put the decoded path in ``scope["path"]``, which is what the router matches.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.routing import Route

from bgeserve.config import M3_MODEL_IDS, Settings
from bgeserve.http import cohere, guards, handlers, linger, rerank, tei
from bgeserve.http.context import PROBE_PATHS, RequestContext
from bgeserve.http.errors import EXCEPTION_HANDLERS, ErrorStyle, envelope, json_error
from bgeserve.http.guards import BearerAuth, BodyAllowance, BodyLimit, InflightLimit, Uploads
from bgeserve.http.linger import LingeringClose
from bgeserve.http.loading import LoadingHold
from bgeserve.http.schemas import BOTH, DENSE, SPARSE

if TYPE_CHECKING:
    from bgeserve.service import Service

ServiceFactory = Callable[[Settings], "Service"]
log = logging.getLogger("bgeserve")

openai_routes = [
    Route("/v1/embeddings", handlers.embed_endpoint(DENSE), methods=["POST"], name="dense"),
    # TEI serves the OpenAI route without /v1 too (an OpenAI client given the bare host).
    Route("/embeddings", handlers.embed_endpoint(DENSE), methods=["POST"]),
    Route("/v1/sparse-embeddings", handlers.embed_endpoint(SPARSE), methods=["POST"],
          name="sparse"),
    Route("/v1/embeddings:both", handlers.embed_endpoint(BOTH), methods=["POST"], name="both"),
    Route("/v1/rerank", rerank.rerank, methods=["POST"], name="rerank"),
    Route("/v2/rerank", rerank.rerank, methods=["POST"], name="rerank_v2"),
    Route("/v1/embed", cohere.embed_v1, methods=["POST"], name="cohere_embed"),
    Route("/v2/embed", cohere.embed_v2, methods=["POST"], name="cohere_embed_v2"),
    Route("/v1/models", handlers.models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", handlers.model, methods=["GET"]),
    # Without /v1 too, as /embeddings: an OpenAI client given the bare host lists models there.
    Route("/models", handlers.models, methods=["GET"]),
    Route("/models/{model_id:path}", handlers.model, methods=["GET"]),
    Route("/health", handlers.health, methods=["GET"]),
    Route("/health/deep", handlers.deep_health, methods=["GET"]),
    Route("/metrics", handlers.metrics, methods=["GET"]),
    Route("/openapi.json", handlers.openapi, methods=["GET"]),
]
# text-embeddings-inference's API: TEI's shapes, and TEI's error shape and statuses for every
# error on these paths (errors.ErrorStyle). A TEI-style route is added here.
tei_routes = [
    # TEI's health checks besides /health: the Inference API's `GET /`, SageMaker's `/ping`.
    # One route for `/`'s two methods, so that its 405 lists both in Allow.
    Route("/", tei.root, methods=["GET", "POST"]),
    Route("/ping", handlers.health, methods=["GET"]),
    Route("/invocations", tei.root, methods=["POST"]),  # TEI's (SageMaker's) name for POST /
    Route("/embed", tei.embed, methods=["POST"]),
    Route("/embed_sparse", tei.embed_sparse, methods=["POST"]),
    Route("/embed_all", tei.embed_all, methods=["POST"]),
    Route("/similarity", tei.similarity, methods=["POST"]),
    Route("/tokenize", tei.tokenize, methods=["POST"]),
    Route("/decode", tei.decode, methods=["POST"]),
    Route("/info", tei.info, methods=["GET"]),
    Route("/rerank", rerank.tei_rerank, methods=["POST"], name="tei_rerank"),
    # A TEI client that checks the model type first is pointed at /reranker (tei.py).
    Route("/reranker/info", tei.reranker_info, methods=["GET"]),
    Route("/reranker/rerank", rerank.tei_rerank, methods=["POST"]),
]
routes = [*openai_routes, *tei_routes]
TEI_PATHS = frozenset(route.path for route in tei_routes)
# TEI routes bgeserve does not serve (a classifier's /predict, Vertex AI's /vertex): their 404
# is in TEI's shape too, so that a TEI client can read it.
TEI_UNSERVED = frozenset({"/predict", "/vertex"})
# Jina's and Cohere's routes: their errors also carry ``detail`` (errors.DETAIL_STYLE).
DETAIL_PATHS = frozenset({"/v1/rerank", "/v2/rerank", "/v1/embed", "/v2/embed"})


def _default_factory(settings: Settings) -> Service:
    # Imported lazily so that the HTTP layer can be built (and tested) without the engine stack.
    from bgeserve.service import build_service

    return build_service(settings)


def model_ids(model_name: str, settings: Settings) -> tuple[str, ...]:
    """Names accepted in ``model``: the service's, the built-in aliases, configured aliases."""
    names = (model_name, *M3_MODEL_IDS, *settings.model_aliases)
    return tuple(dict.fromkeys(names))


# Headers a page may read from an answer: the refusals' advice, the request id, where its time
# went (TEI's, timings.Timings.headers).
CORS_EXPOSED = ("Retry-After", "X-Request-ID", "x-compute-type", "x-compute-time",
                "x-compute-characters", "x-compute-tokens", "x-total-time",
                "x-tokenization-time", "x-queue-time", "x-inference-time")


class Cors(CORSMiddleware):
    """Starlette's CORS middleware, its refused preflight in the error envelope (it answered
    400 text/plain "Disallowed CORS origin"), naming the setting that allows origins."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        what = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        message = (f"CORS preflight refused: this {what} is not allowed"
                   + (" (allowed origins: BGE_M3_CORS_ALLOW_ORIGINS)" if "origin" in what
                      else ""))
        headers = {k: v for k, v in response.headers.items()
                   if k.lower() not in ("content-length", "content-type")}
        return json_error(400, envelope(400, message, "cors_refused", "origin"
                                        if "origin" in what else None), headers)


def _cors(settings: Settings) -> list[Middleware]:
    """Starlette's CORS middleware for BGE_M3_CORS_ALLOW_ORIGINS (as TEI's: GET and POST, any
    origin unless named), outside the key check: a browser's preflight carries no key. None
    where the setting is empty. No credentials (cookies): the key is a header."""
    origins = settings.cors_allow_origins
    if not origins:
        return []
    return [Middleware(Cors, allow_origins=list(origins), allow_methods=["GET", "POST"],
                       # Any header a page asks to send: OpenAI's JS SDK adds x-stainless-*
                       # to every request, and a fixed list refused its preflights.
                       allow_headers=["*"],
                       expose_headers=list(CORS_EXPOSED), max_age=600)]


def create_app(settings: Settings, service_factory: ServiceFactory | None = None) -> Starlette:
    """The bgeserve ASGI app; the lifespan builds, starts and stops the service."""
    factory = service_factory or _default_factory

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        service = factory(settings)
        metrics = getattr(service, "metrics_registry", None)
        if metrics is not None:
            metrics.watch_bodies(bodies)
        await service.start()
        try:
            yield {
                "service": service,
                "settings": settings,
                "model_ids": model_ids(service.model_name, settings),
            }
        finally:
            await service.stop()

    # Bodies still arriving at a stop: answered 503 at its deadline (cli.py starts it).
    uploads = Uploads()
    # The bodies in progress, shared with the metrics (their bytes, the 429s they cause).
    bodies = BodyAllowance(settings.inflight_limit_bytes)
    if settings.is_explicit("BGE_M3_MAX_INFLIGHT_MB") and settings.max_inflight_mb and \
            settings.max_inflight_mb << 20 < settings.max_body_bytes:
        log.warning("BGE_M3_MAX_INFLIGHT_MB=%d is less than one largest body "
                    "(BGE_M3_MAX_BODY_BYTES=%d): %.0f MiB of bodies are let in at once",
                    settings.max_inflight_mb, settings.max_body_bytes,
                    settings.inflight_limit_bytes / 2**20)
    open_paths = set(PROBE_PATHS)  # probes carry no key
    if not settings.metrics_auth:
        open_paths.add("/metrics")
    middleware = [
        Middleware(RequestContext, routes=routes),
        *_cors(settings),
        # Outside the guards: an answer they send before the body is read still reaches
        # clients that write the whole body first (linger.py).
        Middleware(LingeringClose, max_bytes=linger.LINGER_BODY_FACTOR * settings.max_body_bytes,
                   max_seconds=linger.LINGER_SECONDS),
        Middleware(ErrorStyle, tei_paths=TEI_PATHS | TEI_UNSERVED, detail_paths=DETAIL_PATHS),
        Middleware(BearerAuth, keys=settings.api_keys, open_paths=frozenset(open_paths)),
        Middleware(LoadingHold, paths=frozenset(r.path for r in routes
                                                if "POST" in (r.methods or ()))),
        Middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                   idle_timeout=guards.BODY_IDLE_TIMEOUT_S, grace=guards.BODY_GRACE_S,
                   min_rate=guards.BODY_MIN_RATE, uploads=uploads),
        Middleware(InflightLimit, allowance=bodies, uploads=uploads),
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
    app.state.uploads = uploads
    return app
