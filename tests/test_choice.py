"""The measured default variant (bgeserve/service/choice.py) with fake timings: which variants
are timed, which one wins, what is cached under which key, and when the rule stays.

The export is fake (manifest entries over empty files): nothing is loaded, the timer stands in
for the timing process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from bgeserve.config import Settings
from bgeserve.runtime.select import Machine
from bgeserve.service import choice
from bgeserve.service.plan import resolve
from bgeserve.tuning.cache import ChoiceCache
from bgeserve.tuning.child import ChildDied

OPENVINO = Machine(openvino=lambda: True, native_bf16=lambda: False, amx=lambda: False)
NO_OPENVINO = Machine(openvino=lambda: False, native_bf16=lambda: False, amx=lambda: False)
GOOD = {"dense_cos_min": 0.9995, "dense_cos_mean": 0.9998}


def fake_export(root: Path, entries: dict[str, dict[str, Any]]) -> Path:
    """An export whose variants are empty files (``runtime`` as the manifest says)."""
    variants = {}
    for name, extra in entries.items():
        openvino = extra.get("runtime") == "openvino"
        path = f"{name}/model.{'xml' if openvino else 'onnx'}"
        (root / name).mkdir(parents=True)
        (root / path).write_bytes(b"x" * 1000)
        if openvino:
            (root / name / "model.bin").write_bytes(b"x" * 1000)
        variants[name] = {"path": path, **extra}
    (root / "tokenizer.json").write_text("{}")
    (root / "manifest.json").write_text(json.dumps({
        "format": "bgeserve-export", "schema": 1, "variants": variants,
        "model": {"hidden": 32, "heads": 2, "intermediate": 64, "attention_block": 256}}))
    return root


def default_settings(export: Path, cache: Path, **changes: Any) -> Settings:
    """Settings as from an environment that sets neither BGE_M3_EP nor BGE_M3_MODEL."""
    s = Settings(model_path=export, cache_dir=cache, available_memory_bytes=8 << 30,
                 explicit=frozenset({"BGE_M3_MODEL_PATH", "BGE_M3_CACHE_DIR"}), **changes)
    return resolve(s, machine=OPENVINO)


class FakeTimer:
    """Tokens/s per variant, as the timing process would answer; records what it was asked."""

    def __init__(self, rates: dict[str, float | Exception]) -> None:
        self.rates = rates
        self.asked: list[dict[str, Any]] = []

    def __call__(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.asked.append(spec)
        rate = self.rates[spec["variant"]]
        if isinstance(rate, Exception):
            raise rate
        return {"tokens_per_s": rate, "rounds": 2, "model_rss_bytes": 1 << 20}


@pytest.fixture
def export(tmp_path: Path) -> Path:
    return fake_export(tmp_path / "export", {
        "fp32": {}, "int8": {"agreement": GOOD},
        "bf16": {"runtime": "openvino", "agreement": GOOD},
        "fp16": {"agreement": GOOD},  # a GPU variant: never timed on the CPU
        "int8-bad": {"agreement": {"dense_cos_min": 0.97}},
    })


def test_every_candidate_that_meets_the_bar_is_timed_and_the_fastest_serves(export, tmp_path):
    """Candidates come from the manifest (runtime from its entry); fp16 and a variant below
    the bar are left out with a reason; the fastest wins and says it was measured."""
    timer = FakeTimer({"fp32": 250.0, "int8": 800.0, "bf16": 300.0})
    settings = default_settings(export, tmp_path / "cache")
    assert (settings.variant, settings.variant_choice) == ("int8", "rule")
    steps: list[str] = []
    decision = choice.decide(settings, tmp_path / "cache", timer=timer, machine=OPENVINO,
                             on_step=steps.append)
    assert sorted(spec["variant"] for spec in timer.asked) == ["bf16", "bf16", "fp32", "fp32", "int8", "int8"]
    # /health's step says which one is being timed (it said the step before, for minutes).
    assert steps == [f"choosing the variant: timing {spec['variant']} (pass {n} of 2)"
                     for n, spec in zip((1, 1, 1, 2, 2, 2), timer.asked, strict=True)]
    assert timer.asked[0]["variant"] == "int8"  # the rule's pick first
    assert {s["variant"]: s["provider"] for s in timer.asked}["bf16"] == "openvino"
    assert decision.candidates == {"fp32": 250.0, "int8": 800.0, "bf16": 300.0}
    assert set(decision.left_out) == {"fp16", "int8-bad"}
    s = decision.settings
    assert (s.variant, s.execution_provider, s.variant_choice) == ("int8", "cpu", "measured")


def test_a_damaged_variant_is_left_out_with_a_warning(export, tmp_path, caplog):
    """A variant whose file no longer matches the manifest is left out of the timing and said
    in the log (it was only in variant-choice.json's left_out)."""
    (export / "bf16" / "model.bin").unlink()
    timer = FakeTimer({"fp32": 250.0, "int8": 800.0})
    with caplog.at_level(logging.WARNING, logger="bgeserve"):
        decision = choice.decide(default_settings(export, tmp_path / "c"), tmp_path / "c",
                                 timer=timer, machine=OPENVINO)
    assert decision.left_out["bf16"].startswith("cannot be opened")
    assert any("bf16 left out" in r.getMessage() for r in caplog.records), caplog.text


def test_servers_starting_together_on_one_cache_time_once(export, tmp_path):
    """Two starts on one cache directory at once: one times the candidates, the other waits
    (its step says so) and takes that choice (each timed while the other ran, and the last
    one's skewed choice was kept for both: QA with replicas on a shared volume)."""
    import threading

    cache = tmp_path / "shared"
    timing, b_waits = threading.Event(), threading.Event()

    class Held(FakeTimer):
        def __call__(self, spec):
            timing.set()
            assert b_waits.wait(20), "the second start never waited"
            return super().__call__(spec)

    rates = {"fp32": 250.0, "int8": 800.0, "bf16": 300.0}
    timers = [Held(rates), FakeTimer(rates)]
    decided = {}

    def start(i: int, on_step) -> None:
        decided[i] = choice.decide(default_settings(export, cache), cache, timer=timers[i],
                                   machine=OPENVINO, on_step=on_step)

    first = threading.Thread(target=start, args=(0, None), daemon=True)
    first.start()
    assert timing.wait(20)
    second = threading.Thread(target=start, daemon=True, args=(
        1, lambda step: "waiting for another process" in step and b_waits.set()))
    second.start()
    for t in (first, second):
        t.join(30)
        assert not t.is_alive()
    assert timers[0].asked and not timers[1].asked
    assert not decided[0].cached and decided[1].cached
    assert decided[0].settings.variant == decided[1].settings.variant == "int8"


def test_the_measuring_lock_is_none_where_locks_fail_or_a_stop_comes(tmp_path, monkeypatch,
                                                                     caplog):
    """A mount without locks (ENOLCK: NFS without lockd) measures without one, said once,
    instead of failing the start; a stop while waiting ends the wait at once."""
    import errno
    import fcntl
    import threading

    from bgeserve.tuning import lock

    with lock.measuring(tmp_path, "k" * 64) as turn:  # held: another start must wait
        stop = threading.Event()
        stop.set()
        with lock.measuring(tmp_path, "k" * 64, stop) as other:
            assert other == lock.Turn(held=False, waited=True)
        assert turn == lock.Turn(held=True, waited=False)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="bgeserve"), \
            lock.measuring(tmp_path, "j" * 64) as turn:
        assert turn == lock.Turn(held=False, waited=False)
    assert any("No locks available" in r.getMessage() for r in caplog.records)


def test_a_faster_variant_on_another_runtime_moves_the_provider(export, tmp_path):
    """OpenVINO measured fastest: the variant and its provider change together."""
    timer = FakeTimer({"fp32": 250.0, "int8": 300.0, "bf16": 900.0})
    decision = choice.decide(default_settings(export, tmp_path / "c"), tmp_path / "c",
                             timer=timer, machine=OPENVINO)
    assert (decision.settings.variant, decision.settings.execution_provider) == (
        "bf16", "openvino")


def test_the_rule_stays_when_another_is_only_marginally_faster(export, tmp_path):
    """Within PRIOR_MARGIN of the fastest, the rule's pick (the prior) serves: timing noise
    must not move the choice. Every candidate is timed twice, the second pass in the other
    order (A B C, C B A), the mean of its passes counting."""
    timer = FakeTimer({"fp32": 250.0, "int8": 800.0, "bf16": 820.0})
    decision = choice.decide(default_settings(export, tmp_path / "c"), tmp_path / "c",
                             timer=timer, machine=OPENVINO)
    assert decision.settings.variant == "int8"
    asked = [s["variant"] for s in timer.asked]
    assert len(asked) == 6 and asked[3:] == asked[:3][::-1]


def test_a_machine_speeding_up_while_timing_does_not_pick_the_last_timed(export, tmp_path):
    """The machine's speed rises steadily (another job ending) while the candidates are
    timed: int8, twice fp32's speed but timed first, still wins. One pass would have picked
    fp32 (timed at 3x int8's factor); the mirrored second pass cancels the drift."""
    speeds = {"fp32": 250.0, "int8": 500.0}
    calls: list[str] = []

    def timer(spec: dict) -> dict:
        calls.append(spec["variant"])
        factor = 0.5 + (len(calls) - 1)  # 0.5, 1.5, 2.5, 3.5
        return {"tokens_per_s": speeds[spec["variant"]] * factor, "rounds": 2}

    decision = choice.decide(default_settings(export, tmp_path / "c"), tmp_path / "c",
                             timer=timer, machine=NO_OPENVINO)
    # Each pass picked another by far: two passes more, mirrored again, so the drift still
    # cancels (factors 4.5-7.5), and the middle two of four count.
    assert calls == ["int8", "fp32", "fp32", "int8"] * 2
    assert decision.settings.variant == "int8"
    assert decision.candidates == {"int8": 500.0 * (3.5 + 4.5) / 2,
                                   "fp32": 250.0 * (2.5 + 5.5) / 2}


def test_a_pass_disturbed_by_noise_does_not_decide(export, tmp_path):
    """QA: one start's passes read fp32 43,924 then 94,617 tokens/s, int8 105,883 then 59,745
    (another job on the machine): each pass chose another variant, and the mean's choice
    was cached for every later start. Two passes more, and the middle two of four count: here
    fp32 wins, which one slow pass (30,000) made the mean of two lose (65,000 vs 91,000)."""
    rates = {"fp32": iter([30_000.0, 100_000.0, 99_000.0, 101_000.0]),
             "int8": iter([90_000.0, 92_000.0, 91_000.0, 89_000.0])}
    calls: list[str] = []

    def timer(spec: dict) -> dict:
        calls.append(spec["variant"])
        return {"tokens_per_s": next(rates[spec["variant"]]), "rounds": 2}

    decision = choice.decide(default_settings(export, tmp_path / "c"), tmp_path / "c",
                             timer=timer, machine=NO_OPENVINO)
    assert calls == ["int8", "fp32", "fp32", "int8"] * 2
    assert decision.candidates == {"int8": (90_000.0 + 91_000.0) / 2,
                                   "fp32": (99_000.0 + 100_000.0) / 2}
    assert decision.settings.variant == "fp32"


@pytest.mark.parametrize("second", [
    {"int8": 790.0, "fp32": 800.0},  # fp32 ahead in one pass, by less than the margin
    {"int8": 700.0, "fp32": 250.0},  # both passes choose int8
    {"int8": 700.0, "fp32": 250.0, "bf16": 300.0},  # losers trade places: int8 both times
])
def test_passes_that_agree_or_differ_within_the_margin_are_not_timed_again(export, tmp_path,
                                                                          second):
    first = {"int8": 800.0, "fp32": 250.0, "bf16": 200.0}
    calls: list[str] = []
    machine = OPENVINO if "bf16" in second else NO_OPENVINO
    n = len(second)

    def timer(spec: dict) -> dict:
        calls.append(spec["variant"])
        return {"tokens_per_s": (second if len(calls) > n else first)[spec["variant"]],
                "rounds": 2}

    choice.decide(default_settings(export, tmp_path / "c"), tmp_path / "c", timer=timer,
                  machine=machine)
    assert len(calls) == 2 * n and calls[n:] == calls[:n][::-1]


def test_a_candidate_that_fails_a_later_pass_is_left_out_of_the_choice(export, tmp_path):
    """Review: timed in two passes, then its timing process died in the third, it kept the
    mean of its passes, was timed again in the fourth and could still be chosen."""
    rates = {"fp32": iter([300.0, 100.0, 100.0, 100.0]),
             "int8": iter([100.0, 300.0, ChildDied("killed by signal 9"), 300.0])}
    calls: list[str] = []

    def timer(spec: dict) -> dict:
        calls.append(spec["variant"])
        rate = next(rates[spec["variant"]])
        if isinstance(rate, Exception):
            raise rate
        return {"tokens_per_s": rate, "rounds": 2}

    decision = choice.decide(default_settings(export, tmp_path / "c"), tmp_path / "c",
                             timer=timer, machine=NO_OPENVINO)
    assert calls == ["int8", "fp32", "fp32", "int8", "int8", "fp32", "fp32"]
    assert set(decision.candidates) == {"fp32"} and "int8" in decision.left_out
    assert decision.settings.variant == "fp32"


def test_the_choice_is_cached_under_a_key_that_does_not_depend_on_it(export, tmp_path):
    """A warm start times nothing and gets the same choice; the key holds every candidate's
    files, so changing one (a re-export) measures again; remeasure ignores the cache."""
    cache = tmp_path / "cache"
    first = choice.decide(default_settings(export, cache), cache,
                          timer=FakeTimer({"fp32": 250.0, "int8": 300.0, "bf16": 900.0}),
                          machine=OPENVINO)
    untouched = FakeTimer({})
    warm = choice.decide(default_settings(export, cache), cache, timer=untouched,
                         machine=OPENVINO)
    assert untouched.asked == [] and warm.cached
    assert warm.settings == first.settings and warm.candidates == first.candidates
    assert warm.settings.variant_choice == "measured"
    record = json.loads((cache / "variant-choice.json").read_text())
    assert "bf16" not in json.dumps(record["parts"]["runtimes"])  # versions, not the choice
    assert set(record["parts"]["candidates"]) == {"fp32@cpu", "int8@cpu", "bf16@openvino"}
    (export / "fp32" / "model.onnx").write_bytes(b"y" * 2000)
    again = FakeTimer({"fp32": 250.0, "int8": 300.0, "bf16": 900.0})
    choice.decide(default_settings(export, cache), cache, timer=again, machine=OPENVINO)
    assert len(again.asked) == 6  # two passes of three
    forced = FakeTimer({"fp32": 250.0, "int8": 300.0, "bf16": 900.0})
    choice.decide(default_settings(export, cache), cache, timer=forced, machine=OPENVINO,
                  remeasure=True)
    assert len(forced.asked) == 6


@pytest.mark.parametrize("how", ["model", "ep", "disabled"])
def test_nothing_is_measured_when_asked_for_or_disabled(export, tmp_path, how):
    """BGE_M3_MODEL or BGE_M3_EP set (pinned), or BGE_M3_DISABLE_AUTO_BUDGET=1: the rule or
    the setting stands, nothing is timed."""
    settings = default_settings(export, tmp_path / "c")
    if how == "disabled":
        settings = dataclasses.replace(settings, disable_auto_budget=True)
    else:
        name = "BGE_M3_MODEL" if how == "model" else "BGE_M3_EP"
        settings = dataclasses.replace(settings, explicit=settings.explicit | {name})
    timer = FakeTimer({})
    decision = choice.decide(settings, tmp_path / "c", timer=timer, machine=OPENVINO)
    assert timer.asked == [] and decision.settings == settings and decision.candidates == {}


def test_one_candidate_is_no_choice(tmp_path):
    """An export with one variant meeting the bar (here openvino is missing for bf16) keeps
    the rule's pick, says why the others were left out, and times nothing."""
    export = fake_export(tmp_path / "e", {"fp32": {}, "bf16": {"runtime": "openvino",
                                                                "agreement": GOOD}})
    settings = resolve(Settings(model_path=export, cache_dir=tmp_path / "c",
                                explicit=frozenset()), machine=NO_OPENVINO)
    timer = FakeTimer({})
    decision = choice.decide(settings, tmp_path / "c", timer=timer, machine=NO_OPENVINO)
    assert timer.asked == [] and decision.settings.variant_choice == "rule"
    assert "openvino is not installed" in decision.left_out["bf16"]


def test_candidates_that_do_not_fit_or_die_are_left_out(export, tmp_path, monkeypatch):
    """A candidate too big for the memory left is never loaded; one whose timing process dies
    is left out with the reason; the others still decide."""
    sizes = {"fp32": 6 << 30, "int8": 1 << 30, "bf16": 1 << 30}
    monkeypatch.setattr(choice, "memory_needed", lambda s, artifacts, provider, max_seq:
                        sizes[artifacts.variant])
    timer = FakeTimer({"int8": 800.0, "bf16": ChildDied("by signal 9 (out of memory?)")})
    settings = dataclasses.replace(default_settings(export, tmp_path / "c"),
                                   available_memory_bytes=4 << 30)
    decision = choice.decide(settings, tmp_path / "c", timer=timer, machine=OPENVINO)
    assert [s["variant"] for s in timer.asked] == ["int8", "bf16"]
    assert "MiB are free" in decision.left_out["fp32"]
    assert "signal 9" in decision.left_out["bf16"]
    assert decision.candidates == {"int8": 800.0}
    assert decision.settings.variant_choice == "measured"
    # The same memory again: the kept choice. More memory: fp32, left out for want of it,
    # fits now, so the candidates are timed again (the choice was kept without it for good).
    again = FakeTimer({"int8": 800.0, "bf16": 300.0, "fp32": 900.0})
    assert choice.decide(settings, tmp_path / "c", timer=again, machine=OPENVINO).cached
    assert again.asked == []
    roomy = dataclasses.replace(settings, available_memory_bytes=64 << 30)
    grown = choice.decide(roomy, tmp_path / "c", timer=again, machine=OPENVINO)
    assert not grown.cached and grown.settings.variant == "fp32"
    assert "fp32" in {spec["variant"] for spec in again.asked}


def test_nothing_timed_keeps_the_rule(export, tmp_path):
    """Every timing process dies: the rule's pick serves (``rule``), with the reasons."""
    dead = ChildDied("with exit code 1")
    timer = FakeTimer({"fp32": dead, "int8": dead, "bf16": dead})
    settings = default_settings(export, tmp_path / "c")
    decision = choice.decide(settings, tmp_path / "c", timer=timer, machine=OPENVINO)
    assert decision.settings == settings and decision.settings.variant_choice == "rule"
    assert decision.candidates == {} and len(decision.left_out) == 5
    assert ChoiceCache.at(tmp_path / "c").path.exists() is False


def test_the_timing_spec_carries_each_runtimes_chunk_budget(export, tmp_path):
    """Each candidate is timed with the chunk budget it would serve with (its runtime's)."""
    timer = FakeTimer({"fp32": 1.0, "int8": 2.0, "bf16": 3.0})
    choice.decide(default_settings(export, tmp_path / "c"), tmp_path / "c", timer=timer,
                  machine=OPENVINO)
    budgets = {s["variant"]: s["chunk_tokens"] for s in timer.asked}
    assert budgets == {"fp32": 256, "int8": 256, "bf16": 1024}
    assert all(s["task"] == "time" and s["threads"] >= 1 for s in timer.asked)


def test_the_workload_is_cut_to_what_the_model_holds(tmp_path):
    """A model of fewer positions than the workload's longest text (400 tokens) is timed on
    texts cut to what it holds, as the server cuts them: every candidate failed on the longer
    shapes (an index past the position embeddings), and the rule's pick served unmeasured.
    BGE_M3_MAX_SEQ_LENGTH cuts them too; the cut is part of the choice's key."""
    variants = {"fp32": {}, "int8": {"agreement": GOOD}}
    short = fake_export(tmp_path / "short", variants)
    manifest = json.loads((short / "manifest.json").read_text())
    manifest["model"]["max_positions"] = 128
    (short / "manifest.json").write_text(json.dumps(manifest))
    timer = FakeTimer({"fp32": 1.0, "int8": 2.0})
    choice.decide(default_settings(short, tmp_path / "c"), tmp_path / "c", timer=timer,
                  machine=OPENVINO)
    assert timer.asked and {s["max_seq"] for s in timer.asked} == {128}
    timer = FakeTimer({"fp32": 1.0, "int8": 2.0})
    choice.decide(default_settings(fake_export(tmp_path / "long", variants), tmp_path / "d",
                                   max_seq_length=300), tmp_path / "d", timer=timer,
                  machine=OPENVINO)
    assert {s["max_seq"] for s in timer.asked} == {300}


# -- through the Service, on the tiny model: timed for real, then cached -------------------------
@pytest.fixture(scope="module")
def two_variant_export(tiny_export: Path, tiny_export_bf16: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's fp32 (ONNX Runtime) and bf16 (OpenVINO) in one export: two candidates."""
    import shutil

    root = tmp_path_factory.mktemp("two-variants")
    manifest = json.loads((tiny_export / "manifest.json").read_text())
    bf16 = json.loads((tiny_export_bf16 / "manifest.json").read_text())
    # Exported alone, bf16 has no fp32 to be validated against: give it the agreement the
    # tiny model's bf16 measures in a full export (0.99999), so it is a candidate.
    manifest["variants"] = {"fp32": manifest["variants"]["fp32"],
                            "bf16": {**bf16["variants"]["bf16"],
                                     "agreement": {"dense_cos_min": 0.99999}}}
    for src, name in ((tiny_export, "fp32"), (tiny_export_bf16, "bf16")):
        shutil.copytree(src / name, root / name)
    for path in tiny_export.iterdir():
        if path.is_file() and path.name != "manifest.json":
            shutil.copy2(path, root / path.name)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.mark.slow
def test_the_service_serves_the_measured_choice_and_a_restart_reuses_it(two_variant_export,
                                                                         tmp_path):
    """No BGE_M3_EP / BGE_M3_MODEL: each candidate is timed in its own process, the fastest
    serves, /health says ``measured`` with every candidate's tokens/s; a restart with the same
    cache times nothing and serves the same variant, its probe fit a cache hit."""
    import asyncio

    from bgeserve.service import Service
    from bgeserve.tuning import probe as probe_module

    env = {"BGE_M3_MODEL_PATH": str(two_variant_export), "BGE_M3_CACHE_DIR": str(tmp_path),
           "HF_HUB_OFFLINE": "1", "BGE_M3_MAX_SEQ_LENGTH": "512",
           "BGE_M3_AVAILABLE_MEMORY_BYTES": str(8 << 30)}

    def start() -> Service:
        service = Service(Settings.from_env(env))
        service.load_blocking()
        assert service.tuner is not None and service.tuner.wait(60)
        return service

    first = start()
    try:
        model = first.health()["model"]
        assert model["choice"] == "measured", first.choice.left_out
        assert set(model["candidates"]) == {"fp32", "bf16"}
        assert model["variant"] == max(model["candidates"], key=model["candidates"].get) or (
            model["variant"] == "fp32")  # the rule's pick, within the margin
        assert first.engine is not None and first.engine.embed("hello").dense is not None
        status = first.tuner.state.probe_status  # type: ignore[union-attr]
    finally:
        asyncio.run(first.stop())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(choice, "_child_timer", lambda stop: pytest.fail("timed again"))
        mp.setattr(probe_module, "PeakMeter", lambda cumulative: pytest.fail("probed again"))
        second = start()
    try:
        again = second.health()["model"]
        assert (again["variant"], again["choice"]) == (model["variant"], "measured")
        assert again["candidates"] == model["candidates"]
        if status == "complete":
            assert second.health()["tuning"]["probe_status"] == "cache_hit"
    finally:
        asyncio.run(second.stop())


def test_a_pinned_variant_this_cpu_would_saturate_is_served_with_a_warning(tmp_path, caplog):
    """BGE_M3_MODEL=int8 over signed 8-bit weights on a CPU without VNNI: the operator's pick
    stands, but the log says its results may be off (the default never picks it there)."""
    export = fake_export(tmp_path / "export", {
        "fp32": {}, "int8": {"agreement": GOOD, "quantization": {"weights": "s8"}}})
    pinned = Settings(model_path=export, cache_dir=tmp_path / "cache", variant="int8",
                      explicit=frozenset({"BGE_M3_MODEL_PATH", "BGE_M3_MODEL"}))
    for int8_dot, warned in ((True, False), (False, True)):
        caplog.clear()
        machine = dataclasses.replace(NO_OPENVINO, int8_dot=lambda v=int8_dot: v)
        with caplog.at_level("WARNING", logger="bgeserve"):
            s = resolve(pinned, machine=machine)
        assert (s.variant, s.variant_choice) == ("int8", "pinned")
        assert any("BGE_M3_MODEL=int8" in r.getMessage() and "VNNI" in r.getMessage()
                   for r in caplog.records) == warned


def test_each_keys_choice_is_kept_beside_the_newest(tmp_path):
    """Two exports (or settings) in one cache directory by turns: each finds its own measured
    choice (the file held the newest alone, so every switch timed the candidates again)."""
    from bgeserve.tuning.cache import Choice

    store = ChoiceCache.at(tmp_path / "c")
    first = Choice("int8", "cpu", {"int8": 800.0, "fp32": 250.0}, {})
    second = Choice("bf16", "openvino", {"bf16": 900.0}, {"fp32": "too slow"})
    store.save("k1", first, {"export": "one"})
    store.save("k2", second, {"export": "two"})
    assert (store.load("k1"), store.load("k2"), store.load("k3")) == (first, second, None)


def test_a_timing_stopped_by_a_signal_is_not_kept(export, tmp_path):
    """A timing process ended by SIGTERM (the server's process group stopped) leaves its
    candidate out for no reason of its own: the choice serves this start but is not kept, so
    the next start times every candidate again (kept, it left bf16 out for good)."""
    from bgeserve.tuning.child import ChildStopped

    timer = FakeTimer({"fp32": 250.0, "int8": 800.0,
                       "bf16": ChildStopped("on SIGTERM, asked to stop")})
    settings = default_settings(export, tmp_path / "c")
    decision = choice.decide(settings, tmp_path / "c", timer=timer, machine=OPENVINO)
    assert decision.settings.variant == "int8" and "SIGTERM" in decision.left_out["bf16"]
    assert ChoiceCache.at(tmp_path / "c").path.exists() is False


@pytest.mark.slow
def test_a_measured_choice_that_does_not_fit_the_memory_serves_the_next(two_variant_export,
                                                                       tmp_path):
    """fp32 measured fastest but too big for the memory here: the next fastest measured that
    loads in less (bf16: the tiny model's IR holds half fp32's bytes) serves, in the same
    start, and the choice cache says so once it has served, so a restart serves it at once.
    Every start was refused for memory, the refused choice cached: a crash loop."""
    import asyncio

    from bgeserve.service import Service
    from bgeserve.tuning import tuner as tuner_module

    env = {"BGE_M3_MODEL_PATH": str(two_variant_export), "BGE_M3_CACHE_DIR": str(tmp_path),
           "HF_HUB_OFFLINE": "1", "BGE_M3_MAX_SEQ_LENGTH": "512",
           "BGE_M3_AVAILABLE_MEMORY_BYTES": str(8 << 30)}
    rates = {"fp32": 900.0, "bf16": 250.0}
    real = tuner_module.Tuner.check_room
    refused: list[str] = []

    def check_room(self, resident, files, other_variants=lambda: ""):  # fp32 does not fit
        if not self.config.retains_workspace:  # ONNX Runtime's: fp32
            refused.append(other_variants())
            raise tuner_module.DoesNotFit("the model's files alone are too big", param="x")
        return real(self, resident, files, other_variants)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(choice, "_child_timer", lambda stop: lambda spec: {
            "tokens_per_s": rates[spec["variant"]]})
        mp.setattr(tuner_module.Tuner, "check_room", check_room)
        service = Service(Settings.from_env(env))
        service.load_blocking()
    try:
        model = service.health()["model"]
        assert (model["variant"], model["choice"]) == ("bf16", "fallback"), model
        assert refused and "bf16 (~" in refused[0]  # the refusal names what loads in less
        assert "too big" in service.choice.left_out["fp32"]
        assert service.engine is not None and service.engine.embed("hi").dense is not None
    finally:
        asyncio.run(service.stop())
    kept = json.loads(ChoiceCache.at(tmp_path).path.read_text())
    assert (kept["variant"], kept["rates"]) == ("bf16", {"bf16": 250.0})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(choice, "_child_timer", lambda stop: pytest.fail("timed again"))
        again = Service(Settings.from_env(env))
        again.load_blocking()
    try:
        assert (again.health()["model"]["variant"], again.choice.cached) == ("bf16", True)
    finally:
        asyncio.run(again.stop())


def test_ov_int8_is_said_to_take_what_openvino_holds_of_it() -> None:
    """OpenVINO unpacks ov-int8's compressed weights: its 549 MiB IR holds ~2 GiB loaded and
    run (3.7x, measured), where bf16's IR holds about its size. At bf16's 1.7 the check before
    loading asked ~934 MiB of it, and a 1.5 GiB cap OOM-killed the start with nothing said
    (memory QA); an fp32 that did not fit named it as the variant that "loads in less"."""
    mib = 1 << 20
    entries = {"ov-int8": {"total_bytes": 549 * mib, "runtime": "openvino"},
               "bf16": {"total_bytes": 1084 * mib, "runtime": "openvino"},
               "fp32": {"total_bytes": 2166 * mib}}
    assert choice.loaded_bytes(entries, "ov-int8") >= 2061 * mib
    assert choice.loaded_bytes(entries, "bf16") == int(1084 * mib * 1.7)
    assert choice.loaded_bytes(entries, "fp32") == int(2166 * mib * 1.25)



def test_a_timing_process_is_asked_ov_int8s_unpacked_size(tmp_path) -> None:
    """The variant choice leaves out a candidate its timing process has no memory for: ov-int8
    was asked bf16's 1.7x of its files, and its timing child was OOM-killed under a 1.5 GiB cap
    (memory QA). Two IRs of the same files and dimensions: ov-int8 is asked 4.0x, bf16 1.7x."""
    from bgeserve.model.artifacts import resolve as resolve_artifacts

    export = fake_export(tmp_path / "e", {"ov-int8": {"runtime": "openvino"},
                                          "bf16": {"runtime": "openvino"}})
    settings = default_settings(export, tmp_path / "c")
    needs = {v: choice.memory_needed(settings, resolve_artifacts(
        model_path=export, variant=v, cache_dir=tmp_path / "c", offline=True), "openvino")
        for v in ("ov-int8", "bf16")}
    files = 2000  # model.xml and model.bin, 1,000 bytes each
    assert needs["ov-int8"] - needs["bf16"] == int(files * 4.0) - int(files * 1.7)


def test_without_serves_the_next_fastest_that_loads_in_less(tmp_path):
    """``without``: the fastest measured candidate left that loads in less memory serves
    (``fallback``; the full-size bf16, which OpenVINO holds in more than int8, is no way out
    of int8 not fitting), the one left out says why; ``keep`` puts it in the cache. Nothing
    measured left: None, as for a choice that was not measured (a pinned BGE_M3_MODEL is the
    operator's)."""
    gib = 1 << 30
    export = fake_export(tmp_path / "e", {"fp32": {}, "int8": {}, "bf16": {"runtime": "openvino"}})
    manifest = json.loads((export / "manifest.json").read_text())
    for variant, size in (("fp32", 2.27), ("int8", 1.37), ("bf16", 1.14)):
        manifest["variants"][variant]["total_bytes"] = int(size * gib)
    (export / "manifest.json").write_text(json.dumps(manifest))
    assert choice.loaded_bytes(manifest["variants"], "bf16") > choice.loaded_bytes(
        manifest["variants"], "int8")  # 1.14 GB x 1.7 (a bf16 copy) > 1.37 GB x 1.25
    settings = default_settings(export, tmp_path / "c")
    int8_first = choice.Decision(
        dataclasses.replace(settings, variant="int8", variant_choice="measured"),
        {"int8": 800.0, "bf16": 900.0, "fp32": 250.0},
        providers={"bf16": "openvino", "int8": "cpu", "fp32": "cpu"}, key="k0")
    assert choice.without(int8_first, "int8", "too big") is None  # only bigger ones left
    measured = choice.Decision(
        dataclasses.replace(settings, variant="bf16", execution_provider="openvino",
                            variant_choice="measured"),
        {"bf16": 900.0, "int8": 800.0, "fp32": 250.0},
        providers={"bf16": "openvino", "int8": "cpu", "fp32": "cpu"}, key="k1",
        parts={"x": 1})
    nxt = choice.without(measured, "bf16", "too big here")
    assert nxt is not None
    assert (nxt.settings.variant, nxt.settings.execution_provider,
            nxt.settings.variant_choice) == ("int8", "cpu", "fallback")
    assert nxt.left_out == {"bf16": "too big here"} and "bf16" not in nxt.candidates
    assert ChoiceCache.at(tmp_path / "c").load("k1") is None  # kept once it has served
    choice.keep(nxt, tmp_path / "c")
    kept = ChoiceCache.at(tmp_path / "c").load("k1")
    assert kept.variant == "int8"
    # bf16, refused, is timed again once a start has clearly more memory than this one
    assert kept.needs["bf16"] == (8 << 30) + choice.REFUSED_MARGIN_BYTES
    assert choice.without(nxt, "int8", "no") is None  # fp32 loads in more
    # a manifest of an older version records no sizes: no way to tell, no fallback
    del manifest["variants"]["int8"]["total_bytes"]
    (export / "manifest.json").write_text(json.dumps(manifest))
    assert choice.without(measured, "bf16", "too big here") is None
    pinned = dataclasses.replace(measured, settings=dataclasses.replace(
        measured.settings, variant_choice="pinned"))
    assert choice.without(pinned, "bf16", "x") is None


def test_a_choice_timed_while_the_server_stops_is_not_kept(export, tmp_path):
    """The server asked to stop while candidates are timed (its stop event set): no other
    candidate is timed (each was started and killed in turn: QA), what was timed decides
    this start, nothing is kept (the candidates stopped mid-way were left out for no reason
    of their own)."""
    import threading

    stop = threading.Event()
    rates = {"fp32": 250.0, "int8": 800.0, "bf16": 300.0}
    asked = []

    def timer(spec):
        asked.append(spec["variant"])
        stop.set()
        return {"tokens_per_s": rates[spec["variant"]]}

    settings = default_settings(export, tmp_path / "c")
    decision = choice.decide(settings, tmp_path / "c", timer=timer, machine=OPENVINO,
                             stop=stop)
    assert decision.settings.variant_choice == "measured" and asked == ["int8"]
    assert ChoiceCache.at(tmp_path / "c").path.exists() is False
