"""Which runtime and variant serve: the settings plus this machine → a concrete EP and variant.

- ``BGE_M3_EP=openvino`` runs the ``bf16`` variant (an OpenVINO IR made by ``bgeserve export``)
  on the native OpenVINO runtime; ``BGE_M3_MODEL=bf16`` alone implies it.
- With neither ``BGE_M3_EP`` nor ``BGE_M3_MODEL`` set, the CPU default is the fastest variant
  that keeps dense cosine ≥ 0.999 against fp32 on this machine: ``bf16`` on OpenVINO when the
  package is installed, the CPU computes bf16 natively (AVX512_BF16 or AMX) and the export holds
  that variant; otherwise exact ``fp32`` on ONNX Runtime. int8 (dynamic, per channel) is faster
  still but measured below 0.999 (docs/benchmarks.md), so it is only used when asked for.
- GPU EPs are then checked by ``runtime.gpu.resolve`` (fp16 default, GPUs counted).

Idempotent: resolving resolved settings changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from .artifacts import export_variants
from .config import Settings
from .errors import ConfigError
from .runtime import gpu
from .runtime import openvino as ov_runtime

log = logging.getLogger("bgeserve.backend")


@dataclasses.dataclass(frozen=True)
class Machine:
    """What this machine offers (a seam: tests pass their own)."""

    openvino: Callable[[], bool] = ov_runtime.available
    native_bf16: Callable[[], bool] = ov_runtime.native_bf16


def resolve(settings: Settings, *, model_explicit: bool = True, ep_explicit: bool = True,
            machine: Machine = Machine()) -> Settings:
    """Settings with a concrete runtime and variant (``ConfigError`` naming what to change)."""
    s = settings
    if s.execution_provider == "cpu" and s.variant == "bf16":
        if ep_explicit:
            raise ConfigError("BGE_M3_MODEL=bf16 runs on OpenVINO, not ONNX Runtime: set "
                              "BGE_M3_EP=openvino (or unset BGE_M3_EP)", param="BGE_M3_MODEL")
        s = dataclasses.replace(s, execution_provider="openvino")
    if s.execution_provider == "openvino":
        return _openvino(s, model_explicit, machine)
    if s.execution_provider == "cpu" and not model_explicit and not ep_explicit:
        return _cpu_default(s, machine)
    return gpu.resolve(s, model_explicit=model_explicit)


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
    if s.variant != "bf16":
        if model_explicit:
            raise ConfigError(f"BGE_M3_EP=openvino runs the bf16 variant, not {s.variant}: set "
                              "BGE_M3_MODEL=bf16 (or unset it), or BGE_M3_EP=cpu for "
                              f"{s.variant} on ONNX Runtime", param="BGE_M3_MODEL")
        s = dataclasses.replace(s, variant="bf16")
    return s


def _cpu_default(s: Settings, machine: Machine) -> Settings:
    """Neither BGE_M3_EP nor BGE_M3_MODEL given: the fastest variant keeping cos ≥ 0.999."""
    if not machine.openvino():
        why = f"openvino is not installed ({ov_runtime.INSTALL_HINT})"
    elif not machine.native_bf16():
        why = "this CPU has no native bf16 (AVX512_BF16 / AMX)"
    elif "bf16" not in export_variants(s.model_path):
        why = ("the model has no bf16 variant (`bgeserve export` writes it when openvino is "
               "installed)")
    else:
        log.info("BGE_M3_EP and BGE_M3_MODEL not set: serving bf16 on OpenVINO (native bf16 on "
                 "this CPU; dense cosine vs fp32 >= 0.999)")
        return dataclasses.replace(s, execution_provider="openvino", variant="bf16")
    log.info("BGE_M3_EP and BGE_M3_MODEL not set: serving %s on ONNX Runtime (bf16 on OpenVINO "
             "not used: %s)", s.variant, why)
    return s
