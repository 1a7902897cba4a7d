"""What a run of a shape takes on this machine, so the packer pads only where padding pays.

``measure_run_cost`` times a few small unpadded shapes and fits ``binpack.RunCost``: a fixed
cost per run, a cost per token and attention's per token per position (``RunCost``), which the bin-packer
(``engine.binpack.plan``) asks before padding a chunk to take one more text. On the CPU the fixed
part is mostly reading the weights once per run, so it is what batching saves; padding costs
tokens. Where the fixed cost is small against a token's (OpenVINO int8 on a 2-core Zen 4:
~13 ms against ~0.85 ms per token, docs/benchmarks.md) a text should run alone rather than
pad its neighbours by more than ~15 tokens. Never imports a runtime: runs arrive as callables.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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

    @classmethod
    def from_json(cls, data: object) -> RunCost | None:
        """The cost ``asdict`` wrote (a probe's answer, the probe cache); None for anything
        else (an older cache, a damaged record)."""
        if not isinstance(data, Mapping):
            return None
        try:
            values = {k: float(data[k]) for k in ("fixed", "per_token", "per_pair")}
        except (TypeError, KeyError, ValueError):
            return None
        if not all(math.isfinite(v) and v >= 0 for v in values.values()):
            return None
        if values["per_token"] <= 0:
            return None
        return cls(**values)

    def as_info(self) -> dict[str, float]:
        """For ``/info`` and logs: milliseconds per run and per token, microseconds per token
        per position."""
        return {"fixed_ms": round(self.fixed * 1e3, 3),
                "per_token_ms": round(self.per_token * 1e3, 4),
                "per_token_position_us": round(self.per_pair * 1e6, 4)}

    def seconds(self, batch: int, seq: int) -> float:
        return self.fixed + batch * seq * (self.per_token + seq * self.per_pair)

    def joining_pays(self, count: int, longest: int, length: int) -> bool:
        """Whether a text of ``length`` tokens (>= ``longest``) should join a chunk of ``count``
        texts padded to ``longest``, rather than run on its own."""
        return (self.seconds(count + 1, length)
                <= self.seconds(count, longest) + self.seconds(1, length))


# Small shapes, cheap to time (~800 tokens a pass), apart in rows (what the fixed cost is read
# from) and in length at equal rows (what separates attention's share): (8, 16) and (1, 128).
SHAPES = ((1, 16), (8, 16), (2, 64), (1, 128), (1, 384))
ROUNDS = 3


def fit(timings: Sequence[tuple[int, int, float]]) -> RunCost:
    """Least squares of seconds = fixed + per_token·b·s + per_pair·b·s² over ``(batch, seq,
    seconds)``; a term the fit makes negative (noise) is dropped and the rest refitted."""
    rows = np.array([[1.0, b * s, b * s * s] for b, s, _ in timings])
    y = np.array([t for _, _, t in timings])
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(rows[:, keep], y, rcond=None)
        negative = [k for k, c in zip(keep, coef, strict=True) if c < 0 and k != 1]
        if not negative:
            break
        keep.remove(negative[0])
    full = dict.fromkeys(range(3), 0.0) | dict(zip(keep, map(float, coef), strict=True))
    return RunCost(fixed=full[0], per_token=max(full[1], 1e-9), per_pair=full[2])


def measure_run_cost(run: Callable[[int, int], None], shapes: Sequence[tuple[int, int]] = SHAPES,
                     *, rounds: int = ROUNDS, clock: Callable[[], float] = time.perf_counter,
                     log: Callable[[str], None] = logger.info) -> RunCost | None:
    """Time ``run(batch, seq)`` on ``shapes`` (each once to warm up, then ``rounds`` rounds
    interleaved, the fastest run of each counting: a drifting machine drifts for all alike)
    and fit the cost of a run; None (logged) when a run fails: the packer then pads by
    ``min_fill`` alone, as it did before it could measure."""
    best: dict[tuple[int, int], float] = {}
    try:
        for batch, seq in shapes:
            run(batch, seq)
        for _ in range(rounds):
            for shape in shapes:
                start = clock()
                run(*shape)
                elapsed = clock() - start
                best[shape] = min(best.get(shape, elapsed), elapsed)
    except Exception as exc:  # noqa: BLE001 - a failing shape is data, not fatal
        log(f"probe run cost: not measured, {type(exc).__name__}: {exc}")
        return None
    cost = fit([(b, s, t) for (b, s), t in best.items()])
    log(f"probe run cost: {cost.fixed * 1e3:.1f} ms per run, {cost.per_token * 1e3:.3f} ms per "
        f"token, {cost.per_pair * 1e6:.3f} us per token per position "
        f"({', '.join(f'{b}x{s} {t * 1e3:.1f} ms' for (b, s), t in best.items())})")
    return cost
