"""The startup probe: measure each shape's own workspace, fit (a, b), cache the fit; and time
a few chunk sizes, so the packer's padded-token budget fits the machine (``choose_chunk_tokens``).

``run_probe`` calls the caller's ``run(batch, seq)`` once per shape (cheap shapes twice) and
measures that run alone: peak RSS is reset before the run and read after it, minus the RSS
before. The caller must disable ONNX Runtime's memory arena on the probe session, so that every
run allocates afresh and returns memory afterwards; otherwise the arena keeps its high-water
mark and later, smaller runs read as zero. ``ProbeCache`` keeps the fit across restarts, keyed by
a fingerprint of everything that changes memory use. Never imports onnxruntime.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, Self

from bgeserve.tuning.chunks import (  # re-exported: the chunk budgets the probe times
    CHUNK_CANDIDATES,
    CHUNK_MARGIN,
    CHUNK_SEQ,
    choose_chunk_tokens,
    time_chunk_budgets,
)
from bgeserve.tuning.costmodel import CostModel, Fit, FitError, MiB, Sample, fit
from bgeserve.tuning.memory import (
    SERVING_MMAP_THRESHOLD,
    peak_rss_bytes,
    pin_mmap_threshold,
    reset_peak_rss,
    rss_bytes,
    trim_heap,
)
from bgeserve.tuning.runcost import FRESH_SHAPES, RunCost, measure_run_cost
from bgeserve.tuning.runcost import SHAPES as RUN_COST_SHAPES

logger = logging.getLogger("bgeserve.probe")
__all__ = ["CHUNK_CANDIDATES", "CHUNK_MARGIN", "CHUNK_SEQ", "LocalProbe", "PeakMeter",
           "ProbeRequest", "ProbeResult", "ProbeSource", "choose_chunk_tokens", "default_held_out",
           "default_shapes", "describe", "probe_table", "run_probe", "time_chunk_budgets"]

# Fitting shapes: batch varies at equal batch·seq so a (∝ B·S) and b (∝ B·S²) separate.
_BASE_SHAPES = [
    (1, 64),
    (8, 64),
    (1, 128),
    (1, 256),
    (4, 256),
    (1, 512),
    (2, 1024),
    (1, 2048),
    (1, 4096),
]
_MIN_SHAPES = 6
# A run this fast is repeated and the larger reading kept: small shapes are where page-fault
# timing and allocator noise matter most, and a second run costs nothing.
_REPEAT_BELOW_SECONDS = 1.0
_SAMPLE_INTERVAL = 0.002
def default_shapes(max_seq: int) -> list[tuple[int, int]]:
    """At least 6 fitting shapes from short to ``max_seq``, ending with ``(1, max_seq)``."""
    shapes = [(b, s) for b, s in _BASE_SHAPES if s < max_seq]
    # Short max_seq leaves few base shapes; pad with fractions of max_seq at larger batches.
    fillers = [
        (2, max_seq),
        (4, max_seq // 2),
        (16, max_seq // 4),
        (2, max_seq // 2),
        (4, max_seq // 4),
        (8, max_seq // 8),
    ]
    for b, s in fillers:
        if len(shapes) + 1 >= _MIN_SHAPES:
            break
        if s >= 1 and (b, s) not in shapes:
            shapes.append((b, s))
    return shapes + [(1, max_seq)]


def default_held_out(max_seq: int) -> tuple[int, int]:
    """One shape, not among ``default_shapes(max_seq)``, to validate the fit on."""
    return (2, 768) if max_seq >= 768 else (3, max(1, max_seq * 3 // 4))


GUARD_SKIP = "predicted "  # how a shape skipped for its predicted cost is reported


@dataclass(frozen=True)
class ProbeResult:
    """What the probe measured and concluded.

    ``skipped`` holds ``(batch, seq, reason)`` for shapes not measured (guard or error);
    ``fit`` is None when ``error`` says why no trustworthy fit came out; ``process_died``
    when the probe's own process ended without an answer (killed for memory, say).
    """

    samples: list[Sample]
    skipped: list[tuple[int, int, str]]
    held_out: Sample | None
    fit: Fit | None
    error: str | None
    seconds: float
    chunk_rates: dict[int, float] = field(default_factory=dict)  # padded tokens → tokens/s
    process_died: bool = False
    run_cost: RunCost | None = None  # what a run of a shape takes (timed with the chunks)
    # Its process was asked to stop (SIGTERM, SIGINT, SIGHUP: a service manager stopping the
    # server's whole process group), not killed: no fact about the model, nothing to remember.
    stopped: bool = False

    @property
    def starved(self) -> bool:
        """No fit because the budget let too few shapes run (fewer than the two a fit needs,
        the others skipped for their predicted cost): a fact about the memory this start had,
        not about the model, so not a failure to remember for later starts."""
        guarded = [reason.startswith(GUARD_SKIP) for _, _, reason in self.skipped]
        # A shape that failed when run is about the model or runtime: that is remembered.
        return (self.fit is None and not self.process_died and len(self.samples) < 2
                and any(guarded) and all(guarded))

    def to_json(self) -> dict[str, Any]:
        """Plain data (the probe process's answer to the server)."""
        return {
            "samples": [asdict(s) for s in self.samples],
            "skipped": [list(s) for s in self.skipped],
            "held_out": asdict(self.held_out) if self.held_out else None,
            "fit": asdict(self.fit) if self.fit else None,
            "error": self.error,
            "seconds": self.seconds,
            "chunk_rates": {str(k): v for k, v in self.chunk_rates.items()},
            "run_cost": asdict(self.run_cost) if self.run_cost else None,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeResult:
        """The result ``to_json`` wrote."""
        return cls(
            [Sample(**s) for s in data["samples"]],
            [(int(b), int(q), str(r)) for b, q, r in data["skipped"]],
            Sample(**data["held_out"]) if data["held_out"] else None,
            Fit(**data["fit"]) if data["fit"] else None,
            data["error"], data["seconds"],
            {int(k): float(v) for k, v in (data.get("chunk_rates") or {}).items()},
            run_cost=RunCost.from_json(data.get("run_cost")))

    @classmethod
    def failed(cls, error: str, *, process_died: bool = False,
               stopped: bool = False) -> ProbeResult:
        """No measurement at all (the probe process died, say)."""
        return cls([], [], None, None, error, 0.0, process_died=process_died, stopped=stopped)


class _PeakSampler:
    """Polls RSS on a thread and keeps the maximum: the fallback when VmHWM cannot be reset.

    It under-reads spikes shorter than the poll interval, and it needs the GIL, which ONNX
    Runtime releases during ``run`` but pure-Python work may not.
    """

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bgeserve-rss-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(_SAMPLE_INTERVAL):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


class PeakMeter:
    """What one run of a shape costs: the peak RSS during the run above a baseline.

    The peak is ``VmHWM`` reset just before the run (``/proc/self/clear_refs`` ← 5), or, where
    that is not writable, a thread polling RSS. The baseline depends on what the runtime does
    with its workspace after a run:

    - ``cumulative=False`` (ONNX Runtime: its arena shrinks after every run): the RSS just
      before the run, so each shape is measured alone.
    - ``cumulative=True`` (OpenVINO: its CPU plugin keeps a stream's intermediate buffers at
      their high-water mark for the life of the compiled model, and a new infer request reuses
      them): the RSS before the probe's first shape. Per-run readings there are increments over
      everything run before (measured: a 4,096-token run after a 1,024-token one read +88 of the
      160 MiB it takes alone, and any smaller shape after it read 0), while the process
      really holds the high-water mark from then on. Run in ascending cost order, each reading
      is what the process holds once that shape has run, which is what serving it costs.
    """

    def __init__(self, cumulative: bool = False) -> None:
        self.cumulative = cumulative
        self._start: int | None = None

    def measure(self, run: Callable[[int, int], None], batch: int,
                seq: int) -> tuple[int, float]:
        """Workspace bytes and seconds of one ``run(batch, seq)``."""
        # Freed-but-resident heap from earlier runs would be reused without raising RSS.
        trim_heap()
        before = rss_bytes()
        if self._start is None:
            self._start = before
        baseline = self._start if self.cumulative else before
        if reset_peak_rss():
            start = time.perf_counter()
            run(batch, seq)
            seconds = time.perf_counter() - start
            peak = peak_rss_bytes()
        else:
            with _PeakSampler() as sampler:
                start = time.perf_counter()
                run(batch, seq)
                seconds = time.perf_counter() - start
            peak = sampler.peak
        return max(0, peak - baseline), seconds


def _sample(run: Callable[[int, int], None], batch: int, seq: int, meter: PeakMeter) -> Sample:
    workspace, seconds = meter.measure(run, batch, seq)
    if seconds < _REPEAT_BELOW_SECONDS:
        workspace = max(workspace, meter.measure(run, batch, seq)[0])
    return Sample(batch, seq, workspace, seconds)


def run_probe(
    run: Callable[[int, int], None],
    *,
    shapes: list[tuple[int, int]],
    held_out: tuple[int, int] | None,
    guard: CostModel,
    log: Callable[[str], None] = logger.info,
    chunk_candidates: Sequence[int] = (),
    chunk_run: Callable[[int, int], None] | None = None,
    meter: PeakMeter | None = None,
) -> ProbeResult:
    """Measure every shape ``guard`` lets through, cheapest first, then fit and validate.

    ``run(batch, seq)`` must execute one inference of exactly that shape. A shape that ``guard``
    predicts not to fit, or whose run raises, is skipped with the reason. The held-out shape is
    measured in the same order and used only to validate the fit. ``meter`` measures each run
    (default: ``PeakMeter()``, each shape alone). With ``chunk_candidates``, the chunk
    budgets are timed last (``time_chunk_budgets``) with ``chunk_run`` (default ``run``); then,
    in every case, what a run of a shape takes (``runcost.measure_run_cost``: the packer's
    padding rule, and, from the shapes' own timings, what a long text's attention costs).
    """
    meter = meter or PeakMeter()
    started = time.perf_counter()
    samples: list[Sample] = []
    skipped: list[tuple[int, int, str]] = []

    def measure(batch: int, seq: int) -> Sample | None:
        if not guard.fits(batch, seq):
            reason = (
                f"{GUARD_SKIP}{guard.cost(batch, seq) / MiB:.0f} MiB exceeds the "
                f"{guard.max_workspace_bytes / MiB:.0f} MiB per-worker budget"
            )
            skipped.append((batch, seq, reason))
            log(f"probe ({batch}, {seq}): skipped, {reason}")
            return None
        try:
            sample = _sample(run, batch, seq, meter)
        # Any failure of the caller's runtime is data about that shape, not fatal to the probe.
        except Exception as exc:  # noqa: BLE001
            skipped.append((batch, seq, f"{type(exc).__name__}: {exc}"))
            log(f"probe ({batch}, {seq}): failed, {type(exc).__name__}: {exc}")
            return None
        log(
            f"probe ({batch}, {seq}): {sample.workspace_bytes / MiB:.1f} MiB "
            f"in {sample.seconds:.2f} s"
        )
        return sample

    # The held-out shape takes its place in cost order too: each shape is measured after smaller
    # ones only. Measured last, after the 8,192-token shape, the full-size fp32 held-out read
    # half its workspace (63.7 MiB, vs 120-130 MiB before it): buffers ONNX Runtime keeps from
    # the biggest run served it, and the fit was rejected for it.
    planned = [(shape, False) for shape in shapes]
    if held_out is not None:
        planned.append((held_out, True))
    held: Sample | None = None
    for (batch, seq), is_held in sorted(planned, key=lambda p: guard.cost(*p[0])):
        sample = measure(batch, seq)
        if sample is not None and is_held:
            held = sample
        elif sample is not None:
            samples.append(sample)
    result_fit: Fit | None = None
    error: str | None = None
    try:
        result_fit = fit(pooled(samples) if getattr(meter, "cumulative", False) else samples, held)
        log(f"probe fit: {describe(result_fit)}")
    except FitError as exc:
        error = str(exc)
        log(f"probe fit rejected: {error}")
    rates = time_chunk_budgets(chunk_run or run, chunk_candidates, guard,
                               log=log) if chunk_candidates else {}
    # Timed whatever the chunk budget: what a run costs decides padding at any budget. Only
    # shapes as long as the probe's own (max_seq) and within the memory guard.
    longest = max((seq for _, seq in [*shapes, *([held_out] if held_out else [])]), default=None)
    run_cost = measure_run_cost(chunk_run or run,
                                [x for x in RUN_COST_SHAPES if guard.fits(*x)],
                                max_seq=longest, log=log,
                                fresh=[x for x in FRESH_SHAPES if guard.fits(*x)],
                                long=[(x.batch, x.seq, x.seconds) for x in samples])
    return ProbeResult(samples, skipped, held, result_fit, error, time.perf_counter() - started,
                       rates, run_cost=run_cost)


def pooled(samples: Sequence[Sample], floor: float = 16 * MiB) -> list[Sample]:
    """Cumulative readings (``PeakMeter(cumulative=True)``) to fit: those under the noise
    floor left out while three or more remain above it.

    OpenVINO's CPU plugin grows its pool at the first shape past a size and keeps it: on the
    full-size bf16 IR (2-core Zen 3) (1, 64) read 4.8 MiB, then (1, 128) 421 MiB and every
    later shape 432-536 MiB. The shapes read before the pool grew say nothing of what serving
    holds, and fitted they made every form miss (1, 128) by 92-98 %. Left out, c + a·B·S fits
    (c ≈ the pool); the fit still covers them (``covering`` raises it over every sample)."""
    above = [x for x in samples if x.workspace_bytes >= floor]
    return above if len(above) >= 3 else list(samples)


def describe(f: Fit) -> str:
    """One line for logs and ``bgeserve probe``: the fit as served and how well it fits."""
    held = "n/a" if f.held_out_rel_error is None else f"{f.held_out_rel_error:.0%}"
    cover = f"; {f.cover}" if f.cover else ""
    return (f"c={f.c / MiB:.1f} MiB/run, a={f.a:.0f} B/token, b={f.b:.2f} B/token², "
            f"worst residual {f.max_rel_residual:.0%}, held-out error {held}{cover}")


@dataclass(frozen=True)
class ProbeRequest:
    """What a probe measures: fitting shapes, the held-out shape, the guard that skips shapes
    predicted not to fit, the chunk budgets to time, and whether readings are cumulative
    (``PeakMeter``: the runtime keeps its workspace)."""

    shapes: list[tuple[int, int]]
    held_out: tuple[int, int] | None
    guard: CostModel
    chunk_candidates: tuple[int, ...] = ()
    cumulative: bool = False


class ProbeSource(Protocol):
    """Where a probe runs: ``measure`` returns what it found (a failed result, never an
    exception, for a probe that could not run); ``stop`` set asks it to give up."""

    def measure(self, request: ProbeRequest, stop: threading.Event) -> ProbeResult: ...


class LocalProbe:
    """The probe in this process, over ``run(batch, seq)`` (``synthetic_run`` on a session).

    ``pin_heap``: make glibc map every block of at least that many bytes while the memory
    shapes run, so each run's workspace is mapped and unmapped (``memory.pin_mmap_threshold``;
    see ``service.probe_child`` for why), then leave it at the serving process's settled
    threshold. ``close`` runs when the probe ends (the session it opened). ``meter``: how a run
    is measured (default ``PeakMeter``; tests pass a fake memory reader).
    """

    def __init__(self, run: Callable[[int, int], None], *,
                 chunk_run: Callable[[int, int], None] | None = None,
                 close: Callable[[], None] | None = None, pin_heap: int | None = None,
                 meter: Callable[[bool], PeakMeter] | None = None,
                 log: Callable[[str], None] = logger.info) -> None:
        self.run, self.chunk_run, self.close = run, chunk_run, close
        self.pin_heap, self.meter, self.log = pin_heap, meter, log

    def measure(self, request: ProbeRequest, stop: threading.Event) -> ProbeResult:
        meter = (self.meter or PeakMeter)(request.cumulative)
        if self.pin_heap is not None:
            pin_mmap_threshold(self.pin_heap)
        try:
            return run_probe(self.run, shapes=request.shapes, held_out=request.held_out,
                             guard=request.guard, log=self.log,
                             chunk_candidates=request.chunk_candidates,
                             chunk_run=self.chunk_run, meter=meter)
        finally:
            if self.pin_heap is not None:
                pin_mmap_threshold(SERVING_MMAP_THRESHOLD)
            if self.close is not None:
                self.close()


def probe_table(result: ProbeResult) -> str:
    """A markdown table of a probe: measured vs fitted workspace per shape, held-out marked."""
    rows = ["| batch | seq | measured MiB | fitted MiB | error | seconds |",
            "|---:|---:|---:|---:|---:|---:|"]
    f = result.fit
    shapes = [(s, "") for s in result.samples]
    if result.held_out is not None:
        shapes.append((result.held_out, " (held out)"))
    for sample, note in shapes:
        measured = sample.workspace_bytes / 2**20
        if f is not None:
            fitted = f.predict(sample.batch, sample.seq) / 2**20
            err = f"{(fitted - measured) / max(measured, 1e-9):+.0%}"
            fitted_s = f"{fitted:.0f}"
        else:
            fitted_s, err = "—", "—"
        rows.append(f"| {sample.batch} | {sample.seq}{note} | {measured:.0f} | {fitted_s} | {err} "
                    f"| {sample.seconds:.2f} |")
    for batch, seq, reason in result.skipped:
        rows.append(f"| {batch} | {seq} | skipped: {reason} | | | |")
    return "\n".join(rows)
