"""The workspace cost model: ``bytes(batch, seq) = c + a·batch·seq + b·batch·seq²``.

A leaf: pure arithmetic, no runtime (numpy only inside ``fit_cab``). ``CostModel`` answers
"does this chunk fit the per-worker budget?"; ``conservative_coefficients`` gives an
upward-biased (a, b) from the model's dimensions; ``fit`` turns probe measurements into
(c, a, b) or says why it cannot. The theory and the numbers behind the defaults are in
``docs/startup-probe.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bgeserve.errors import ConfigError

MiB = 1 << 20
# No measured shape is predicted further below its measurement (of max(measured, noise floor))
# by a served fit (``covering``); stricter than the held-out tolerance (25 %).
MAX_UNDER_PREDICTION = 0.10

# Tensors of width `hidden` alive at the peak of one encoder layer, per token, counted generously:
# residual stream in+out (2), Q/K/V (3) and their per-head transposes (3), context and its
# transpose back (2), attention output projection + LayerNorm temporaries (2), the embedding sum
# (word + position + type, 3), and the graph outputs: `colbert` plus up to two
# `last_hidden_state` copies (3). ONNX Runtime frees most of these as it goes; we assume it doesn't.
_HIDDEN_COPIES = 18
# FFN intermediate (B·S·intermediate) plus the erf-GELU temporaries (x/√2, erf, 1+erf, x·(…)),
# of which at most ~3 are alive at once.
_FFN_COPIES = 3
# Unfused attention materialises the raw scores, the masked/scaled scores and the softmax output
# (B·heads·S·S each); in-place reuse usually keeps it to two (measured b ≈ 130 = 2·16·4), but
# nothing guarantees it.
_SCORE_COPIES = 3


def workspace(c: float, a: float, b: float, batch: int, seq: int) -> float:
    """The cost formula: ``c + a·batch·seq + b·batch·seq²`` bytes (the one place it is written)."""
    return c + a * batch * seq + b * batch * seq * seq


@dataclass(frozen=True)
class CostModel:
    """Predicts a chunk's workspace in bytes and whether it fits ``max_workspace_bytes``.

    ``a`` is bytes per token position (projections, FFN, hidden buffers), ``b`` bytes per token
    position squared (attention scores). Only one layer is alive at a time, so depth does not
    appear.
    """

    a: float
    b: float
    max_workspace_bytes: int
    c: float = 0.0  # fixed bytes per run, whatever its shape (the probe's intercept)

    def __post_init__(self) -> None:
        for name, value in (("a", self.a), ("b", self.b), ("c", self.c)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(
                    f"cost model coefficient {name}={value!r} must be a finite number >= 0; "
                    "check BGE_M3_COST_MODEL_A / BGE_M3_COST_MODEL_B",
                    param=f"BGE_M3_COST_MODEL_{name.upper()}",
                )
        if self.a == 0 and self.b == 0:
            raise ConfigError(
                "cost model a = b = 0 would let any chunk fit; set BGE_M3_COST_MODEL_A or _B > 0",
                param="BGE_M3_COST_MODEL_A",
            )
        if self.max_workspace_bytes < 0:
            raise ConfigError(
                f"max_workspace_bytes={self.max_workspace_bytes} is negative; "
                "check BGE_M3_TOKEN_BUDGET / BGE_M3_AVAILABLE_MEMORY_BYTES",
                param="BGE_M3_TOKEN_BUDGET",
            )

    def cost(self, batch: int, seq: int) -> float:
        """Predicted workspace bytes of ``batch`` texts padded to ``seq`` tokens."""
        return workspace(self.c, self.a, self.b, batch, seq)

    def fits(self, batch: int, seq: int) -> bool:
        """True when ``cost(batch, seq)`` is within the budget."""
        return self.cost(batch, seq) <= self.max_workspace_bytes

    def max_batch(self, seq: int) -> int:
        """The largest count of texts padded to ``seq`` that fits; 0 if one text does not."""
        if seq < 1:
            raise ValueError(f"seq={seq} must be >= 1 (this is a bug in the caller)")
        estimate = int(self.max_workspace_bytes // self.cost(1, seq))
        return _settle(estimate, lambda n: self.fits(n, seq))

    def max_seq(self) -> int:
        """The longest single text (in tokens) that fits; 0 if not even one token does."""
        budget = float(self.max_workspace_bytes) - self.c
        if budget <= 0:
            s = 0.0
        elif self.b == 0:
            s = budget / self.a
        else:
            # Positive root of b·s² + a·s − budget = 0, written to avoid cancellation.
            s = 2 * budget / (self.a + math.sqrt(self.a * self.a + 4 * self.b * budget))
        return _settle(int(s), lambda n: self.fits(1, n))

    def with_budget(self, max_workspace_bytes: int) -> CostModel:
        """The same coefficients under another per-worker budget."""
        return CostModel(self.a, self.b, max_workspace_bytes, self.c)


def _settle(estimate: int, fits: Callable[[int], bool]) -> int:
    """The largest n >= 0 with ``fits(n)``, from an estimate float rounding may have put off."""
    n = estimate
    while fits(n + 1):
        n += 1
    while n > 0 and not fits(n):
        n -= 1
    return n


def conservative_coefficients(
    *, hidden: int = 1024, heads: int = 16, intermediate: int = 4096, dtype_bytes: int = 4,
    attention_block: int = 0,
) -> tuple[float, float]:
    """Upward-biased ``(a, b)`` for a BERT-style encoder run unfused on ONNX Runtime.

    ``a = dtype·(18·hidden + 3·intermediate)``: eighteen hidden-width buffers per token (residual
    in/out, Q/K/V and their per-head transposes, context ×2, projection/LayerNorm temporaries ×2,
    the embedding sum ×3, the ``colbert`` output and two ``last_hidden_state`` copies) plus three
    FFN-width ones (the intermediate and erf-GELU temporaries).
    ``b = dtype·heads·3``: the score tensor, its masked copy and the softmax output, all
    ``heads × seq²`` and alive together in the worst case.

    For bge-m3 fp32 that is ``a = 122,880`` B/token and ``b = 192`` B/token², predicting
    108 MiB at (1,512), 1,008 MiB at (1,2048), 12.9 GiB at (1,8192) and 864 MiB at (8,512),
    against measured 80 MiB, 587 MiB, 8.4 GiB and 351 MiB. Depth does not enter: layers run
    one after another and each frees its intermediates before the next peaks.

    With ``attention_block`` > 0 (graphs exported by bgeserve compute attention over blocks of
    that many query rows), the score tensors are ``heads × block × seq``: linear in seq, so
    their bytes move from ``b`` into ``a`` (``3·dtype·heads·block`` per token) and ``b`` is 0.
    """
    a = float(dtype_bytes * (_HIDDEN_COPIES * hidden + _FFN_COPIES * intermediate))
    b = float(dtype_bytes * heads * _SCORE_COPIES)
    if attention_block > 0:
        return a + b * attention_block, 0.0
    return a, b


@dataclass(frozen=True)
class Sample:
    """One probe measurement: ``workspace_bytes`` above baseline for one run of that shape."""

    batch: int
    seq: int
    workspace_bytes: int
    seconds: float


@dataclass(frozen=True)
class Fit:
    """Fitted coefficients and how well they describe the data they came from.

    ``max_rel_residual`` is the worst fitting-sample error relative to
    ``max(measured, noise floor)``; ``held_out_rel_error`` the same for the held-out shape
    (None when none was given); both as served, after ``covering`` raised the validated fit so
    that no measured shape is under-predicted by more than ``MAX_UNDER_PREDICTION``
    (``cover`` says how; empty when nothing needed raising).
    """

    a: float
    b: float
    max_rel_residual: float
    held_out_rel_error: float | None
    c: float = 0.0
    cover: str = ""

    def predict(self, batch: int, seq: int) -> float:
        """The fitted workspace bytes of ``batch`` texts padded to ``seq`` tokens."""
        return workspace(self.c, self.a, self.b, batch, seq)


class FitError(Exception):
    """The samples do not support a trustworthy fit; the message says why."""


class ShapeSetError(FitError):
    """The probed shapes themselves cannot determine the coefficients (too few, collinear...)."""


def rel_error(a: float, b: float, sample: Sample, floor: float, c: float = 0.0) -> float:
    """``|predicted − measured| / max(measured, floor)`` for one sample."""
    predicted = workspace(c, a, b, sample.batch, sample.seq)
    return abs(predicted - sample.workspace_bytes) / max(sample.workspace_bytes, floor)


def fit(
    samples: Sequence[Sample],
    held_out: Sample | None = None,
    *,
    max_rel_residual: float = 0.5,
    max_held_out_error: float = 0.25,
    noise_floor_bytes: float = 16 * MiB,
    max_under: float = MAX_UNDER_PREDICTION,
) -> Fit:
    """The fit the packer serves with: ``fit_ab``, else (a fixed per-run cost it cannot
    express) ``fit_cab``; validated, then raised to cover the measured shapes (``covering``).

    Together they search every non-negative ``c + a·B·S + b·B·S²`` with any term at 0: what
    every runtime bgeserve ships measures (docs/startup-probe.md §5), from plain attention
    (b ≈ 130 B/token²) to fused kernels (b ≈ 0, a per-run c). Fewer terms first.
    """
    kwargs = {"max_rel_residual": max_rel_residual, "max_held_out_error": max_held_out_error,
              "noise_floor_bytes": noise_floor_bytes}
    try:
        found = fit_ab(samples, held_out, **kwargs)
    except ShapeSetError:
        raise
    except FitError as first:
        try:
            found = fit_cab(samples, held_out, **kwargs)
        except FitError as second:
            raise FitError(f"{first}; with a fixed per-run term: {second}") from None
    return covering(found, samples, held_out, noise_floor_bytes=noise_floor_bytes,
                    max_under=max_under)


def covering(found: Fit, samples: Sequence[Sample], held_out: Sample | None = None, *,
             noise_floor_bytes: float = 16 * MiB,
             max_under: float = MAX_UNDER_PREDICTION) -> Fit:
    """``found`` raised just enough that no measured shape (fitting or held out) is
    under-predicted by more than ``max_under`` of ``max(measured, noise floor)``.

    A least-squares fit leaves about half its shapes below the line (by up to the 50 %
    residual limit), exactly the shapes the packer would then put over budget. One term is
    raised by the least that covers every shape: of c, a or b, the one inflating the measured
    shapes' predictions least, so a short small shape costs MiB of c, not every long text more.
    """
    measured = [*samples, *([held_out] if held_out is not None else [])]
    deficits = []
    for x in measured:
        need = x.workspace_bytes - max_under * max(x.workspace_bytes, noise_floor_bytes)
        gap = need - found.predict(x.batch, x.seq)
        if gap > 0:
            deficits.append((x, gap))
    if not deficits:
        return found
    options = []
    for term, per in (("c", lambda x: 1.0), ("a", lambda x: float(x.batch * x.seq)),
                      ("b", lambda x: float(x.batch * x.seq * x.seq))):
        delta = max(gap / per(x) for x, gap in deficits)
        inflation = max(delta * per(x) / max(x.workspace_bytes, noise_floor_bytes)
                        for x in measured)
        options.append((inflation, term, delta))
    _, term, delta = min(options)
    c, a, b = (v + delta * (term == t) for t, v in (("c", found.c), ("a", found.a),
                                                    ("b", found.b)))
    worst_shape = max(deficits, key=lambda d: d[1])[0]
    amount = f"{delta / MiB:.1f} MiB" if term == "c" else f"{delta:.4g}"
    cover = (f"{term} raised by {amount} so that no measured shape is predicted more than "
             f"{max_under:.0%} below its measurement (most short: ({worst_shape.batch}, "
             f"{worst_shape.seq}))")
    worst = max(rel_error(a, b, x, noise_floor_bytes, c) for x in samples)
    held = None if held_out is None else rel_error(a, b, held_out, noise_floor_bytes, c)
    return Fit(a=a, b=b, max_rel_residual=worst, held_out_rel_error=held, c=c, cover=cover)


def fit_cab(
    samples: Sequence[Sample],
    held_out: Sample | None = None,
    *,
    max_rel_residual: float = 0.5,
    max_held_out_error: float = 0.25,
    noise_floor_bytes: float = 16 * MiB,
) -> Fit:
    """Non-negative weighted least squares of ``c + a·B·S + b·B·S²`` (c: bytes per run).

    ONNX Runtime allocates some buffers per run whatever the shape (measured ~90 MiB on
    full-size bge-m3 with blocked attention), which the two-term model cannot express. Every
    subset of {c, a, b} that contains c is solved and the best non-negative one is kept.
    """
    import itertools

    import numpy as np

    if len(samples) < 3:
        raise FitError(f"need at least 3 measured shapes to fit c, a and b, got {len(samples)}")
    w = np.array([1.0 / max(x.workspace_bytes, noise_floor_bytes) for x in samples])
    cols = np.array([[1.0, x.batch * x.seq, x.batch * x.seq**2] for x in samples]) * w[:, None]
    scale = np.abs(cols).max(axis=0)
    cols = cols / scale
    target = w * np.array([x.workspace_bytes for x in samples], dtype=float)
    best: tuple[float, np.ndarray] | None = None
    for k in (3, 2):
        for subset in itertools.combinations(range(3), k):
            if 0 not in subset:
                continue
            coef, *_ = np.linalg.lstsq(cols[:, subset], target, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(subset)] = coef
            sse = float(((cols @ full - target) ** 2).sum())
            if best is None or sse < best[0]:
                best = (sse, full)
    if best is None:
        raise FitError("no non-negative c, a, b describes the data")
    c, a, b = (best[1] / scale).tolist()
    return _validated(c, a, b, samples, held_out, max_rel_residual, max_held_out_error,
                      noise_floor_bytes, label=f"fit c={c:.4g} a={a:.4g} b={b:.4g}", note="")


def fit_ab(
    samples: Sequence[Sample],
    held_out: Sample | None = None,
    *,
    max_rel_residual: float = 0.5,
    max_held_out_error: float = 0.25,
    noise_floor_bytes: float = 16 * MiB,
) -> Fit:
    """Least-squares ``(a, b) >= 0`` through the samples, validated, or ``FitError``.

    Weighted least squares without intercept: each row is divided by ``max(measured,
    noise_floor_bytes)`` so the objective is relative error, and tiny shapes whose workspace is
    within measurement noise neither dominate nor get ignored. Columns ``batch·seq`` and
    ``batch·seq²`` are scaled to max 1 before solving the 2×2 normal equations. If the
    unconstrained solution has a negative coefficient, the best one-parameter fit (a only or
    b only) is taken instead, which is the exact non-negative least-squares optimum for two
    unknowns; the residual check then decides whether it is good enough.

    Raises:
        FitError: fewer than two samples, collinear shapes, no growth with size, a worst
            relative residual above ``max_rel_residual``, or a held-out error above
            ``max_held_out_error``.
    """
    if len(samples) < 2:
        raise ShapeSetError(f"need at least 2 measured shapes to fit a and b, got {len(samples)}")
    rows = []
    for s in samples:
        w = 1.0 / max(s.workspace_bytes, noise_floor_bytes)
        rows.append((w * s.batch * s.seq, w * s.batch * s.seq**2, w * s.workspace_bytes))
    s1 = max(abs(r[0]) for r in rows)
    s2 = max(abs(r[1]) for r in rows)
    if s1 == 0 or s2 == 0:
        raise ShapeSetError("every sample has batch·seq = 0; probe shapes need batch >= 1, seq >= 1")
    n = [(u1 / s1, u2 / s2, t) for u1, u2, t in rows]
    g11 = sum(r[0] * r[0] for r in n)
    g12 = sum(r[0] * r[1] for r in n)
    g22 = sum(r[1] * r[1] for r in n)
    r1 = sum(r[0] * r[2] for r in n)
    r2 = sum(r[1] * r[2] for r in n)
    det = g11 * g22 - g12 * g12
    # det / (g11·g22) = sin² of the angle between the columns: near 0, noise is amplified ~1/sin.
    if det <= 1e-4 * g11 * g22:
        shapes = sorted({(s.batch, s.seq) for s in samples})
        raise ShapeSetError(
            f"shapes {shapes} are (nearly) collinear in batch·seq vs batch·seq², so a and b "
            "cannot be separated; probe several sequence lengths"
        )
    alpha = (r1 * g22 - r2 * g12) / det
    beta = (g11 * r2 - g12 * r1) / det
    note = ""
    if alpha < 0 or beta < 0:
        negative = "a" if alpha < 0 else "b"
        only_a = (max(r1 / g11, 0.0), 0.0)
        only_b = (0.0, max(r2 / g22, 0.0))

        def sse(ab: tuple[float, float]) -> float:
            return sum((ab[0] * x1 + ab[1] * x2 - t) ** 2 for x1, x2, t in n)

        alpha, beta = min(only_a, only_b, key=sse)
        note = f" (the unconstrained fit had {negative} < 0; kept the best fit with it at 0)"
    a, b = alpha / s1, beta / s2
    if a == 0 and b == 0:
        raise ShapeSetError(
            "measured workspace does not grow with batch·seq (negative coefficients); "
            "is peak-RSS measurement working (arena disabled, clear_refs permitted)?"
        )
    return _validated(0.0, a, b, samples, held_out, max_rel_residual, max_held_out_error,
                      noise_floor_bytes, label=f"fit a={a:.4g} b={b:.4g}", note=note,
                      model="a·B·S + b·B·S²")


def _validated(c: float, a: float, b: float, samples: Sequence[Sample], held_out: Sample | None,
               max_rel_residual: float, max_held_out_error: float, floor: float, *,
               label: str, note: str, model: str = "c + a·B·S + b·B·S²") -> Fit:
    """The fit, once every sample and the held-out shape are close enough; else FitError."""
    errors = [rel_error(a, b, x, floor, c) for x in samples]
    worst = max(errors)
    if worst > max_rel_residual:
        x = samples[errors.index(worst)]
        raise FitError(f"{label} misses shape ({x.batch}, {x.seq}) by {worst:.0%} "
                       f"(limit {max_rel_residual:.0%}){note}; the data is not {model}")
    held_err = None
    if held_out is not None:
        held_err = rel_error(a, b, held_out, floor, c)
        if held_err > max_held_out_error:
            raise FitError(f"{label} predicts held-out shape ({held_out.batch}, {held_out.seq}) "
                           f"{held_err:.0%} off its measured "
                           f"{held_out.workspace_bytes / MiB:.1f} MiB "
                           f"(limit {max_held_out_error:.0%}){note}")
    return Fit(a=a, b=b, max_rel_residual=worst, held_out_rel_error=held_err, c=c)
