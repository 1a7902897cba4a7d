"""CPU sessions draw their workspace from one shrinking ONNX Runtime arena (runtime/onnx.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bgeserve.runtime import SessionConfig
from bgeserve.runtime.onnx import OnnxSession, run_options, session_options

SHRINK = "memory.enable_memory_arena_shrinkage"


def test_cpu_runs_give_the_arena_back() -> None:
    config = SessionConfig(provider="cpu")
    opts = session_options(config)
    assert opts.enable_cpu_mem_arena
    assert opts.get_session_config_entry("session.use_env_allocators") == "1"
    assert run_options(config).get_run_config_entry(SHRINK) == "cpu:0"


def test_without_the_arena_or_off_the_cpu_nothing_is_shrunk() -> None:
    off = SessionConfig(cpu_arena=False)
    assert not session_options(off).enable_cpu_mem_arena
    assert run_options(off) is None
    assert run_options(SessionConfig(provider="cuda")) is None
    assert not session_options(SessionConfig(provider="cuda")).enable_cpu_mem_arena


def test_under_a_cpu_quota_the_intra_op_threads_do_not_spin(monkeypatch) -> None:
    """A cgroup CPU quota: several threads wait without spinning (spinning spends the quota
    the others need); one thread, or no quota, keeps ONNX Runtime's default."""
    from bgeserve.cgroup import Cpus
    from bgeserve.runtime import onnx

    spin = "session.intra_op.allow_spinning"

    def spins(config: SessionConfig) -> bool:
        try:
            return session_options(config).get_session_config_entry(spin) != "0"
        except RuntimeError:  # not set: ONNX Runtime's default, spinning
            return True

    monkeypatch.setattr(onnx, "usable_cpus", lambda: Cpus(2, 64, 1.5))
    assert not spins(SessionConfig(threads=2))
    assert spins(SessionConfig(threads=1))
    monkeypatch.setattr(onnx, "usable_cpus", lambda: Cpus(2, 2, None))
    assert spins(SessionConfig(threads=2))


def test_sessions_on_the_shared_arena_agree_with_glibc_sessions(tiny_export: Path) -> None:
    """Same outputs with and without the arena, run after run (shrinking between runs)."""
    graph = tiny_export / "int8" / "model.onnx"
    arena = OnnxSession(graph, SessionConfig(threads=1))
    plain = OnnxSession(graph, SessionConfig(threads=1, cpu_arena=False))
    rng = np.random.default_rng(5)
    for length in (5, 300, 40, 2100):  # 2,100 tokens: two FFN row blocks
        ids = np.concatenate([[0], rng.integers(5, 2000, length - 2), [2]])[None, :]
        mask = np.ones_like(ids)
        got, want = arena.run(ids, mask), plain.run(ids, mask)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
