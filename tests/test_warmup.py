"""Warm-up-only mode: exit codes of ``bgeserve serve``, and the TensorRT flow with fake sessions."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bgeserve.config import Settings
from bgeserve.errors import EngineFailed, ModelUnavailable
from bgeserve.runtime import gpu, trt
from bgeserve.runtime.onnx import available_providers
from bgeserve.service import warmup
from tests.serverproc import ServerProc


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def run_to_exit(env: dict[str, str], timeout: float = 60.0) -> tuple[int, str, bool]:
    """Run ``bgeserve serve``; (exit code, output, whether its port ever accepted a connection)."""
    proc = ServerProc(env).start()
    bound = False
    deadline = time.monotonic() + timeout
    try:
        while proc.returncode is None and time.monotonic() < deadline:
            bound = bound or port_open(proc.port)
            time.sleep(0.05)
        rc = proc.wait(5)
    finally:
        proc.stop()
    return rc, proc.output(), bound or port_open(proc.port)


# ------------------------------------------------------------------------ the real command
@pytest.mark.slow
def test_warmup_only_with_cpu_warns_and_exits_0_without_a_port(tiny_export: Path,
                                                              tmp_path: Path):
    """BGE_M3_WARMUP_ONLY=1 on the CPU EP: the model is checked, a warning, exit 0, no port."""
    rc, out, bound = run_to_exit({"BGE_M3_WARMUP_ONLY": "1", "BGE_M3_EP": "cpu",
                                  "BGE_M3_MODEL_PATH": str(tiny_export),
                                  "BGE_M3_CACHE_DIR": str(tmp_path / "cache")})
    assert rc == 0, out
    assert "nothing to compile" in out and '"level":"warning"' in out
    assert not bound
    assert "Uvicorn running" not in out


def test_warmup_only_with_tensorrt_and_no_gpu_fails_clearly(tmp_path: Path):
    """tensorrt where there is none (this onnxruntime, no GPU): an error naming BGE_M3_EP, rc≠0."""
    if "tensorrt" in available_providers() and gpu.detect_gpu_count():
        pytest.skip("this machine has TensorRT and a GPU")
    rc, out, bound = run_to_exit({"BGE_M3_WARMUP_ONLY": "1", "BGE_M3_EP": "tensorrt",
                                  "BGE_M3_CACHE_DIR": str(tmp_path / "cache")})
    assert rc != 0
    assert "BGE_M3_EP=tensorrt" in out and "BGE_M3_ALLOW_CPU_FALLBACK" in out
    assert not bound


def test_warmup_only_fails_when_the_model_is_missing(tmp_path: Path):
    """A model that cannot be resolved is a failure: exit 1, before anything is compiled."""
    settings = Settings(warmup_only=True, model_path=tmp_path / "missing",
                        cache_dir=tmp_path / "cache")
    assert warmup.run(settings) == 1


# ---------------------------------------------------------------- TensorRT, sessions faked
class FakeForward:
    """A session that 'builds' an engine file on open and records the shapes it ran."""

    def __init__(self, worker: int, engines: Path, fail: set[tuple[int, int]]):
        self.worker, self.fail, self.ran, self.closed = worker, fail, [], False
        engines.mkdir(parents=True, exist_ok=True)
        (engines / "TensorrtExecutionProvider_TRTKernel_graph_main_0_sm90.engine").write_bytes(
            b"plan")

    def run(self, ids: np.ndarray, mask: np.ndarray, **outputs: bool) -> None:
        assert ids.dtype == np.int64 and (ids[:, 0] == 0).all() and (ids[:, -1] == 2).all()
        assert mask.shape == ids.shape and outputs == {"dense": True, "sparse": True, "colbert": True}
        if ids.shape in self.fail:
            raise EngineFailed(f"inference failed for shape {ids.shape}")
        self.ran.append(ids.shape)

    def close(self) -> None:
        self.closed = True


class FakeFactory:
    def __init__(self, engines: Path, fail=(), open_error_for: int | None = None):
        self.engines, self.fail, self.open_error_for = engines, set(fail), open_error_for
        self.opened: list[int] = []
        self.forwards: dict[int, FakeForward] = {}
        self.lock = threading.Lock()

    def __call__(self, worker: int = 0) -> FakeForward:
        with self.lock:
            self.opened.append(worker)
        if worker == self.open_error_for:
            raise ModelUnavailable("execution provider 'tensorrt' failed to initialise")
        self.forwards[worker] = FakeForward(worker, self.engines, self.fail)
        return self.forwards[worker]


def test_warm_opens_worker_0_first_then_runs_each_shard_once(tmp_path: Path):
    """Worker 0 builds first; every shape runs exactly once, on its stride shard's worker."""
    factory = FakeFactory(tmp_path)
    shapes = [(1, 16), (2, 16), (1, 32), (4, 8), (2, 8)]
    results = warmup.warm(factory, shapes, workers=2, engines=tmp_path, device_count=2)
    assert factory.opened[0] == 0 and sorted(factory.opened) == [0, 1]
    assert factory.forwards[0].ran == [(1, 16), (1, 32), (2, 8)]
    assert factory.forwards[1].ran == [(2, 16), (4, 8)]
    assert all(r.error is None for r in results) and len(results) == 5
    assert all(f.closed for f in factory.forwards.values())


def test_warm_reports_failed_shapes_and_sessions(tmp_path: Path):
    """A failing shape, or a worker whose session did not open, is reported per shape."""
    factory = FakeFactory(tmp_path, fail={(2, 16)}, open_error_for=1)
    results = warmup.warm(factory, [(1, 16), (2, 16), (4, 16)], workers=2, engines=tmp_path)
    errors = {(r.batch, r.seq): r.error for r in results}
    assert errors[(1, 16)] is None
    assert "no session" in errors[(2, 16)] and "failed to initialise" in errors[(2, 16)]
    assert errors[(4, 16)] is None


def trt_settings(tmp_path: Path, **kw) -> Settings:
    return Settings(execution_provider="tensorrt", gpu_count=2, workers=2, warmup_only=True,
                    cache_dir=tmp_path / "cache", trt_warmup_shapes="1x16,2x16,1x32",
                    max_seq_length=64, **kw)


@pytest.fixture
def fake_tensorrt(monkeypatch, tmp_path: Path):
    """warmup.run with the model resolved to a stub and sessions from a FakeFactory."""
    made: dict[str, FakeFactory] = {}

    def factory(artifacts, session, **kw):
        assert session.provider == "tensorrt" and session.device_count == 2
        made["factory"] = FakeFactory(Path(session.provider_options["trt_engine_cache_path"]),
                                      **made.pop("kw", {}))
        return made["factory"]

    monkeypatch.setattr(warmup, "resolve", lambda **kw: type("A", (), {"source": "stub"})())
    monkeypatch.setattr(warmup, "forward_factory", factory)
    return made


def test_run_compiles_fsyncs_and_summarises(tmp_path: Path, fake_tensorrt, caplog):
    """Success: exit 0 and a summary with the engine count and the cache path."""
    with caplog.at_level(logging.INFO):
        assert warmup.run(trt_settings(tmp_path)) == 0
    engines = tmp_path / "cache" / "trt-engines"
    summary = [r for r in caplog.records if "all TRT engines compiled" in r.getMessage()]
    assert summary and summary[0].engine_count == 1 and summary[0].cache_path == str(engines)
    assert "trt cache: empty (will compile)" in caplog.text
    assert sorted(s for f in fake_tensorrt["factory"].forwards.values() for s in f.ran) == [
        (1, 16), (1, 32), (2, 16)]


def test_run_exits_1_when_a_shape_fails(tmp_path: Path, fake_tensorrt, caplog):
    """Any failed shape makes the init container fail (the server must not start cold)."""
    fake_tensorrt["kw"] = {"fail": {(2, 16)}}
    with caplog.at_level(logging.ERROR):
        assert warmup.run(trt_settings(tmp_path)) == 1
    assert "shapes 2x16 failed" in caplog.text


def test_run_exits_1_when_no_engine_was_written(tmp_path: Path, monkeypatch, fake_tensorrt,
                                                caplog):
    """Every shape ran but the engine folder is empty: a failure, not a silent success."""
    monkeypatch.setattr(trt, "count_engines", lambda folder: 0)
    with caplog.at_level(logging.ERROR):
        assert warmup.run(trt_settings(tmp_path)) == 1
    assert "no engine was written" in caplog.text
