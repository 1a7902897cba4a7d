"""Tests for bgeserve.model.prepared: keys from content, digests remembered, atomic builds."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bgeserve.model import prepared
from bgeserve.model.prepared import (
    PreparedStore,
    file_digests,
    int8_weights,
    source_key,
    sums_int8_in_int32,
)
from bgeserve.model.ptload import HeadWeights


def _heads(bias: float = 0.5) -> HeadWeights:
    return HeadWeights(np.ones(4, np.float32), bias, np.eye(4, dtype=np.float32),
                       np.zeros(4, np.float32))


def _files(root: Path) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.onnx").write_bytes(b"graph")
    (root / "model.onnx_data").write_bytes(b"\0" * 1000)
    (root / "tokenizer.json").write_text("{}")
    return [root / n for n in ("model.onnx", "model.onnx_data", "tokenizer.json")]


def test_the_key_follows_file_contents_heads_and_recipe(tmp_path: Path) -> None:
    """Same content → same key; one byte of a source file, the heads or a machine-dependent
    recipe choice changed → another key."""
    files = _files(tmp_path / "src")
    memo = tmp_path / "digests.json"
    key = source_key(file_digests(files, memo), _heads())

    assert source_key(file_digests(files, memo), _heads()) == key
    assert source_key(file_digests(files, memo), _heads(0.25)) != key
    assert source_key(file_digests(files, memo), _heads(), int8_weights="s8") != key
    files[1].write_bytes(b"\0" * 999 + b"\1")
    assert source_key(file_digests(files, memo), _heads()) != key


def test_digests_are_remembered_until_a_file_changes(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A second start hashes nothing; a rewritten file (new mtime or size) is hashed again."""
    files = _files(tmp_path / "src")
    memo = tmp_path / "digests.json"
    hashed: list[str] = []
    real = prepared.sha256
    monkeypatch.setattr(prepared, "sha256", lambda p: hashed.append(Path(p).name) or real(p))

    first = file_digests(files, memo)
    assert sorted(hashed) == sorted(p.name for p in files)
    hashed.clear()
    assert file_digests(files, memo) == first and hashed == []
    files[2].write_text('{"a": 1}')
    os.utime(files[2], ns=(time.time_ns(), time.time_ns() + 10**9))
    assert file_digests(files, memo)["tokenizer.json"] != first["tokenizer.json"]
    assert hashed == ["tokenizer.json"]


def test_symlinked_sources_are_hashed_by_their_target(tmp_path: Path) -> None:
    """The hub cache's snapshot files are symlinks to blobs: the digest is the blob's."""
    files = _files(tmp_path / "blobs")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    links = []
    for f in files:
        (snapshot / f.name).symlink_to(f)
        links.append(snapshot / f.name)
    memo = tmp_path / "digests.json"
    assert file_digests(links, memo) == file_digests(files, memo)


def test_a_build_is_invisible_until_committed(tmp_path: Path) -> None:
    """A staged build has no manifest under its key; commit moves it into place whole, replacing
    an older one, and left-over staging directories are cleaned by the next build."""
    store = PreparedStore(tmp_path)
    with store.lock("k"):
        staged = store.staging("k")
        (staged / "manifest.json").write_text('{"format": "bgeserve-export", "variants": {}}')
        assert store.manifest("k") is None
        final = store.commit("k", staged)
    assert final == tmp_path / "prepared" / "k" and store.manifest("k") is not None
    stale = tmp_path / "prepared" / ".k.999.tmp"
    stale.mkdir()
    with store.lock("k"):
        again = store.staging("k")
        (again / "manifest.json").write_text('{"format": "bgeserve-export", "variants": '
                                             '{"fp32": {}}}')
        store.commit("k", again)
    assert not stale.exists() and store.manifest("k")["variants"] == {"fp32": {}}
    assert [p.name for p in (tmp_path / "prepared").iterdir() if p.is_dir()] == ["k"]


def test_a_second_builder_waits_for_the_first(tmp_path: Path) -> None:
    """Two processes (here threads with their own lock files) preparing one key take turns:
    the second is told it waits, and enters only after the first leaves."""
    store = PreparedStore(tmp_path)
    events: list[str] = []
    inside = threading.Event()

    def first() -> None:
        with store.lock("k"):
            events.append("first in")
            inside.set()
            time.sleep(0.3)
            events.append("first out")

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(5)
    with store.lock("k", on_wait=lambda: events.append("waiting")):
        events.append("second in")
    thread.join()
    assert events == ["first in", "waiting", "first out", "second in"]


def test_a_mount_without_locks_prepares_unlocked(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """flock failing otherwise than "would block" (ENOLCK: NFS without lockd) is said and the
    build goes on without the lock: it failed the start before."""
    import errno
    import fcntl

    def no_locks(fd: object, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with PreparedStore(tmp_path).lock("k") as writable:
        assert writable


def test_the_recipe_in_the_key_is_the_one_the_export_writes() -> None:
    """RECIPE's block sizes are export/'s: a change there changes every key (re-prepares)."""
    from bgeserve.export import ATTENTION_BLOCK, FFN_ROWS

    assert (prepared.RECIPE["attention_block"], prepared.RECIPE["ffn_rows"]) == (
        ATTENTION_BLOCK, FFN_ROWS)


@pytest.mark.parametrize(("flags", "weights"), [
    ("fpu sse2 avx2 fma", "u8"),  # AVX2 only (Zen 3): signed 8-bit weights saturate MLAS's kernel
    ("fpu avx2 avx512f avx512_vnni", "s8"),
    ("fpu avx2 avx_vnni", "s8"),
    ("fpu avx2 amx_bf16 amx_int8 amx_tile", "s8"),
])
def test_int8_weights_take_the_8_bit_encoding_this_cpu_cannot_saturate(flags, weights,
                                                                      tmp_path) -> None:
    """Signed 8-bit int8 weights on CPUs with VNNI or AMX (u8 x s8 summed in int32), unsigned
    8-bit elsewhere and when the CPU is unknown (MLAS's u8 x u8 kernels cannot saturate)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert int8_weights(cpuinfo) == weights
    assert sums_int8_in_int32(cpuinfo) == (weights == "s8")
    assert int8_weights(tmp_path / "missing") == "u8"
    assert not sums_int8_in_int32(tmp_path / "missing")
