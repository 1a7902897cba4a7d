"""The CPUs this process may keep busy: affinity narrowed by a cgroup CPU quota (v2 and v1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bgeserve.cgroup import (
    Cpus,
    detect_cpus,
    parse_cfs_quota,
    parse_cpu_max,
    usable_cpus,
)
from bgeserve.runtime.session import SessionConfig


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def detect(tmp_path: Path, cgroup: str, files: dict[str, str], affinity: int = 64) -> Cpus:
    write(tmp_path / "proc" / "self" / "cgroup", cgroup)
    for name, text in files.items():
        write(tmp_path / "sys" / name, text)
    return detect_cpus(proc=tmp_path / "proc", sys_cgroup=tmp_path / "sys", affinity=affinity)


def test_parse_cpu_max():
    assert parse_cpu_max("200000 100000\n") == 2.0
    assert parse_cpu_max("150000 100000") == 1.5
    assert parse_cpu_max("max 100000\n") is None
    for garbage in ("", "max", "-1 100000", "0 100000", "100000 0", "a b"):
        assert parse_cpu_max(garbage) is None, garbage


def test_parse_cfs_quota():
    assert parse_cfs_quota("400000\n", "100000\n") == 4.0
    assert parse_cfs_quota("-1\n", "100000\n") is None
    assert parse_cfs_quota("50000", "") is None


def test_v2_quota_narrows_the_affinity(tmp_path):
    """docker --cpus 2 on a 64-core host: cpu.max "200000 100000" in the container's cgroup."""
    cpus = detect(tmp_path, "0::/pod/ctr\n", {"pod/ctr/cpu.max": "200000 100000\n"})
    assert cpus == Cpus(count=2, affinity=64, quota=2.0)
    assert str(cpus) == "2 CPUs (affinity 64, cgroup CPU quota 2)"
    assert str(Cpus(1, 2, 0.5)) == "1 CPU (affinity 2, cgroup CPU quota 0.5)"


def test_v2_the_smallest_quota_on_the_way_up_applies(tmp_path):
    """A pod's limit sits on the parent (the leaf reads "max"); a tighter child one wins."""
    parent_only = detect(tmp_path / "a", "0::/pod/ctr\n", {
        "pod/ctr/cpu.max": "max 100000\n", "pod/cpu.max": "300000 100000\n"})
    assert parent_only.count == 3
    tighter_child = detect(tmp_path / "b", "0::/pod/ctr\n", {
        "pod/ctr/cpu.max": "150000 100000\n", "pod/cpu.max": "400000 100000\n"})
    assert (tighter_child.count, tighter_child.quota) == (2, 1.5)  # rounded up


def test_no_quota_keeps_the_affinity(tmp_path):
    assert detect(tmp_path / "a", "0::/\n", {"cpu.max": "max 100000\n"}, affinity=6) == \
        Cpus(6, 6, None)
    assert detect(tmp_path / "b", "", {}, affinity=3) == Cpus(3, 3, None)


def test_affinity_below_the_quota_wins(tmp_path):
    """--cpuset-cpus 0,1 with --cpus 8: two CPUs to run on."""
    assert detect(tmp_path, "0::/x\n", {"x/cpu.max": "800000 100000\n"}, affinity=2).count == 2


def test_a_quota_under_one_cpu_still_gives_one(tmp_path):
    assert detect(tmp_path, "0::/x\n", {"x/cpu.max": "50000 100000\n"}).count == 1


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_v1_cfs_quota(tmp_path, mount):
    """cgroup v1 (and the hybrid layout, whose unified hierarchy has no cpu controller)."""
    cgroup = "4:memory:/ctr\n2:cpu,cpuacct:/ctr\n0::/ctr\n"
    cpus = detect(tmp_path, cgroup, {f"{mount}/ctr/cpu.cfs_quota_us": "400000\n",
                                     f"{mount}/ctr/cpu.cfs_period_us": "100000\n"})
    assert cpus == Cpus(4, 64, 4.0)
    unlimited = detect(tmp_path / "u", cgroup, {f"{mount}/ctr/cpu.cfs_quota_us": "-1\n",
                                                 f"{mount}/ctr/cpu.cfs_period_us": "100000\n"})
    assert unlimited == Cpus(64, 64, None)


def test_a_path_from_proc_never_leaves_the_mount(tmp_path):
    """".." in /proc/self/cgroup is dropped: the walk reads under the mount only (sys/..
    would be tmp_path, whose cpu.max says 1 CPU)."""
    write(tmp_path / "cpu.max", "100000 100000\n")  # outside the mount
    assert detect(tmp_path, "0::/..\n", {"cpu.max": "max 100000\n"}).quota is None


def test_a_namespace_root_carries_the_containers_quota(tmp_path):
    """With a private cgroup namespace the container sees itself as "0::/", its cpu.max at
    the mount's root."""
    assert detect(tmp_path, "0::/\n", {"cpu.max": "300000 100000\n"}).count == 3


def test_a_sessions_default_threads_follow_a_quota_only(monkeypatch):
    """threads=0 leaves the count to the runtime (its physical cores), unless a quota leaves
    fewer CPUs than that: the runtimes never read it. OpenVINO's streams share them."""
    from bgeserve.runtime import session

    monkeypatch.setattr(session.psutil, "cpu_count", lambda logical=True: 32)
    monkeypatch.setattr(session, "usable_cpus", lambda: Cpus(3, 64, 2.5))
    assert SessionConfig().cpu_threads == 3
    assert SessionConfig(streams=2).cpu_threads == 1
    assert SessionConfig(streams=4).cpu_threads == 1
    assert SessionConfig(threads=5).cpu_threads == 5
    monkeypatch.setattr(session, "usable_cpus", lambda: Cpus(48, 64, 48.0))
    assert SessionConfig().cpu_threads == 0  # more than the 32 cores the runtime would take
    monkeypatch.setattr(session, "usable_cpus", lambda: Cpus(4, 4, None))
    assert SessionConfig().cpu_threads == 0


def test_this_process():
    """On the machine running the tests: at least one CPU, never more than its affinity."""
    cpus = usable_cpus()
    assert 1 <= cpus.count <= cpus.affinity
