"""``GET /health``'s body: readiness (``status``) and the facts operators look for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bgeserve import __version__
from bgeserve.service import plan
from bgeserve.tuning import memory

if TYPE_CHECKING:
    from bgeserve.service import Service


def report(service: Service) -> dict[str, Any]:
    """loading (with the start-up step), fail (with the error), else ok / warn / idle /
    draining from the workers, with the model, the queue, the tuning and the reranker."""
    s = service.settings
    # No max_seq_length until ready: the setting is cut to the model's positions once its
    # files are read (a 514-position model said 8192 while it loaded, 512 once ready).
    body: dict[str, Any] = {"status": "loading", "version": __version__}
    if service.fatal_error is not None:
        body.update(status="fail", error=str(service.fatal_error),
                    prepare=service.preparation.status)
        return body
    if service.engine is None or not service._ready.is_set():
        body.update(service.progress.snapshot())  # step, progress
        return body
    stats = service.engine.stats()
    # A worker that is dead, restarting or cannot open its session is not live: that is
    # warn even when the others are idle-unloaded, and fail once none is left.
    if stats["live"] == 0:
        status = "fail"
    elif stats["live"] < stats["total"]:
        status = "warn"
    elif stats["loaded"] == 0:
        status = "idle"
    else:
        status = "ok"
    if service._draining:  # out of the load balancer while in-flight requests finish
        status = "draining"
    assert service.artifacts is not None and service.tuner is not None
    body.update(
        status=status,
        max_seq_length=s.max_seq_length,
        workers={k: stats[k] for k in ("live", "loaded", "total", "busy")},
        queue={"texts": stats["queue_texts"], "tokens": stats["queue_tokens"]},
        model={"name": service.model_name, "variant": service.artifacts.variant,
               "choice": s.variant_choice, "candidates": {
                   v: round(r, 1) for v, r in service.choice.candidates.items()},
               "layout": service.artifacts.layout.value, "source": service.artifacts.source,
               "backend": plan.runtime_version(service.artifacts, s.execution_provider),
               "execution_provider": s.execution_provider,
               "threads_per_worker": s.threads_per_worker,
               "prepare": service.preparation.status},
        tuning=service.tuner.state.as_dict(),
        # The per-request limits in force, where some are derived from the memory at start
        # (unset BGE_M3_MAX_COLBERT_MB / BGE_M3_MAX_INFLIGHT_MB): the figures a 413 / 429 names.
        limits=limits(service),
        # What the process holds now, beside what it may use (tuning.available_bytes; QA:
        # /health gave no current figure).
        memory={"rss_mb": round(memory.rss_bytes() / 2**20, 1)},
    )
    rerank = service.reranking.health()
    if rerank is not None:
        body["reranker"] = rerank
        if status == "ok" and rerank["status"] in ("warn", "fail"):
            body["status"] = "warn"
    return body


def limits(service: Service) -> dict[str, Any]:
    """Request limits in force: ColBERT output per request, request bodies in progress, one
    body, texts per request."""
    s, engine = service.settings, service.engine
    colbert = engine.config.max_colbert_bytes if engine is not None else None
    return {"max_colbert_mb": None if colbert is None else round(colbert / 2**20, 1),
            # The allowance in force (never below one largest body), not the setting alone.
            "max_inflight_mb": round(s.inflight_limit_bytes / 2**20, 1),
            "max_body_bytes": s.max_body_bytes,
            "max_batch": s.max_batch}
