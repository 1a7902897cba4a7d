"""TensorRT: the optimisation profile, the engine and timing caches on disk, the warm-up grid.

Plain values in, plain values out (tested without a GPU). TensorRT gets one explicit
optimisation profile (batch 1..max_chunk × seq 1..max_seq), so one engine per GPU type covers
every chunk the scheduler can form and is built when a session opens, instead of growing (and
rebuilding) shape by shape. Engines are fsynced once built: one left in the page cache is lost
when the container is killed right after.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("bgeserve.gpu")

ENGINE_DIR, TIMING_DIR = "trt-engines", "trt-timing"
WARMUP_BATCHES = (1, 2, 4, 8, 16, 32)
WARMUP_SEQS = (128, 512, 2048, 8192)
# Batch-major: the small batches most requests use are warm first.
DEFAULT_WARMUP_SHAPES = tuple((b, s) for b in WARMUP_BATCHES for s in WARMUP_SEQS)
PROFILE_INPUTS = ("input_ids", "attention_mask")
_SHAPE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


# -- profile and provider options -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrtProfile:
    """One TensorRT optimisation profile: (batch, seq) at its min, opt and max."""

    min: tuple[int, int]
    opt: tuple[int, int]
    max: tuple[int, int]


def trt_profile(max_batch: int, max_seq: int) -> TrtProfile:
    """Batch 1..``max_batch`` × seq 1..``max_seq``, tuned for 8 × 512 (or less, if capped)."""
    return TrtProfile((1, 1), (min(max_batch, 8), min(max_seq, 512)), (max_batch, max_seq))


def profile_shapes(shape: tuple[int, int], inputs: Sequence[str] = PROFILE_INPUTS) -> str:
    """ORT's profile syntax for one shape: ``input_ids:BxL,attention_mask:BxL``."""
    return ",".join(f"{name}:{shape[0]}x{shape[1]}" for name in inputs)


def engine_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / ENGINE_DIR


def timing_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / TIMING_DIR


def trt_options(cache_dir: Path, profile: TrtProfile,
                max_workspace_bytes: int | None = None) -> dict[str, str]:
    """TensorRT EP options: fp16, engine and timing caches under ``cache_dir``, the profile."""
    options = {
        "trt_fp16_enable": "True",
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(engine_dir(cache_dir)),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(timing_dir(cache_dir)),
        "trt_profile_min_shapes": profile_shapes(profile.min),
        "trt_profile_opt_shapes": profile_shapes(profile.opt),
        "trt_profile_max_shapes": profile_shapes(profile.max),
    }
    if max_workspace_bytes:
        options["trt_max_workspace_size"] = str(int(max_workspace_bytes))
    return options


# -- warm-up grid ----------------------------------------------------------------------------
def parse_warmup_shapes(raw: str, max_seq: int,
                        max_batch: int | None = None) -> list[tuple[int, int]]:
    """``BxL,BxL`` → shapes in order, deduplicated.

    ``BGE_M3_TRT_WARMUP_SHAPES`` is checked when the settings are read (config.py: a token
    that is no shape stops the start); here, for a value given in code, invalid tokens are
    skipped with a warning; an empty or all-invalid value gives the default grid; shapes
    longer than ``max_seq`` (or wider than ``max_batch``) are dropped with a warning, and if
    none is left, ``1×max_seq`` is used.
    """
    shapes: list[tuple[int, int]] = []
    for token in (t for t in raw.split(",") if t.strip()):
        match = _SHAPE.match(token)
        if match is None or 0 in (int(match[1]), int(match[2])):
            log.warning("BGE_M3_TRT_WARMUP_SHAPES: skipping %r (want BxL, e.g. 8x512)", token)
            continue
        shapes.append((int(match[1]), int(match[2])))
    if not shapes:
        if raw.strip():
            log.warning("BGE_M3_TRT_WARMUP_SHAPES=%r has no valid shape: using the default grid",
                        raw)
        shapes = list(DEFAULT_WARMUP_SHAPES)
    kept = [(b, s) for b, s in dict.fromkeys(shapes)
            if s <= max_seq and (max_batch is None or b <= max_batch)]
    dropped = [f"{b}x{s}" for b, s in dict.fromkeys(shapes) if (b, s) not in kept]
    if dropped:
        log.warning("warm-up shapes %s dropped: beyond BGE_M3_MAX_SEQ_LENGTH=%d%s",
                    ", ".join(dropped), max_seq,
                    f" or BGE_M3_MAX_CHUNK={max_batch}" if max_batch is not None else "")
    return kept or [(1, max_seq)]


def shard(shapes: Sequence[tuple[int, int]], worker: int, workers: int) -> list[tuple[int, int]]:
    """Worker ``worker``'s stride share of ``shapes``: index ``i`` with ``i % workers == worker``."""
    return [shape for i, shape in enumerate(shapes) if i % max(workers, 1) == worker]


# -- the engine cache on disk ----------------------------------------------------------------
def count_engines(folder: Path) -> int:
    """Serialized TensorRT engines (``*.engine``) in ``folder``."""
    try:
        return sum(1 for p in folder.iterdir() if p.suffix == ".engine" and p.is_file())
    except OSError:
        return 0


def announce_trt_cache(folder: Path) -> int:
    """Log whether ``folder`` already holds engines (operators check a volume is reused)."""
    found = count_engines(folder)
    if found:
        log.info("trt cache: found %d cached engines at %s", found, folder,
                 extra={"engine_count": found, "cache_path": str(folder)})
    else:
        log.info("trt cache: empty (will compile)", extra={"cache_path": str(folder)})
    return found


def fsync_tree(folder: Path) -> int:
    """fsync every regular file under ``folder``, then each folder; returns the files synced.

    An engine left in the page cache is lost when the container is killed (OOM, 137) right
    after building it; synced, the next start finds it.
    """
    synced = 0
    if not folder.is_dir():
        return 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            _fsync(path)
            synced += 1
        _fsync(root)
    return synced


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
