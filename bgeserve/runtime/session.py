"""What every runtime's session looks like to the engine, and how one is opened (plain data).

``Session`` is the seam between the engine and a runtime: padded int64 ``input_ids`` and
``attention_mask`` in, named float arrays out. ONNX Runtime's ``OnnxSession`` (and the handles
of a ``SharedSession``) and OpenVINO's ``OpenVinoSession`` satisfy it; tests pass fakes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import psutil

from bgeserve.cgroup import usable_cpus


class Session(Protocol):
    """One worker's session over a graph."""

    input_names: list[str]
    output_names: list[str]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run one padded chunk; the requested outputs (all when None) by name."""
        ...

    def close(self) -> None:
        """Release the session."""
        ...


@dataclass(frozen=True)
class SessionConfig:
    """How to open one session (``provider``: cpu | cuda | tensorrt | coreml | openvino)."""

    provider: str = "cpu"
    threads: int = 0  # 0: the runtime picks (one per physical core)
    # CPU workspace from ONNX Runtime's arena, grown by exactly what a run asks for and shrunk
    # back at the end of every run (``onnx.run_options``), so a chunk's workspace goes back
    # after it, as the cost model assumes. Off, glibc's heap serves it and fragments: one
    # 2,048–4,096-token text left 0.4–1.2 GiB behind on the row-blocked graphs (measured).
    cpu_arena: bool = True
    device_id: int = 0
    # GPU EPs: worker i runs on device ``i % device_count`` (``runtime.gpu.pin``).
    device_count: int = 1
    provider_options: dict[str, str] = field(default_factory=dict)
    # Options of the CUDA EP registered under TensorRT for the nodes TensorRT rejects.
    cuda_options: dict[str, str] = field(default_factory=dict)
    optimization: str = "all"
    # OpenVINO: inference streams of the one compiled model the workers share (= workers).
    streams: int = 1

    @property
    def cpu_threads(self) -> int:
        """Threads per stream: ``threads``; for 0, the runtime's own count (0: its physical
        cores, which never sees a cgroup CPU quota) unless a quota leaves fewer CPUs than
        that, then the quota's CPUs shared among the streams."""
        if self.threads:
            return self.threads
        cpus = usable_cpus()
        if cpus.quota is None:  # no need to count the physical cores
            return 0
        if cpus.count >= (psutil.cpu_count(logical=False) or cpus.affinity):
            return 0
        return max(1, cpus.count // max(1, self.streams))

    @property
    def shrinking_arena(self) -> bool:
        """The CPU arena is on, and shrunk after every run (CPU sessions only: GPU sessions keep
        it off, since nothing there would shrink it between runs)."""
        return self.cpu_arena and self.provider == "cpu"
