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

from bgeserve.errors import ModelUnavailable
from bgeserve.runtime import GPU_PROVIDERS
from bgeserve.runtime.onnx import OnnxSession
from bgeserve.runtime.session import SessionConfig
from bgeserve.runtime.trt import (
    announce_trt_cache,
    engine_dir,
    fsync_tree,
    timing_dir,
    trt_options,
    trt_profile,
)

log = logging.getLogger("bgeserve.gpu")

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
    if config.provider not in GPU_PROVIDERS:
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


# -- providers and sessions ----------------------------------------------------------------
def provider_problem(ep: str, have: Iterable[str], gpu_count: int,
                     proc: Path = Path("/proc")) -> str:
    """Why ``ep`` cannot run here ("" when it can): a provider this onnxruntime build lacks, or
    a GPU provider with no GPU found (``gpu_count``: the setting, /proc or NVML)."""
    have = list(have)
    if ep not in have:
        return (f"BGE_M3_EP={ep}, but this onnxruntime build has no {ep} execution provider "
                f"(it has: {', '.join(have)}); "
                + _INSTALL_HINT.get(ep, f"{ep} needs a platform and build that offer it"))
    if ep in GPU_PROVIDERS and not gpu_count:
        return (f"BGE_M3_EP={ep}, but no NVIDIA GPU was found (nothing under "
                f"{proc}/driver/nvidia/gpus, no device from NVML); run with the GPU visible to "
                "the process (docker --gpus all, a Kubernetes nvidia.com/gpu limit) or set "
                "BGE_M3_GPU_COUNT")
    return ""


def session_config(provider: str, *, threads: int, workers: int, gpu_count: int | None,
                   cache_dir: Path, max_batch: int, max_seq: int,
                   gpu_mem_limit: int | None = None) -> SessionConfig:
    """The session options for ``provider``.

    For TensorRT this also creates the engine and timing cache folders and logs what the engine
    folder holds (``trt cache: found N cached engines at PATH`` / ``trt cache: empty``).
    """
    base = SessionConfig(provider=provider, threads=threads, streams=workers)
    if provider not in GPU_PROVIDERS:
        return base
    cuda = cuda_options(gpu_mem_limit)
    base = dataclasses.replace(base, device_count=gpu_count or 1)
    if provider == "cuda":
        return dataclasses.replace(base, provider_options=cuda)
    for folder in (engine_dir(cache_dir), timing_dir(cache_dir)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ModelUnavailable(f"cannot create the TensorRT cache folder {folder}: "
                                   f"{exc.strerror or exc}", param="BGE_M3_CACHE_DIR") from exc
    announce_trt_cache(engine_dir(cache_dir))
    profile = trt_profile(max_batch, max_seq)
    return dataclasses.replace(base, provider_options=trt_options(cache_dir, profile),
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


def workspace_vram(devices: int, model_files: Iterable[Path], safety_factor: float,
                   nvml: Any = None) -> int | None:
    """Workspace VRAM per device, measured: (free VRAM of the fullest of the first ``devices``
    devices − the model's size) × ``safety_factor``; None without NVML.

    Per worker, i.e. per device (each worker has a GPU of its own), as the reference server
    meant its VRAM budget.
    """
    free = free_vram_bytes(range(max(1, devices)), nvml)
    if free is None:
        return None
    model = sum(p.stat().st_size for p in model_files if p.is_file())
    per_device = max(int((free - model) * safety_factor), 1)
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
