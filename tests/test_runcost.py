"""What a run costs (``tuning.runcost``) and the packing rule it gives ``binpack.plan``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from bgeserve.engine.binpack import plan
from bgeserve.engine.packing import Packer, Rules
from bgeserve.tuning.cache import ProbeCache
from bgeserve.tuning.costmodel import Fit
from bgeserve.tuning.probe import ProbeResult
from bgeserve.tuning.runcost import (
    FRESH_SHAPES,
    LONG_SEQ,
    MAX_RESIDUAL,
    SHAPES,
    RunCost,
    fit,
    fit_shorter,
    long_attention,
    measure_new_shape,
    measure_run_cost,
)

# OpenVINO int8 on a 2-core Zen 4 (docs/benchmarks.md): ~11 ms a run, ~0.76 ms a token.
OV_INT8 = RunCost(fixed=0.0114, per_token=0.00076, per_pair=3.4e-7)


def always(batch: int, seq: int) -> bool:
    return True


def test_fit_recovers_the_cost_it_was_timed_with():
    timings = [(b, s, OV_INT8.seconds(b, s)) for b, s in SHAPES]
    got = fit(timings)
    assert got.fixed == pytest.approx(OV_INT8.fixed, rel=1e-6)
    assert got.per_token == pytest.approx(OV_INT8.per_token, rel=1e-6)
    assert got.per_pair == pytest.approx(OV_INT8.per_pair, rel=1e-4)


def test_fit_drops_a_term_noise_made_negative():
    """Timings with no attention share and a little noise that would make it negative: the
    refit without it keeps the other two terms and never returns a negative cost."""
    cost = RunCost(fixed=0.01, per_token=0.001)
    timings = [(b, s, cost.seconds(b, s) * (0.995 if s == 384 else 1.0)) for b, s in SHAPES]
    got = fit(timings)
    assert got is not None and got.per_pair == 0.0 and got.per_token > 0
    assert got.fixed == pytest.approx(0.01, rel=0.1)
    assert got.per_token == pytest.approx(0.001, rel=0.05)


def test_fit_without_a_fixed_cost_keeps_attention():
    """No fixed cost, noise pushing it below 0: the fit drops it, not attention's term."""
    cost = RunCost(fixed=0.0, per_token=0.001, per_pair=2e-6)
    timings = [(b, s, cost.seconds(b, s) * (1.03 if (b, s) == (1, 16) else 1.0))
               for b, s in SHAPES]
    timings[0] = (1, 16, timings[0][2] * 0.9)
    got = fit(timings)
    assert got is not None and got.fixed == 0.0
    assert got.per_pair == pytest.approx(2e-6, rel=0.1)


@pytest.mark.parametrize("timings", [
    [(b, s, 0.1 / (b * s)) for b, s in SHAPES],  # bigger runs faster: nothing describes it
    [(b, s, RunCost(0.01, 0.001).seconds(b, s) * (3.0 if s == 64 else 1.0))
     for b, s in SHAPES],  # one shape disturbed far past MAX_RESIDUAL
])
def test_timings_no_fit_describes_give_no_cost(timings):
    assert fit(timings) is None


@pytest.mark.parametrize(("cost", "joins"), [
    (RunCost(fixed=0.0, per_token=1e-3), [(3, 10, 10), (1, 100, 100)]),  # only equal lengths
    (RunCost(fixed=0.010, per_token=1e-3), [(1, 100, 109), (2, 100, 104)]),  # < 10 ms padding
])
def test_a_text_joins_only_where_padding_costs_less_than_its_run(cost, joins):
    for count, longest, length in joins:
        assert cost.joining_pays(count, longest, length)
    # One token more padding than the fixed cost pays for: the text runs alone.
    worst = max(0, round(cost.fixed / cost.per_token))
    assert not cost.joining_pays(1, 100, 100 + worst + 1)
    assert not cost.joining_pays(2, 100, 100 + worst // 2 + 1)


def test_attention_makes_padding_long_texts_dearer():
    cost = RunCost(fixed=0.010, per_token=1e-3, per_pair=1e-5)
    assert cost.joining_pays(1, 20, 25)
    assert not cost.joining_pays(1, 400, 405)  # 5 tokens of a 400-token text cost 45 ms


def test_a_run_of_a_count_the_session_has_not_run_costs_the_new_shape_too():
    """OpenVINO prepares its kernels for every new token count (37 ms here): on a session that
    has met no shape a text joins where the padding costs less than its run and the new shape
    it would meet alone; where the session has run the counts, against its run alone."""
    cost = RunCost(fixed=0.010, per_token=1e-3, new_shape=0.037)
    fresh, warm = (lambda tokens: False), (lambda tokens: True)
    assert not cost.joining_pays(1, 100, 130)  # 30 ms of padding against a 10 ms run
    assert not cost.joining_pays(1, 100, 130, known=warm)
    assert cost.joining_pays(1, 100, 130, known=fresh)  # 30 ms against 10 + 37
    assert not cost.joining_pays(1, 100, 150, known=fresh)  # 50 ms against 47
    # Only new counts pay: the joined chunk's 260 known, the others not.
    assert cost.joining_pays(1, 100, 130, known=lambda tokens: tokens == 260)
    # Never less joining than by the runs' own cost: the joined count (200, 210) new, the rest
    # known, joining still pays by the runs alone (it buys the count; declined, the saved run
    # would be paid every time these texts meet).
    assert cost.joining_pays(1, 100, 100, known=lambda tokens: tokens == 100)
    assert cost.joining_pays(1, 100, 105, known=lambda tokens: tokens in (100, 105))
    assert not cost.joining_pays(1, 100, 130, known=lambda tokens: tokens in (100, 130))


def test_a_runtime_that_takes_any_shape_packs_alike_whatever_the_session_has_run():
    cost = RunCost(fixed=0.010, per_token=1e-3)
    for known in (lambda tokens: False, lambda tokens: True, None):
        assert not cost.joining_pays(1, 100, 130, known=known)
        assert cost.joining_pays(1, 100, 105, known=known)


def test_plan_batches_more_for_a_session_that_has_met_few_shapes():
    lengths = [120, 100, 135]
    cost = RunCost(fixed=0.010, per_token=1e-3, new_shape=0.037)

    def packed(known=None):
        return plan(lengths, fits=always, max_chunk=64, max_tokens=1024, min_fill=0.75,
                    run_cost=cost, known=known)

    assert [c.indices for c in packed(lambda tokens: False)] == [(1, 0, 2)]
    assert [c.indices for c in packed(lambda tokens: True)] == [(1,), (0,), (2,)]
    assert packed() == packed(lambda tokens: True)
    packer = Packer(Rules(max_chunk=64, max_tokens=1024, min_fill=0.75, run_cost=cost))
    assert len(packer.plan(lengths, known=lambda tokens: False)) == 1


def test_plan_asks_about_the_counts_chunks_run_at_once_rounded():
    """With pad_multiple 16, a chunk of 100- and 120-token texts runs at 2 x 128: that count
    (and 112, 128 for the runs apart) is what a session may have run."""
    asked: list[int] = []

    def known(tokens: int) -> bool:
        asked.append(tokens)
        return False

    plan([100, 120], fits=always, max_chunk=64, max_tokens=1024, min_fill=0.75,
         pad_multiple=16, pad_cap=512, run_cost=RunCost(fixed=0.01, per_token=1e-3,
                                                        new_shape=0.037), known=known)
    assert sorted(set(asked)) == [112, 128, 256]


def test_plan_with_a_small_run_cost_does_not_pad_texts_of_different_lengths():
    """Four one-text clients of 100-480 tokens on OpenVINO int8: min_fill 0.75 alone pads them
    together; the run cost leaves each to its own run, and still batches equal short texts."""
    lengths = [300, 480, 250, 100]
    loose = plan(lengths, fits=always, max_chunk=64, max_tokens=1024, min_fill=0.75)
    assert max(len(c.indices) for c in loose) > 1
    costed = plan(lengths, fits=always, max_chunk=64, max_tokens=1024, min_fill=0.75,
                  run_cost=OV_INT8)
    assert [c.indices for c in costed] == [(3,), (2,), (0,), (1,)]
    assert sum(c.padded_tokens for c in costed) == sum(lengths)
    shorts = plan([16, 16, 17, 16], fits=always, max_chunk=64, max_tokens=1024, min_fill=0.75,
                  run_cost=OV_INT8)
    assert [c.indices for c in shorts] == [(0, 1, 3, 2)]  # 3 tokens of padding < 11 ms


@pytest.mark.parametrize("lengths", [
    [16, 20, 24],  # 24 pads the two before it by 4 and 8 tokens: ~9 ms of an 11 ms run
    [20, 20, 20, 24],  # three texts 4 tokens each: ~9 ms, not four texts (~12 ms)
])
def test_the_cost_of_joining_is_the_padding_of_the_texts_already_in_the_chunk(lengths):
    chunks = plan(lengths, fits=always, max_chunk=64, max_tokens=1024, min_fill=0.75,
                  run_cost=OV_INT8)
    assert len(chunks) == 1


def test_joining_is_priced_at_the_lengths_chunks_are_rounded_to():
    """With pad_multiple 32 four texts of 40-50 tokens are all padded to 64 whether 50 runs
    with them or alone: joining costs no padding, and saves a run."""
    chunks = plan([40, 40, 40, 50], fits=always, max_chunk=64, max_tokens=1024, min_fill=0.75,
                  pad_multiple=32, run_cost=OV_INT8)
    assert [(c.indices, c.pad_to) for c in chunks] == [((0, 1, 2, 3), 64)]
    unrounded = plan([40, 40, 40, 50], fits=always, max_chunk=64, max_tokens=1024,
                     min_fill=0.75, run_cost=OV_INT8)
    assert len(unrounded) == 2  # 3 texts x 10 tokens: ~23 ms of padding against an 11 ms run


def test_plan_with_a_run_cost_never_pads_more_than_min_fill_allows():
    """A run that costs far more than its tokens (a GPU's launch) pads up to min_fill, no
    further: the run cost only ever splits chunks min_fill would have formed."""
    lengths = [10, 11, 12, 30, 31, 100, 400, 401]
    gpu_like = RunCost(fixed=10.0, per_token=1e-6)
    baseline = plan(lengths, fits=always, max_chunk=64, max_tokens=4096, min_fill=0.75)
    costed = plan(lengths, fits=always, max_chunk=64, max_tokens=4096, min_fill=0.75,
                  run_cost=gpu_like)
    assert costed == baseline
    for cost in (OV_INT8, RunCost(fixed=0.05, per_token=1e-3)):
        chunks = plan(lengths, fits=always, max_chunk=64, max_tokens=4096, min_fill=0.75,
                      run_cost=cost)
        assert sorted(i for c in chunks for i in c.indices) == list(range(len(lengths)))
        for c in chunks:
            real = sum(lengths[i] for i in c.indices)
            assert len(c.indices) == 1 or real >= 0.75 * c.padded_tokens


def test_the_packer_applies_a_run_cost_from_the_next_plan_on():
    packer = Packer(Rules(max_chunk=64, max_tokens=1024, min_fill=0.75))
    lengths = [300, 250]
    assert len(packer.plan(lengths)) == 1
    packer.set_run_cost(OV_INT8)
    assert len(packer.plan(lengths)) == 2
    packer.set_run_cost(None)
    assert len(packer.plan(lengths)) == 1


class FakeClock:
    """Advances by what ``seconds(batch, seq)`` says the last run took, plus ``new`` the
    first time a run holds its count of tokens (as OpenVINO prepares its kernels)."""

    def __init__(self, seconds: Callable[[int, int], float], new: float = 0.0):
        self.seconds, self.new, self.now, self.runs = seconds, new, 0.0, []

    def run(self, batch: int, seq: int) -> None:
        if all(b * s != batch * seq for b, s in self.runs):
            self.now += self.new
        self.runs.append((batch, seq))
        self.now += self.seconds(batch, seq)

    def __call__(self) -> float:
        return self.now


def test_measure_warms_each_shape_then_times_interleaved_rounds():
    clock = FakeClock(OV_INT8.seconds)
    logged: list[str] = []
    got = measure_run_cost(clock.run, rounds=2, clock=clock, log=logged.append)
    # one warm-up pass, two timed rounds; then the new shapes: once new, twice more
    assert clock.runs == list(SHAPES) * 3 + list(FRESH_SHAPES) * 3
    assert got is not None and got.fixed == pytest.approx(OV_INT8.fixed, rel=1e-6)
    assert got.new_shape == 0.0
    assert "ms per run" in logged[-1] and "0.0 ms more for a new shape" in logged[-1]


def test_measure_times_what_a_new_shape_costs():
    """A runtime that pays 37 ms the first time it meets a token count: the warm-up absorbs it
    for the fitted shapes, and the fresh shapes read it."""
    clock = FakeClock(OV_INT8.seconds, new=0.037)
    got = measure_run_cost(clock.run, clock=clock, log=lambda m: None)
    assert got is not None and got.new_shape == pytest.approx(0.037, rel=1e-6)
    assert got.fixed == pytest.approx(OV_INT8.fixed, rel=1e-6)


def test_a_new_shape_never_costs_less_than_nothing():
    """Noise that makes the first runs faster than the repeats reads as no cost."""
    times = iter([0.08, 0.08, 0.1, 0.1, 0.1, 0.1])
    clock = FakeClock(lambda b, s: next(times))
    assert measure_new_shape(clock.run, ((1, 41), (1, 67)), clock) == 0.0
    assert measure_new_shape(clock.run, (), clock) == 0.0


@pytest.mark.parametrize("first, expect", [
    ((0.14, 0.14, 0.14), 0.04),  # 40 ms on 100 ms runs: a new shape's cost
    ((0.105, 0.105, 0.105), 0.0),  # 5 ms on 100 ms runs: below NEW_SHAPE_FLOOR, noise
    ((0.14, 0.14, 0.099), 0.0),  # one first run faster than its repeats: noise
])
def test_a_new_shape_cost_is_told_from_noise(first, expect):
    """ONNX Runtime's first runs read a few ms slower now and then; what the packer pads for
    must stand clear of that: every fresh shape slower the first time, by ≥ 10 % of a run."""
    times = iter([*first, *[0.1] * 6])
    clock = FakeClock(lambda b, s: next(times))
    assert measure_new_shape(clock.run, ((1, 41), (1, 67), (1, 97)), clock) == \
        pytest.approx(expect)


def test_a_failing_fresh_shape_leaves_the_run_cost_without_it():
    clock = FakeClock(OV_INT8.seconds)
    logged: list[str] = []

    def run(batch: int, seq: int) -> None:
        if (batch, seq) in FRESH_SHAPES:
            raise MemoryError("no room")
        clock.run(batch, seq)

    got = measure_run_cost(run, clock=clock, log=logged.append)
    assert got is not None and got.new_shape == 0.0
    assert got.fixed == pytest.approx(OV_INT8.fixed, rel=1e-6)
    assert any("a new shape's cost not measured, MemoryError" in m for m in logged)


def test_measure_times_only_shapes_within_max_seq():
    clock = FakeClock(OV_INT8.seconds)
    got = measure_run_cost(clock.run, rounds=1, clock=clock, max_seq=128, log=lambda m: None)
    assert got is not None and {s for _, s in clock.runs} == {16, 64, 128, 41, 67, 97}
    clock = FakeClock(OV_INT8.seconds)
    got = measure_run_cost(clock.run, rounds=1, clock=clock, max_seq=64, log=lambda m: None)
    assert got is not None and {s for _, s in clock.runs} == {16, 64, 41}
    few: list[str] = []
    assert measure_run_cost(clock.run, clock=clock, max_seq=32, log=few.append) is None
    assert "2 shapes fit max_seq 32" in few[-1]


def test_measure_gives_none_when_no_fit_describes_the_runs():
    logged: list[str] = []
    clock = FakeClock(lambda b, s: 0.1 / (b * s))  # bigger runs faster
    assert measure_run_cost(clock.run, clock=clock, log=logged.append) is None
    assert f"no fit within {MAX_RESIDUAL:.0%}" in logged[-1]


def test_measure_gives_none_when_a_run_fails():
    def run(batch: int, seq: int) -> None:
        if seq == 384:
            raise MemoryError("no room")

    logged: list[str] = []
    assert measure_run_cost(run, log=logged.append) is None
    assert "not measured, MemoryError" in logged[-1]


@pytest.mark.parametrize("data", [None, "x", {}, {"fixed": 1, "per_token": 1},
                                  {"fixed": -1, "per_token": 1, "per_pair": 0},
                                  {"fixed": 0, "per_token": 0, "per_pair": 0},
                                  {"fixed": "NaN", "per_token": 1, "per_pair": 0},
                                  {"fixed": [1], "per_token": 1, "per_pair": 0},
                                  {"fixed": 10 ** 400, "per_token": 1, "per_pair": 0},
                                  {"fixed": 1, "per_token": 1, "per_pair": 0, "new_shape": -1},
                                  {"fixed": 1, "per_token": 1, "per_pair": 0, "new_shape": "x"},
                                  {"fixed": 1, "per_token": 1, "per_pair": 0,
                                   "new_shape": float("inf")},
                                  *({"fixed": 1, "per_token": 1, "per_pair": 0, "attention": a}
                                    for a in (0, -5, "x", [1], float("nan"), float("inf")))])
def test_a_damaged_record_reads_as_no_cost(data):
    assert RunCost.from_json(data) is None


# The probe's memory shapes at least LONG_SEQ long (probe._BASE_SHAPES, max_seq 8,192).
LONG_RUNS = ((2, 1024), (1, 2048), (1, 4096), (1, 8192))


def test_the_attention_length_is_read_off_the_long_runs():
    """Runs whose attention costs 4x what the short shapes' fit says (the tiny model's kernels
    change with length): the length is read off the long ones, what shorter runs took is left
    out, and one run disturbed by other work (2x slower) does not move it."""
    truth = replace(OV_INT8, per_pair=4 * OV_INT8.per_pair)
    runs = [(b, s, truth.seconds(b, s)) for b, s in LONG_RUNS]
    want = OV_INT8.per_token / truth.per_pair
    assert long_attention(OV_INT8, runs) == pytest.approx(want, rel=1e-9)
    disturbed = [(b, s, t * (2.0 if s == 4096 else 1.0)) for b, s, t in runs]
    shorter = [(1, LONG_SEQ - 1, 50.0), (8, 64, 50.0)]  # slow, but too short to count
    assert long_attention(OV_INT8, disturbed + shorter) == pytest.approx(want, rel=0.2)
    assert long_attention(OV_INT8, shorter) is None
    assert long_attention(OV_INT8, []) is None
    # Each run was its shape's first: what a new shape costs is not read as attention.
    fresh = replace(OV_INT8, new_shape=0.5)
    first = [(b, s, t + fresh.new_shape) for b, s, t in runs]
    assert long_attention(fresh, first) == pytest.approx(want, rel=1e-9)
    # No attention beyond the fit's per-token part (a GPU, say): the fit's own term stands.
    flat = [(b, s, OV_INT8.fixed + b * s * OV_INT8.per_token * 0.99) for b, s in LONG_RUNS]
    assert long_attention(OV_INT8, flat) is None


def test_the_attention_length_measured_is_the_one_the_cost_gives():
    fitted = OV_INT8.per_token / OV_INT8.per_pair
    assert OV_INT8.attention_tokens == pytest.approx(fitted)
    assert replace(OV_INT8, attention=40.0).attention_tokens == 40.0
    assert RunCost(0.01, per_token=1e-3).attention_tokens is None
    assert replace(OV_INT8, attention=40.4).as_info()["attention_tokens"] == 40
    assert OV_INT8.as_info()["attention_tokens"] is None


def test_measure_reads_the_attention_length_off_the_long_runs_it_is_given():
    truth = replace(OV_INT8, per_pair=4 * OV_INT8.per_pair)
    long = [(b, s, truth.seconds(b, s)) for b, s in LONG_RUNS]
    logged: list[str] = []
    clock = FakeClock(OV_INT8.seconds)
    got = measure_run_cost(clock.run, clock=clock, long=long, log=logged.append)
    assert got is not None and got.attention is not None
    assert got.attention == pytest.approx(OV_INT8.per_token / truth.per_pair, rel=0.05)
    assert f"at {got.attention:.0f} tokens on the runs of at least {LONG_SEQ}" in logged[-1]
    clock = FakeClock(OV_INT8.seconds)
    alone = measure_run_cost(clock.run, clock=clock, log=logged.append)
    assert alone is not None and alone.attention is None and "not measured" in logged[-1]


def test_a_runtime_whose_kernels_change_past_a_length_is_fitted_on_the_shorter_shapes():
    # The tiny test model's int8 graph on a 2-core Zen 3: 1x128 0.9 ms, 1x384 11-12 ms (its
    # blocked attention), which no one quadratic follows beside the shorter shapes: without
    # a cost its long texts' attention was the admission's default, 2,048 tokens, where its
    # long runs read ~30-70 (a request of 2,048 texts of ~2,300 tokens admitted as ~2 min of
    # work under a 300 s deadline ran ~16 min: its 504 came after 300 s of work).
    short = RunCost(fixed=0.0006, per_token=2.5e-6)
    truth = replace(short, per_pair=short.per_token / 40)
    clock = FakeClock(lambda b, s: short.seconds(b, s) * (12.0 if s > 256 else 1.0))
    long = [(b, s, truth.seconds(b, s)) for b, s in LONG_RUNS]
    logged: list[str] = []
    got = measure_run_cost(clock.run, clock=clock, long=long, log=logged.append)
    assert got is not None and got.fixed == pytest.approx(short.fixed, rel=1e-6)
    assert got.per_token == pytest.approx(short.per_token, rel=1e-6)
    assert got.attention == pytest.approx(40, rel=0.05)
    assert "with the 384-token shape no fit came within 30%: fitted on the shapes to 128" in (
        logged[-1])
    # Disturbed below the longest shape, it fits none still.
    clock = FakeClock(lambda b, s: short.seconds(b, s) * (3.0 if s == 64 else 1.0))
    assert measure_run_cost(clock.run, clock=clock, long=long, log=logged.append) is None
    assert f"no fit within {MAX_RESIDUAL:.0%} of the timings" in logged[-1]


def test_the_shorter_shapes_are_fitted_only_where_four_are_left_and_the_longest_ran_slow():
    cost = RunCost(fixed=0.0006, per_token=2.5e-6)
    three = [(1, 16, cost.seconds(1, 16)), (8, 16, cost.seconds(8, 16)),
             (2, 64, cost.seconds(2, 64)), (1, 384, 1.0)]
    assert fit_shorter(three) == (None, 0)  # three shapes fit any three terms: no evidence
    assert fit_shorter([(1, 16, 0.1)]) == (None, 0)
    four = [*three, (1, 128, cost.seconds(1, 128))]
    got, upto = fit_shorter(four)
    assert upto == 128 and got is not None and got.per_token == pytest.approx(2.5e-6, rel=1e-6)
    # The longest ran as the shorter ones' fit says, or faster: not a kernel change.
    assert fit_shorter([*four[:3], four[4], (1, 384, cost.seconds(1, 384))]) == (None, 0)
    assert fit_shorter([*four[:3], four[4], (1, 384, cost.seconds(1, 384) / 3)]) == (None, 0)


def test_a_shorter_shape_disturbed_by_noise_gives_no_cost():
    """Review: with 1x128 twice as slow (noise), the four shapes left when the longest is
    dropped fitted per_token 50x low and per_pair 55x high, and the long runs read an
    attention length of 21 for a true 2,000: long texts counted as ~100x their work."""
    truth = RunCost(fixed=0.0006, per_token=2.5e-6, per_pair=2.5e-6 / 2000)
    timings = [(b, s, truth.seconds(b, s) * (2.0 if s == 128 else 1.0)) for b, s in SHAPES]
    assert fit(timings) is None
    assert fit_shorter(timings) == (None, 0)
    clock = FakeClock(lambda b, s: truth.seconds(b, s) * (2.0 if s == 128 else 1.0))
    long = [(b, s, truth.seconds(b, s)) for b, s in LONG_RUNS]
    assert measure_run_cost(clock.run, clock=clock, long=long, log=lambda m: None) is None


def test_a_record_without_the_new_shape_cost_reads_as_none():
    """A probe child of the version before timed no new shape: nothing to pad for."""
    got = RunCost.from_json({"fixed": 0.01, "per_token": 0.001, "per_pair": 0.0})
    assert got == RunCost(0.01, 0.001, 0.0, new_shape=0.0)
    assert RunCost.from_json(asdict(replace(OV_INT8, new_shape=0.04))).new_shape == 0.04
    assert got.attention is None  # nor the attention length (a cache written before it was)
    assert RunCost.from_json(asdict(replace(OV_INT8, attention=812.5))).attention == 812.5
    assert replace(OV_INT8, new_shape=0.0371).as_info()["new_shape_ms"] == 37.1


def test_the_probe_result_and_cache_carry_the_run_cost(tmp_path: Path):
    timed = replace(OV_INT8, new_shape=0.041, attention=1900.0)  # the child's JSON, whole
    result = ProbeResult([], [], None, None, "e", 1.0, {256: 10.0}, run_cost=timed)
    assert ProbeResult.from_json(json.loads(json.dumps(result.to_json()))).run_cost == timed
    assert ProbeResult.from_json({**result.to_json(), "run_cost": None}).run_cost is None
    old = result.to_json()
    del old["run_cost"]  # a probe child of an older version
    assert ProbeResult.from_json(old).run_cost is None
    store = ProbeCache(tmp_path / "probe-coefficients.json")
    fit_ = Fit(1.0, 2.0, 0.01, 0.02)
    store.save("f" * 64, fit_, {"x": 1}, [], {256: 1.0}, run_cost=timed)
    assert store.run_cost("f" * 64) == timed
    assert json.loads(store.path.read_text())["run_cost"] == asdict(timed)
    assert store.run_cost("e" * 64) is None  # another fingerprint
    store.save("f" * 64, fit_, {"x": 1}, [])  # saved without it (chunk budget pinned)
    assert store.run_cost("f" * 64) is None and store.load("f" * 64) is not None
    store.path.write_text("[1, 2]")
    assert store.run_cost("f" * 64) is None
