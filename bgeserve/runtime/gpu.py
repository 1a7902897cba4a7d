"""GPU execution: which devices, which provider options, how much VRAM.

Plain values in, plain values out, so all of it is tested on machines without a GPU: the device
count comes from ``/proc/driver/nvidia/gpus`` under a given proc root, and NVML (``pynvml``,
from the optional ``nvidia-ml-py``) is imported only when installed and can be passed in as a
fake. TensorRT's own parts (profile, engine cache, warm-up grid) are in ``trt.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bgeserve.config import Settings
from bgeserve.errors import ConfigError, ModelUnavailable
from bgeserve.runtime.onnx import OnnxSession, SessionConfig, available_providers
from bgeserve.runtime.trt import (
    announce_trt_cache,
    engine_dir,
    fsync_tree,
    timing_dir,
    trt_options,
    trt_profile,
)

log = logging.getLogger("bgeserve.gpu")

GPU_EPS = ("cuda", "tensorrt")
_INSTALL_HINT = {
    "cuda": "install onnxruntime-gpu in place of onnxruntime, built for the host's CUDA (PyPI: "
            "<1.27 for CUDA 12, >=1.27 for CUDA 13); the Dockerfile.cuda image has it",
    "tensorrt": "install onnxruntime-gpu in place of onnxruntime and TensorRT 10 "
                "(tensorrt-cu12-libs, on LD_LIBRARY_PATH); the Dockerfile.cuda image has both",
}


# -- devices ---------------------------------------------------------------------------------
def detect_gpu_count(proc: Path = Path("/proc")) -> int:
    """NVIDIA GPUs the driver exposes: one directory per device under ``driver/nvidia/gpus``."""
    try:
        return sum(1 for entry in (proc / "driver" / "nvidia" / "gpus").iterdir()
                   if entry.is_dir())
    except OSError:
        return 0


def device_for_worker(worker: int, gpu_count: int) -> int:
    """The device worker ``worker`` runs on: ``worker % gpu_count``."""
    return worker % max(gpu_count, 1)


def pin(config: SessionConfig, worker: int) -> SessionConfig:
    """``config`` for one worker: on a GPU EP, pinned to its device; otherwise unchanged."""
    if config.provider not in GPU_EPS:
        return config
    return dataclasses.replace(config, device_id=device_for_worker(worker, config.device_count))


def open_pinned(path: Path, config: SessionConfig, worker: int = 0) -> OnnxSession:
    """Open worker ``worker``'s session; a TensorRT engine it built is fsynced before returning."""
    session = OnnxSession(path, pin(config, worker))
    if config.provider == "tensorrt":
        for key in ("trt_engine_cache_path", "trt_timing_cache_path"):
            if config.provider_options.get(key):
                fsync_tree(Path(config.provider_options[key]))
    return session


# -- settings --------------------------------------------------------------------------------
def resolve(settings: Settings, *, model_explicit: bool = True, proc: Path = Path("/proc"),
            available: Iterable[str] | None = None, nvml: Any = None) -> Settings:
    """Settings with the execution provider checked, GPUs counted and workers clamped.

    A provider this onnxruntime build lacks, or a GPU EP with no GPU found, is a ``ConfigError``
    naming BGE_M3_EP, unless BGE_M3_ALLOW_CPU_FALLBACK=1 (then a warning and the CPU). On a GPU
    EP, ``gpu_count`` is filled in (BGE_M3_GPU_COUNT, else /proc, else NVML), workers are
    clamped to it, and fp16 becomes the variant unless BGE_M3_MODEL was given
    (``model_explicit``). Idempotent: resolving resolved settings changes nothing.
    """
    ep = settings.execution_provider
    if ep == "cpu":
        return settings
    have = available_providers() if available is None else list(available)
    count = 0
    if ep not in have:
        problem = (f"BGE_M3_EP={ep}, but this onnxruntime build has no {ep} execution provider "
                   f"(it has: {', '.join(have)}); "
                   + _INSTALL_HINT.get(ep, f"{ep} needs a platform and build that offer it"))
    elif ep in GPU_EPS:
        count = settings.gpu_count or detect_gpu_count(proc) or nvml_device_count(nvml)
        problem = "" if count else (
            f"BGE_M3_EP={ep}, but no NVIDIA GPU was found (nothing under "
            f"{proc}/driver/nvidia/gpus, no device from NVML); run with the GPU visible to the "
            "process (docker --gpus all, a Kubernetes nvidia.com/gpu limit) or set "
            "BGE_M3_GPU_COUNT")
    else:
        problem = ""
    if problem:
        if not settings.allow_cpu_fallback:
            raise ConfigError(f"{problem}; or set BGE_M3_EP=cpu, or BGE_M3_ALLOW_CPU_FALLBACK=1 "
                              "to run on the CPU instead", param="BGE_M3_EP")
        log.warning("%s. BGE_M3_ALLOW_CPU_FALLBACK=1: running on the CPU instead", problem)
        return dataclasses.replace(settings, execution_provider="cpu")
    if ep not in GPU_EPS:
        return settings
    changes: dict[str, Any] = {"gpu_count": count}
    if settings.workers > count:
        log.warning("BGE_M3_WORKERS=%d clamped to %d: on %s each worker owns one GPU and "
                    "there are %d (BGE_M3_GPU_COUNT or detected)", settings.workers, count, ep,
                    count)
        changes["workers"] = count
    if not model_explicit and settings.variant != "fp16":
        log.info("BGE_M3_MODEL not set: using the fp16 variant on %s", ep)
        changes["variant"] = "fp16"
    return dataclasses.replace(settings, **changes)


def profile_max_batch(settings: Settings) -> int:
    """Most texts one ``session.run`` may hold (the scheduler's chunk cap)."""
    return settings.max_chunk if settings.onnx_batch_size is None else settings.onnx_batch_size


def session_config(settings: Settings, *, gpu_mem_limit: int | None = None) -> SessionConfig:
    """The session options for ``settings``' provider (resolve the settings first).

    For TensorRT this also creates the engine and timing cache folders and logs what the engine
    folder holds (``trt cache: found N cached engines at PATH`` / ``trt cache: empty``).
    """
    s = settings
    base = SessionConfig(provider=s.execution_provider, threads=s.threads_per_worker,
                         streams=s.workers)
    if s.execution_provider not in GPU_EPS:
        return base
    cuda = cuda_options(gpu_mem_limit)
    base = dataclasses.replace(base, device_count=s.gpu_count or 1)
    if s.execution_provider == "cuda":
        return dataclasses.replace(base, provider_options=cuda)
    for folder in (engine_dir(s.cache_dir), timing_dir(s.cache_dir)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ModelUnavailable(f"cannot create the TensorRT cache folder {folder}: "
                                   f"{exc.strerror or exc}", param="BGE_M3_CACHE_DIR") from exc
    announce_trt_cache(engine_dir(s.cache_dir))
    profile = trt_profile(profile_max_batch(s), s.max_seq_length)
    return dataclasses.replace(base, provider_options=trt_options(s.cache_dir, profile),
                               cuda_options=cuda)


# -- provider options ------------------------------------------------------------------------
def cuda_options(gpu_mem_limit: int | None = None) -> dict[str, str]:
    """CUDA EP options: an arena that grows by what is asked (not by powers of two), capped."""
    options = {"arena_extend_strategy": "kSameAsRequested"}
    if gpu_mem_limit:
        options["gpu_mem_limit"] = str(int(gpu_mem_limit))
    return options


# -- NVML (optional) -------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _system_nvml() -> Any:
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]  # optional: nvidia-ml-py
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 -- not installed, no driver, no device: all mean no NVML
        return None
    return pynvml


def _nvml(nvml: Any) -> Any:
    return _system_nvml() if nvml is None else nvml


def nvml_device_count(nvml: Any = None) -> int:
    """Devices NVML sees (0 without NVML)."""
    lib = _nvml(nvml)
    try:
        return int(lib.nvmlDeviceGetCount()) if lib else 0
    except Exception:  # noqa: BLE001 -- pynvml.NVMLError and friends: treat as no device
        return 0


def free_vram_bytes(devices: Iterable[int], nvml: Any = None) -> int | None:
    """Free memory of the fullest of ``devices`` (None without NVML)."""
    lib = _nvml(nvml)
    if lib is None:
        return None
    try:
        free = [int(lib.nvmlDeviceGetMemoryInfo(lib.nvmlDeviceGetHandleByIndex(d)).free)
                for d in devices]
    except Exception:  # noqa: BLE001 -- NVML failed: the caller falls back to the setting
        return None
    return min(free) if free else None


def vram_budget(settings: Settings, model_files: Iterable[Path] = (),
                nvml: Any = None) -> int | None:
    """Workspace VRAM for the tuner: BGE_M3_GPU_VRAM_BUDGET_BYTES, else measured with NVML.

    Per worker, i.e. per device (each worker has a GPU of its own), as the reference server
    meant it. Measured: (free VRAM of the fullest device in use − the model's size) × the
    safety factor. None when neither is available (the tuner then assumes its default).
    """
    s = settings
    if s.gpu_vram_budget_bytes is not None or s.execution_provider not in GPU_EPS:
        return s.gpu_vram_budget_bytes
    devices = min(s.workers, s.gpu_count or 1)
    free = free_vram_bytes(range(devices), nvml)
    if free is None:
        return None
    model = sum(p.stat().st_size for p in model_files if p.is_file())
    per_device = max(int((free - model) * s.memory_safety_factor), 1)
    log.info("gpu: %d MiB free VRAM on the fullest device, %d MiB for workspace per device",
             free >> 20, per_device >> 20)
    return per_device


def heartbeat_fields(nvml: Any = None) -> dict[str, Any]:
    """Per-device VRAM used/total, utilisation and temperature for the heartbeat ({} w/o NVML)."""
    lib = _nvml(nvml)
    if lib is None:
        return {}
    try:
        devices = []
        for index in range(int(lib.nvmlDeviceGetCount())):
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            memory = lib.nvmlDeviceGetMemoryInfo(handle)
            devices.append({
                "index": index,
                "vram_used_bytes": int(memory.used),
                "vram_total_bytes": int(memory.total),
                "utilization_pct": int(lib.nvmlDeviceGetUtilizationRates(handle).gpu),
                "temperature_c": int(lib.nvmlDeviceGetTemperature(handle,
                                                                   lib.NVML_TEMPERATURE_GPU)),
            })
    except Exception:  # noqa: BLE001 -- a heartbeat must never fail because NVML did
        return {}
    return {"gpus": devices}
