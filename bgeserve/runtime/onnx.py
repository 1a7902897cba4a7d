"""ONNX Runtime adapter: the only module that imports ``onnxruntime``.

It opens sessions with bgeserve's options; a failed run is translated where it enters
(``common.run_failure``: OutOfMemory, which the scheduler splits, or EngineFailed).
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bgeserve.cgroup import usable_cpus
from bgeserve.errors import ModelUnavailable
from bgeserve.runtime import GPU_PROVIDERS
from bgeserve.runtime.common import Shared, feeds, run_failure
from bgeserve.runtime.session import SessionConfig

_PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
}


def version() -> str:
    """ONNX Runtime's version (part of the probe fingerprint)."""
    return ort.__version__


def available_providers() -> list[str]:
    """Execution providers this onnxruntime build offers, by bgeserve's short names."""
    have = set(ort.get_available_providers())
    return [short for short, name in _PROVIDERS.items() if name in have]


_ARENA_LOCK = threading.Lock()
_arena_registered: bool | None = None  # once per process: ONNX Runtime's environment is global


def _shared_cpu_arena() -> bool:
    """Register one CPU arena for the process's sessions (extend by the requested size, not the
    default next power of two, which can double a long text's peak); False if refused."""
    global _arena_registered
    with _ARENA_LOCK:
        if _arena_registered is None:
            try:
                info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                         ort.OrtMemType.DEFAULT)
                # (max memory: unlimited, strategy 1 = kSameAsRequested, defaults, defaults)
                ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
                _arena_registered = True
            except Exception:  # noqa: BLE001 - an older build, or one registered first
                _arena_registered = False
        return _arena_registered


def run_options(config: SessionConfig) -> ort.RunOptions | None:
    """Per-run options: with the arena, give its free regions back once the run ends."""
    if not config.shrinking_arena:
        return None
    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


def session_options(config: SessionConfig) -> ort.SessionOptions:
    """bgeserve's session options (the benchmark and recipe scripts use them too, so what they
    time is what the server runs); pair them with ``run_options``."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads = config.cpu_threads
    if threads != 1 and usable_cpus().quota is not None:
        # Under a cgroup CPU quota a thread spinning for its next piece of work spends the
        # quota the others need (int8, 1.5-CPU quota, 2 threads: 1.06x faster without).
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.enable_cpu_mem_arena = config.shrinking_arena
    if opts.enable_cpu_mem_arena and _shared_cpu_arena():
        opts.add_session_config_entry("session.use_env_allocators", "1")
    opts.graph_optimization_level = {
        "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[config.optimization]
    opts.log_severity_level = 3
    return opts


def _providers(config: SessionConfig) -> list[str | tuple[str, dict[str, str]]]:
    name = _PROVIDERS[config.provider]
    if config.provider == "cpu":
        return [name]
    if config.provider not in GPU_PROVIDERS:
        return [(name, dict(config.provider_options)), "CPUExecutionProvider"]
    device = {"device_id": str(config.device_id)}
    chain: list[str | tuple[str, dict[str, str]]] = [(name, {**config.provider_options, **device})]
    if config.provider == "tensorrt":
        chain.append((_PROVIDERS["cuda"], {**config.cuda_options, **device}))
    return [*chain, "CPUExecutionProvider"]


class OnnxSession:
    """One ONNX Runtime inference session over a bge-m3 graph."""

    def __init__(self, path: Path, config: SessionConfig, *, graph: bytes | None = None):
        """Open ``path``; or, with ``graph``, that serialized model (e.g. ``path``'s graph with
        extra outputs) whose external data is read from ``path``'s directory, not copied."""
        if _PROVIDERS[config.provider] not in ort.get_available_providers():
            raise ModelUnavailable(
                f"execution provider {config.provider!r} is not available in this onnxruntime "
                f"build (have: {', '.join(available_providers())})", param="BGE_M3_EP")
        opts = session_options(config)
        if graph is not None:
            opts.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", str(Path(path).parent))
        try:
            self._session = ort.InferenceSession(
                graph if graph is not None else str(path), sess_options=opts,
                providers=_providers(config))
        except Exception as exc:  # ORT raises its own pybind exception types
            raise ModelUnavailable(f"cannot open ONNX model {path}: {exc}") from exc
        active = self._session.get_providers()
        if _PROVIDERS[config.provider] not in active:
            # onnxruntime's Python API retries on the next provider when one fails to start
            # (a missing libnvinfer, a driver problem): serving silently on the CPU is worse.
            raise ModelUnavailable(
                f"execution provider {config.provider!r} failed to initialise and onnxruntime "
                f"fell back to {', '.join(active)}; see its error above (a library not found, "
                "e.g. libcublas.so.13, means onnxruntime-gpu was built for another CUDA major "
                "than the host has: PyPI's <1.27 are CUDA 12 builds, >=1.27 CUDA 13)",
                param="BGE_M3_EP")
        self.path = path
        self.config = config
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]
        self._run_options = run_options(config)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run one padded chunk; returns the requested outputs by name."""
        names = list(outputs) if outputs else self.output_names
        try:
            values = self._session.run(names, feeds(self.input_names, input_ids, attention_mask),
                                       self._run_options)
        except Exception as exc:
            raise run_failure(exc, tuple(input_ids.shape), "onnxruntime") from exc
        return dict(zip(names, values))

    def close(self) -> None:
        """Release the session (its memory is freed once no reference remains)."""
        self._session = None


class SharedSession:
    """One CPU session for every worker: ``session()`` hands each worker a handle on it.

    ``InferenceSession.run`` is thread-safe and, on the CPU EP, computes on its caller's thread
    (plus the session's intra-op pool), so N workers with cores/N threads each run N chunks at
    once on ONE copy of the weights and of their prepacked forms, where a session per worker
    holds N. Measured (full-size, 2 cores, 64 texts of 16-512 tokens, batch 1): two concurrent
    single-thread runs vs one two-thread run, fp32 285 vs 267 tokens/s, int8 852 vs 809, for
    +40 MiB RSS, not the +1.9 GiB of a second fp32 session.

    Opened on the first ``session()``, released when the last handle closes (idle unload). A
    worker that reopens after a failed run gets the same session while others hold it: a CPU
    session keeps no state between runs (the per-worker reopen is for GPU contexts, which are
    not shared).
    """

    def __init__(self, path: Path, config: SessionConfig):
        self.path = path
        self.config = config
        self._shared = Shared(lambda: OnnxSession(path, config))

    def session(self) -> SharedHandle:
        return SharedHandle(self._shared, self._shared.acquire())

    @property
    def users(self) -> int:
        return self._shared.users


class SharedHandle:
    """One worker's view of a ``SharedSession``: the same ``run`` / ``close`` as ``OnnxSession``."""

    def __init__(self, owner: Shared[OnnxSession], session: OnnxSession):
        self._owner = owner
        self._session: OnnxSession | None = session
        self.path = session.path
        self.config = session.config
        self.input_names = session.input_names
        self.output_names = session.output_names

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        if self._session is None:
            raise RuntimeError("run() on a closed session")
        return self._session.run(input_ids, attention_mask, outputs)

    def close(self) -> None:
        if self._session is not None:
            self._session = None
            self._owner.release()


def cpu_description() -> str:
    """CPU model and architecture (part of the probe fingerprint)."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.machine()} {model}".strip()
