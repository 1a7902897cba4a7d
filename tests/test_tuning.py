"""Auto-tuning on the real tiny model: the probe, its cache, the overrides, the start-up floor.

The probe is real (``synthetic_run`` over a dedicated ONNX session, peak-RSS measurement), kept
fast with a short ``max_seq``. Its outcome depends on the graph and the machine's memory
accounting, so a ``failed`` real probe is accepted as long as the reason is recorded and the
conservative model stays. The ``complete`` path (fit swapped in, cache written, ``cache_hit`` on
the next start) is pinned two ways: through the Service, by the in-process probe on the
serving session (the path taken where a second copy of the model does not fit) read by a fake
memory reader (``ExactMeter``) that reports known workspaces while the real model runs; and on
the Tuner directly with ``exact_run``, a workload whose workspace is known exactly, measured by
the real probe machinery.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest

from bgeserve import Engine
from bgeserve.config import Settings
from bgeserve.errors import ConfigError
from bgeserve.model.artifacts import resolve
from bgeserve.model.dims import model_dims
from bgeserve.service import Service
from bgeserve.tuning import probe as probe_module
from bgeserve.tuning.cache import Failure, ProbeCache
from bgeserve.tuning.costmodel import CostModel, conservative_coefficients
from bgeserve.tuning.probe import LocalProbe
from bgeserve.tuning.runcost import RunCost
from bgeserve.tuning.synthetic import synthetic_run
from bgeserve.tuning.tuner import LEGACY_BATCH_SEQ, MAX_ATTEMPTS, Tuner, TuningConfig

pytestmark = pytest.mark.slow

MAX_SEQ = 1024
PROBE_TIMEOUT = 60.0


def tiny_dims(export: Path) -> dict[str, int]:
    """The encoder sizes the service derives the conservative model from."""
    return model_dims(resolve(model_path=export, variant="fp32", cache_dir=export, offline=True))


def env_for(export: Path, cache: Path, **extra: str) -> dict[str, str]:
    env = {"BGE_M3_MODEL_PATH": str(export), "BGE_M3_CACHE_DIR": str(cache),
           "HF_HUB_OFFLINE": "1", "BGE_M3_MAX_SEQ_LENGTH": str(MAX_SEQ)}
    env.update(extra)
    return env


@contextmanager
def loaded(env: dict[str, str]) -> Iterator[Service]:
    """A Service loaded synchronously; stopped (probe finished first) on exit."""
    service = Service(Settings.from_env(env))
    try:
        service.load_blocking()
        yield service
    finally:
        if service.tuner is not None:
            service.tuner.wait(PROBE_TIMEOUT)
        asyncio.run(service.stop())


def ready_status(caplog: pytest.LogCaptureFixture) -> str:
    """The probe status the service logged when it became ready."""
    lines = [r.getMessage() for r in caplog.records
             if r.name == "bgeserve.service" and r.getMessage().startswith("ready: probe ")]
    assert lines, "the service logged no ready line"
    return lines[-1].split()[2].rstrip(",")


def assert_probe_outcome(service: Service, dims: dict[str, int]) -> str:
    """The probe ended (complete or failed, consistently); returns the status."""
    assert service.tuner is not None
    assert service.tuner.wait(PROBE_TIMEOUT), "the probe did not finish"
    state = service.tuner.state
    assert state.probe_status in ("complete", "failed"), state
    assert state.probe_seconds is not None or state.probe_status == "failed"
    if state.probe_status == "failed":
        assert state.probe_error, "a failed probe must record its reason"
        assert (state.a, state.b) == conservative_coefficients(**dims)
    else:
        assert state.probe_error is None
        assert state.a >= 0 and state.b >= 0 and state.a + state.b > 0
    # whatever the outcome, the engine serves with the published model
    assert service.engine is not None and service.engine.cost_model is not None
    cost = service.engine.cost_model
    assert (cost.a, cost.b, cost.max_workspace_bytes) == (state.a, state.b,
                                                           state.max_workspace_bytes)
    return state.probe_status


# -- a workload whose workspace is known exactly --------------------------------------------------
TRUE_A, TRUE_B = 20_000.0, 100.0  # bytes per token, per token squared


def exact_run(batch: int, seq: int) -> None:
    """Touch exactly ``TRUE_A·B·S + TRUE_B·B·S²`` fresh bytes, as a forward pass would.

    An anonymous mapping, not malloc: its pages are faulted in by the fill and returned by the
    unmap, whatever state the allocator's arenas are in.
    """
    size = int(TRUE_A * batch * seq + TRUE_B * batch * seq * seq)
    with mmap.mmap(-1, size) as region:
        view = np.frombuffer(region, dtype=np.uint8)
        view.fill(1)
        del view


METER_A, METER_B = 2_000.0, 1.0  # what ExactMeter reports: (1, 8192) is 80 MiB


class ExactMeter:
    """A fake memory reader: runs the shape for real (the serving session computes it) and
    reports ``METER_A·B·S + METER_B·B·S²`` as its workspace."""

    runs: ClassVar[list[tuple[int, int]]] = []

    def __init__(self, cumulative: bool = False) -> None:
        self.cumulative = cumulative

    def measure(self, run, batch: int, seq: int) -> tuple[int, float]:
        started = time.perf_counter()
        run(batch, seq)
        ExactMeter.runs.append((batch, seq))
        return int(METER_A * batch * seq + METER_B * batch * seq * seq), (
            time.perf_counter() - started)


# With max_seq 8192, memory for the server's one copy of the tiny model and one max_seq text by
# the conservative model (~440 MiB), but not for a second copy beside it (~620 MiB): the probe
# measures on the serving session, before the server is ready.
IN_PROCESS_MEMORY = str(530 << 20)


def in_process_env(export: Path, cache: Path, **extra: str) -> dict[str, str]:
    # IN_PROCESS_MEMORY is sized for the model, its probe and the 8,192-token shape: the
    # embedding cache's reservation (BGE_M3_CACHE_MB) would take that shape's room.
    # fp32 pinned: the memory is sized for fp32, and an unpinned start would first time the
    # default's candidates (the tiny export's int8 keeps the bar) in processes of their own.
    return env_for(export, cache, BGE_M3_MAX_SEQ_LENGTH="8192",
                   BGE_M3_AVAILABLE_MEMORY_BYTES=IN_PROCESS_MEMORY, BGE_M3_CACHE_MB="0",
                   **{"BGE_M3_MODEL": "fp32", **extra})


@contextmanager
def bgeserve_logs() -> Iterator[list[logging.LogRecord]]:
    """INFO records of the ``bgeserve`` loggers (for module-scoped fixtures, without caplog)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, logger = Keep(logging.INFO), logging.getLogger("bgeserve")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def probe_once(export: Path, cache: Path, env: dict[str, str] | None = None) -> dict[str, object]:
    """Start a service with the probe on; wait for it; what it concluded."""
    with bgeserve_logs() as records, loaded(env or env_for(export, cache)) as service:
        status = assert_probe_outcome(service, tiny_dims(export))
        state = service.tuner.state  # type: ignore[union-attr]
        assert service.engine is not None
        # it serves after the probe whatever the outcome
        assert service.engine.embed("after the probe").dense is not None
        health = service.health()["tuning"]
        engine_run_cost = service.engine.run_cost
    ready = [r.getMessage() for r in records if r.getMessage().startswith("ready: probe ")]
    return {"cache": cache, "status": status, "a": state.a, "b": state.b,
            "error": state.probe_error, "ready_line": ready[-1] if ready else "",
            "health": health, "engine_run_cost": engine_run_cost,
            "state_run_cost": state.run_cost}


@pytest.fixture(scope="module")
def real_probe(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The real probe (ONNX session, synthetic ids) on the tiny model."""
    return probe_once(tiny_export, tmp_path_factory.mktemp("real-probe"))


@pytest.fixture(scope="module")
def exact_probe(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The service's in-process probe read by ``ExactMeter``: it must complete and cache."""
    cache = tmp_path_factory.mktemp("exact-probe")
    ExactMeter.runs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe_module, "PeakMeter", ExactMeter)
        result = probe_once(tiny_export, cache, in_process_env(tiny_export, cache))
    assert result["status"] == "complete", result["error"]
    result["runs"] = list(ExactMeter.runs)
    return result


def copy_cache(probe: dict[str, object], to: Path) -> Path:
    """A private copy of a probe's cache dir (a test that probes again may overwrite it)."""
    src = Path(str(probe["cache"])) / "probe-coefficients.json"
    to.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, to / src.name)
    return to


# -- the probe through the Service ---------------------------------------------------------------
def test_real_probe_runs_in_background_then_ends(real_probe: dict[str, object]) -> None:
    # ready (conservative model) while the probe was still running
    assert str(real_probe["ready_line"]).startswith("ready: probe running"), real_probe
    health = real_probe["health"]
    assert isinstance(health, dict) and health["probe_status"] == real_probe["status"]
    cache_file = Path(str(real_probe["cache"])) / "probe-coefficients.json"
    if real_probe["status"] == "complete":
        record = json.loads(cache_file.read_text())
        assert (record["a"], record["b"]) == (real_probe["a"], real_probe["b"])
        # The probe child also timed the chunk budgets, starting from the CPU default (256).
        assert "256" in health["chunk_rates"] and record["chunk_rates"] == {
            k: pytest.approx(v, rel=0.01) for k, v in health["chunk_rates"].items()}
        assert health["chunk_tokens"] in (256, 1024, 4096)
        # ... and what a run costs, which the packer now pads by (None: no fit on this
        # machine's timings of the tiny model, which the log says).
        measured = RunCost.from_json(record["run_cost"])
        assert real_probe["engine_run_cost"] == measured == real_probe["state_run_cost"]
        assert health["run_cost"] == (measured.as_info() if measured else None)
        assert health["chunk_tokens_source"] in ("default", "probe")
    else:
        assert real_probe["error"] and health["probe_error"] == real_probe["error"]
        # A failure is kept (so the next start knows), never as a fit.
        store = ProbeCache(cache_file)
        record = json.loads(cache_file.read_text())
        assert isinstance(store.outcome(record["fingerprint"]), Failure)
        assert store.load(record["fingerprint"]) is None
    assert health["probe_mode"] == "child"


def test_complete_probe_swaps_in_the_fit_and_caches_it(exact_probe: dict[str, object]) -> None:
    """No room for a second copy: measured on the serving session before ready (so the
    server is ready with the fit), every shape run for real on that session, the fit cached."""
    assert str(exact_probe["ready_line"]).startswith("ready: probe complete"), exact_probe
    assert (1, 8192) in exact_probe["runs"]  # type: ignore[operator]
    a, b = float(exact_probe["a"]), float(exact_probe["b"])  # type: ignore[arg-type]
    # the fit recovers what the reader reported
    assert a == pytest.approx(METER_A, rel=0.01) and b == pytest.approx(METER_B, rel=0.01)
    health = exact_probe["health"]
    assert isinstance(health, dict)
    assert health["probe_status"] == "complete" and health["probe_error"] is None
    assert health["probe_mode"] == "in_process"
    assert (health["a_bytes_per_token"], health["b_bytes_per_token_sq"]) == (a, b)
    assert health["probe_seconds"] is not None
    record = json.loads((Path(str(exact_probe["cache"])) / "probe-coefficients.json").read_text())
    assert (record["a"], record["b"]) == (a, b)
    assert record["parts"]["max_seq"] == 8192 and record["parts"]["variant"] == "fp32"
    assert len(record["fingerprint"]) == 64 and len(record["samples"]) >= 6


def test_second_start_is_a_cache_hit(exact_probe: dict[str, object], tiny_export: Path,
                                     tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A warm restart with the same fingerprint measures nothing: ``cache_hit`` at once."""
    caplog.set_level(logging.INFO, logger="bgeserve")
    cache = copy_cache(exact_probe, tmp_path / "cache")
    started = time.monotonic()
    with loaded(in_process_env(tiny_export, cache)) as service:
        elapsed = time.monotonic() - started
        state = service.tuner.state  # type: ignore[union-attr]
        assert state.probe_status == "cache_hit"
        assert ready_status(caplog) == "cache_hit"
        assert (state.a, state.b) == (exact_probe["a"], exact_probe["b"])
        assert service.tuner.wait(0), "no probe may run on a cache hit"  # type: ignore[union-attr]
        assert elapsed < 10, f"a cache hit took {elapsed:.1f}s to be ready"
        assert service.health()["tuning"]["probe_status"] == "cache_hit"
        assert service.engine is not None and service.engine.cost_model is not None
        assert service.engine.cost_model.a == state.a


def test_a_shorter_max_seq_reads_the_fit_of_a_longer_one(
        exact_probe: dict[str, object], tiny_export: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_seq is part of the fingerprint, but the probe measured every shape up to it: a
    start with a shorter one serves the fit made for the longer one (QA: refused at 8,192
    with "longest that fits: 2,278", a start at 2,278 probed again in what was left and said
    "1,119"), and a probe it runs is saved under its own key (``ProbeCache.covering``)."""
    caplog.set_level(logging.INFO, logger="bgeserve")
    monkeypatch.setattr(probe_module, "PeakMeter", ExactMeter)
    cache = copy_cache(exact_probe, tmp_path / "cache")
    env = in_process_env(tiny_export, cache)
    env["BGE_M3_MAX_SEQ_LENGTH"] = "7168"  # still no room for a second copy
    with loaded(env) as service:
        assert ready_status(caplog) == "cache_hit"
        state = service.tuner.state  # type: ignore[union-attr]
        assert (state.a, state.b) == (exact_probe["a"], exact_probe["b"])
    assert "using the fit measured for max_seq 8192, which covers 7168" in caplog.text


def test_disable_probe_cache_forces_a_probe(exact_probe: dict[str, object], tiny_export: Path,
                                           tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="bgeserve")
    monkeypatch.setattr(probe_module, "PeakMeter", ExactMeter)
    cache = copy_cache(exact_probe, tmp_path / "cache")
    cache_file = cache / "probe-coefficients.json"
    before = cache_file.read_bytes(), cache_file.stat().st_mtime_ns
    with loaded(in_process_env(tiny_export, cache, BGE_M3_DISABLE_PROBE_CACHE="1")) as service:
        assert ready_status(caplog) == "complete"
        assert assert_probe_outcome(service, tiny_dims(tiny_export)) == "complete"
    after = cache_file.read_bytes(), cache_file.stat().st_mtime_ns
    assert after == before, "BGE_M3_DISABLE_PROBE_CACHE must not write the cache either"


# -- overrides disable the probe -----------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    {"BGE_M3_COST_MODEL_A": "5000", "BGE_M3_COST_MODEL_B": "60"},
    {"BGE_M3_TOKEN_BUDGET": str(512 << 20)},
    {"BGE_M3_DISABLE_AUTO_BUDGET": "1"},
], ids=["cost-model", "token-budget", "disable-auto-budget"])
def test_overrides_disable_the_probe(extra: dict[str, str], tiny_export: Path, tmp_path: Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bgeserve")
    with loaded(env_for(tiny_export, tmp_path, **extra)) as service:
        state = service.tuner.state  # type: ignore[union-attr]
        assert state.probe_status == "disabled"
        assert ready_status(caplog) == "disabled"
        assert service.tuner.wait(0)  # type: ignore[union-attr]
        conservative = conservative_coefficients(**tiny_dims(tiny_export))
        if "BGE_M3_COST_MODEL_A" in extra:
            assert (state.a, state.b) == (5000.0, 60.0)
        else:
            assert (state.a, state.b) == conservative
        if "BGE_M3_TOKEN_BUDGET" in extra:
            assert state.max_workspace_bytes == 512 << 20
        assert service.health()["tuning"]["probe_status"] == "disabled"
        assert service.engine is not None and service.engine.embed("x").dense is not None
    assert not (tmp_path / "probe-coefficients.json").exists()


def test_the_start_up_log_says_how_chunks_are_formed(tiny_export: Path, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Operators read the chunk limits from the log: texts, padded tokens, rounding, batching."""
    caplog.set_level(logging.INFO, logger="bgeserve")
    env = env_for(tiny_export, tmp_path, BGE_M3_DISABLE_AUTO_BUDGET="1", BGE_M3_MAX_CHUNK="16",
                  BGE_M3_PAD_MULTIPLE="8", BGE_M3_CROSS_REQUEST_BATCHING="0")
    with loaded(env):
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chunks: ")]
    assert lines == [("chunks: up to 16 texts and 256 padded tokens per run, lengths rounded up "
                      "to a multiple of 8, cross-request batching off")]


def test_onnx_batch_size_becomes_a_token_budget(tiny_export: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bgeserve")
    with pytest.warns(DeprecationWarning, match="BGE_M3_ONNX_BATCH_SIZE"):
        settings = Settings.from_env(env_for(tiny_export, tmp_path, BGE_M3_ONNX_BATCH_SIZE="4"))
    service = Service(settings)
    try:
        service.load_blocking()
        state = service.tuner.state  # type: ignore[union-attr]
        a, b = conservative_coefficients(**tiny_dims(tiny_export))
        expected = int(CostModel(a, b, 0).cost(4, LEGACY_BATCH_SEQ))
        assert state.probe_status == "disabled"
        assert state.max_workspace_bytes == expected
        assert service.tuner.config.token_budget == expected  # type: ignore[union-attr]
        warnings = [r for r in caplog.records
                    if r.name == "bgeserve.tuning" and r.levelno == logging.WARNING]
        assert any("BGE_M3_ONNX_BATCH_SIZE=4" in r.getMessage()
                   and f"BGE_M3_TOKEN_BUDGET={expected}" in r.getMessage() for r in warnings), (
            [r.getMessage() for r in warnings])
    finally:
        asyncio.run(service.stop())


# -- the start-up floor -------------------------------------------------------------------------
def test_tiny_memory_refuses_to_start(tiny_export: Path, tmp_path: Path) -> None:
    settings = Settings.from_env(env_for(tiny_export, tmp_path, BGE_M3_MODEL="fp32",
                                         BGE_M3_AVAILABLE_MEMORY_BYTES=str(64 << 20)))
    service = Service(settings)
    with pytest.raises(ConfigError) as info:
        service.load_blocking()
    assert service.fatal_error is info.value
    assert isinstance(service.fatal_error, ConfigError)
    assert "BGE_M3_MAX_SEQ_LENGTH" in str(info.value)
    assert info.value.param == "BGE_M3_MAX_SEQ_LENGTH"
    # No measurement cached yet: the refusal says how to get one (the conservative model is
    # far above what the probe measures).
    assert "`bgeserve probe`" in str(info.value)
    # The whole sum is shown, the memory held beside the model named with its variable.
    message = str(info.value)
    assert "0.06 GiB available from BGE_M3_AVAILABLE_MEMORY_BYTES" in message, message
    assert "256 MiB headroom" in message and "safety factor 0.7" in message
    assert "4 MiB embedding cache (BGE_M3_CACHE_MB)" in message  # 1/16 of 64 MiB, unset
    assert "set BGE_M3_CACHE_MB=0" in message
    health = service.health()
    assert health["status"] == "fail" and "BGE_M3_MAX_SEQ_LENGTH" in health["error"]
    assert service.engine is None
    asyncio.run(service.stop())


def test_a_pinned_budget_too_small_says_to_raise_it(tiny_export: Path, tmp_path: Path) -> None:
    """BGE_M3_TOKEN_BUDGET is each worker's workspace in bytes, whatever the memory, workers or
    cache: a refusal says to raise it (and how far), not to reduce workers or memory, which
    change nothing (8192, a token count as the reference's code read it, said so)."""
    settings = Settings.from_env(env_for(tiny_export, tmp_path, BGE_M3_MODEL="fp32",
                                         BGE_M3_TOKEN_BUDGET="8192"))
    service = Service(settings)
    with pytest.raises(ConfigError) as info:
        service.load_blocking()
    message = str(info.value)
    assert "(BGE_M3_TOKEN_BUDGET, in bytes)" in message, message
    assert f"raise BGE_M3_TOKEN_BUDGET (workspace bytes per worker: one {MAX_SEQ}-token text " \
        "needs " in message, message
    assert "BGE_M3_WORKERS" not in message and "memory limit" not in message
    # the same for every variant: no reason to serve another measured one (DoesNotFit's)
    from bgeserve.tuning.tuner import DoesNotFit

    assert not isinstance(info.value, DoesNotFit)
    asyncio.run(service.stop())


def test_a_refusal_by_the_conservative_estimate_is_measured_first(
        tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """When the upward-biased estimate alone says one max_seq text cannot fit, the server
    unloads its sessions, runs the probe in the foreground and decides on the measurement:
    here the estimate is made 20x too high, and the measured model starts the server."""
    from bgeserve.tuning import tuner as tuning

    real = tuning.conservative_coefficients
    monkeypatch.setattr(tuning, "conservative_coefficients",
                        lambda **dims: tuple(20 * x for x in real(**dims)))
    env = env_for(tiny_export, tmp_path, BGE_M3_MAX_SEQ_LENGTH="8192",
                  BGE_M3_AVAILABLE_MEMORY_BYTES=str(2 << 30))
    caplog.set_level(logging.INFO)
    with loaded(env) as service:
        assert service.tuner is not None and service.engine is not None
        state = service.tuner.state
        assert state.probe_status == "complete"
        assert state.max_seq_that_fits >= 8192
        assert state.a < 20 * real(**service.tuner.config.dims)[0] / 4  # measured, not estimated
        assert any("Measuring with the probe before deciding" in r.getMessage()
                   for r in caplog.records)
        assert service.engine.embed("served after measuring").dense.shape[0] == 1
        assert service.health()["status"] == "ok"


# -- the Tuner directly, with synthetic_run over the engine's sessions --------------------------
@pytest.fixture(scope="module")
def engine(tiny_export: Path) -> Iterator[Engine]:
    with Engine(tiny_export, "fp32") as e:
        yield e


def test_tuner_probe_with_synthetic_run(engine: Engine, tiny_export: Path, tmp_path: Path) -> None:
    """The real probe over a dedicated session of the engine: running → complete or failed."""
    dims = tiny_dims(tiny_export)
    applied: list[CostModel] = []
    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=dims,
                          available_override=8 << 30)
    tuner = Tuner(config, apply=applied.append)
    initial = tuner.initial(model_cost=16 << 20, fingerprint="f" * 64)
    assert tuner.state.probe_status == "running"
    assert tuner.state.memory_source == "override" and tuner.state.available_bytes == 8 << 30
    assert (initial.a, initial.b) == conservative_coefficients(**dims)
    assert applied == [initial]

    shapes: list[tuple[int, int]] = []
    run, close = synthetic_run(engine.open_forward, engine.tokenizer.vocab_size)

    def recording_run(batch: int, seq: int) -> None:
        shapes.append((batch, seq))
        run(batch, seq)

    closed: list[bool] = []

    def on_done() -> None:
        close()
        closed.append(True)

    tuner.start_probe(recording_run, 16 << 20, "f" * 64, {"max_seq": 512}, on_done=on_done)
    assert tuner.wait(PROBE_TIMEOUT)
    assert closed == [True], "the probe session must be closed when the probe ends"
    assert (1, 512) in shapes, "max_seq itself must be probed"
    assert len(set(shapes)) >= 6
    state = tuner.state
    assert state.probe_status in ("complete", "failed")
    assert len(applied) == 2 and (applied[-1].a, applied[-1].b) == (state.a, state.b)
    store = ProbeCache(tmp_path / "probe-coefficients.json")
    if state.probe_status == "failed":
        assert state.probe_error
        assert (state.a, state.b) == conservative_coefficients(**dims)
        assert isinstance(store.outcome("f" * 64), Failure)
    else:
        assert store.load("f" * 64) is not None


def test_tuner_complete_then_cache_hit(tiny_export: Path, tmp_path: Path) -> None:
    dims = tiny_dims(tiny_export)
    applied: list[CostModel] = []
    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=dims,
                          available_override=8 << 30)
    tuner = Tuner(config, apply=applied.append)
    tuner.initial(model_cost=16 << 20, fingerprint="f" * 64)
    assert tuner.state.probe_status == "running"
    tuner.start_probe(exact_run, 16 << 20, "f" * 64, {"max_seq": 512})
    assert tuner.wait(PROBE_TIMEOUT)
    state = tuner.state
    assert state.probe_status == "complete", state.probe_error
    assert state.a == pytest.approx(TRUE_A, rel=0.3) and state.b == pytest.approx(TRUE_B, rel=0.3)
    assert (applied[-1].a, applied[-1].b) == (state.a, state.b)
    assert (tmp_path / "probe-coefficients.json").exists()
    # a warm start with the same fingerprint reuses the fit; another fingerprint probes again
    again = Tuner(config, apply=lambda cost: None)
    cost = again.initial(model_cost=16 << 20, fingerprint="f" * 64)
    assert again.state.probe_status == "cache_hit"
    assert (cost.a, cost.b) == (pytest.approx(state.a), pytest.approx(state.b))
    other = Tuner(config, apply=lambda cost: None)
    other.initial(model_cost=16 << 20, fingerprint="0" * 64)
    assert other.state.probe_status == "running"
    forced = Tuner(TuningConfig(**{**config.__dict__, "disable_probe_cache": True}),
                   apply=lambda cost: None)
    forced.initial(model_cost=16 << 20, fingerprint="f" * 64)
    assert forced.state.probe_status == "running"


def test_a_fit_probed_short_of_memory_is_measured_again_once_memory_is_there(
        tiny_export: Path, tmp_path: Path) -> None:
    """A fit whose probe skipped shapes for its budget is extrapolated past them (QA: from
    4x256 in a 300 MB container, 17.8 bytes/token² against 0.15 measured whole, and the start
    with the limit raised refused for good on that cache). A start with the same memory hits
    the cache; one with well more probes again; a fit that skipped nothing is kept."""
    dims = tiny_dims(tiny_export)

    def probed(available: int, cache_dir: Path) -> Tuner:
        config = TuningConfig(max_seq=512, cache_dir=cache_dir, dims=dims,
                              available_override=available)
        tuner = Tuner(config, apply=lambda cost: None)
        tuner.initial(model_cost=16 << 20, fingerprint="f" * 64)
        if tuner.state.probe_status == "running":
            tuner.start_probe(exact_run, 16 << 20, "f" * 64, {"max_seq": 512})
            assert tuner.wait(PROBE_TIMEOUT)
        return tuner

    short = tmp_path / "short"
    assert probed(330 << 20, short).state.probe_status == "complete"
    record = json.loads((short / "probe-coefficients.json").read_text())
    assert record["skipped_for_memory"] > 0 and record["probe_budget_bytes"] > 0
    assert probed(330 << 20, short).state.probe_status == "cache_hit"
    again = probed(600 << 20, short)
    assert again.state.probe_status == "complete"  # measured, not the cached fit
    record = json.loads((short / "probe-coefficients.json").read_text())
    assert record["skipped_for_memory"] == 0
    assert probed(330 << 20, short).state.probe_status == "cache_hit"  # less memory: kept
    whole = tmp_path / "whole"
    assert probed(600 << 20, whole).state.probe_status == "complete"
    assert probed(4 << 30, whole).state.probe_status == "cache_hit"


def test_the_probe_cache_reads_a_fit_made_for_a_longer_max_seq(tmp_path: Path) -> None:
    """``covering``: a key's own fit first; else the fit of the shortest longer max_seq with
    every other part alike; never a failure's, another model's or variant's, nor a record
    whose parts are not what its key was made of."""
    from bgeserve.tuning.cache import fingerprint
    from bgeserve.tuning.costmodel import Fit

    store = ProbeCache.at(tmp_path)
    fit = Fit(a=1e4, b=1.0, max_rel_residual=0.01, held_out_rel_error=None)

    def parts(max_seq: int, variant: str = "fp32") -> dict[str, object]:
        return {"model": "m:1:2", "variant": variant, "threads": 2, "max_seq": max_seq}

    def key(max_seq: int, variant: str = "fp32") -> str:
        return fingerprint(parts(max_seq, variant))

    assert store.covering(key(2048), parts(2048)) == key(2048)  # nothing cached
    store.save(key(8192), fit, parts(8192), [])
    store.save(key(4096), fit, parts(4096), [])
    store.save_failure(key(3072), "killed", parts(3072), [])
    store.save(key(1024, "int8"), fit, parts(1024, "int8"), [])
    assert store.covering(key(2048), parts(2048)) == key(4096)  # the shortest that covers
    assert store.covering(key(6000), parts(6000)) == key(8192)
    assert store.covering(key(9000), parts(9000)) == key(9000)  # none measured that long
    assert store.covering(key(3000), parts(3000)) == key(4096)  # not the failure of 3,072
    assert store.covering(key(512, "int8"), parts(512, "int8")) == key(1024, "int8")
    assert store.covering(key(512, "bf16"), parts(512, "bf16")) == key(512, "bf16")
    assert store.covering(key(8192), parts(8192)) == key(8192)  # its own
    store.save(key(2048), fit, parts(2048), [])
    assert store.covering(key(2048), parts(2048)) == key(2048)
    # A record whose parts are not those its key was made of is no one's.
    forged = tmp_path / "forged"
    ProbeCache.at(forged).save(key(8192), fit, parts(8192, "int8"), [])
    assert ProbeCache.at(forged).covering(key(100), parts(100)) == key(100)
    assert ProbeCache.at(forged).covering(key(100, "int8"), parts(100, "int8")) == key(
        100, "int8")


def test_a_covering_fit_measured_short_leaves_the_starts_own_record(tiny_export: Path,
                                                                    tmp_path: Path) -> None:
    """A longer max_seq's fit whose probe skipped shapes for memory, where a start has well more
    now, is measured again as the start's own record has it: its own failures cached twice
    keep it from probing (review: it probed in a child at every start)."""
    from bgeserve.tuning.cache import fingerprint
    from bgeserve.tuning.costmodel import Fit

    dims = tiny_dims(tiny_export)
    store = ProbeCache.at(tmp_path)
    longer, own = {"model": "m", "max_seq": 8192}, {"model": "m", "max_seq": 512}
    store.save(fingerprint(longer), Fit(a=1e4, b=1.0, max_rel_residual=0.01,
                                        held_out_rel_error=None),
               longer, [], probe_budget=10 << 20, skipped_for_memory=3)
    for _ in range(2):
        store.save_failure(fingerprint(own), "killed", own, [], process_died=True)
    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=dims,
                          available_override=4 << 30)
    tuner = Tuner(config, apply=lambda cost: None)
    tuner.initial(model_cost=16 << 20, fingerprint=fingerprint(own), parts=own)
    assert tuner.state.probe_status == "failed"
    assert "the probe failed 2 times" in str(tuner.state.probe_error)


def test_a_cached_fit_that_refuses_the_start_says_so(tiny_export: Path, tmp_path: Path) -> None:
    """The refusal of a start whose cached fit does not fit one text names the cache and how to
    measure again (the operator raising the limit as it advised got the same refusal)."""
    from bgeserve.tuning.costmodel import Fit
    from bgeserve.tuning.tuner import DoesNotFit

    ProbeCache.at(tmp_path).save("f" * 64, Fit(a=1e6, b=1e4, max_rel_residual=0.1,
                                               held_out_rel_error=None), {}, [])
    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=tiny_dims(tiny_export),
                          available_override=1 << 30)
    with pytest.raises(DoesNotFit, match="BGE_M3_DISABLE_PROBE_CACHE=1") as refused:
        Tuner(config, apply=lambda cost: None).initial(model_cost=16 << 20,
                                                       fingerprint="f" * 64)
    assert str(tmp_path / "probe-coefficients.json") in str(refused.value)


def test_a_cached_fit_just_short_of_one_text_serves_as_the_start_that_measured_it(
        tiny_export: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A measured fit whose longest text is within 10% of max_seq serves (with a warning;
    texts past it get 413) as the start that measured it did once its probe finished (QA:
    that start served under a 400 MiB cap, and every restart refused on its cached fit, exit
    3: a crash loop); further short it still refuses, and so does the unmeasured estimate."""
    from bgeserve.errors import ConfigError

    def start(budget: int, status: str = "cache_hit") -> None:
        tuner = Tuner(TuningConfig(max_seq=512, dims=tiny_dims(tiny_export), cache_dir=tmp_path,
                                   available_override=1 << 30), apply=lambda cost: None)
        tuner.state.probe_status = status
        tuner._check_floor(CostModel(0.0, 1000.0, budget), 16 << 20)

    with caplog.at_level(logging.WARNING, logger="bgeserve.tuning"):
        start(1000 * 470 ** 2)  # fits 470 of 512 tokens: 91.8%
        start(1000 * 470 ** 2, "complete")  # measured on the serving session first
    assert caplog.text.count("fits texts of at most 470 tokens, below "
                             "BGE_M3_MAX_SEQ_LENGTH=512 (within 10%): serving") == 2
    with pytest.raises(ConfigError, match="longest that fits: 441"):  # 2% under 450
        start(1000 * 450 ** 2)  # 87.9%
    with pytest.raises(ConfigError, match="longest that fits: 460"):
        start(1000 * 470 ** 2, "running")  # the conservative estimate: measured first


def test_tuner_probe_failure_keeps_the_conservative_model(tiny_export: Path,
                                                          tmp_path: Path) -> None:
    dims = tiny_dims(tiny_export)
    applied: list[CostModel] = []
    tuner = Tuner(TuningConfig(max_seq=512, cache_dir=tmp_path, dims=dims,
                               available_override=8 << 30), apply=applied.append)
    tuner.initial(model_cost=16 << 20, fingerprint="e" * 64)

    def broken(batch: int, seq: int) -> None:
        raise RuntimeError("no memory measurement here")

    tuner.start_probe(broken, 16 << 20, "e" * 64, {})
    assert tuner.wait(PROBE_TIMEOUT)
    assert tuner.state.probe_status == "failed"
    assert tuner.state.probe_error
    assert (tuner.state.a, tuner.state.b) == conservative_coefficients(**dims)
    assert applied[-1].a == tuner.state.a and applied[-1].fits(1, 512)
    assert ProbeCache(tmp_path / "probe-coefficients.json").load("e" * 64) is None


def test_a_failed_probe_is_retried_once_then_served_from_the_cache(tiny_export: Path,
                                                                  tmp_path: Path) -> None:
    """A probe whose fit fails is cached as a failure with its reason: the next start tries
    once more, and the one after that does not repeat the doomed probe (``failed`` at once,
    the reason in ``probe_error`` and naming BGE_M3_DISABLE_PROBE_CACHE); another
    fingerprint, or the cache disabled, probes again."""
    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=tiny_dims(tiny_export),
                          available_override=8 << 30)

    def flat(batch: int, seq: int) -> None:  # every shape fails: no fit can come out
        raise RuntimeError("this runtime measures nothing")

    for attempt in range(1, MAX_ATTEMPTS + 1):
        tuner = Tuner(config, apply=lambda cost: None)
        tuner.initial(model_cost=16 << 20, fingerprint="a" * 64)
        assert tuner.state.probe_status == "running", attempt
        tuner.start_probe(flat, 16 << 20, "a" * 64, {"max_seq": 512})
        assert tuner.wait(PROBE_TIMEOUT)
        assert tuner.state.probe_status == "failed"
        assert f"attempt {attempt} of {MAX_ATTEMPTS}" in (tuner.state.probe_error or "")
    warm = Tuner(config, apply=lambda cost: None)
    warm.initial(model_cost=16 << 20, fingerprint="a" * 64)
    assert warm.state.probe_status == "failed" and warm.state.probe_mode is None
    assert "at least 2 measured shapes" in (warm.state.probe_error or "")
    assert "BGE_M3_DISABLE_PROBE_CACHE=1" in (warm.state.probe_error or "")
    warm.start_probe(flat, 16 << 20, "a" * 64, {})
    assert warm.wait(0)  # nothing was started
    other = Tuner(config, apply=lambda cost: None)
    other.initial(model_cost=16 << 20, fingerprint="b" * 64)
    assert other.state.probe_status == "running"
    forced = Tuner(TuningConfig(**{**config.__dict__, "disable_probe_cache": True}),
                   apply=lambda cost: None)
    forced.initial(model_cost=16 << 20, fingerprint="a" * 64)
    assert forced.state.probe_status == "running"


def test_a_probe_starved_of_memory_is_not_remembered(tiny_export: Path, tmp_path: Path) -> None:
    """A probe whose budget let fewer than two shapes run (the others skipped for their
    predicted cost) says nothing of the model: it is not cached as a failure, so starts after
    it, with more memory, probe again (two starts capped at 300 MB made every later start on
    that cache serve the conservative model, or refuse)."""
    from bgeserve.tuning.probe import ProbeResult

    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=tiny_dims(tiny_export),
                          available_override=8 << 30)
    skipped = [(1, 64, "predicted 900 MiB exceeds the 0 MiB per-worker budget"),
               (4, 512, "predicted 950 MiB exceeds the 0 MiB per-worker budget")]
    starved = SimpleNamespace(measure=lambda request, stop: ProbeResult(
        [], skipped, None, None, "need at least 2 measured shapes to fit a and b, got 0", 0.1))
    assert ProbeResult([], skipped, None, None, "x", 0.1).starved
    assert not ProbeResult([], [(1, 64, "RuntimeError: boom")], None, None, "x", 0.1).starved
    # a shape that failed when run is about the model or runtime, whatever else was skipped
    assert not ProbeResult([], [*skipped, (1, 16, "RuntimeError: boom")], None, None, "x",
                           0.1).starved
    for _ in range(MAX_ATTEMPTS + 1):
        tuner = Tuner(config, apply=lambda cost: None)
        tuner.initial(model_cost=16 << 20, fingerprint="c" * 64)
        assert tuner.state.probe_status == "running"
        tuner.start_probe(starved, 16 << 20, "c" * 64, {"max_seq": 512})
        assert tuner.wait(PROBE_TIMEOUT)
        assert tuner.state.probe_status == "failed"
        assert "not remembered" in (tuner.state.probe_error or "")
    assert ProbeCache(tmp_path / "probe-coefficients.json").outcome("c" * 64) is None


def test_a_probe_child_that_died_means_measuring_in_process_next_time(tmp_path: Path) -> None:
    """A probe process killed (by the OOM killer, say) is kept as a failure of its own kind:
    the next start measures on the serving session instead of starting another child."""
    store = ProbeCache(tmp_path / "probe-coefficients.json")
    store.save_failure("d" * 64, "the probe process ended by signal 9 (out of memory?)", {}, [],
                       process_died=True)
    tuner = Tuner(TuningConfig(max_seq=512, cache_dir=tmp_path, available_override=8 << 30),
                  apply=lambda cost: None)
    cost = tuner.initial(model_cost=16 << 20, fingerprint="d" * 64)
    assert (tuner.state.probe_status, tuner.state.probe_mode) == ("running", "in_process")
    assert cost.max_workspace_bytes == tuner.budget(16 << 20)  # the workers' own budget


def test_no_room_for_a_second_copy_means_measuring_in_process(tmp_path: Path) -> None:
    """Memory for the server but not for a second model copy: the probe is still run, on the
    serving session (``in_process``), with the workers' own budget as its guard."""
    applied: list[object] = []
    gib = 1 << 30
    config = TuningConfig(max_seq=512, available_override=int(2.2 * gib) + (256 << 20),
                          cache_dir=tmp_path)
    tuner = Tuner(config, apply=applied.append)
    cost = tuner.initial(model_cost=gib, fingerprint="f")
    assert (tuner.state.probe_status, tuner.state.probe_mode) == ("running", "in_process")
    assert cost.fits(1, 512) and applied == [cost]
    assert cost.max_workspace_bytes == tuner.budget(gib)
    roomy = Tuner(TuningConfig(max_seq=512, available_override=8 * gib, cache_dir=tmp_path),
                  apply=lambda cost: None)
    shared = roomy.initial(model_cost=gib, fingerprint="f")
    assert roomy.state.probe_mode == "child"  # beside the server, which shares what is left
    assert shared.max_workspace_bytes == roomy.budget(gib, extra_sessions=1)


def test_in_process_probe_on_the_serving_session(engine: Engine, tiny_export: Path,
                                                 tmp_path: Path) -> None:
    """``measure_first`` over a LocalProbe on the engine's own session, read by a fake
    memory reader: every shape runs on that session, the fit recovers what the reader
    reported, is cached, and the engine serves on afterwards with the fitted model."""
    applied: list[CostModel] = []
    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=tiny_dims(tiny_export),
                          available_override=8 << 30)
    tuner = Tuner(config, apply=applied.append)
    tuner.initial(model_cost=16 << 20, fingerprint="p" * 64)
    run, close = synthetic_run(engine.open_forward, engine.tokenizer.vocab_size)
    ExactMeter.runs = []
    closed: list[bool] = []
    source = LocalProbe(run, close=lambda: closed.append(True), meter=ExactMeter)
    assert tuner.measure_first(source, 16 << 20, "p" * 64, {"max_seq": 512})
    close()
    assert closed == [True] and (1, 512) in ExactMeter.runs
    cost = tuner.initial(model_cost=16 << 20, fingerprint="p" * 64)
    assert tuner.state.probe_status == "complete" and tuner.state.probe_mode == "in_process"
    assert cost.a == pytest.approx(METER_A, rel=0.01) and cost.b == pytest.approx(METER_B,
                                                                                rel=0.01)
    assert ProbeCache(tmp_path / "probe-coefficients.json").load("p" * 64) is not None
    assert engine.embed("still serving").dense is not None


def test_a_failed_in_process_probe_serves_the_conservative_model(tiny_export: Path,
                                                                 tmp_path: Path) -> None:
    """Measured before serving and no fit: the server still starts (``failed``, the reason
    kept), with the conservative model; nothing is probed again in the background."""
    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=tiny_dims(tiny_export),
                          available_override=8 << 30)
    tuner = Tuner(config, apply=lambda cost: None)
    tuner.initial(model_cost=16 << 20, fingerprint="q" * 64)
    def broken(batch: int, seq: int) -> None:
        raise RuntimeError("out of luck")

    assert not tuner.measure_first(broken, 16 << 20, "q" * 64, {})
    cost = tuner.initial(model_cost=16 << 20, fingerprint="q" * 64)
    assert tuner.state.probe_status == "failed"
    assert "at least 2 measured shapes" in (tuner.state.probe_error or "")
    assert (cost.a, cost.b) == conservative_coefficients(**tiny_dims(tiny_export))


def test_synthetic_shapes_take_the_masked_path() -> None:
    """Every probe shape longer than two tokens carries one padding token, so it measures the
    graph's masked (costlier) path, the upper bound for lone texts too."""
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    class Recorder:
        def run(self, ids, mask, **_):
            seen.append((ids.copy(), mask.copy()))

        def close(self):
            pass

    run, _ = synthetic_run(lambda: Recorder(), 1000)
    run(1, 16)
    run(4, 16)
    run(1, 2)
    run(4, 16, padded=False)  # what the chunk timing runs: the unmasked path
    for ids, mask in seen[:2]:
        assert mask[:-1].all() and mask[-1, -1] == 0 and mask[-1, :-1].all()
        assert ids[-1, -1] == 1 and ids[-1, -2] == 2  # </s> then <pad>, as pad_chunk makes it
    short_ids, short_mask = seen[2]
    assert short_mask.all() and short_ids.tolist() == [[0, 2]]
    ids, mask = seen[3]
    assert mask.all() and (ids[:, -1] == 2).all() and (ids[:, 0] == 0).all()


# -- chunk budgets timed by the probe --------------------------------------------------------
def launch_bound_run(batch: int, seq: int) -> None:
    """exact_run plus a fixed 200 ms per run, as on a GPU: bigger chunks are nearly free (the
    fixed cost far above exact_run's own, which a loaded machine stretches)."""
    exact_run(batch, seq)
    time.sleep(0.2)


def test_probe_timing_moves_the_chunk_budget_when_clearly_faster(tiny_export: Path,
                                                                  tmp_path: Path) -> None:
    """Runs cost ~200 ms whatever their size: 4,096 padded tokens per run beats the default 256
    by far, so the probe moves the engine's budget there, says so in /health, caches it, and a
    warm start applies the cached choice again."""
    dims = tiny_dims(tiny_export)
    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=dims,
                          available_override=8 << 30, chunk_tokens=256)
    moved: list[int] = []
    tuner = Tuner(config, apply=lambda cost: None, apply_chunk_tokens=moved.append)
    tuner.initial(model_cost=16 << 20, fingerprint="c" * 64)
    assert tuner.state.as_dict()["chunk_tokens"] == 256
    tuner.start_probe(launch_bound_run, 16 << 20, "c" * 64, {"max_seq": 512})
    assert tuner.wait(PROBE_TIMEOUT)
    state = tuner.state
    assert state.probe_status == "complete", state.probe_error
    assert sorted(state.chunk_rates) == [256, 1024, 4096]
    assert moved == [4096] and (state.chunk_tokens, state.chunk_tokens_source) == (4096, "probe")
    assert json.loads(json.dumps(state.as_dict()))["chunk_rates"].keys() == {"256", "1024", "4096"}
    again: list[int] = []
    warm = Tuner(config, apply=lambda cost: None, apply_chunk_tokens=again.append)
    warm.initial(model_cost=16 << 20, fingerprint="c" * 64)
    assert warm.state.probe_status == "cache_hit" and again == [4096]


def costed_run(batch: int, seq: int) -> None:
    """exact_run plus 100 ms per run and 50 us per token: a run cost sleep can show."""
    exact_run(batch, seq)
    time.sleep(0.1 + 5e-5 * batch * seq)


@pytest.mark.parametrize("pinned", [False, True])
def test_the_probe_measures_what_a_run_costs_and_the_packer_pads_by_it(
        tiny_export: Path, tmp_path: Path, pinned: bool) -> None:
    """Runs of 100 ms plus 50 us a token: the probe fits that cost (a pinned chunk budget
    too: the rule decides padding at any budget), hands it to the packer
    (``apply_run_cost``), shows it in /health, caches it, and a warm start applies it again."""
    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=tiny_dims(tiny_export),
                          available_override=8 << 30, chunk_tokens=256, chunk_pinned=pinned)
    applied: list[RunCost | None] = []
    tuner = Tuner(config, apply=lambda cost: None, apply_run_cost=applied.append)
    tuner.initial(model_cost=16 << 20, fingerprint="r" * 64)
    assert tuner.state.run_cost is None and applied == []
    tuner.start_probe(costed_run, 16 << 20, "r" * 64, {"max_seq": 512})
    assert tuner.wait(PROBE_TIMEOUT)
    assert tuner.state.probe_status == "complete", tuner.state.probe_error
    [cost] = applied
    assert cost is not None and cost == tuner.state.run_cost
    assert 0.08 < cost.fixed < 0.2 and 3e-5 < cost.per_token < 1e-4
    info = json.loads(json.dumps(tuner.state.as_dict()))["run_cost"]
    assert info["fixed_ms"] == pytest.approx(cost.fixed * 1e3, abs=1e-3)
    again: list[RunCost] = []
    warm = Tuner(config, apply=lambda cost: None, apply_run_cost=again.append)
    warm.initial(model_cost=16 << 20, fingerprint="r" * 64)
    assert warm.state.probe_status == "cache_hit" and again == [cost]


def test_a_pinned_chunk_budget_is_neither_timed_nor_moved(tiny_export: Path,
                                                          tmp_path: Path) -> None:
    """BGE_M3_MAX_CHUNK_TOKENS set: the probe measures memory only and the budget stays."""
    runs: ClassVar[list[tuple[int, int]]] = []

    def run(batch: int, seq: int) -> None:
        runs.append((batch, seq))
        exact_run(batch, seq)

    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=tiny_dims(tiny_export),
                          available_override=8 << 30, chunk_tokens=256, chunk_pinned=True)
    moved: list[int] = []
    tuner = Tuner(config, apply=lambda cost: None, apply_chunk_tokens=moved.append)
    tuner.initial(model_cost=16 << 20, fingerprint="d" * 64)
    tuner.start_probe(run, 16 << 20, "d" * 64, {"max_seq": 512})
    assert tuner.wait(PROBE_TIMEOUT)
    assert tuner.state.probe_status == "complete"
    assert moved == [] and tuner.state.chunk_rates == {}
    assert (tuner.state.chunk_tokens, tuner.state.chunk_tokens_source) == (256, "setting")
    assert (2, 128) not in runs and (8, 128) not in runs


def test_the_embedding_cache_is_held_outside_the_workspace_budget() -> None:
    """The tuner's budget subtracts reserved bytes (the cache's limit) from the memory
    available, as the model's cost is subtracted."""
    def tuner(reserved: int) -> Tuner:
        t = Tuner(TuningConfig(workers=2, safety_factor=0.5, reserved_bytes=reserved),
                  apply=lambda cost: None)
        t.state.available_bytes = 8 << 30
        return t

    assert tuner(0).budget(1 << 30) - tuner(256 << 20).budget(1 << 30) == (256 << 20) // 4


@pytest.mark.parametrize(("extra", "reserved"), [
    ({}, 128 << 20), ({"BGE_M3_CACHE_MB": "0"}, 0), ({"BGE_M3_CACHE_MB": "64"}, 64 << 20),
    ({"BGE_M3_MODEL": "int8"}, 0), ({"BGE_M3_MODEL": "int8", "BGE_M3_MAX_CHUNK": "1"}, 128 << 20),
])
def test_the_plan_reserves_the_cache_where_the_engine_keeps_one(
        extra: dict[str, str], reserved: int, tiny_export: Path, tmp_path: Path) -> None:
    """BGE_M3_CACHE_MB is reserved from the budget exactly when the engine builds a cache."""
    from bgeserve.service import plan

    extra = {"BGE_M3_MODEL": "fp32", **extra}
    settings = plan.resolve(Settings.from_env(env_for(tiny_export, tmp_path, **extra)))
    artifacts = resolve(model_path=tiny_export, variant=settings.variant, cache_dir=tmp_path,
                        offline=True)
    serving = plan.for_model(settings, artifacts, tmp_path)
    assert serving.tuning.reserved_bytes == reserved
    engine = Engine(artifacts=artifacts, config=serving.engine, start=False, auto_budget=False)
    assert engine.reserved_bytes == reserved


@pytest.mark.parametrize("asked", [True, False])
def test_a_probe_child_stopped_on_request_is_not_called_out_of_memory(
        asked: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed because the server or a bulk job was ending, the probe child's death says so;
    killed by a signal otherwise, it may be the OOM killer (every bulk job ended warning
    "the probe process ended by signal 9 (out of memory?)")."""
    import threading

    from bgeserve.tuning import child

    (tmp_path / "fakeprobe.py").write_text(
        "import os, signal, sys, time\n"
        "if sys.argv[1] == '\"die\"':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(30)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(child, "CHILD_MODULE", "fakeprobe")
    stop = threading.Event()
    if asked:
        threading.Timer(0.3, stop.set).start()
    with pytest.raises(child.ChildDied) as died:
        child.run_json("sleep" if asked else "die", stop)  # type: ignore[arg-type]
    assert ("asked to stop" in str(died.value)) is asked
    assert ("out of memory?" in str(died.value)) is not asked


def test_a_probe_child_stopped_by_a_signal_to_the_group_is_not_remembered(
        tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd's default KillMode (and ``timeout``, supervisord's ``stopasgroup``) SIGTERMs the
    server's whole process group: the probe child may end before the server hears of it. That
    was cached as a probe process that died ("out of memory?"), so the next start measured on
    the serving session before serving (minutes at full size). A child ended by SIGTERM,
    SIGINT or SIGHUP is a stop: nothing is remembered and the next start probes in a child."""
    import threading

    from bgeserve.tuning import child

    (tmp_path / "fakeprobe.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(child, "CHILD_MODULE", "fakeprobe")
    with pytest.raises(child.ChildStopped, match="SIGTERM"):
        child.run_json({}, threading.Event())
    result = child.run_child({}, threading.Event())
    assert result.stopped and not result.process_died

    config = TuningConfig(max_seq=512, cache_dir=tmp_path, dims=tiny_dims(tiny_export),
                          available_override=8 << 30)
    tuner = Tuner(config, apply=lambda cost: None)
    tuner.initial(model_cost=16 << 20, fingerprint="s" * 64)
    tuner.start_probe(SimpleNamespace(measure=lambda request, stop: result), 16 << 20,
                      "s" * 64, {"max_seq": 512})
    assert tuner.wait(PROBE_TIMEOUT) and tuner.state.probe_status == "failed"
    assert ProbeCache(tmp_path / "probe-coefficients.json").outcome("s" * 64) is None
    again = Tuner(config, apply=lambda cost: None)
    again.initial(model_cost=16 << 20, fingerprint="s" * 64)
    assert (again.state.probe_status, again.state.probe_mode) == ("running", "child")


def test_a_model_bigger_than_the_memory_is_refused_before_it_loads(tmp_path: Path) -> None:
    """Files plus headroom past a real limit (a cgroup's, MemAvailable): refused before the
    load, which was killed for memory (a 1.5 GiB container and the full-size int8: exit 137,
    nothing said), naming what else would load. Not for BGE_M3_AVAILABLE_MEMORY_BYTES (a
    budget nothing enforces: the floor after loading speaks), nor on a GPU."""
    from bgeserve.tuning.budget import HEADROOM_BYTES
    from bgeserve.tuning.tuner import DoesNotFit

    tuner = Tuner(TuningConfig(max_seq=512, cache_dir=tmp_path), apply=lambda cost: None)
    tuner.state.memory_source, tuner.state.available_bytes = "cgroup_v1", 1536 << 20
    files = 1084 << 20  # the full-size bf16 IR: OpenVINO holds ~1.7x it (a bf16 copy)
    with pytest.raises(DoesNotFit) as info:
        tuner.check_room(int(files * 1.7), files,
                         lambda: "ov-int8 (~933 MiB loaded, BGE_M3_MODEL=ov-int8)")
    message = info.value.message
    assert "~1842 MiB once loaded (its files: 1084 MiB" in message, message
    assert "1536 MiB of memory available (cgroup_v1)" in message
    assert "loads in less: ov-int8" in message and info.value.param == "BGE_M3_MODEL"
    hints: list[str] = []
    fits = (1536 << 20) - HEADROOM_BYTES
    tuner.check_room(fits, fits, lambda: hints.append("asked") or "")  # exactly fits: loads
    assert hints == []  # the hint is only worked out for a refusal
    tuner.state.memory_source = "override"
    tuner.check_room(8 << 30, 8 << 30)
    gpu = Tuner(TuningConfig(max_seq=512, cache_dir=tmp_path, gpu=True), apply=lambda c: None)
    gpu.state.memory_source, gpu.state.available_bytes = "cgroup_v1", 1 << 30
    gpu.check_room(8 << 30, 8 << 30)


def test_the_servers_engines_name_their_own_variables(tiny_export: Path,
                                                      tiny_reranker_export: Path,
                                                      tmp_path: Path) -> None:
    """The server's errors name its environment variables, the reranker's its own pair length
    and workers (a library caller's name EngineConfig's fields: test_engine.py)."""
    from bgeserve.service import plan

    for export, max_seq, workers in ((tiny_export, "BGE_M3_MAX_SEQ_LENGTH", "BGE_M3_WORKERS"),
                                     (tiny_reranker_export, "BGE_M3_RERANK_MAX_LENGTH",
                                      "BGE_M3_RERANK_WORKERS")):
        settings = plan.resolve(Settings.from_env(env_for(export, tmp_path,
                                                          BGE_M3_MODEL="fp32")))
        artifacts = resolve(model_path=export, variant="fp32", cache_dir=tmp_path,
                            offline=True, reranker=export == tiny_reranker_export)
        names = plan.for_model(settings, artifacts, tmp_path).engine.names
        assert (names.max_seq, names.workers) == (max_seq, workers)
        assert plan.for_model(settings, artifacts, tmp_path).engine.scheduler.names == names
