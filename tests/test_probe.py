"""Tests for bgeserve.probe: shapes, isolated measurement, fit, and the fingerprinted cache."""

from __future__ import annotations

import json
import logging
import math
import mmap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bgeserve.tuning import cache as probe_cache
from bgeserve.tuning import probe, runcost
from bgeserve.tuning.cache import PROBE_SCHEMA, ProbeCache, fingerprint
from bgeserve.tuning.costmodel import CostModel, Fit, MiB, Sample
from bgeserve.tuning.probe import (
    ProbeResult,
    choose_chunk_tokens,
    default_held_out,
    default_shapes,
    run_probe,
    time_chunk_budgets,
)

A, B = 20000.0, 5.0  # the fake model's true bytes per token and per token²
SHAPES = [(1, 64), (8, 64), (1, 256), (4, 256), (1, 512), (2, 1024), (1, 2048), (1, 4096)]
WIDE = CostModel(A * 2, B * 2, 1 << 40)


def true_cost(batch: int, seq: int) -> int:
    return int(A * batch * seq + B * batch * seq * seq)


def fake_run(batch: int, seq: int, hold: float = 0.0) -> None:
    """Allocate exactly the true workspace, touch every page, hold it, free it."""
    block = np.ones(true_cost(batch, seq), dtype=np.uint8)
    if hold:
        time.sleep(hold)
    assert block[-1] == 1


def collect() -> tuple[list[str], object]:
    lines: list[str] = []
    return lines, lines.append


# --- shapes --------------------------------------------------------------------------------


@pytest.mark.parametrize("max_seq", [16, 128, 512, 768, 1000, 2048, 8192])
def test_default_shapes_span_to_max_seq(max_seq):
    """≥ 6 distinct shapes within max_seq, (1, max_seq) last, more than one batch size."""
    shapes = default_shapes(max_seq)
    assert len(shapes) >= 6 and len(set(shapes)) == len(shapes)
    assert shapes[-1] == (1, max_seq)
    assert all(1 <= s <= max_seq and b >= 1 for b, s in shapes)
    assert len({b for b, _ in shapes}) > 1


@pytest.mark.parametrize("max_seq", [1, 2])
def test_default_shapes_for_degenerate_max_seq(max_seq):
    """Even a 1–2 token limit gives valid shapes ending with the capability check."""
    shapes = default_shapes(max_seq)
    assert shapes[-1] == (1, max_seq) and all(1 <= s <= max_seq for _, s in shapes)


@pytest.mark.parametrize("max_seq", [16, 128, 512, 768, 8192])
def test_default_held_out_is_not_a_fitting_shape(max_seq):
    """The held-out shape is within max_seq and not among the fitting shapes."""
    held = default_held_out(max_seq)
    assert held not in default_shapes(max_seq)
    assert 1 <= held[1] <= max_seq


# --- run_probe -----------------------------------------------------------------------------


def test_probe_measures_each_shape_and_fits_the_truth():
    """Measured workspaces match the allocated bytes, and the fit recovers a and b."""
    lines, log = collect()
    result = run_probe(fake_run, shapes=SHAPES, held_out=(2, 768), guard=WIDE, log=log)
    assert isinstance(result, ProbeResult)
    assert result.error is None and result.skipped == []
    for s in result.samples:
        assert s.workspace_bytes == pytest.approx(true_cost(s.batch, s.seq), abs=3 * MiB, rel=0.05)
        assert s.seconds >= 0
    assert [(s.batch, s.seq) for s in result.samples] == sorted(SHAPES, key=lambda s: WIDE.cost(*s))
    assert result.held_out is not None and (result.held_out.batch, result.held_out.seq) == (2, 768)
    assert result.fit is not None
    assert result.fit.a == pytest.approx(A, rel=0.1)
    assert result.fit.b == pytest.approx(B, rel=0.1)
    assert result.fit.held_out_rel_error is not None and result.fit.held_out_rel_error < 0.1
    # one per shape, the held-out one, the fit, then what a run costs
    assert len(lines) == len(SHAPES) + 3
    assert "MiB" in lines[0] and "probe fit" in lines[-2] and "probe run cost" in lines[-1]


def test_probe_skips_shapes_the_guard_refuses():
    """Shapes predicted over budget are not run; the reason names the budget."""
    ran: list[tuple[int, int]] = []
    guard = CostModel(A, B, true_cost(2, 1024))

    def run(batch: int, seq: int) -> None:
        ran.append((batch, seq))

    result = run_probe(run, shapes=SHAPES, held_out=(1, 8192), guard=guard, log=lambda _: None)
    assert {(b, s) for b, s, _ in result.skipped} == {(1, 2048), (1, 4096), (1, 8192)}
    assert all("per-worker budget" in why for *_, why in result.skipped)
    assert (1, 4096) not in ran and result.held_out is None


def test_probe_records_a_failing_shape_and_carries_on():
    """A run that raises is skipped with its error text; the other shapes still fit."""

    def run(batch: int, seq: int) -> None:
        if (batch, seq) == (1, 2048):
            raise RuntimeError("Failed to allocate memory")
        fake_run(batch, seq)

    result = run_probe(run, shapes=SHAPES, held_out=None, guard=WIDE, log=lambda _: None)
    assert result.skipped == [(1, 2048, "RuntimeError: Failed to allocate memory")]
    assert len(result.samples) == len(SHAPES) - 1
    assert result.fit is not None and result.fit.held_out_rel_error is None


def test_probe_without_enough_samples_reports_why():
    """Nothing measurable gives no fit and an error saying so."""
    result = run_probe(fake_run, shapes=[(1, 64)], held_out=None, guard=WIDE, log=lambda _: None)
    assert result.fit is None and "at least 2" in (result.error or "")


def test_probe_falls_back_to_sampling_without_clear_refs(monkeypatch):
    """With clear_refs unavailable, a polling thread still sees allocations held ≥ 20 ms."""
    monkeypatch.setattr(probe, "reset_peak_rss", lambda: False)
    shapes = [(1, 1024), (4, 1024), (1, 2048), (1, 4096)]

    def run(batch: int, seq: int) -> None:
        fake_run(batch, seq, hold=0.02)

    result = run_probe(run, shapes=shapes, held_out=None, guard=WIDE, log=lambda _: None)
    for s in result.samples:
        assert s.workspace_bytes == pytest.approx(true_cost(s.batch, s.seq), abs=3 * MiB, rel=0.1)
    assert result.fit is not None


def test_slow_shapes_are_measured_once(monkeypatch):
    """A run slower than the repeat threshold is not repeated; a fast one is."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(probe, "_REPEAT_BELOW_SECONDS", 0.005)

    def run(batch: int, seq: int) -> None:
        calls.append((batch, seq))
        if seq == 2048:
            time.sleep(0.01)

    run_probe(run, shapes=[(1, 64), (1, 2048)], held_out=None, guard=WIDE, log=lambda _: None)
    assert calls[:3] == [(1, 64), (1, 64), (1, 2048)]
    # then what a run costs is timed, and what a new shape costs
    assert set(calls[3:]) == {*runcost.SHAPES, *runcost.FRESH_SHAPES}


# --- fingerprint ---------------------------------------------------------------------------

PARTS = {
    "probe_schema": PROBE_SCHEMA,
    "model": "model.onnx:2271145830:1718000000",
    "variant": "fp32",
    "execution_provider": "cpu",
    "ort_version": "1.24.1",
    "intra_op_threads": 2,
    "cpu": "x86_64 Intel(R) Xeon(R) Platinum 8481C",
    "max_seq": 8192,
}


def test_fingerprint_is_stable_and_order_independent():
    """The same parts in any order give the same 64-hex digest."""
    fp = fingerprint(PARTS)
    assert fp == fingerprint(dict(reversed(list(PARTS.items()))))
    assert len(fp) == 64 and int(fp, 16) >= 0


@pytest.mark.parametrize("key", sorted(PARTS))
def test_fingerprint_changes_with_every_part(key):
    """Changing any single part changes the fingerprint."""
    changed = dict(PARTS)
    value = PARTS[key]
    changed[key] = value + 1 if isinstance(value, int) else f"{value}-x"
    assert fingerprint(changed) != fingerprint(PARTS)


def test_fingerprint_includes_the_probe_schema(monkeypatch):
    """A new probe schema invalidates every cache, whatever the caller passes."""
    before = fingerprint({"x": 1})
    monkeypatch.setattr(probe_cache, "PROBE_SCHEMA", PROBE_SCHEMA + 1)
    assert fingerprint({"x": 1}) != before


# --- cache ---------------------------------------------------------------------------------

FIT = Fit(a=41000.0, b=128.5, max_rel_residual=0.12, held_out_rel_error=0.03)
SAMPLES = [Sample(1, 64, 3 * MiB, 0.05), Sample(1, 8192, 9 * 1024 * MiB, 85.0)]


@pytest.fixture
def cache(tmp_path):
    return ProbeCache(tmp_path / "cache" / "probe-coefficients.json")


def test_cache_round_trip(cache):
    """A saved fit loads back unchanged under the same fingerprint, with its parts recorded."""
    fp = fingerprint(PARTS)
    cache.save(fp, FIT, PARTS, SAMPLES)
    assert cache.load(fp) == FIT
    data = json.loads(cache.path.read_text())
    assert data["parts"] == PARTS and len(data["samples"]) == 2


def test_cache_round_trip_without_held_out(cache):
    """A fit with no held-out error round-trips as None."""
    fit = Fit(1.0, 2.0, 0.1, None)
    cache.save("f", fit, {}, [])
    assert cache.load("f") == fit


def test_missing_cache_is_a_silent_miss(cache, caplog):
    """No file: None, nothing logged."""
    with caplog.at_level(logging.WARNING, "bgeserve.probe"):
        assert cache.load("f") is None
    assert caplog.text == ""


def write_record(cache: ProbeCache, **changes: object) -> None:
    record = {
        "schema": PROBE_SCHEMA,
        "fingerprint": "f",
        "a": 1.0,
        "b": 2.0,
        "max_rel_residual": 0.1,
        "held_out_rel_error": None,
    }
    record.update(changes)
    cache.path.parent.mkdir(parents=True, exist_ok=True)
    cache.path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "changes,reason",
    [
        ({"schema": 0}, "probe schema 0"),
        ({"schema": None}, "probe schema None"),
        ({"fingerprint": "other"}, "another model"),
        ({"a": -1.0}, "unusable coefficients"),
        ({"a": 0.0, "b": 0.0}, "unusable coefficients"),  # b = 0 alone is a valid fit
        ({"a": "1"}, "unusable coefficients"),
        ({"b": True}, "unusable coefficients"),
        ({"max_rel_residual": None}, "fit-quality"),
        ({"held_out_rel_error": "x"}, "fit-quality"),
    ],
)
def test_unusable_records_are_misses_with_a_reason(cache, caplog, changes, reason):
    """Wrong schema, foreign fingerprint, bad coefficients or fields: None and a warning."""
    write_record(cache, **changes)
    with caplog.at_level(logging.WARNING, "bgeserve.probe"):
        assert cache.load("f") is None
    assert reason in caplog.text


def test_non_finite_coefficients_are_rejected(cache, caplog):
    """NaN/Infinity in the file (json allows them) are not coefficients."""
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text(
        f'{{"schema": {PROBE_SCHEMA}, "fingerprint": "f", "a": NaN, "b": Infinity, '
        '"max_rel_residual": 0.1}'
    )
    with caplog.at_level(logging.WARNING, "bgeserve.probe"):
        assert cache.load("f") is None
    assert "unusable coefficients" in caplog.text


@pytest.mark.parametrize("text", ["{not json", "", '["a", "list"]'])
def test_corrupt_cache_is_a_miss(cache, caplog, text):
    """Corrupt JSON or a non-object is None with a warning, never an exception."""
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text(text)
    with caplog.at_level(logging.WARNING, "bgeserve.probe"):
        assert cache.load("f") is None
    assert "ignoring it" in caplog.text


def test_truncated_cache_is_a_miss(cache, caplog):
    """A file cut off halfway (e.g. by a crash mid-write elsewhere) is a miss; where the
    fingerprint's kept copy is whole, that copy is the hit."""
    from bgeserve.tuning.cache import kept_path

    cache.save("f", FIT, PARTS, SAMPLES)
    text = cache.path.read_text()
    cache.path.write_text(text[: len(text) // 2])
    assert cache.load("f") == FIT  # the copy kept beside it
    kept = kept_path(cache.path, "f")
    assert kept is not None
    kept.write_text(text[: len(text) // 2])
    with caplog.at_level(logging.WARNING, "bgeserve.probe"):
        assert cache.load("f") is None
    assert "corrupt or truncated" in caplog.text


def test_unreadable_cache_is_a_miss(cache, caplog):
    """A cache path that is a directory cannot be read: None with a warning."""
    cache.path.mkdir(parents=True)
    with caplog.at_level(logging.WARNING, "bgeserve.probe"):
        assert cache.load("f") is None
    assert "cannot be read" in caplog.text


def saved_files(cache: ProbeCache) -> list[str]:
    """Every file under the cache's directory, temporary ones included, by relative path."""
    root = cache.path.parent
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_save_leaves_no_temp_files(cache):
    """Saving twice replaces the file in place; only the cache file and each fingerprint's
    kept copy remain."""
    cache.save("f", FIT, PARTS, SAMPLES)
    cache.save("g", FIT, PARTS, SAMPLES)
    assert saved_files(cache) == ["probe-coefficients.d/f.json", "probe-coefficients.d/g.json",
                                  cache.path.name]
    assert cache.load("g") == FIT


def test_each_fingerprints_record_is_kept_beside_the_newest(cache, caplog):
    """One cache directory, two models or variants by turns: each start finds its own fit,
    chunk rates and run cost (the file held the newest alone, so every switch probed again);
    a failure is counted per fingerprint; the oldest beyond KEPT_RECORDS are removed."""
    from bgeserve.tuning import cache as cache_module

    other = Fit(7.0, 8.0, 0.2, None)
    cache.save("f", FIT, PARTS, SAMPLES, chunk_rates={4096: 900.0})
    cache.save("g", other, PARTS, SAMPLES, chunk_rates={2048: 700.0})
    with caplog.at_level(logging.WARNING, "bgeserve.probe"):
        assert (cache.load("f"), cache.load("g")) == (FIT, other)
    assert caplog.text == ""
    assert json.loads(cache.path.read_text())["fingerprint"] == "g"  # the file: the newest
    assert (cache.chunk_rates("f"), cache.chunk_rates("g")) == ({4096: 900.0}, {2048: 700.0})
    cache.save_failure("h", "no fit", PARTS, SAMPLES)
    cache.save_failure("h", "no fit", PARTS, SAMPLES)
    assert cache.load("f") == FIT and cache.outcome("h").attempts == 2
    with caplog.at_level(logging.WARNING, "bgeserve.probe"):
        assert cache.load("unknown") is None
    assert "another model" in caplog.text  # none kept: a miss that says so, as before
    for n in range(cache_module.KEPT_RECORDS):
        cache.save(f"n{n}", FIT, PARTS, SAMPLES)
    kept = [p for p in saved_files(cache) if p.startswith("probe-coefficients.d/")]
    assert len(kept) == cache_module.KEPT_RECORDS and cache.load("n0") == FIT
    assert cache.load("f") is None  # the oldest, removed


def test_save_to_an_unusable_directory_only_warns(tmp_path, caplog):
    """A cache directory that cannot be created logs a warning and does not raise."""
    (tmp_path / "file").write_text("")
    cache = ProbeCache(tmp_path / "file" / "probe-coefficients.json")
    with caplog.at_level(logging.WARNING, "bgeserve.probe"):
        cache.save("f", FIT, PARTS, SAMPLES)
    # said once: the kept copy beside it fails the same way (it was said twice)
    assert caplog.text.count("cannot save") == 1 and "probe-coefficients" in caplog.text


def test_failed_write_removes_its_temp_file(cache, caplog):
    """Unserialisable data fails the write, removes the temp file and keeps the old cache."""
    cache.save("f", FIT, PARTS, SAMPLES)
    bad = Fit(1.0, 2.0, math.nan, None)

    class Boom:
        def __str__(self) -> str:
            raise ValueError("cannot serialise")

    with caplog.at_level(logging.WARNING, "bgeserve.probe"):
        cache.save("g", bad, {"x": Boom()}, [])
    assert "cannot save" in caplog.text and "probe-coefficients" in caplog.text
    assert saved_files(cache) == ["probe-coefficients.d/f.json", cache.path.name]
    assert cache.load("f") == FIT


def test_module_never_imports_onnxruntime():
    """probe measures through a callable: no runtime import."""
    assert "onnxruntime" not in probe.__dict__


# --- chunk budgets -------------------------------------------------------------------------
class FakeClock:
    """A clock the fake run advances by a cost per shape."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_run(clock: FakeClock, seconds: Callable[[int, int], float]):
    def run(batch: int, seq: int) -> None:
        clock.now += seconds(batch, seq)
    return run


def test_chunk_budgets_are_warmed_then_timed_in_interleaved_rounds():
    """Each budget warms up once (smallest first), then rounds time every budget once in turn;
    the fastest run of each counts."""
    clock = FakeClock()
    costs = iter([0.5, 0.9,  # warm-ups: 2x128, 8x128
                  0.010, 0.050, 0.020, 0.040])  # round 1, round 2
    shapes: list[tuple[int, int]] = []

    def seconds(batch: int, seq: int) -> float:
        shapes.append((batch, seq))
        return next(costs)

    lines, log = collect()
    rates = time_chunk_budgets(timed_run(clock, seconds), (1024, 256), WIDE, clock=clock,
                               log=log)
    assert rates == {256: pytest.approx(25_600), 1024: pytest.approx(25_600)}
    assert shapes == [(2, 128), (8, 128), (2, 128), (8, 128), (2, 128), (8, 128)]
    assert any("(1024 padded tokens): 25600 tokens/s" in line for line in lines)


def test_a_slow_warm_up_ends_the_list_of_budgets():
    """A budget whose warm-up run takes longer than max_run_seconds is not timed, nor any
    bigger one."""
    clock = FakeClock()
    shapes: list[tuple[int, int]] = []

    def seconds(batch: int, seq: int) -> float:
        shapes.append((batch, seq))
        return 0.1 * batch

    rates = time_chunk_budgets(timed_run(clock, seconds), (256, 1024, 4096), WIDE, clock=clock,
                               log=lambda _: None, max_run_seconds=0.5)
    assert list(rates) == [256]  # 8x128 warmed up in 0.8 s; 32x128 is never run
    assert shapes.count((8, 128)) == 1 and (32, 128) not in shapes


def test_chunk_budget_timing_skips_what_does_not_fit_and_survives_failures():
    clock = FakeClock()
    tight = CostModel(A, B, true_cost(2, 128))  # (2, 128) fits, (8, 128) does not
    assert list(time_chunk_budgets(timed_run(clock, lambda b, s: 0.01), (256, 1024), tight,
                                   clock=clock, log=lambda _: None)) == [256]

    def broken(batch: int, seq: int) -> None:
        raise RuntimeError("no")

    assert time_chunk_budgets(broken, (256,), WIDE, clock=clock, log=lambda _: None) == {}
    calls = []

    def fails_after_warm_up(batch: int, seq: int) -> None:
        calls.append(batch)
        if len(calls) > 1:
            raise RuntimeError("no")

    assert time_chunk_budgets(fails_after_warm_up, (256,), WIDE, clock=clock,
                              log=lambda _: None) == {}


@pytest.mark.parametrize("rates, chosen", [
    ({256: 100.0, 1024: 109.0, 4096: 50.0}, 256),  # 9 % faster is noise: the default stays
    ({256: 100.0, 1024: 110.0}, 1024),  # 10 % faster moves it
    ({256: 100.0, 1024: 130.0, 4096: 150.0}, 4096),  # to the fastest
    ({1024: 500.0}, 256),  # the default itself was not timed: nothing to compare
    ({}, 256),
])
def test_choose_chunk_tokens_keeps_the_default_unless_clearly_beaten(rates, chosen):
    assert choose_chunk_tokens(256, rates) == chosen


def test_the_cache_keeps_chunk_rates_with_the_fit(tmp_path: Path):
    cache = ProbeCache(tmp_path / "probe-coefficients.json")
    fit_ = Fit(A, B, 0.01, 0.02)
    cache.save("f" * 64, fit_, {"x": 1}, [], {256: 100.0, 1024: 150.5})
    assert cache.chunk_rates("f" * 64) == {256: 100.0, 1024: 150.5}
    assert cache.chunk_rates("e" * 64) == {}  # another fingerprint
    cache.save("f" * 64, fit_, {"x": 1}, [])  # saved without timings
    assert cache.chunk_rates("f" * 64) == {}
    record = json.loads(cache.path.read_text())
    record["chunk_rates"] = {"256": "NaN", "oops": 1, "1024": -5}
    cache.path.write_text(json.dumps(record))
    assert cache.chunk_rates("f" * 64) == {}
    assert cache.load("f" * 64) is not None  # bad timings never cost the fit


def test_the_run_cost_reads_attention_off_the_probes_own_shapes(monkeypatch):
    """The memory shapes' timings (to 4,096 tokens here) go to the run cost, where a long
    text's attention is read off them (runcost.long_attention); the held-out shape's do not."""
    given: dict[str, object] = {}

    def measure(run, shapes, **kwargs):
        given.update(kwargs)

    monkeypatch.setattr(probe, "measure_run_cost", measure)
    result = run_probe(fake_run, shapes=SHAPES, held_out=(2, 768), guard=WIDE,
                       log=lambda _: None)
    assert given["long"] == [(s.batch, s.seq, s.seconds) for s in result.samples]
    assert {(b, s) for b, s, _ in given["long"]} == set(SHAPES)


def test_the_held_out_shape_is_measured_in_cost_order_not_last():
    """A runtime may keep buffers from its biggest run: a shape measured after it reads low.
    So the held-out shape, like every shape, comes after smaller ones only."""
    order: list[tuple[int, int]] = []

    def run(batch: int, seq: int) -> None:
        order.append((batch, seq))
        fake_run(batch, seq)

    result = run_probe(run, shapes=SHAPES, held_out=(2, 768), guard=WIDE, log=lambda _: None)
    assert result.held_out is not None and (result.held_out.batch, result.held_out.seq) == (2, 768)
    firsts = list(dict.fromkeys(order))
    assert firsts.index((2, 768)) < firsts.index((1, 4096))
    assert all((s.batch, s.seq) != (2, 768) for s in result.samples)


# --- runtimes that keep their workspace (OpenVINO): cumulative readings ----------------------


class Retaining:
    """A runtime that keeps its workspace at the high-water mark of the shapes run so far,
    as OpenVINO's CPU plugin does: a run needing more frees the old buffer and takes a bigger
    one, a smaller run reuses it."""

    def __init__(self) -> None:
        # Anonymous mappings, not malloc: returned to the OS when replaced, whatever state
        # glibc's heap (and its mmap threshold) is in after the other tests.
        self.held: mmap.mmap | None = None

    def __call__(self, batch: int, seq: int) -> None:
        need = true_cost(batch, seq)
        if self.held is None or need > len(self.held):
            if self.held is not None:
                self.held.close()
            self.held = mmap.mmap(-1, need)
        np.frombuffer(self.held, dtype=np.uint8, count=need)[::4096] = 2  # touch what it uses


def test_cumulative_readings_measure_a_runtime_that_keeps_its_workspace():
    """Per-run readings of a retaining runtime are increments (a smaller shape after a bigger
    one reads 0); cumulative ones (above the RSS before the first shape) are what the process
    holds once a shape has run, which in ascending order is each shape's own cost: the fit
    recovers the truth."""
    shapes = [(1, 256), (4, 256), (1, 1024), (2, 1024), (1, 2048), (1, 4096)]
    per_run, keeping = probe.PeakMeter(), Retaining()
    per_run.measure(keeping, 1, 2048)
    assert per_run.measure(keeping, 1, 512)[0] < 2 * MiB  # it reused the held buffer
    growth = per_run.measure(keeping, 1, 4096)[0]
    assert growth < 0.8 * true_cost(1, 4096)  # only the growth over (1, 2048)
    result = run_probe(Retaining(), shapes=shapes, held_out=(2, 768), guard=WIDE,
                       log=lambda _: None, meter=probe.PeakMeter(cumulative=True))
    for s in result.samples:
        assert s.workspace_bytes == pytest.approx(true_cost(s.batch, s.seq), abs=3 * MiB,
                                                  rel=0.05)
    assert result.fit is not None and result.fit.a == pytest.approx(A, rel=0.1)


def test_local_probe_measures_with_its_meter_and_closes():
    """A LocalProbe runs the request's shapes through its run and meter, then calls close."""
    seen: list[bool] = []
    closed: list[bool] = []

    class Meter(probe.PeakMeter):
        def __init__(self, cumulative: bool = False) -> None:
            super().__init__(cumulative)
            seen.append(cumulative)

    source = probe.LocalProbe(fake_run, close=lambda: closed.append(True), meter=Meter,
                              log=lambda _: None)
    request = probe.ProbeRequest(shapes=SHAPES, held_out=(2, 768), guard=WIDE, cumulative=True)
    import threading

    result = source.measure(request, threading.Event())
    assert result.fit is not None and seen == [True] and closed == [True]


def test_describe_says_how_the_fit_was_raised():
    """The one-line summary carries every term, both errors and the covering note."""
    fit_ = Fit(a=41000.0, b=0.5, max_rel_residual=0.2, held_out_rel_error=0.04, c=12 * MiB,
               cover="c raised by 3.0 MiB ...")
    line = probe.describe(fit_)
    assert "c=12.0 MiB/run" in line and "a=41000" in line and "held-out error 4%" in line
    assert line.endswith("c raised by 3.0 MiB ...")


# Recorded: the full-size random bge-m3's bf16 IR on OpenVINO 2026.4 (2-core AMD EPYC Zen 3,
# no native bf16), the probe's cumulative readings in cost order (batch, seq, bytes, s), and
# its held-out shape (scripts/serve-check.py ov ... BGE_M3_MODEL=bf16 BGE_M3_EP=openvino).
OPENVINO_POOL = [(1, 64, 4816896, 1.01), (1, 128, 421687296, 1.56), (1, 256, 432095232, 2.28),
                 (8, 64, 444674048, 4.36), (1, 512, 443142144, 5.15),
                 (4, 256, 466345984, 12.44), (2, 1024, 533581824, 25.63),
                 (1, 2048, 536670208, 24.97)]
OPENVINO_POOL_HELD = (2, 768, 504700928, 16.4)


def test_cumulative_readings_fit_once_the_pool_readings_before_it_are_left_out() -> None:
    """OpenVINO grows its pool at the first shape past a size and keeps it: the reading
    before it (4.8 MiB) made every form miss (1, 128) by 92-98 % and the server kept the
    conservative model. Without the readings under the noise floor, c + a·B·S fits within
    a few %, c is the pool, and no measured shape is under-predicted."""
    from bgeserve.tuning.costmodel import FitError, MiB, Sample, fit
    from bgeserve.tuning.probe import pooled

    samples = [Sample(*x) for x in OPENVINO_POOL]
    held = Sample(*OPENVINO_POOL_HELD)
    with pytest.raises(FitError, match=r"misses shape \(1, 128\)"):
        fit(samples, held)  # what the server did with every reading
    found = fit(pooled(samples), held)
    assert 380 * MiB < found.c < 425 * MiB
    assert found.max_rel_residual < 0.1 and found.held_out_rel_error < 0.1
    for x in [*samples, held]:
        assert found.predict(x.batch, x.seq) >= 0.9 * x.workspace_bytes
    assert pooled(samples[:3]) == samples[:3]  # too few above the floor: all kept


def test_the_probe_command_says_an_unusable_cache_dir_in_one_line(
        tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``bgeserve probe`` with a cache directory that is a file: one line and exit 3, as
    ``serve`` says it (a 30-line traceback before)."""
    from bgeserve.cli import main

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("BGE_M3_MODEL_PATH", str(tiny_export))
    monkeypatch.setenv("BGE_M3_CACHE_DIR", str(tmp_path / "file"))
    assert main(["probe"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bgeserve probe: cache directory") and "Traceback" not in err[0]
