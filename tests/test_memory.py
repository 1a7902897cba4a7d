"""Tests for bgeserve.memory: the file parsers, detection order on fake trees, RSS and peak."""

from __future__ import annotations

import logging
import os
import platform
import sys
from pathlib import Path

import numpy as np
import pytest

from bgeserve.errors import ConfigError
from bgeserve.tuning import memory
from bgeserve.tuning.budget import worker_budget
from bgeserve.tuning.memory import (
    MemoryInfo,
    detect_available_memory,
    parse_cgroup_v1_path,
    parse_cgroup_v2_path,
    parse_limit_in_bytes,
    parse_meminfo,
    parse_memory_max,
    parse_statm_resident_pages,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)

GiB = 1 << 30
MEMINFO = "MemTotal:       16000000 kB\nMemFree:  1000 kB\nMemAvailable:   12000000 kB\n"
HYBRID_CGROUP = "9:name=systemd:/\n4:memory:/pod/ctr\n1:cpu,cpuacct:/\n0::/pod/ctr\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def tree(tmp_path):
    """A fake /proc (meminfo 16 GB total, 12 GB available) and an empty /sys/fs/cgroup."""
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "meminfo", MEMINFO)
    cg.mkdir()
    return proc, cg


def detect(tree, override=None):
    proc, cg = tree
    return detect_available_memory(override, proc=proc, sys_cgroup=cg)


# --- parsers -------------------------------------------------------------------------------


def test_parse_cgroup_v2_path():
    """The 0:: line gives the unified path; none means no cgroup v2."""
    assert parse_cgroup_v2_path("0::/system.slice/x.service\n") == "/system.slice/x.service"
    assert parse_cgroup_v2_path(HYBRID_CGROUP) == "/pod/ctr"
    assert parse_cgroup_v2_path("4:memory:/a\n") is None


def test_parse_cgroup_v1_path():
    """The line whose controller list includes memory gives the v1 path."""
    assert parse_cgroup_v1_path(HYBRID_CGROUP) == "/pod/ctr"
    assert parse_cgroup_v1_path("3:cpu,memory:/x\n") == "/x"
    assert parse_cgroup_v1_path("0::/only-v2\ngarbage\n") is None


@pytest.mark.parametrize(
    "text,expected",
    [
        ("8589934592\n", 8589934592),
        ("max\n", None),
        ("", None),
        ("-1", None),
        ("12k", None),
        ("0", None),
    ],
)
def test_parse_memory_max(text, expected):
    """Numbers are bytes; "max" means no limit; garbage is ignored."""
    assert parse_memory_max(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4294967296\n", 4294967296),
        ("9223372036854771712\n", None),
        (str(2**60), None),
        ("9223372036854710272", None),
        ("junk", None),
    ],
)
def test_parse_limit_in_bytes(text, expected):
    """v1 limits are bytes; the page-rounded LONG_MAX "unlimited" sentinels mean no limit."""
    assert parse_limit_in_bytes(text) == expected


def test_parse_meminfo():
    """kB values become bytes; a missing key is None; a unitless field is taken as is."""
    assert parse_meminfo(MEMINFO, "MemAvailable") == 12000000 * 1024
    assert parse_meminfo(MEMINFO, "MemTotal") == 16000000 * 1024
    assert parse_meminfo(MEMINFO, "SwapTotal") is None
    assert parse_meminfo("HugePages_Total:       0\n", "HugePages_Total") == 0
    assert parse_meminfo("VmHWM:\t    1940 kB\n", "VmHWM") == 1940 * 1024


def test_parse_meminfo_malformed_line_is_logged(caplog):
    """A key with a non-numeric value is ignored with a warning."""
    with caplog.at_level(logging.WARNING, "bgeserve.memory"):
        assert parse_meminfo("MemAvailable: lots kB\n", "MemAvailable") is None
    assert "malformed MemAvailable" in caplog.text


def test_parse_statm_resident_pages():
    """The second field of statm is resident pages."""
    assert parse_statm_resident_pages("1000 250 30 1 0 60 0\n") == 250
    assert parse_statm_resident_pages("") is None
    assert parse_statm_resident_pages("1000 x") is None


# --- detection order -----------------------------------------------------------------------


def test_override_wins(tree):
    """An override is reported as given, even above MemTotal, with source "override"."""
    write(tree[0] / "self" / "cgroup", "0::/\n")
    write(tree[1] / "memory.max", "1073741824\n")
    assert detect(tree, override=64 * GiB) == MemoryInfo(64 * GiB, "override")


def test_non_positive_override_names_the_knob(tree):
    """A zero override is a configuration error naming BGE_M3_AVAILABLE_MEMORY_BYTES."""
    with pytest.raises(ConfigError, match="BGE_M3_AVAILABLE_MEMORY_BYTES"):
        detect(tree, override=0)


def test_cgroup_v2_leaf_limit(tree):
    """The process's own cgroup memory.max is used."""
    write(tree[0] / "self" / "cgroup", "0::/pod/ctr\n")
    write(tree[1] / "pod" / "ctr" / "memory.max", "4294967296\n")
    write(tree[1] / "pod" / "memory.max", "8589934592\n")
    assert detect(tree) == MemoryInfo(4 * GiB, "cgroup_v2")


def test_cgroup_v2_walks_up_to_a_parent_limit(tree):
    """A leaf reading "max" defers to the nearest ancestor with a number."""
    write(tree[0] / "self" / "cgroup", "0::/pod/ctr\n")
    write(tree[1] / "pod" / "ctr" / "memory.max", "max\n")
    write(tree[1] / "pod" / "memory.max", "2147483648\n")
    write(tree[1] / "memory.max", "8589934592\n")
    assert detect(tree) == MemoryInfo(2 * GiB, "cgroup_v2")


def test_cgroup_v2_namespaced_root(tree):
    """With a private cgroup namespace the path is "/" and the mount root holds the limit."""
    write(tree[0] / "self" / "cgroup", "0::/\n")
    write(tree[1] / "memory.max", "3221225472\n")
    assert detect(tree) == MemoryInfo(3 * GiB, "cgroup_v2")


def test_cgroup_v2_all_max_falls_back_to_meminfo(tree):
    """No numeric memory.max anywhere up the path means MemAvailable."""
    write(tree[0] / "self" / "cgroup", "0::/pod/ctr\n")
    write(tree[1] / "pod" / "ctr" / "memory.max", "max\n")
    write(tree[1] / "memory.max", "max\n")
    assert detect(tree) == MemoryInfo(12000000 * 1024, "meminfo")


def test_cgroup_path_cannot_escape_the_mount(tree, tmp_path):
    """ ".." in the /proc path is dropped, so a file outside the cgroup mount is never read."""
    write(tree[0] / "self" / "cgroup", "0::/../outside\n")
    write(tmp_path / "outside" / "memory.max", "1073741824\n")
    assert detect(tree).source == "meminfo"


def test_cgroup_limit_is_capped_at_mem_total(tree):
    """A limit above physical RAM reports MemTotal instead."""
    write(tree[0] / "self" / "cgroup", "0::/\n")
    write(tree[1] / "memory.max", str(1 << 40))
    assert detect(tree) == MemoryInfo(16000000 * 1024, "cgroup_v2")


def test_cgroup_limit_without_meminfo_is_uncapped(tree):
    """Without /proc/meminfo the cgroup limit is reported as is."""
    (tree[0] / "meminfo").unlink()
    write(tree[0] / "self" / "cgroup", "0::/\n")
    write(tree[1] / "memory.max", "1073741824\n")
    assert detect(tree) == MemoryInfo(GiB, "cgroup_v2")


def test_cgroup_v1_limit(tree):
    """On a v1 host, the memory controller's limit_in_bytes is used."""
    write(tree[0] / "self" / "cgroup", "4:memory:/\n")
    write(tree[1] / "memory" / "memory.limit_in_bytes", "1073741824\n")
    assert detect(tree) == MemoryInfo(GiB, "cgroup_v1")


def test_cgroup_v1_walks_the_hybrid_path(tree):
    """Hybrid hosts: v2 has no memory.max, the v1 limit sits at the process's v1 path."""
    write(tree[0] / "self" / "cgroup", HYBRID_CGROUP)
    write(tree[1] / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(tree[1] / "memory" / "pod" / "ctr" / "memory.limit_in_bytes", "2147483648\n")
    assert detect(tree) == MemoryInfo(2 * GiB, "cgroup_v1")


def test_cgroup_v1_root_without_a_memory_line(tree):
    """No memory line in /proc/self/cgroup still checks the v1 mount root."""
    write(tree[1] / "memory" / "memory.limit_in_bytes", "1073741824\n")
    assert detect(tree) == MemoryInfo(GiB, "cgroup_v1")


def test_cgroup_v1_unlimited_sentinel_falls_back_to_meminfo(tree):
    """The v1 "unlimited" value is not a limit."""
    write(tree[0] / "self" / "cgroup", "4:memory:/\n")
    write(tree[1] / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert detect(tree) == MemoryInfo(12000000 * 1024, "meminfo")


def test_meminfo_only(tree):
    """No cgroup files at all means MemAvailable."""
    assert detect(tree) == MemoryInfo(12000000 * 1024, "meminfo")


def test_malformed_files_fall_back_with_a_warning(tree, caplog):
    """Garbage in memory.max and limit_in_bytes is logged and skipped, not fatal."""
    write(tree[0] / "self" / "cgroup", HYBRID_CGROUP)
    write(tree[1] / "pod" / "ctr" / "memory.max", "lots\n")
    write(tree[1] / "memory" / "memory.limit_in_bytes", "\x00\x01")
    write(
        tree[1] / "memory" / "pod" / "ctr" / "memory.limit_in_bytes", b"\xff\xfe".decode("latin-1")
    )
    with caplog.at_level(logging.WARNING, "bgeserve.memory"):
        assert detect(tree).source == "meminfo"
    assert "malformed memory.max" in caplog.text


def test_unreadable_file_is_skipped(tree):
    """A memory.max that cannot be decoded is treated as absent."""
    write(tree[0] / "self" / "cgroup", "0::/\n")
    (tree[1] / "memory.max").write_bytes(b"\xff\xfe\xfa")
    assert detect(tree).source == "meminfo"


def test_nothing_detectable_names_the_override(tree):
    """No cgroup limit and no MemAvailable is an error telling the operator what to set."""
    write(tree[0] / "meminfo", "MemTotal: 1000 kB\n")
    with pytest.raises(ConfigError, match="set BGE_M3_AVAILABLE_MEMORY_BYTES"):
        detect(tree)


# --- RSS and peak --------------------------------------------------------------------------


def test_rss_uses_statm_and_the_real_page_size(tmp_path):
    """RSS = statm resident pages × the system page size."""
    write(tmp_path / "self" / "statm", "100 7 3 1 0 5 0\n")
    assert rss_bytes(proc=tmp_path) == 7 * os.sysconf("SC_PAGE_SIZE")


def test_rss_falls_back_to_psutil(tmp_path):
    """Without /proc/self/statm, psutil supplies the RSS."""
    assert rss_bytes(proc=tmp_path) > 10 << 20


def test_reset_peak_rss_unsupported_returns_false(tmp_path):
    """When clear_refs cannot be written, reset reports False instead of raising."""
    assert reset_peak_rss(proc=tmp_path / "missing") is False


def test_peak_rss_falls_back_to_ru_maxrss(tmp_path):
    """Without VmHWM, getrusage's high-water mark is used, never below the current RSS."""
    before = rss_bytes()
    assert peak_rss_bytes(proc=tmp_path) >= before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_peak_reset_sees_a_freed_allocation():
    """After a reset, VmHWM catches a 200 MB allocation that is already freed again."""
    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here")
    size = 200 << 20
    baseline = rss_bytes()
    assert reset_peak_rss()
    block = np.ones(size, dtype=np.uint8)  # ones() writes every page, so all are resident
    assert int(block[-1]) == 1
    del block
    peak = peak_rss_bytes()
    after = rss_bytes()
    assert peak - baseline >= 0.9 * size
    assert after - baseline < 0.25 * size


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_heap_runs_on_glibc():
    """On glibc, malloc_trim is called and trim_heap reports it."""
    assert memory.trim_heap() is True


def test_trim_heap_without_malloc_trim(monkeypatch):
    """A libc without malloc_trim (musl, macOS) reports False instead of raising."""

    class NoTrim:
        def __init__(self, name):
            pass

    monkeypatch.setattr(memory.ctypes, "CDLL", NoTrim)
    assert memory.trim_heap() is False


# --- budget --------------------------------------------------------------------------------


def test_worker_budget_formula():
    """(available − workers·model − headroom) · safety / workers."""
    assert worker_budget(10 * GiB, 2, 2 * GiB, headroom=GiB, safety_factor=0.5) == int(
        5 * GiB * 0.5 / 2
    )


def test_worker_budget_floors_at_zero():
    """Models bigger than the memory leave a zero budget, not a negative one."""
    assert worker_budget(GiB, 4, GiB, headroom=0, safety_factor=1.0) == 0


@pytest.mark.parametrize("workers,safety", [(0, 0.5), (1, 0.0), (1, 1.5)])
def test_worker_budget_rejects_bad_arguments(workers, safety):
    """Zero workers or a safety factor outside (0, 1] are caller bugs."""
    with pytest.raises(ValueError):
        worker_budget(GiB, workers, 0, headroom=0, safety_factor=safety)


def test_module_never_imports_onnxruntime():
    """memory is a measurement module: no runtime import."""
    assert "onnxruntime" not in memory.__dict__


_ARENAS_SCRIPT = """
import ctypes, os, sys, tempfile, threading
from bgeserve.tuning.memory import limit_malloc_arenas
cap = limit_malloc_arenas(os.environ, 2) if sys.argv[1] == "cap" else None
barrier = threading.Barrier(12)
def work():
    barrier.wait()  # all alive at once: each new thread's first malloc may take a new arena
    keep = [bytearray(8192) for _ in range(50)]  # past pymalloc: glibc's malloc
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(12)]
[t.start() for t in threads]
[t.join() for t in threads]
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
path = tempfile.mktemp()
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(fp))
libc.fclose(ctypes.c_void_p(fp))
print(cap, open(path).read().count("<heap nr="))
os.unlink(path)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc arenas")
def test_malloc_arenas_are_capped_unless_the_environment_sets_them() -> None:
    """serve and bulk cap glibc's arenas (8 per core by default: RSS crept under load); 12
    threads allocating at once then share 2 heaps, not 12 of their own; MALLOC_ARENA_MAX or
    GLIBC_TUNABLES' arena_max set wins (nothing is changed)."""
    import subprocess

    def heaps(mode: str, **env: str) -> str:
        run_env = {k: v for k, v in os.environ.items()
                   if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
        return subprocess.run([sys.executable, "-c", _ARENAS_SCRIPT, mode], check=True,
                              capture_output=True, text=True, env={**run_env, **env},
                              cwd=Path(__file__).resolve().parent.parent).stdout.split()

    assert heaps("cap") == ["2", "2"]
    assert int(heaps("none")[1]) > 2  # glibc's own default: the cap is what changed it
    assert heaps("cap", MALLOC_ARENA_MAX="3") == ["None", "3"]
    assert heaps("cap", GLIBC_TUNABLES="glibc.malloc.arena_max=3") == ["None", "3"]


def test_the_colbert_cap_follows_the_memory_unless_set() -> None:
    """Unset, a request's ColBERT output may take 1/20 of the memory (its peak before it is
    sent is ~5x: a fixed 512 MiB let one request OOM-kill a server in a 600 MiB container),
    at most 512 MiB; BGE_M3_MAX_COLBERT_MB wins whatever the memory."""
    from bgeserve.config import Settings
    from bgeserve.service.plan import colbert_bytes, engine_config

    small = Settings(available_memory_bytes=600 << 20)
    assert colbert_bytes(small) == 30 << 20
    assert engine_config(small).max_colbert_bytes == 30 << 20
    assert colbert_bytes(Settings(available_memory_bytes=64 << 30)) == 512 << 20
    assert colbert_bytes(Settings(available_memory_bytes=600 << 20, max_colbert_mb=64)) == 64 << 20


def test_the_embedding_cache_follows_the_memory_unless_set() -> None:
    """Unset, the embedding cache takes 1/16 of the memory, at most 128 MiB: it is reserved
    out of the workspace, and a fixed 128 MiB left a 600 MiB container too little for one
    8,192-token text (the start failed). BGE_M3_CACHE_MB wins whatever the memory."""
    from bgeserve.config import Settings
    from bgeserve.service.plan import cache_bytes, embedding_cache_bytes, engine_config

    small = Settings(available_memory_bytes=600 << 20, variant="fp32")
    assert embedding_cache_bytes(small) == cache_bytes(small) == (600 << 20) // 16
    assert engine_config(small).cache_bytes == (600 << 20) // 16
    assert embedding_cache_bytes(Settings(available_memory_bytes=64 << 30)) == 128 << 20
    for mb in (0, 512):
        assert embedding_cache_bytes(Settings(available_memory_bytes=600 << 20,
                                              cache_mb=mb)) == mb << 20


def test_the_cache_default_is_read_once_when_settings_are_resolved(monkeypatch) -> None:
    """Where no cgroup caps the memory, what is available moves between two reads: the
    engine's cache and the tuner's reservation for it must come from one."""
    from bgeserve.config import Settings
    from bgeserve.service import plan
    from bgeserve.tuning import memory

    reads = iter(range(600, 6000, 100))
    real = memory.detect_available_memory

    def moving(explicit: object = None) -> object:
        return real(next(reads) << 20)

    monkeypatch.setattr(memory, "detect_available_memory", moving)
    resolved = plan.resolve(Settings(variant="fp32"), model_explicit=True, ep_explicit=True)
    assert resolved.cache_mb == 600 // 16
    assert plan.cache_bytes(resolved) == plan.engine_config(resolved).cache_bytes == 37 << 20
    assert plan.resolve(Settings(variant="fp32", cache_mb=0), model_explicit=True,
                        ep_explicit=True).cache_mb == 0
