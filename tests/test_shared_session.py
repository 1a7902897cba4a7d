"""Workers on the CPU share one ONNX Runtime session (runtime.onnx.SharedSession)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bgeserve import Engine, runtime
from bgeserve.engine import EngineConfig
from bgeserve.engine.forward import forward_factory
from bgeserve.engine.scheduler import SchedulerConfig
from bgeserve.model.artifacts import resolve
from bgeserve.runtime import SessionConfig
from bgeserve.runtime.common import Shared
from bgeserve.tuning.budget import measure_model_cost

TEXTS = ["short", "a somewhat longer text about the weather in spring", "x " * 300,
         "second short one", "tokens " * 40]


def test_shared_opens_once_under_concurrency_and_goes_with_last_user() -> None:
    opened: list[object] = []

    def slow_open() -> object:
        time.sleep(0.05)  # wide window for a second opener to slip in, if the lock let it
        opened.append(object())
        return opened[-1]

    shared: Shared[object] = Shared(slow_open)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(shared.acquire())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opened) == 1 and all(g is opened[0] for g in got) and shared.users == 4
    for _ in range(3):
        shared.release()
    assert shared.users == 1 and shared.acquire() is opened[0]  # still held: same object
    shared.release()
    shared.release()
    assert shared.users == 0
    assert shared.acquire() is not opened[0] and len(opened) == 2  # released: opened afresh
    shared.release()
    shared.release()  # an extra release never goes negative
    assert shared.users == 0


def test_cpu_workers_run_one_session(tiny_export: Path, tmp_path: Path) -> None:
    artifacts = resolve(model_path=tiny_export, variant="fp32", cache_dir=tmp_path)
    open_forward = forward_factory(artifacts, SessionConfig(threads=1))
    a, b = open_forward(0), open_forward(1)
    assert a.session._session is b.session._session  # one InferenceSession, two handles
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.session.run(np.ones((1, 3), np.int64), np.ones((1, 3), np.int64))
    c = open_forward(0)
    assert c.session._session is b.session._session  # b still holds it
    inner = b.session._session
    b.close()
    c.close()
    d = open_forward(0)
    assert d.session._session is not inner  # all closed (idle unload): a fresh session
    d.close()


@pytest.mark.parametrize("how", ["another graph copied over", "moved link", "rebuilt"])
def test_a_reload_refuses_model_files_replaced_since_the_start(tiny_export: Path,
                                                              tmp_path: Path, how: str) -> None:
    """After an idle unload the next open reads the graph again: files replaced since the
    start (another graph copied over, or the model path's symlink moved to another export)
    are refused by name, not served under the old tokenizer and cache; the same graph
    rebuilt (a new file, the manifest's digest and size) opens."""
    import json
    import shutil

    from bgeserve.errors import ModelUnavailable

    copies = [tmp_path / "a", tmp_path / "b"]
    for copy in copies:
        shutil.copytree(tiny_export, copy)
    manifest = copies[1] / "manifest.json"  # b: another model (its own digest)
    record = json.loads(manifest.read_text())
    record["variants"]["fp32"]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(record))
    link = tmp_path / "current"
    link.symlink_to(copies[0])
    artifacts = resolve(model_path=link, variant="fp32", cache_dir=tmp_path / "cache")
    open_forward = forward_factory(artifacts, SessionConfig(threads=1))
    open_forward(0).close()  # loaded, then unloaded for idleness
    open_forward(0).close()  # the same files: reopened
    graph = artifacts.onnx_path.resolve()
    if how == "moved link":
        link.unlink()
        link.symlink_to(copies[1])
    else:
        source = graph if how == "rebuilt" else copies[0] / "int8" / "model.onnx"
        shutil.copyfile(source, tmp_path / "graph")  # a new file: inode and mtime
        (tmp_path / "graph").replace(graph)
    if how == "rebuilt":
        open_forward(0).close()
        return
    with pytest.raises(ModelUnavailable, match="changed since bgeserve started"):
        open_forward(0)


def test_two_workers_on_one_session_give_one_worker_results(tiny_export: Path,
                                                            tmp_path: Path) -> None:
    texts = TEXTS * 8  # enough chunks for both workers to run at once
    one = Engine(tiny_export, config=EngineConfig(session=SessionConfig(threads=1)),
                 cache_dir=tmp_path)
    two = Engine(tiny_export, config=EngineConfig(session=SessionConfig(threads=1),
                                                  scheduler=SchedulerConfig(workers=2,
                                                                            max_chunk=2)),
                 cache_dir=tmp_path)
    with one, two:
        ref = one.embed(texts, dense=True, sparse=True, colbert=True)
        got = two.embed(texts, dense=True, sparse=True, colbert=True)
    np.testing.assert_allclose(got.dense, ref.dense, atol=1e-6)
    for (ids, weights), (ref_ids, ref_weights) in zip(got.sparse, ref.sparse):
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(weights, ref_weights, atol=1e-5)
    for x, y in zip(got.colbert, ref.colbert):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_weight_copies(tiny_export: Path, tmp_path: Path) -> None:
    artifacts = resolve(model_path=tiny_export, variant="fp32", cache_dir=tmp_path)
    assert runtime.weight_copies(runtime.kind_of(artifacts, "cpu"), 4) == 1
    assert runtime.weight_copies(runtime.kind_of(artifacts, "cuda"), 4) == 4
    assert runtime.weight_copies(runtime.kind_of(artifacts, "cuda"), 0) == 1


def test_model_cost_floor_counts_each_copy_once() -> None:
    gib = 2**30
    # Loading costs nothing measurable here: the floor (the files) decides.
    assert measure_model_cost(lambda: None, 2, 2 * gib) == 2 * gib  # a copy per worker
    assert measure_model_cost(lambda: None, 2, 2 * gib, copies=1) == gib  # one shared copy
    assert measure_model_cost(lambda: None, 4, 2 * gib, copies=1) == gib // 2


def test_engine_without_config_chunks_by_the_runtime_best(tiny_export: Path,
                                                          tmp_path: Path) -> None:
    with Engine(tiny_export, cache_dir=tmp_path, start=False) as engine:
        assert engine.config.scheduler.max_chunk_tokens == 256  # ORT on the CPU (measured best)
    config = EngineConfig(scheduler=SchedulerConfig(max_chunk_tokens=4096))
    with Engine(tiny_export, config=config, cache_dir=tmp_path, start=False) as engine:
        assert engine.config.scheduler.max_chunk_tokens == 4096  # what the caller set stays
