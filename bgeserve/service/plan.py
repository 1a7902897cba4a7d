"""Settings → what serves: the one step that turns ``Settings`` into plain values.

``resolve`` decides, before any port is bound, the runtime, the execution provider and the
variant (the CPU default by ``runtime.select``'s rule, the GPU's fp16, OpenVINO's bf16), checks
that the provider exists and counts the GPUs. ``for_model`` then, with the model's files known,
derives everything the engine and the tuner take: the tokens per text the model holds
(``max_seq``, clamped once), chunk tokens and rounding from the runtime registry unless set,
the session options, the engine's and the tuner's configurations. Nothing below the service
reads ``Settings``: they get these values.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bgeserve import runtime
from bgeserve.config import OPENVINO_VARIANTS, Settings
from bgeserve.engine import EngineConfig
from bgeserve.engine import cache as embedding_cache
from bgeserve.engine.names import SettingNames
from bgeserve.engine.scheduler import SchedulerConfig
from bgeserve.errors import ConfigError
from bgeserve.model.artifacts import ModelArtifacts, export_variants
from bgeserve.model.dims import clamp_max_seq, model_dims
from bgeserve.runtime import gpu
from bgeserve.runtime import openvino as ov_runtime
from bgeserve.runtime.select import (
    MIN_DENSE_COS,
    SATURATES,
    THIS_MACHINE,
    Machine,
    cpu_default,
    runs_right,
)
from bgeserve.runtime.session import SessionConfig
from bgeserve.tuning import memory
from bgeserve.tuning.tuner import TuningConfig

log = logging.getLogger("bgeserve.backend")
gpu_log = logging.getLogger("bgeserve.gpu")


# -- runtime and variant ------------------------------------------------------------------------
def resolve(settings: Settings, *, model_explicit: bool | None = None,
            ep_explicit: bool | None = None, machine: Machine = THIS_MACHINE,
            proc: Path = Path("/proc"), available: Any = None, nvml: Any = None) -> Settings:
    """Settings with a concrete runtime, provider and variant (``ConfigError`` naming what to
    change). ``model_explicit`` / ``ep_explicit``: whether BGE_M3_MODEL / BGE_M3_EP were given
    (default: as ``settings`` recorded). Idempotent: resolving resolved settings changes
    nothing."""
    if settings.variant_choice:
        return settings
    if model_explicit is None:
        model_explicit = settings.is_explicit("BGE_M3_MODEL")
    if ep_explicit is None:
        ep_explicit = settings.is_explicit("BGE_M3_EP")
    s = settings
    if not model_explicit and s.execution_provider == "openvino":
        s = dataclasses.replace(s, variant="bf16")  # OpenVINO's default (ov-int8 when asked)
    if s.execution_provider == "cpu" and s.variant in OPENVINO_VARIANTS:
        if ep_explicit:
            raise ConfigError(f"BGE_M3_MODEL={s.variant} runs on OpenVINO, not ONNX Runtime: set "
                              "BGE_M3_EP=openvino (or unset BGE_M3_EP)", param="BGE_M3_MODEL")
        s = dataclasses.replace(s, execution_provider="openvino")
    if s.execution_provider == "openvino":
        s = _openvino(s, model_explicit, machine)
    elif s.execution_provider == "cpu" and not model_explicit and not ep_explicit:
        s = _cpu_default(s, machine)
    else:
        s = resolve_gpu(s, model_explicit=model_explicit, proc=proc, available=available,
                        nvml=nvml)
    if model_explicit and s.execution_provider in ("cpu", "openvino"):
        entry = export_variants(s.model_path).get(s.variant)
        if entry is not None and not runs_right(entry, machine):
            # Asked for by name: served, but never silently (the default never picks it here).
            log.warning("BGE_M3_MODEL=%s: %s; its results here may be far from what its "
                        "export measured", s.variant, SATURATES)
    if s.cache_mb is None:
        # Read once: the engine's cache and the tuner's reservation for it are the same size
        # (where no cgroup caps it, the memory available moves between two reads).
        s = dataclasses.replace(s, cache_mb=embedding_cache_bytes(s) >> 20)
    # "pinned": BGE_M3_MODEL said so; "rule": a default (the CPU rule, fp16 on GPUs, bf16 on
    # OpenVINO), which the tuner may replace by measuring ("measured").
    return dataclasses.replace(
        s, variant_choice=s.variant_choice or ("pinned" if model_explicit else "rule"))


def _openvino(s: Settings, model_explicit: bool, machine: Machine) -> Settings:
    if not machine.openvino():
        problem = ("BGE_M3_EP=openvino, but the openvino package is missing: "
                   + ov_runtime.INSTALL_HINT)
        if not s.allow_cpu_fallback:
            raise ConfigError(f"{problem}; or set BGE_M3_EP=cpu, or BGE_M3_ALLOW_CPU_FALLBACK=1",
                              param="BGE_M3_EP")
        log.warning("%s. BGE_M3_ALLOW_CPU_FALLBACK=1: running fp32 on ONNX Runtime instead",
                    problem)
        return dataclasses.replace(s, execution_provider="cpu", variant="fp32")
    if s.variant not in OPENVINO_VARIANTS:
        if model_explicit:
            raise ConfigError(f"BGE_M3_EP=openvino runs the bf16 or ov-int8 variant, not "
                              f"{s.variant}: set BGE_M3_MODEL=bf16 or ov-int8 (or unset it), "
                              "or BGE_M3_EP=cpu for "
                              f"{s.variant} on ONNX Runtime", param="BGE_M3_MODEL")
        s = dataclasses.replace(s, variant="bf16")
    return s


def _cpu_default(s: Settings, machine: Machine) -> Settings:
    """Neither BGE_M3_EP nor BGE_M3_MODEL given: the rule's fastest variant keeping the bar."""
    variants = export_variants(s.model_path)
    choice = cpu_default(variants, machine)
    # A hub snapshot that is to be prepared: the choice is made again over what preparing
    # makes (service/preparation.py logs that one); this one would only mislead in the log.
    say = log.debug if s.prepare and not variants else log.info
    # "The rule's pick", not "serving": the variant choice times the candidates next and
    # may serve another (the first line named int8, then bf16 was served: QA).
    if choice.variant == "fp32":
        say("BGE_M3_EP and BGE_M3_MODEL not set: the rule's pick is exact %s on ONNX Runtime "
            "(%s); timing the candidates may serve another", s.variant,
            "; ".join(choice.notes))
        return dataclasses.replace(s, variant_choice="rule")
    say("BGE_M3_EP and BGE_M3_MODEL not set: the rule's pick is %s on %s (%s; dense cosine vs "
        "fp32 >= %s); timing the candidates may serve another", choice.variant,
        "OpenVINO" if choice.provider == "openvino" else "ONNX Runtime", choice.why,
        MIN_DENSE_COS)
    return dataclasses.replace(s, execution_provider=choice.provider, variant=choice.variant,
                               variant_choice="rule")


def resolve_gpu(settings: Settings, *, model_explicit: bool | None = None,
                proc: Path = Path("/proc"), available: Any = None, nvml: Any = None) -> Settings:
    """Settings with the execution provider checked, GPUs counted and workers clamped.

    A provider this onnxruntime build lacks, or a GPU EP with no GPU found, is a ``ConfigError``
    naming BGE_M3_EP, unless BGE_M3_ALLOW_CPU_FALLBACK=1 (then a warning and the CPU). On a GPU
    EP, ``gpu_count`` is filled in (BGE_M3_GPU_COUNT, else /proc, else NVML), workers are
    clamped to it, and fp16 becomes the variant unless BGE_M3_MODEL was given. Idempotent.
    """
    if model_explicit is None:
        model_explicit = settings.is_explicit("BGE_M3_MODEL")
    ep = settings.execution_provider
    if ep == "cpu":
        return settings
    if available is None:
        from bgeserve.runtime.onnx import available_providers

        available = available_providers()
    have = list(available)
    count = 0
    if ep in have and runtime.on_gpu(ep):
        count = settings.gpu_count or gpu.detect_gpu_count(proc) or gpu.nvml_device_count(nvml)
    problem = gpu.provider_problem(ep, have, count, proc)
    if problem:
        if not settings.allow_cpu_fallback:
            raise ConfigError(f"{problem}; or set BGE_M3_EP=cpu, or BGE_M3_ALLOW_CPU_FALLBACK=1 "
                              "to run on the CPU instead", param="BGE_M3_EP")
        gpu_log.warning("%s. BGE_M3_ALLOW_CPU_FALLBACK=1: running on the CPU instead", problem)
        return dataclasses.replace(settings, execution_provider="cpu")
    if not runtime.on_gpu(ep):
        return settings
    changes: dict[str, Any] = {"gpu_count": count}
    if settings.workers > count:
        gpu_log.warning("BGE_M3_WORKERS=%d clamped to %d: on %s each worker owns one GPU and "
                        "there are %d (BGE_M3_GPU_COUNT or detected)", settings.workers, count,
                        ep, count)
        changes["workers"] = count
    if not model_explicit and settings.variant != "fp16":
        gpu_log.info("BGE_M3_MODEL not set: using the fp16 variant on %s", ep)
        changes["variant"] = "fp16"
    return dataclasses.replace(settings, **changes)


# -- values derived from resolved settings ------------------------------------------------------
def chunk_tokens(settings: Settings) -> int:
    """BGE_M3_MAX_CHUNK_TOKENS, else the measured best of the settings' runtime."""
    if settings.max_chunk_tokens is not None:
        return settings.max_chunk_tokens
    return runtime.get(settings.execution_provider).chunk_tokens


def pad_multiple(settings: Settings) -> int:
    """BGE_M3_PAD_MULTIPLE, else the runtime's default (rounding pays on GPUs only)."""
    if settings.pad_multiple is not None:
        return settings.pad_multiple
    return runtime.get(settings.execution_provider).pad_multiple


def profile_max_batch(settings: Settings) -> int:
    """Most texts one ``session.run`` may hold (the scheduler's chunk cap)."""
    # BGE_M3_MAX_CHUNK, set, wins over the deprecated BGE_M3_ONNX_BATCH_SIZE it replaces
    # (Settings made in code record no variables: there, a max_chunk off its default is set).
    s = settings
    given = "BGE_M3_MAX_CHUNK" in s.explicit if s.explicit is not None else (
        s.max_chunk != Settings.max_chunk)
    return s.max_chunk if s.onnx_batch_size is None or given else s.onnx_batch_size


def session_config(settings: Settings, *, gpu_mem_limit: int | None = None) -> SessionConfig:
    """The session options for ``settings``' provider (resolve the settings first)."""
    s = settings
    return gpu.session_config(s.execution_provider, threads=s.threads_per_worker,
                              workers=s.workers, gpu_count=s.gpu_count, cache_dir=s.cache_dir,
                              max_batch=profile_max_batch(s), max_seq=s.max_seq_length,
                              gpu_mem_limit=gpu_mem_limit)


def vram_budget(settings: Settings, model_files: Any = (), nvml: Any = None) -> int | None:
    """Workspace VRAM per worker for the tuner: BGE_M3_GPU_VRAM_BUDGET_BYTES, else measured
    with NVML (``gpu.workspace_vram``); None when neither is available (the tuner's default)."""
    s = settings
    if s.gpu_vram_budget_bytes is not None or not runtime.on_gpu(s.execution_provider):
        return s.gpu_vram_budget_bytes
    devices = min(s.workers, s.gpu_count or 1)
    return gpu.workspace_vram(devices, model_files, s.memory_safety_factor, nvml)


# What the server's errors tell an operator to change: its environment variables.
SERVER_NAMES = SettingNames(
    max_seq="BGE_M3_MAX_SEQ_LENGTH", pair_length="BGE_M3_RERANK_MAX_LENGTH",
    max_colbert="BGE_M3_MAX_COLBERT_MB", workers="BGE_M3_WORKERS",
    max_chunk="BGE_M3_MAX_CHUNK=1", max_queue="BGE_M3_MAX_QUEUE_TOKENS",
    timeout="BGE_M3_REQUEST_TIMEOUT_SECS", max_text_chars="BGE_M3_MAX_TEXT_CHARS",
    more_memory="give the server more memory")
RERANKER_NAMES = dataclasses.replace(SERVER_NAMES, max_seq="BGE_M3_RERANK_MAX_LENGTH",
                                     workers="BGE_M3_RERANK_WORKERS")


def engine_config(settings: Settings, names: SettingNames = SERVER_NAMES) -> EngineConfig:
    """The engine's plain-value configuration, from resolved Settings."""
    s = settings
    scheduler = SchedulerConfig(
        workers=s.workers, max_chunk=profile_max_batch(s), max_chunk_tokens=chunk_tokens(s),
        pad_multiple=pad_multiple(s),
        batch_delay_s=s.batch_delay_ms / 1000.0, cross_request=s.cross_request_batching,
        max_queue_tokens=s.max_queue_tokens,
        idle_timeout_s=s.idle_timeout_secs, names=names)
    return EngineConfig(max_seq=s.max_seq_length, session=session_config(s), scheduler=scheduler,
                        request_timeout_s=s.request_timeout_secs or None,
                        max_colbert_bytes=colbert_bytes(s), cache_bytes=embedding_cache_bytes(s),
                        max_text_chars=s.max_text_chars, names=names)


# A request's ColBERT output peaks at ~5x its float32 size before it is sent (the chunks'
# arrays, each text's, the contiguous copy, the base64 or float text, the body): 120 texts of
# 8,192 tokens under the fixed 512 MiB (126 MB of vectors on the tiny model) OOM-killed a
# server in a 600 MiB container. At 1/20 of the memory one such request peaks at ~1/4 of it.
MAX_COLBERT_MB = 512
COLBERT_MEMORY_SHARE = 20
# The embedding cache's memory is reserved out of the workspace: a fixed 128 MiB left a
# 600 MiB container's worker 141 MiB, short of one 8,192-token text (176 MiB on the tiny
# model), and the start failed (exit 3) where the cache had not been asked for.
MAX_CACHE_MB = 128
CACHE_MEMORY_SHARE = 16


def memory_share(settings: Settings, share: int, cap_mb: int) -> int:
    """1/``share`` of the memory the server may use, at most ``cap_mb`` MiB: the default of a
    limit left unset (the ColBERT output, the embedding cache, the request bodies in
    progress)."""
    available = memory.detect_available_memory(settings.available_memory_bytes).available_bytes
    return min(cap_mb << 20, available // share)


def colbert_bytes(settings: Settings) -> int:
    """A request's ColBERT output cap, and that of the requests in progress together:
    BGE_M3_MAX_COLBERT_MB, else 1/20 of the memory the server may use, at most 512 MiB."""
    s = settings
    if s.max_colbert_mb is not None:
        return s.max_colbert_mb << 20
    return max(1 << 20, memory_share(s, COLBERT_MEMORY_SHARE, MAX_COLBERT_MB))


def embedding_cache_bytes(settings: Settings) -> int:
    """The embedding cache's size: BGE_M3_CACHE_MB, else 1/16 of the memory the server may
    use, at most 128 MiB."""
    s = settings
    if s.cache_mb is not None:
        return s.cache_mb << 20
    return memory_share(s, CACHE_MEMORY_SHARE, MAX_CACHE_MB)


def cache_bytes(settings: Settings) -> int:
    """The memory the engine's embedding cache may hold (0 where it is off for the variant)."""
    s = settings
    if not embedding_cache.applies(s.variant, profile_max_batch(s), pad_multiple(s)):
        return 0
    return embedding_cache_bytes(s)


@dataclass(frozen=True)
class Plan:
    """What serves one model: the settings with ``max_seq`` clamped to what the model holds,
    and the configurations derived from them."""

    settings: Settings
    artifacts: ModelArtifacts
    engine: EngineConfig
    tuning: TuningConfig
    runtime: str  # the registry kind that runs the graph

    @property
    def max_seq(self) -> int:
        return self.settings.max_seq_length


def for_model(settings: Settings, artifacts: ModelArtifacts, cache_dir: Path) -> Plan:
    """The plan for ``artifacts`` under resolved ``settings``."""
    s = dataclasses.replace(settings, max_seq_length=clamp_max_seq(settings.max_seq_length,
                                                                   artifacts))
    # The reranker's pair length and workers are settings of their own.
    engine = engine_config(s, RERANKER_NAMES if artifacts.layout.reranker else SERVER_NAMES)
    kind = runtime.kind_of(artifacts, s.execution_provider)
    tuning = TuningConfig(
        workers=s.workers, max_seq=s.max_seq_length, safety_factor=s.memory_safety_factor,
        available_override=s.available_memory_bytes, token_budget=s.token_budget,
        cost_a=s.cost_model_a, cost_b=s.cost_model_b,
        disable_auto_budget=s.disable_auto_budget,
        disable_probe_cache=s.disable_probe_cache,
        legacy_batch_size=s.onnx_batch_size,
        gpu=runtime.on_gpu(s.execution_provider),
        gpu_vram_budget=vram_budget(s, (artifacts.onnx_path, *artifacts.external_data)),
        cache_dir=cache_dir,
        dims=model_dims(artifacts),
        chunk_tokens=engine.scheduler.max_chunk_tokens,
        chunk_pinned=s.max_chunk_tokens is not None,
        retains_workspace=runtime.get(kind).retains_workspace,
        reserved_bytes=cache_bytes(s))
    return Plan(s, artifacts, engine, tuning, kind)


def probe_parts(settings: Settings, artifacts: ModelArtifacts) -> dict[str, Any]:
    """Everything that changes a session's memory use: the probe cache's fingerprint parts."""
    from bgeserve.runtime.onnx import cpu_description

    return {
        "model": artifacts.identity(), "layout": artifacts.layout.value,
        "variant": artifacts.variant, "provider": settings.execution_provider,
        "runtime": runtime_version(artifacts), "threads": settings.threads_per_worker,
        "workers": settings.workers,
        "cpu": cpu_description(), "max_seq": settings.max_seq_length,
    }


def runtime_version(artifacts: ModelArtifacts, provider: str = "cpu") -> str:
    """The runtime that reads the graph, with its version (health, logs, probe fingerprint)."""
    return runtime.get(runtime.kind_of(artifacts, provider)).version()


def oversubscribed(settings: Settings, cpus: int) -> str | None:
    """Why the compute threads asked for exceed ``cpus`` (the CPUs usable), or None: each
    worker's session runs its intra-op threads at once, and threads past the CPUs wait on
    each other's time slices (QA: 4 workers x 2 threads on 2 CPUs started without a word).
    A GPU session's threads mostly wait on the device: not counted."""
    s = settings
    if s.execution_provider not in ("cpu", "openvino"):
        return None
    threads = s.workers * s.threads_per_worker
    if threads <= cpus:
        return None
    if s.intra_threads:
        asked = f"BGE_M3_WORKERS={s.workers} x BGE_M3_INTRA_THREADS={s.intra_threads}"
        fix = ("unset BGE_M3_INTRA_THREADS (the CPUs are then shared among the workers), or "
               f"run at most {cpus} threads in all")
        if s.workers > cpus:
            fix = f"run at most {cpus} workers and unset BGE_M3_INTRA_THREADS"
    else:
        asked = f"BGE_M3_WORKERS={s.workers} (one thread each at least)"
        fix = f"run at most {cpus} workers (each then gets the CPUs' share)"
    return (f"{asked} runs {threads} compute threads on {cpus} usable CPUs: the threads past "
            f"the CPUs wait on each other, slower rather than faster: {fix}")
