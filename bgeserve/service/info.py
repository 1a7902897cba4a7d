"""``model_info``: what TEI's ``GET /info`` reports, from the settings and the loaded engine."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from bgeserve import __version__
from bgeserve.cgroup import usable_cpus
from bgeserve.model.artifacts import HUB_SOURCES
from bgeserve.model.rerank_artifacts import RERANK_REPO, RERANK_REVISION
from bgeserve.results import ModelInfo

if TYPE_CHECKING:
    from bgeserve.config import Settings
    from bgeserve.engine import Engine
    from bgeserve.service import Service

MODEL_ID = "BAAI/bge-m3"
# TEI's names for what the variant computes in (ov-int8 is int8 too, on OpenVINO).
DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8", "bf16": "bfloat16",
          "ov-int8": "int8"}


def tokenizing_slots() -> int:
    """Requests tokenized at once (the service's semaphore: more than the cores only adds
    memory)."""
    return max(2, usable_cpus().count)


def _engine_limits(engine: Engine, s: Settings) -> dict[str, Any]:
    """What an engine serving with ``s`` (its resolved settings) tells a client to plan with:
    bge-m3's, or the reranker's."""
    variant = engine.artifacts.variant
    max_chunk = engine.config.scheduler.max_chunk
    return {
        "dtype": DTYPES.get(variant, variant),
        "max_input_length": s.max_seq_length,
        # A text longer than the chunk-token cap runs alone, so a run can hold max_seq tokens.
        "max_batch_tokens": max(engine.max_chunk_tokens or s.max_seq_length * max_chunk,
                             s.max_seq_length),
        "max_batch_requests": max_chunk,
        # Requests are bounded by queued tokens (each text holds >= 2), not by a count.
        "max_concurrent_requests": max(1, s.max_queue_tokens // 2),
    }


def model_info(service: Service) -> ModelInfo:
    """The served model and the limits a client can plan with. Needs the engine loaded."""
    engine = service._engine()
    s = service.settings
    assert service.artifacts is not None
    variant = service.artifacts.variant
    # A preparation serves its own export (a model path) made from the hub's fp32 graph.
    hub = HUB_SOURCES.get(variant) if s.model_path is None else service.preparation.hub
    return ModelInfo(
        model_id=hub.repo_id if hub else MODEL_ID,
        model_sha=hub.revision if hub else None,
        **_engine_limits(engine, s),
        max_client_batch_size=s.max_batch,
        auto_truncate=s.truncate,
        tokenization_workers=tokenizing_slots(),
        version=__version__,
    )


def reranker_info(service: Service) -> ModelInfo:
    """What ``/rerank`` scores with, as TEI's ``GET /info`` of a reranker reports it: the
    cross-encoder and its pair limits when one is loaded, else bge-m3 (its own scores)."""
    base = model_info(service)
    reranking = service.reranking
    engine, s = reranking.engine, reranking.settings
    if engine is None or s is None:
        return base
    return dataclasses.replace(
        base, model_id=RERANK_REPO,
        model_sha=RERANK_REVISION if s.rerank_model_path is None else None,
        **_engine_limits(engine, s))
