"""What a run of a shape takes on this machine, so the packer pads only where padding pays.

``measure_run_cost`` times a few small unpadded shapes and fits a ``RunCost``: a fixed cost per
run, a cost per token and attention's per token per position, which the bin-packer
(``engine.binpack.plan``) asks before padding a chunk to take one more text. On the CPU the
fixed part is mostly reading the weights once per run, so it is what batching saves; padding
costs tokens. Where the fixed cost is small against a token's (OpenVINO int8 on a 2-core Zen 4,
as the server's probe measured it: ~12 ms against ~0.9 ms per token, docs/benchmarks.md) a text
should run alone rather than pad its neighbours by more than ~14 tokens in all.

It also times what a run pays the first time the runtime meets its shape (``new_shape``):
OpenVINO's CPU plugin prepares its kernels for every new count of tokens a run holds (batch ×
padded length), ~35-40 ms on full-size ov-int8 on that Zen 4 whatever the count, ~40 % of a
67-token run; ONNX Runtime's CPU kernels take any shape (0-5 ms, noise: read as 0 below 10 % of
a run). The scheduler then pads a chunk to a count the runtime has already run where that costs
less (``engine.shapes``).

The shapes are timed unpadded (the fused-attention path) while a chunk of unequal lengths runs
masked, which costs a little more per run: the rule prices joining slightly low, so it errs
towards the batching ``min_fill`` alone allowed. Never imports a runtime: runs arrive as
callables.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

logger = logging.getLogger("bgeserve.probe")


@dataclass(frozen=True)
class RunCost:
    """Seconds one run of ``batch`` texts padded to ``seq`` tokens takes: a fixed cost per run
    (on a CPU mostly streaming the weights once), a cost per padded token, and attention's
    per token per position of its text."""

    fixed: float
    per_token: float
    per_pair: float = 0.0
    # What a run pays once more the first time the runtime meets its token count (0: nothing,
    # or not measured: a cache written before it was).
    new_shape: float = 0.0
    # The length at which a text's attention costs as much as the rest of its run, read off
    # the probe's long runs (``long_attention``); None: not measured (a cache written before
    # it was, no run that long), and ``attention_tokens`` falls back on the fit's terms.
    attention: float | None = None

    @classmethod
    def from_json(cls, data: object) -> RunCost | None:
        """The cost ``asdict`` wrote (a probe's answer, the probe cache); None for anything
        else (an older cache, a damaged record)."""
        if not isinstance(data, Mapping):
            return None
        try:
            values = {k: float(data[k]) for k in ("fixed", "per_token", "per_pair")}
        except (TypeError, KeyError, ValueError, ArithmeticError):  # 1e999 as an int overflows
            return None
        if not all(math.isfinite(v) and v >= 0 for v in values.values()):
            return None
        if values["per_token"] <= 0:
            return None
        try:
            new_shape = float(data.get("new_shape", 0.0))
        except (TypeError, ValueError, ArithmeticError):
            return None
        if not (math.isfinite(new_shape) and new_shape >= 0):
            return None
        attention = data.get("attention")
        try:
            attention = None if attention is None else float(attention)
        except (TypeError, ValueError, ArithmeticError):
            return None
        if attention is not None and not (math.isfinite(attention) and attention > 0):
            return None
        return cls(**values, new_shape=new_shape, attention=attention)

    def as_info(self) -> dict[str, float | None]:
        """For ``/health`` and logs: milliseconds per run and per token, microseconds per token
        per position, and the attention length the long runs measured (None: not measured)."""
        return {"fixed_ms": round(self.fixed * 1e3, 3),
                "per_token_ms": round(self.per_token * 1e3, 4),
                "per_token_position_us": round(self.per_pair * 1e6, 4),
                "new_shape_ms": round(self.new_shape * 1e3, 3),
                "attention_tokens": None if self.attention is None else round(self.attention)}

    @property
    def attention_tokens(self) -> float | None:
        """The length at which a text's attention costs as much as the rest of its run: as
        the long runs measured it, else ``per_token / per_pair`` of the short shapes' fit;
        None where neither has an attention term."""
        if self.attention is not None:
            return self.attention
        return self.per_token / self.per_pair if self.per_pair > 0 else None

    def seconds(self, batch: int, seq: int) -> float:
        return self.fixed + batch * seq * (self.per_token + seq * self.per_pair)

    def joining_pays(self, count: int, padded: int, joined: int, alone: int | None = None,
                     known: Callable[[int], bool] | None = None) -> bool:
        """Whether a text should join a chunk of ``count`` texts padded to ``padded`` tokens,
        making ``count + 1`` texts padded to ``joined``, rather than run on its own padded to
        ``alone`` (default ``joined``; lengths as the packer rounds them).

        With ``known`` (the token counts the session has run) a text also joins where it pays
        once each run of a new count costs ``new_shape`` more: a session that has met few
        shapes batches more. Never less than by the runs' own cost, which is what they cost
        once their counts are known: a joined count it has not run is bought (declined, the run
        it would save is paid again every time the same texts meet). A new count the
        scheduler then pads to a known one (``engine.shapes``) costs less than priced here,
        so this errs towards joining."""
        alone = joined if alone is None else alone

        def pays(new_shapes: bool) -> bool:
            def cost(batch: int, seq: int) -> float:
                new = new_shapes and known is not None and not known(batch * seq)
                return self.seconds(batch, seq) + (self.new_shape if new else 0.0)

            return cost(count + 1, joined) <= cost(count, padded) + cost(1, alone)

        return pays(False) or (known is not None and self.new_shape > 0 and pays(True))


# Small shapes, cheap to time (~800 tokens a pass), apart in rows (what the fixed cost is read
# from) and in length at equal rows (what separates attention's share): (8, 16) and (1, 128).
SHAPES = ((1, 16), (8, 16), (2, 64), (1, 128), (1, 384))
ROUNDS = 3
# Token counts no probe shape has (odd, apart from the fitting shapes' and the chunk budgets'
# powers of two), each run once new and twice more: what the first run costs over the best
# repeat is what a new shape costs. Short, as the cost does not grow much with the count
# (full-size ov-int8 on a Zen 4: 36, 33, 41, 42 ms at 67, 131, 263, 521 tokens).
FRESH_SHAPES = ((1, 41), (1, 67), (1, 97))
# A new shape's cost below this share of a run is not told from noise (ONNX Runtime read -1 to
# +5 ms on 80-490 ms runs of these lengths; OpenVINO int8 35-39 ms on 100-160 ms).
NEW_SHAPE_FLOOR = 0.10
# The run cost's own shapes stop at 384 tokens, where attention is a small part of a run, so
# the per_pair they fit scatters between starts (full-size ov-int8 on a 2-core Zen 4: per_token
# / per_pair 747 on one start, 1,634-1,890 on three others), and where its kernels change with
# length it is no model of long texts at all: the tiny test model's (hidden 32) short shapes fit
# 83-825, its runs of 2,048-8,192 tokens read 20-200. The probe's memory shapes reach the
# longest texts (8,192 by default), attention most of their run: ``long_attention`` reads it
# off those at least this long, which is what the deadline's share counts long texts by
# (service.admission). Full-size ov-int8 (2-core Zen 4 VMs): its runs of 1,024-8,192 tokens
# read 1,759-2,057 on two starts whose short fits read 1,801 and 1,888, 3,056 on a third (a
# quiet machine) against 3,461: close where the short fit was not disturbed, and a machine's
# state moves both.
LONG_SEQ = 1024
# A fit that misses a timed shape by more than this is no model of the runs (a start disturbed
# by other work): the packer then pads by min_fill alone. The full-size ov-int8 fit over 24
# shapes missed its smallest by 13 %.
MAX_RESIDUAL = 0.30


def fit(timings: Sequence[tuple[int, int, float]]) -> RunCost | None:
    """Least squares of seconds = fixed + per_token·b·s + per_pair·b·s² over ``(batch, seq,
    seconds)``, the terms non-negative: where the full fit makes one negative (noise), the
    subsets without it are fitted and the closest kept. None when no fit with a positive
    per-token cost comes within ``MAX_RESIDUAL`` of every timing."""
    rows = np.array([[1.0, b * s, b * s * s] for b, s, _ in timings])
    y = np.maximum(np.array([t for _, _, t in timings]), 1e-9)
    best: tuple[float, np.ndarray] | None = None
    for keep in ([0, 1, 2], [0, 1], [1, 2], [1]):  # per_token is never dropped
        if len(timings) < len(keep):
            continue
        coef, *_ = np.linalg.lstsq(rows[:, keep], y, rcond=None)
        if (coef < 0).any() or coef[keep.index(1)] <= 0:
            continue
        full = np.zeros(3)
        full[keep] = coef
        worst = float(np.max(np.abs(rows @ full - y) / y))
        if best is None or worst < best[0]:
            best = (worst, full)
        if keep == [0, 1, 2]:
            break  # the full model fits with every term non-negative: nothing to drop
    if best is None or best[0] > MAX_RESIDUAL:
        return None
    fixed, per_token, per_pair = map(float, best[1])
    return RunCost(fixed=fixed, per_token=per_token, per_pair=per_pair)


def fit_shorter(timings: Sequence[tuple[int, int, float]]) -> tuple[RunCost | None, int]:
    """``fit`` of the timings no longer than the second longest length, where those of the
    longest fit none: what the packer prices is mostly short texts, and a runtime may change
    kernels past a length (the tiny test model's int8 graph on a 2-core Zen 3, past its
    256-row attention blocks: 1x128 0.9 ms, 1x384 11-12 ms, every start), which no one
    quadratic follows; a long text's attention is read off the long runs anyway
    (``long_attention``). Only where the longest shapes ran slower than that fit says by more
    than ``MAX_RESIDUAL`` (a kernel change's mark; review: a shorter shape disturbed by noise
    left four shapes that three terms fit with absurd values, ~50x off) and at least four
    shapes are left (three fit any three terms exactly). ``(None, 0)`` otherwise; else the cost
    and the longest length it was fitted on."""
    lengths = sorted({s for _, s, _ in timings})
    if len(lengths) < 2:
        return None, 0
    upto = lengths[-2]
    kept = [x for x in timings if x[1] <= upto]
    if len(kept) < 4:
        return None, 0
    cost = fit(kept)
    if cost is None or any(t <= cost.seconds(b, s) * (1 + MAX_RESIDUAL)
                           for b, s, t in timings if s > upto):
        return None, 0
    return cost, upto


def long_attention(cost: RunCost, timings: Sequence[tuple[int, int, float]]) -> float | None:
    """The length at which a text's attention costs as much as the rest of its run, read off
    ``(batch, seq, seconds)`` runs at least ``LONG_SEQ`` long: what each took beyond ``cost``'s
    fixed, new-shape and per-token parts (each was its shape's first run), per token per
    position, their median (one run disturbed by other work moves it little). None where no
    run is that long or the median is not positive (attention not seen beside the rest: the
    fit's own term stands)."""
    # Each was its shape's first run: what a new shape costs is not attention (review).
    pairs = [(seconds - cost.fixed - cost.new_shape - batch * seq * cost.per_token)
             / (batch * seq * seq)
             for batch, seq, seconds in timings if seq >= LONG_SEQ and seconds > 0]
    if not pairs:
        return None
    per_pair = float(np.median(pairs))
    return cost.per_token / per_pair if per_pair > 0 else None


def first_and_best(run: Callable[[int, int], None], shapes: Sequence[tuple[int, int]],
                   rounds: int, clock: Callable[[], float] = time.perf_counter,
                   ) -> dict[tuple[int, int], tuple[float, float]]:
    """``shape -> (its first run's seconds, its fastest in rounds after)``: every shape once,
    then ``rounds`` (≥ 1) rounds interleaved, so a drifting machine drifts for all alike. Runs
    may raise (the caller's to handle)."""
    first: dict[tuple[int, int], float] = {}
    best: dict[tuple[int, int], float] = {}
    for shape in shapes:
        start = clock()
        run(*shape)
        first[shape] = clock() - start
    for _ in range(rounds):
        for shape in shapes:
            start = clock()
            run(*shape)
            elapsed = clock() - start
            best[shape] = min(best.get(shape, elapsed), elapsed)
    return {x: (first[x], best[x]) for x in first}


def measure_new_shape(run: Callable[[int, int], None],
                      shapes: Sequence[tuple[int, int]] = FRESH_SHAPES,
                      clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds a run pays the first time the runtime meets its shape: over ``shapes`` (each
    new to the runtime), each first run less the best of two repeats; their median where every
    one is positive and the median is at least ``NEW_SHAPE_FLOOR`` of a repeat's median, else 0
    (noise: a runtime that takes any shape, whose first runs are only now and then slower).
    Runs may raise (the caller's to handle)."""
    timed = first_and_best(run, shapes, 2, clock)
    extra = [first - best for first, best in timed.values()]
    if not extra or min(extra) <= 0:
        return 0.0
    median = float(np.median(extra))
    repeat = float(np.median([best for _, best in timed.values()]))
    return median if median >= NEW_SHAPE_FLOOR * repeat else 0.0


def measure_run_cost(run: Callable[[int, int], None], shapes: Sequence[tuple[int, int]] = SHAPES,
                     *, max_seq: int | None = None, rounds: int = ROUNDS,
                     fresh: Sequence[tuple[int, int]] = FRESH_SHAPES,
                     long: Sequence[tuple[int, int, float]] = (),
                     clock: Callable[[], float] = time.perf_counter,
                     log: Callable[[str], None] = logger.info) -> RunCost | None:
    """Time ``run(batch, seq)`` on ``shapes`` no longer than ``max_seq`` (each once to warm up,
    then ``rounds`` rounds interleaved, the fastest run of each counting: a drifting machine
    drifts for all alike) and fit the cost of a run, then time what a new shape costs on
    ``fresh`` (``measure_new_shape``; shapes past ``max_seq`` left out, none: 0), and read the
    attention length off ``long`` (``(batch, seq, seconds)`` runs timed before: the probe's
    memory shapes; ``long_attention``). Where the longest shape fits no cost beside the others,
    the cost is fitted without it (``fit_shorter``). None (logged) when a run fails or no fit
    describes the timings: the packer then pads by ``min_fill`` alone, as it did before it
    could measure, and a long text's attention is the admission's default."""
    shapes = [(b, s) for b, s in shapes if max_seq is None or s <= max_seq]
    fresh = [(b, s) for b, s in fresh if max_seq is None or s <= max_seq]
    if len(shapes) < 3:
        log(f"probe run cost: not measured, {len(shapes)} shapes fit max_seq {max_seq}")
        return None
    try:  # the first runs warm up; the fastest of the rounds after count
        best = {x: b for x, (_, b) in first_and_best(run, shapes, rounds, clock).items()}
    except Exception as exc:  # noqa: BLE001 - a failing shape is data, not fatal
        log(f"probe run cost: not measured, {type(exc).__name__}: {exc}")
        return None
    try:
        new_shape = measure_new_shape(run, fresh, clock)
    except Exception as exc:  # noqa: BLE001 - the run cost stands without it
        log(f"probe run cost: a new shape's cost not measured, {type(exc).__name__}: {exc}")
        new_shape = 0.0
    timings = [(b, s, t) for (b, s), t in best.items()]
    timed = ", ".join(f"{b}x{s} {t * 1e3:.1f} ms" for b, s, t in timings)
    cost, shorter = fit(timings), ""
    if cost is None:
        cost, upto = fit_shorter(timings)
        if cost is None:
            log(f"probe run cost: no fit within {MAX_RESIDUAL:.0%} of the timings ({timed})")
            return None
        shorter = (f"; with the {max(s for _, s, _ in timings)}-token shape no fit came within "
                   f"{MAX_RESIDUAL:.0%}: fitted on the shapes to {upto} tokens")
    cost = replace(cost, new_shape=new_shape)
    cost = replace(cost, attention=long_attention(cost, long))
    fitted = f"{cost.per_token / cost.per_pair:.0f}" if cost.per_pair > 0 else "none"
    measured = ("not measured" if cost.attention is None
                else f"at {cost.attention:.0f} tokens on the runs of at least {LONG_SEQ}")
    log(f"probe run cost: {cost.fixed * 1e3:.1f} ms per run, {cost.per_token * 1e3:.3f} ms per "
        f"token, {cost.per_pair * 1e6:.3f} us per token per position, {new_shape * 1e3:.1f} ms "
        f"more for a new shape ({timed}{shorter}); a text's attention costs as much as the rest "
        f"of its run {measured} (the short shapes' fit: {fitted})")
    return cost
