"""What a preparation makes, and whether this machine has room to make it now.

Kept apart from the making (preparation.py, recipe.py) so the decisions can be read and tested
without a snapshot or a child: which variants a start wants on this CPU, what each step's peak
memory and disk cost against the fp32 weights' size W, and which variants to leave out (with a
reason the manifest and ``/health`` carry) when a step would not fit. ``Skip`` is raised when
not even fp32 fits, so the start serves the snapshot as it is.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bgeserve.config import Settings
from bgeserve.model.artifacts import export_variants
from bgeserve.model.prepared import PrepareSource, sums_int8_in_int32
from bgeserve.runtime import openvino

GiB = 1 << 30
MiB = 1 << 20
# Peak memory of each step: a factor of the fp32 weights' size W plus the runtimes' own
# floor. Measured: full-size bge-m3 (W = 2.27 GB; docs/benchmarks.md) int8 ~7.5 GiB (holds the
# weights twice while quantizing), NNCF's ov-int8 7,068 MiB (the model, its statistics-
# collecting copies and the int8 IR being written), the OpenVINO conversion about 2.5 W;
# the tiny model (W = 1.5 MB) 340 MiB for the whole container at its largest step, all of it
# the runtimes (ONNX Runtime, OpenVINO, NNCF's scipy). A floor of 1 GiB refused to prepare
# the tiny model in a 1 GiB container, whose stock graph then could not hold one 8,192-token
# text; the factors keep the full-size estimates where they were (int8 above its 7.5 GiB).
PEAK = {"int8": (3.35, 512 * MiB), "bf16": (2.75, 512 * MiB), "ov-int8": (3.25, 512 * MiB),
        "fp32": (1.75, 512 * MiB)}


# Disk each variant takes against W (full-size: fp32 a copy of the weights, int8 1.37 GB,
# the bf16 IR 1.14 GB, the ov-int8 IR 0.58 GB for W = 2.27 GB).
DISK = {"fp32": 1.02, "int8": 0.62, "bf16": 0.52, "ov-int8": 0.26}
# Disk a step needs for a while besides what it leaves: int8's writes the smoothed fp32 graph
# (a copy of the weights) and the quantized graph into a temporary directory beside its output
# before saving that in place (export/steps.py export_int8). The tiny model's preparation
# peaked at 4.2 W for 2.1 W left, as these predict (int8 there is ~W: its embeddings stay fp32).
SCRATCH = {"int8": 1.0 + DISK["int8"]}


def size(n: float) -> str:
    """``n`` bytes in a unit that shows it: MiB below 1 GiB, else GiB."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def peak_bytes(step: str, weights: int) -> int:
    """The memory ``step`` is expected to need for fp32 weights of ``weights`` bytes."""
    factor, extra = PEAK[step]
    return int(factor * weights + extra)


class Skip(Exception):
    """Preparing is not attempted (the reason is the message)."""


def not_needed(s: Settings) -> str | None:
    """Why this start serves without preparing, or None if it prepares."""
    if not s.prepare:
        return "BGE_M3_PREPARE=0"
    if s.execution_provider not in ("cpu", "openvino"):
        return f"BGE_M3_EP={s.execution_provider} serves the hub's fp16 graph"
    if s.variant == "fp16":
        return "BGE_M3_MODEL=fp16 is the hub's own graph"
    if is_export(s):
        return "BGE_M3_MODEL_PATH is a `bgeserve export` already"
    return None


def is_export(s: Settings) -> bool:
    """Whether ``s`` serves a `bgeserve export` (nothing to prepare) rather than a snapshot."""
    return s.model_path is not None and bool(export_variants(s.model_path))


def wanted(s: Settings) -> list[str]:
    """With BGE_M3_MODEL given, fp32 (the reference the others are made from and checked
    against) and that variant: nothing else is served (QA: `BGE_M3_MODEL=fp32` on a
    snapshot's first start still quantized int8, bf16 and ov-int8, minutes and ~7.5 GiB of
    peak on the full-size model; a later start that chooses adds what it lacks, keeping
    these). Else fp32 and int8 always; bf16 where OpenVINO is installed and this CPU
    computes in bf16 (or BGE_M3_EP=openvino asks for it); ov-int8 where NNCF is installed too
    and this CPU sums int8 products in int32 (VNNI, AMX-INT8: where OpenVINO's int8 is fast
    and its 8-bit weights compute right). Elsewhere it would cost minutes of quantizing for a
    graph that is slower than ONNX Runtime's int8 and under the bar (7-bit weights, dense
    cosine 0.9973 on full-size random bge-m3, docs/benchmarks.md)."""
    if s.is_explicit("BGE_M3_MODEL"):
        # Only what preparing makes (not fp16, the hub's GPU graph), and only where it can
        # be made here: one it cannot (ov-int8 without NNCF) is said so and not recorded as
        # failed, so a later start makes it once it can (review).
        makeable = {"int8": True, "bf16": openvino.available(), "ov-int8": nncf()}
        return ["fp32", s.variant] if makeable.get(s.variant, False) else ["fp32"]
    wanted = ["fp32", "int8"]
    # BGE_M3_EP=openvino asks for OpenVINO's variant: bf16, unless ov-int8 is the one named.
    asked = s.variant == "bf16" or (s.execution_provider == "openvino" and s.variant != "ov-int8")
    if openvino.available() and (asked or openvino.native_bf16()):
        wanted.append("bf16")
    if nncf() and (s.variant == "ov-int8" or sums_int8_in_int32()):
        wanted.append("ov-int8")
    return wanted


def nncf() -> bool:
    """Whether ov-int8 can be made here: OpenVINO and NNCF installed (looked up, not imported:
    the prepare child imports NNCF, the server never does)."""
    return openvino.available() and importlib.util.find_spec("nncf") is not None


def limits(weights: int, available: int, root: Path, variants: list[str], *,
            copied: int = 0) -> dict[str, str]:
    """The variants of ``variants`` (never fp32) this machine has no room to make now, with
    why: memory for their step, then disk for their files (``disk_skips``). Skip when not
    even fp32 fits."""
    skip = {v: f"needs ~{size(peak_bytes(v, weights))}, {size(available)} available"
            for v in variants if v != "fp32" and available < peak_bytes(v, weights)}
    skip.update(disk_skips(root, weights, [v for v in variants if v not in skip],
                            copied=copied))
    return skip


def copied(source: PrepareSource, root: Path) -> int:
    """Bytes of the snapshot's weights the graphs step copies besides fp32's: its plain graph
    (the reference) hard-links them, which fails from another file system."""
    try:
        same = source.graph.resolve().stat().st_dev == root.stat().st_dev
    except OSError:
        same = False
    return 0 if same else source.weight_bytes


def disk_skips(root: Path, weights: int, wanted: list[str], *,
                copied: int = 0) -> dict[str, str]:
    """Variants left out because the cache's file system cannot hold them while they are made
    (ov-int8, bf16, then int8): the files left (``DISK``), the weights ``copied`` for the plain
    graph and the largest step's scratch (``SCRATCH``). Skip when not even fp32 fits."""
    free = shutil.disk_usage(root).free
    need = {v: int(DISK[v] * weights) for v in ("fp32", *wanted)}

    def peak() -> int:
        return copied + sum(need.values()) + max(int(SCRATCH.get(v, 0) * weights)
                                                 for v in need)

    if free < copied + need["fp32"]:
        raise Skip(f"preparing needs ~{size(copied + need['fp32'])} on BGE_M3_CACHE_DIR "
                    f"({root}) for fp32 alone, {size(free)} are free")
    skips: dict[str, str] = {}
    for variant in ("ov-int8", "bf16", "int8"):
        if variant in need and peak() > free:
            skips[variant] = (f"needs ~{size(peak())} of disk in BGE_M3_CACHE_DIR with the "
                              f"others while it is made, {size(free)} free")
            need.pop(variant)
    return skips


# A step the kernel killed (SIGKILL: out of memory, its real peak past PEAK's estimate) is
# tried again only by a start with this much more memory than the one it was killed in: the
# estimate had passed there, and every start would otherwise spend the step's minutes being
# killed again. Recorded beside the export (KILLED_FILE: variant -> bytes available then).
KILLED_FILE = "killed.json"
KILLED_RETRY_MARGIN = 1.25


def killed(skipped: dict[str, str]) -> list[str]:
    """The variants whose step the kernel killed (most likely out of memory)."""
    return [v for v, why in skipped.items() if "SIGKILL" in why]


def kept_out(killed_at: dict[str, int], available: int) -> dict[str, str]:
    """The variants killed before that this start, with ``available`` bytes, does not try
    again, with the reason (not enough more memory than they were killed with)."""
    return {v: f"killed (out of memory) with {size(at)} available; tried again with more than "
               f"{size(at * KILLED_RETRY_MARGIN)}"
            for v, at in killed_at.items() if available <= at * KILLED_RETRY_MARGIN}


def refit(manifest: dict[str, Any], new: list[str],
          limits: Callable[[], dict[str, str]],
          killed_at: dict[str, int] | None = None, available: int = 0) -> list[str]:
    """The variants of ``new`` (those ``manifest``'s export lacks) an earlier preparation left
    out for want of memory or disk (``prepared.limited``), or whose step was killed for it
    (``killed_at``: retried with ``KILLED_RETRY_MARGIN`` times the memory it had), that
    ``limits`` (this machine's limits for all of ``new``, as the preparation weighs them)
    finds room for now. A variant whose own step failed otherwise is not retried: that takes
    ``bgeserve prepare --force``."""
    killed_at = killed_at or {}
    held = kept_out(killed_at, available)
    wants = set((manifest.get("prepared") or {}).get("limited") or []) | set(killed_at)
    limited = [v for v in new if v in wants and v not in held]
    if not limited:
        return []
    try:
        still = limits()
    except Skip:
        return []
    return [v for v in limited if v not in still]


def covers(manifest: dict[str, Any], wanted: list[str]) -> bool:
    """Whether an export made every variant of ``wanted`` (or recorded why it could not)."""
    made = manifest.get("variants") or {}
    prepared = manifest.get("prepared") or {}
    skipped = prepared.get("skipped") or {}
    return all(v in made or v in skipped for v in wanted)
