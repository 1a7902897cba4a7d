"""This process's cgroup (Linux): where its limits live, and how many CPUs it may keep busy.

A leaf: the settings (threads per worker), the runtimes (a session's default threads, spinning),
the tuning layer (memory limits, malloc arenas), the service (tokenizing slots) and the Ray
embedder (an actor's memory share) read it. Each file format has a small pure parser that takes
text and returns a value or None; a missing or malformed file means "no limit here", never an
error.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def parse_cgroup_v2_path(text: str) -> str | None:
    """The unified-hierarchy path from ``/proc/self/cgroup`` (the ``0::/path`` line), or None."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip()
    return None


def parse_cgroup_v1_path(text: str, controller: str = "memory") -> str | None:
    """The path of ``controller``'s hierarchy from ``/proc/self/cgroup`` (``N:a,b:/path``)."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and controller in parts[1].split(","):
            return parts[2].strip()
    return None


def parse_cpu_max(text: str) -> float | None:
    """CPUs from a cgroup v2 ``cpu.max`` (``quota period`` in µs); None for ``max`` or garbage."""
    fields = text.split()
    if len(fields) != 2 or not fields[0].isdigit() or not fields[1].isdigit():
        return None  # "max 100000": no quota
    return _ratio(int(fields[0]), int(fields[1]))


def parse_cfs_quota(quota: str, period: str) -> float | None:
    """CPUs from cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None for ``-1``."""
    quota, period = quota.strip(), period.strip()
    if not quota.isdigit() or not period.isdigit():
        return None  # -1: no quota
    return _ratio(int(quota), int(period))


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def walk_up(root: Path, cgroup_path: str, read: Callable[[Path], T | None]) -> Iterator[T]:
    """``read(dir)``'s values from ``root/cgroup_path`` up to ``root`` itself, leaf first."""
    # Drop "..": a path from /proc must never lead outside the cgroup mount.
    parts = [p for p in cgroup_path.split("/") if p and p != ".."]
    # Without a private cgroup namespace (e.g. ECS on Bottlerocket) the leaf may read "max"
    # while a parent carries the real limit, hence the walk.
    for depth in range(len(parts), -1, -1):
        value = read(root.joinpath(*parts[:depth]))
        if value is not None:
            yield value


@dataclass(frozen=True)
class Cpus:
    """CPUs this process may keep busy: ``count`` (at least 1), from ``affinity`` (the CPUs it
    may run on) and ``quota`` (the cgroup's CPU bandwidth in CPUs, None without one)."""

    count: int
    affinity: int
    quota: float | None

    def __str__(self) -> str:
        cpus = f"{self.count} CPU{'s' if self.count != 1 else ''}"
        if self.quota is None:
            return f"{cpus} (affinity)"
        return f"{cpus} (affinity {self.affinity}, cgroup CPU quota {self.quota:g})"


def detect_cpus(*, proc: Path = Path("/proc"), sys_cgroup: Path = Path("/sys/fs/cgroup"),
                affinity: int | None = None) -> Cpus:
    """The CPUs this process may use: its affinity, narrowed by the cgroup's CPU quota.

    A container limited with ``--cpus 2`` (a CFS quota) on a 64-core host still sees 64 CPUs in
    ``os.cpu_count()`` and its affinity; 64 compute threads there share two CPUs' time, and
    every parallel kernel waits on threads the scheduler has throttled. The quota is the
    smallest along the hierarchy (each level's applies), rounded up: the cgroup's threads are
    throttled together once its quota is spent, so a fraction of a CPU is work one thread more
    still gets (int8 bge-m3 under a 1.5-CPU quota: 2 threads 1.32x faster than 1), while whole
    threads past the quota only add waiting (1 CPU: 1 thread 1.09x faster than 2;
    docs/benchmarks.md).
    """
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    cgroups = read_text(proc / "self" / "cgroup") or ""
    quotas: list[float] = []
    if (v2 := parse_cgroup_v2_path(cgroups)) is not None:
        quotas += walk_up(sys_cgroup, v2, lambda d: parse_cpu_max(read_text(d / "cpu.max") or ""))
    v1 = parse_cgroup_v1_path(cgroups, "cpu")
    if not quotas and v1 is not None:
        root = next((sys_cgroup / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")
                     if (sys_cgroup / name).is_dir()), sys_cgroup / "cpu")
        quotas += walk_up(root, v1, lambda d: parse_cfs_quota(
            read_text(d / "cpu.cfs_quota_us") or "", read_text(d / "cpu.cfs_period_us") or ""))
    quota = min(quotas) if quotas else None
    count = max(1, affinity if quota is None else min(affinity, math.ceil(quota)))
    return Cpus(count, affinity, quota)


@functools.cache
def usable_cpus() -> Cpus:
    """``detect_cpus()`` once per process: the threads it sizes are made once too."""
    return detect_cpus()
