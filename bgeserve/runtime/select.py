"""Which runtime and variant serve by default on this machine: pure rules over plain facts.

With neither ``BGE_M3_EP`` nor ``BGE_M3_MODEL`` set, the CPU default is the fastest variant that
keeps dense cosine ≥ ``MIN_DENSE_COS`` against fp32 on this machine, among those the model
holds. This module is the rule (the prior, from docs/benchmarks.md); the service may replace
it by timing the candidates (``service.plan``):

1. ``bf16`` on OpenVINO where the CPU has AMX (bf16 matrix tiles: fastest there);
2. ``int8`` on ONNX Runtime when ``bgeserve export`` measured its dense cosine vs fp32 at
   ≥ 0.999 (the manifest's ``agreement``; SmoothQuant made that reachable) and this CPU
   computes it as measured (signed 8-bit weights, made on a VNNI / AMX CPU, saturate on one
   without: ``runs_right``);
3. ``bf16`` on OpenVINO where the CPU has native bf16 without AMX (AVX512_BF16);
4. exact ``fp32`` on ONNX Runtime.

A hub download has only fp32 among these (its int8 is not validated), so it serves fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bgeserve.model.prepared import sums_int8_in_int32
from bgeserve.runtime import openvino as ov_runtime

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
    int8_dot: Callable[[], bool] = sums_int8_in_int32


THIS_MACHINE = Machine()


@dataclasses.dataclass(frozen=True)
class Choice:
    """A default the rule picked: the provider and variant, why, and what was ruled out."""

    provider: str
    variant: str
    why: str
    notes: tuple[str, ...] = ()


def validated_cos(entry: Mapping[str, Any]) -> float | None:
    """The dense cosine vs fp32 that ``bgeserve export`` measured for a variant, if any."""
    agreement = entry.get("agreement")
    value = agreement.get("dense_cos_min") if isinstance(agreement, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


SATURATING_WEIGHTS = ("s8", "8-bit")  # int8's and ov-int8's signed 8-bit weight encodings


def runs_right(entry: Mapping[str, Any], machine: Machine) -> bool:
    """Whether ``machine`` computes the variant of ``entry`` as its export measured it: int8
    weights that are signed 8-bit (``export.steps.INT8_WEIGHTS``' s8, ``export.ovint8.WEIGHTS``'
    8-bit) are right only on CPUs that sum int8 products in int32
    (``model.prepared.sums_int8_in_int32``); elsewhere the kernels saturate them."""
    quantization = entry.get("quantization")
    signed8 = isinstance(quantization, dict) and quantization.get("weights") in SATURATING_WEIGHTS
    return not signed8 or machine.int8_dot()


SATURATES = ("signed 8-bit int8 weights need VNNI or AMX-INT8, which this CPU lacks (its int8 "
             "kernels would saturate them)")


def meets_bar(variant: str, entry: Mapping[str, Any]) -> bool:
    """fp32 is exact; any other variant must have been measured at ≥ ``MIN_DENSE_COS``."""
    if variant == "fp32":
        return True
    cos = validated_cos(entry)
    return cos is not None and cos >= MIN_DENSE_COS


def cpu_default(variants: Mapping[str, Mapping[str, Any]], machine: Machine) -> Choice:
    """The rule's choice among the ``variants`` a local export holds (``{}`` for others)."""
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
    int8_cos = validated_cos(variants["int8"]) if "int8" in variants else None
    int8 = int8_cos is not None and int8_cos >= MIN_DENSE_COS
    if "int8" not in variants:
        notes.append("int8: not in the model")
    elif not runs_right(variants["int8"], machine):
        int8 = False
        notes.append(f"int8: {SATURATES}")
    elif int8_cos is None:
        notes.append("int8: the export did not measure its agreement with fp32")
    elif not int8:
        notes.append(f"int8: dense cosine vs fp32 {int8_cos:.4f} < {MIN_DENSE_COS}")
    if bf16 and machine.amx():
        return Choice("openvino", "bf16", "AMX bf16 on OpenVINO is the fastest path",
                      tuple(notes))
    if int8:
        return Choice("cpu", "int8", f"the export measured dense cosine {int8_cos:.4f} vs fp32",
                      tuple(notes))
    if bf16:
        return Choice("openvino", "bf16", "native bf16 on this CPU", tuple(notes))
    return Choice("cpu", "fp32", "exact", tuple(notes))


# -- the measured default: which variants are timed, and which one wins ------------------------
GPU_VARIANTS = ("fp16",)  # exported for GPUs: ONNX Runtime's CPU EP runs fp16 through casts
PRIOR_MARGIN = 0.05  # the rule's pick stays unless another candidate ran this much faster


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A variant the measured default may choose, and the execution provider it runs on."""

    variant: str
    provider: str  # "cpu" (ONNX Runtime) or "openvino"


def cpu_candidates(variants: Mapping[str, Mapping[str, Any]],
                   machine: Machine) -> tuple[list[Candidate], dict[str, str]]:
    """The variants of an export that the measured CPU default times, and why each other one
    is not a candidate.

    A candidate meets the agreement bar (``meets_bar``) and runs on a CPU runtime this machine
    has: the manifest entry's ``runtime`` (``onnxruntime`` when absent) says which, so a
    variant added to the export (an OpenVINO int8, say) is timed without a change here.
    """
    out: list[Candidate] = []
    left_out: dict[str, str] = {}
    for name, entry in variants.items():
        runtime = entry.get("runtime", "onnxruntime")
        if not meets_bar(name, entry):
            cos = validated_cos(entry)
            left_out[name] = ("the export did not measure its agreement with fp32" if cos is None
                              else f"dense cosine vs fp32 {cos:.4f} < {MIN_DENSE_COS}")
        elif runtime == "openvino" and not machine.openvino():
            left_out[name] = f"openvino is not installed ({ov_runtime.INSTALL_HINT})"
        elif not runs_right(entry, machine):
            left_out[name] = SATURATES
        elif runtime == "onnxruntime" and name in GPU_VARIANTS:
            left_out[name] = "a GPU variant"
        elif runtime not in ("onnxruntime", "openvino"):
            left_out[name] = f"runtime {runtime!r} is not one bgeserve runs"
        else:
            out.append(Candidate(name, "openvino" if runtime == "openvino" else "cpu"))
    return out, left_out


def pick(rates: Mapping[str, float], prior: str | None, margin: float = PRIOR_MARGIN) -> str:
    """The fastest of ``rates`` (variant → tokens/s), unless ``prior`` (the rule's pick) ran
    within ``margin`` of it: timing noise must not move the choice off the rule."""
    if not rates:
        raise ValueError("no candidate was timed (this is a bug in the caller)")
    best = max(rates, key=lambda v: rates[v])
    if prior is not None and prior in rates and rates[prior] * (1 + margin) >= rates[best]:
        return prior
    return best
