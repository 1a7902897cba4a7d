"""The runtimes bgeserve runs graphs on, and everything the layers above need to know of each.

One registry entry per runtime kind (``cpu``, ``coreml``, ``cuda``, ``tensorrt`` on ONNX
Runtime; ``openvino``): how its sessions are opened for the workers, the chunk shape it runs
best, whether workers share one copy of the weights, and its version. A new runtime is one
adapter module here plus one entry in ``_REGISTRY``; nothing above this package spells a
runtime's name to decide how to run it.

Runtime libraries are imported only when a session opens (``onnx``, ``openvino`` adapters), so
importing this package is cheap and works without the optional ones installed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from bgeserve.errors import ConfigError
from bgeserve.model.artifacts import ModelArtifacts
from bgeserve.runtime.session import Session, SessionConfig

__all__ = ["GPU_PROVIDERS", "Runtime", "Session", "SessionConfig", "get", "kind_of", "on_gpu",
           "weight_copies"]

GPU_PROVIDERS = ("cuda", "tensorrt")
OpenSession = Callable[[int], Session]  # worker index -> a session for that worker


@dataclass(frozen=True)
class Runtime:
    """What bgeserve knows of one runtime kind."""

    kind: str
    # Padded tokens per session.run() that gave the most tokens/s on the mixed corpus
    # (docs/benchmarks.md, chunk sweep): ORT on the CPU runs small chunks best (its GEMMs gain
    # little from batching and padding costs), OpenVINO bf16 ~1,024. GPUs want big chunks: on
    # an H200 (CUDA fp16, one run per shape) 1,024 tokens run in ~9 ms (~110k tokens/s), 8,192
    # in ~16 ms (4x2048: 515k tokens/s), 16,384 in 26 ms (32x512: 642k); 8,192 takes most of
    # that gain at a run's latency of ~16 ms. (The memory budget still bounds every chunk.)
    chunk_tokens: int
    # Chunk lengths rounded up to a multiple of this. On an H200 (CUDA, fp16) a warm run costs
    # ~9 ms from 1x16 to 8x512 tokens, but a shape's first run costs ~30-50 ms more: 32 bounds
    # the shapes texts of up to 512 tokens make at 16 lengths, for padding the GPU runs nearly
    # for free. CPUs pay for every padded token and nothing per shape: no rounding.
    pad_multiple: int
    # Workers share one session / compiled model (one copy of the weights), or own one each.
    shares_weights: bool
    opener: Callable[[ModelArtifacts, SessionConfig], OpenSession]
    version: Callable[[], str]
    # Between runs the runtime keeps its workspace at the high-water mark of the shapes run so
    # far, instead of giving it back: OpenVINO's CPU plugin holds each stream's intermediate
    # buffers for the life of the compiled model (a new infer request reuses them). The probe
    # then reads cumulative peaks (tuning.probe.PeakMeter); ONNX Runtime's arena shrinks
    # after every run (runtime/onnx.py).
    retains_workspace: bool = False
    # Resident bytes of a loaded model per byte of its files (a copy's, generously): ONNX
    # Runtime about its files (the full-size int8's 1,304 MiB: 1,489-1,574 MiB RSS); OpenVINO
    # keeps a bf16 copy of fp16-stored weights (its 1,084 MiB IR: 1,751-1,844 MiB) and a pool.
    resident_per_file_byte: float = 1.25
    # Where a variant's files say less (``resident_factor``): OpenVINO's ov-int8 unpacks what
    # NNCF stored compressed, its 549 MiB IR 1,730 MiB loaded and 2,061 MiB after one run
    # (3.7x; AMD EPYC Zen 4), 1,953-1,991 MiB serving (memory QA). At 1.7 the check before
    # loading asked ~934 MiB for it: caps of 1.2-2.4 GiB OOM-killed the start, nothing said.
    resident_by_variant: Mapping[str, float] = field(default_factory=dict, hash=False,
                                                     compare=False)

    def resident_factor(self, variant: str) -> float:
        """Resident bytes per byte of ``variant``'s files once loaded (and run)."""
        return self.resident_by_variant.get(variant, self.resident_per_file_byte)

    @property
    def on_gpu(self) -> bool:
        return self.kind in GPU_PROVIDERS


def _ort_version() -> str:
    from bgeserve.runtime import onnx

    return f"onnxruntime {onnx.version()}"


def _openvino_version() -> str:
    from bgeserve.runtime import openvino

    return f"openvino {openvino.version()}"


def _open_shared_cpu(artifacts: ModelArtifacts, config: SessionConfig) -> OpenSession:
    # One session, one copy of the weights, however many workers (onnx.SharedSession).
    from bgeserve.runtime.onnx import SharedSession

    shared = SharedSession(artifacts.onnx_path, config)

    def open_session(worker: int = 0) -> Session:
        return shared.session()

    return open_session


def _open_pinned(artifacts: ModelArtifacts, config: SessionConfig) -> OpenSession:
    # A session per worker, on device ``worker % device_count`` for GPU providers.
    from bgeserve.runtime.gpu import open_pinned

    def open_session(worker: int = 0) -> Session:
        return open_pinned(artifacts.onnx_path, config, worker)

    return open_session


def _open_openvino(artifacts: ModelArtifacts, config: SessionConfig) -> OpenSession:
    # One compiled model, one stream per worker: the weights are resident once.
    from bgeserve.runtime.openvino import SharedModel

    shared = SharedModel(artifacts.onnx_path, precision=artifacts.variant,
                         threads=config.cpu_threads, streams=config.streams)

    def open_session(worker: int = 0) -> Session:
        return shared.session()

    return open_session


_REGISTRY = {
    "cpu": Runtime("cpu", 256, 1, True, _open_shared_cpu, _ort_version),
    "coreml": Runtime("coreml", 1024, 1, False, _open_pinned, _ort_version),
    "cuda": Runtime("cuda", 8192, 32, False, _open_pinned, _ort_version),
    "tensorrt": Runtime("tensorrt", 8192, 32, False, _open_pinned, _ort_version),
    "openvino": Runtime("openvino", 1024, 1, True, _open_openvino, _openvino_version,
                        retains_workspace=True, resident_per_file_byte=1.7,
                        resident_by_variant={"ov-int8": 4.0}),
}


def get(kind: str) -> Runtime:
    """The registry entry of ``kind`` (``ConfigError`` naming BGE_M3_EP for an unknown one)."""
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise ConfigError(f"unknown runtime {kind!r}: bgeserve has {', '.join(_REGISTRY)}",
                          param="BGE_M3_EP") from None


def kind_of(artifacts: ModelArtifacts, provider: str) -> str:
    """The runtime that runs ``artifacts`` with ``provider``: an OpenVINO IR always runs on
    OpenVINO; an ONNX graph on ONNX Runtime's ``provider``."""
    return "openvino" if artifacts.runtime == "openvino" else provider


def on_gpu(provider: str) -> bool:
    """Whether ``provider`` runs on a GPU (one device per worker, a VRAM budget)."""
    return provider in GPU_PROVIDERS


def weight_copies(kind: str, workers: int) -> int:
    """How many copies of the weights ``workers`` workers keep resident."""
    return 1 if get(kind).shares_weights else max(1, workers)
