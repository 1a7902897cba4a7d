"""How much memory this process may use, and how much it uses now and at peak (Linux).

``detect_available_memory`` tries, in order: the operator's override, the cgroup v2
``memory.max`` of this process's cgroup (walking up), the cgroup v1 ``memory.limit_in_bytes``
(walking up), then ``/proc/meminfo`` MemAvailable. Each file format has a small pure parser that
takes text and returns a number or None; a malformed file is logged and skipped, never fatal.
Never imports onnxruntime.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from bgeserve.cgroup import parse_cgroup_v1_path, parse_cgroup_v2_path, usable_cpus, walk_up
from bgeserve.cgroup import read_text as _read
from bgeserve.errors import ConfigError
from bgeserve.malloc import trim_heap  # noqa: F401 - where the tuner's callers find it

logger = logging.getLogger("bgeserve.memory")

# cgroup v1 reports "no limit" as a huge number: LONG_MAX rounded down to the page size
# (9223372036854771712 on 4 KiB pages), and other values near 2**63 on other page sizes.
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class MemoryInfo:
    """Bytes this process may use and where that number came from.

    ``source`` is one of ``override``, ``cgroup_v2``, ``cgroup_v1``, ``meminfo``.
    """

    available_bytes: int
    source: str


def parse_memory_max(text: str) -> int | None:
    """Bytes from a cgroup v2 ``memory.max``; None for ``max`` (no limit) or garbage."""
    value = text.strip()
    if value == "max":
        return None
    return _positive_int(value, "memory.max")


def parse_limit_in_bytes(text: str) -> int | None:
    """Bytes from a cgroup v1 ``memory.limit_in_bytes``; None for the unlimited sentinel."""
    value = _positive_int(text.strip(), "memory.limit_in_bytes")
    if value is None or value >= _V1_UNLIMITED:
        return None
    return value


def parse_meminfo(text: str, key: str) -> int | None:
    """Bytes of ``key`` (e.g. ``MemAvailable``) from ``/proc/meminfo``-style ``Key: N kB`` text."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == key:
            fields = rest.split()
            if fields and fields[0].isdigit():
                scale = 1024 if fields[1:] == ["kB"] else 1
                return int(fields[0]) * scale
            logger.warning("ignoring malformed %s line %r", key, line)
            return None
    return None


def parse_statm_resident_pages(text: str) -> int | None:
    """Resident pages (second field) from ``/proc/self/statm``."""
    fields = text.split()
    if len(fields) >= 2 and fields[1].isdigit():
        return int(fields[1])
    return None


def _positive_int(value: str, what: str) -> int | None:
    if value.isdigit() and int(value) > 0:
        return int(value)
    logger.warning("ignoring malformed %s value %r", what, value)
    return None


def _parsed(filename: str, parse: Callable[[str], int | None], directory: Path) -> int | None:
    text = _read(directory / filename)
    return None if text is None else parse(text)


def detect_available_memory(
    override: int | None = None,
    *,
    proc: Path = Path("/proc"),
    sys_cgroup: Path = Path("/sys/fs/cgroup"),
) -> MemoryInfo:
    """Bytes this process may use: override, else cgroup v2, else cgroup v1, else MemAvailable.

    A cgroup limit is capped at the host's MemTotal (a limit above physical RAM is not memory);
    the override is taken as given.

    Raises:
        ConfigError: nothing could be read; set ``BGE_M3_AVAILABLE_MEMORY_BYTES``.
    """
    if override is not None:
        if override <= 0:
            raise ConfigError(
                f"BGE_M3_AVAILABLE_MEMORY_BYTES={override} must be > 0",
                param="BGE_M3_AVAILABLE_MEMORY_BYTES",
            )
        return MemoryInfo(override, "override")
    meminfo = _read(proc / "meminfo") or ""
    total = parse_meminfo(meminfo, "MemTotal")
    cgroups = _read(proc / "self" / "cgroup") or ""
    limits = (
        ("cgroup_v2", sys_cgroup, parse_cgroup_v2_path(cgroups), "memory.max", parse_memory_max),
        (
            "cgroup_v1",
            sys_cgroup / "memory",
            parse_cgroup_v1_path(cgroups) or "/",
            "memory.limit_in_bytes",
            parse_limit_in_bytes,
        ),
    )
    for source, root, path, filename, parse in limits:
        if path is None:
            continue
        # The first limit from the leaf up (the leaf's is the one that applies first).
        limit = next(walk_up(root, path, functools.partial(_parsed, filename, parse)), None)
        if limit is not None:
            return MemoryInfo(min(limit, total) if total else limit, source)
    available = parse_meminfo(meminfo, "MemAvailable")
    if available is None:
        raise ConfigError(
            f"cannot detect available memory (no cgroup limit under {sys_cgroup}, no "
            f"MemAvailable in {proc / 'meminfo'}); set BGE_M3_AVAILABLE_MEMORY_BYTES",
            param="BGE_M3_AVAILABLE_MEMORY_BYTES",
        )
    return MemoryInfo(available, "meminfo")


def rss_bytes(*, proc: Path = Path("/proc")) -> int:
    """Current resident set size of this process in bytes."""
    pages = parse_statm_resident_pages(_read(proc / "self" / "statm") or "")
    if pages is not None:
        # The real page size: 16 KiB / 64 KiB on some arm64 kernels, not always 4096.
        return pages * os.sysconf("SC_PAGE_SIZE")
    import psutil  # only off Linux or with /proc hidden

    return int(psutil.Process().memory_info().rss)


def reset_peak_rss(*, proc: Path = Path("/proc")) -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False when not possible."""
    try:
        # "5" resets the peak RSS counter (Linux >= 4.0); see proc(5), /proc/pid/clear_refs.
        (proc / "self" / "clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes(*, proc: Path = Path("/proc")) -> int:
    """Peak resident set size (VmHWM) of this process in bytes since start or the last reset."""
    peak = parse_meminfo(_read(proc / "self" / "status") or "", "VmHWM")
    if peak is not None:
        return peak
    # ru_maxrss (kB on Linux) is the same high-water mark, reachable without /proc; elsewhere it
    # is a lifetime peak, which over-reads but never under-reads.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(maxrss, rss_bytes(proc=proc))


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 128 << 10
# glibc's own mmap threshold in a long-running process (it rises to this after large frees):
# the serving process's allocator state, which chunk timing, and a probe run in the serving
# process, leave behind.
SERVING_MMAP_THRESHOLD = 32 << 20
# What the probe pins it at while it measures: blocks >= 1 MiB are mapped on allocation and
# returned to the OS on free, so each run's workspace is its own (service/probe_child.py).
PROBE_MMAP_THRESHOLD = 1 << 20


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make glibc serve every block ≥ ``threshold`` by mmap, returned to the OS on ``free``.

    By default glibc raises the threshold after each large free (up to 32 MiB) and keeps such
    blocks in per-thread heaps that ``malloc_trim`` cannot always release: RSS then stays at the
    high-water mark of every shape run so far, and a probe measuring one shape after another
    under-reads. Pinned, a chunk's workspace is allocated when it runs and gone when it ends,
    which is what the cost model budgets. False where this is not glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


_M_ARENA_MAX = -8  # glibc mallopt parameter


def limit_malloc_arenas(environ: Mapping[str, str], cpus: int | None = None) -> int | None:
    """Cap glibc's malloc arenas at ``cpus`` (default: the CPUs this process may use; at least
    2) for a long-running process (``serve``, ``bulk``), unless the environment sets
    ``MALLOC_ARENA_MAX`` itself, or ``GLIBC_TUNABLES``' ``glibc.malloc.arena_max`` (glibc has
    applied that already); the cap set, or None (set by the environment, or not glibc).

    glibc's default is 8 arenas per core, each a heap that keeps what its threads freed: in a
    14-minute mixed soak the server's RSS grew 5-9 MiB/min while Python's own allocations stayed
    flat, 1.8-2.0 MiB/min with 2 arenas on that 2-core machine (docs/reliability.md §9). One
    arena per core still leaves the threads that run at once their own; its cost in
    throughput was within the noise (paired medians 0.98-1.03 on the tiny model, where
    allocation weighs most; 1.01 full-size). Called before the threads that allocate start:
    arenas made earlier stay, and once more than 8 exist glibc has fixed its limit (a cap set
    later does nothing).
    """
    if environ.get("MALLOC_ARENA_MAX") or "glibc.malloc.arena_max" in environ.get(
            "GLIBC_TUNABLES", ""):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    arenas = max(2, usable_cpus().count if cpus is None else cpus)
    if mallopt(_M_ARENA_MAX, arenas) != 1:
        return None
    logger.debug("malloc arenas capped at %d (MALLOC_ARENA_MAX sets another cap)", arenas)
    return arenas


