"""Which runtime and variant serve: the settings plus this machine → a concrete EP and variant.

- ``BGE_M3_EP=openvino`` runs the ``bf16`` variant (an OpenVINO IR made by ``bgeserve export``)
  on the native OpenVINO runtime; ``BGE_M3_MODEL=bf16`` alone implies it.
- With neither ``BGE_M3_EP`` nor ``BGE_M3_MODEL`` set, the CPU default is the fastest variant
  that keeps dense cosine ≥ 0.999 against fp32 on this machine, among those the export holds
  (measured in docs/benchmarks.md):

  1. ``bf16`` on OpenVINO where the CPU has AMX (bf16 matrix tiles: fastest there);
  2. ``int8`` on ONNX Runtime when ``bgeserve export`` measured its dense cosine vs fp32 at
     ≥ 0.999 (the manifest's ``agreement``; SmoothQuant made that reachable);
  3. ``bf16`` on OpenVINO where the CPU has native bf16 without AMX (AVX512_BF16);
  4. exact ``fp32`` on ONNX Runtime.

  A hub download has only fp32 among these (its int8 is not validated), so it serves fp32.
- GPU EPs are then checked by ``runtime.gpu.resolve`` (fp16 default, GPUs counted).

Idempotent: resolving resolved settings changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bgeserve.config import Settings
from bgeserve.engine.forward import CHUNK_TOKENS, DEFAULT_CHUNK_TOKENS, PAD_MULTIPLE
from bgeserve.errors import ConfigError
from bgeserve.model.artifacts import export_variants
from bgeserve.runtime import gpu
from bgeserve.runtime import openvino as ov_runtime

log = logging.getLogger("bgeserve.backend")


def chunk_tokens(settings: Settings) -> int:
    """BGE_M3_MAX_CHUNK_TOKENS, else the measured best for the settings' backend."""
    if settings.max_chunk_tokens is not None:
        return settings.max_chunk_tokens
    return CHUNK_TOKENS.get(settings.execution_provider, DEFAULT_CHUNK_TOKENS)


def pad_multiple(settings: Settings) -> int:
    """BGE_M3_PAD_MULTIPLE, else the backend's default (rounding pays on GPUs only)."""
    if settings.pad_multiple is not None:
        return settings.pad_multiple
    return PAD_MULTIPLE.get(settings.execution_provider, 1)


MIN_DENSE_COS = 0.999  # the bar a variant must keep to be chosen without being asked for


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU has AMX bf16 tiles (Sapphire Rapids and later)."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class Machine:
    """What this machine offers (a seam: tests pass their own)."""

    openvino: Callable[[], bool] = ov_runtime.available
    native_bf16: Callable[[], bool] = ov_runtime.native_bf16
    amx: Callable[[], bool] = cpu_has_amx


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


def _validated(entry: dict[str, Any]) -> float | None:
    """The dense cosine vs fp32 that ``bgeserve export`` measured for a variant, if any."""
    agreement = entry.get("agreement")
    value = agreement.get("dense_cos_min") if isinstance(agreement, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def _cpu_default(s: Settings, machine: Machine) -> Settings:
    """Neither BGE_M3_EP nor BGE_M3_MODEL given: the fastest variant keeping cos ≥ 0.999."""
    variants = export_variants(s.model_path)
    notes = []
    bf16 = False
    if "bf16" not in variants:
        notes.append("bf16: not in the model (`bgeserve export` writes it when openvino is "
                     "installed)")
    elif not machine.openvino():
        notes.append(f"bf16: openvino is not installed ({ov_runtime.INSTALL_HINT})")
    elif not machine.native_bf16():
        notes.append("bf16: this CPU has no native bf16 (AVX512_BF16 / AMX)")
    else:
        bf16 = True
    int8_cos = _validated(variants["int8"]) if "int8" in variants else None
    int8 = int8_cos is not None and int8_cos >= MIN_DENSE_COS
    if "int8" not in variants:
        notes.append("int8: not in the model")
    elif int8_cos is None:
        notes.append("int8: the export did not measure its agreement with fp32")
    elif not int8:
        notes.append(f"int8: dense cosine vs fp32 {int8_cos:.4f} < {MIN_DENSE_COS}")
    if bf16 and machine.amx():
        return _choose(s, "openvino", "bf16", "AMX bf16 on OpenVINO is the fastest path")
    if int8:
        return _choose(s, "cpu", "int8", f"the export measured dense cosine {int8_cos:.4f} vs "
                                         "fp32")
    if bf16:
        return _choose(s, "openvino", "bf16", "native bf16 on this CPU")
    log.info("BGE_M3_EP and BGE_M3_MODEL not set: serving exact %s on ONNX Runtime (%s)",
             s.variant, "; ".join(notes))
    return s


def _choose(s: Settings, ep: str, variant: str, why: str) -> Settings:
    log.info("BGE_M3_EP and BGE_M3_MODEL not set: serving %s on %s (%s; dense cosine vs fp32 "
             ">= %s)", variant, "OpenVINO" if ep == "openvino" else "ONNX Runtime", why,
             MIN_DENSE_COS)
    return dataclasses.replace(s, execution_provider=ep, variant=variant)
