"""The cost model checked against what chunks really cost, while serving.

The probe fits ``workspace(batch, seq)`` once; nothing said afterwards whether serving chunks
stay inside it (another allocator behaviour, a runtime upgrade, shapes the probe never saw).
The scheduler calls ``begin`` before and ``end`` after every ``session.run``. At most once per
``interval_s``, a chunk that starts while no other runs is measured: the peak RSS is reset
before it (``tuning.memory``: a write to /proc/self/clear_refs, a read of statm) and read after
(/proc/self/status), and the growth is recorded next to the cost model's prediction for that
shape. Another chunk starting meanwhile spoils the sample (the peak would be both of theirs),
and so does RSS that stays up after the run by more than half the noise floor (another thread
allocated meanwhile): discarded, never guessed at. Recorded: the ratio measured / predicted as
a histogram (for /metrics) and a summary (for the heartbeat). A chunk over its prediction by
more than the probe's own validation tolerance (25 %, the held-out limit) and over the probe's
noise floor is logged as a warning and handed to ``on_breach`` (the service re-probes in the
background), at most once per ``breach_interval_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from bgeserve.tuning import memory

log = logging.getLogger("bgeserve.tuning")

MiB = 1 << 20
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0)
TOLERANCE = 0.25  # costmodel's max_held_out_error: what the probe itself accepts
NOISE_FLOOR = 16 * MiB  # costmodel's noise_floor_bytes: below it RSS growth is noise


@dataclass(frozen=True)
class AuditSample:
    """One measured chunk."""

    batch: int
    seq: int
    predicted_bytes: int
    measured_bytes: int

    @property
    def ratio(self) -> float:
        return self.measured_bytes / max(1, self.predicted_bytes)


@dataclass
class Measurement:
    """A chunk being measured (``begin``'s token for ``end``)."""

    batch: int
    seq: int
    predicted: int
    baseline: int = 0
    spoiled: bool = False


class WorkspaceAudit:
    """Sampled measured-vs-predicted workspace of chunks (thread-safe).

    ``predict(batch, seq)`` gives the live cost model's workspace bytes (None: no model, so
    nothing to check).
    """

    def __init__(self, predict: Callable[[int, int], float | None] = lambda b, s: None, *,
                 interval_s: float = 1.0, tolerance: float = TOLERANCE,
                 floor_bytes: int = NOISE_FLOOR, breach_interval_s: float = 300.0,
                 on_breach: Callable[[AuditSample], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.tolerance = tolerance
        self.floor_bytes = floor_bytes
        self.breach_interval_s = breach_interval_s
        self.on_breach = on_breach
        self.clock = clock
        self.predict = predict
        self._lock = threading.Lock()
        self._running = 0  # chunks in session.run now
        self._measuring: Measurement | None = None
        self.discarded = 0
        self._next_due = float("-inf")
        self._next_breach = float("-inf")
        self.buckets = [0] * (len(RATIO_BUCKETS) + 1)  # the last one is +Inf
        self.count = 0
        self.ratio_sum = 0.0
        self.breaches = 0
        self.last: AuditSample | None = None
        self.worst: AuditSample | None = None

    def due(self) -> bool:
        """Whether a measurement is due (claims the slot: True once per interval)."""
        with self._lock:
            return self._claim()

    def _claim(self) -> bool:
        now = self.clock()
        if now < self._next_due:
            return False
        self._next_due = now + self.interval_s
        return True

    def begin(self, batch: int, seq: int) -> Measurement | None:
        """Before a chunk of ``batch`` texts padded to ``seq`` runs: its measurement, when it
        runs alone and one is due (else None). Pair every call with ``end``."""
        with self._lock:
            self._running += 1
            if self._measuring is not None:
                self._measuring.spoiled = True  # two chunks share the peak now
            if self._running != 1 or self.clock() < self._next_due:
                return None
            predicted = self.predict(batch, seq)
            if predicted is None or not self._claim():
                return None
            m = self._measuring = Measurement(batch, seq, int(predicted))
        m.baseline = memory.rss_bytes()
        if not memory.reset_peak_rss():  # no clear_refs here: the peak cannot be isolated
            m.spoiled = True
        return m

    def end(self, m: Measurement | None) -> None:
        """After the chunk ran (or failed): record its measurement if it is clean."""
        with self._lock:
            self._running -= 1
            if m is not None and self._measuring is m:
                self._measuring = None
        if m is None:
            return
        peak, after = memory.peak_rss_bytes(), memory.rss_bytes()
        if m.spoiled or after - m.baseline > self.floor_bytes // 2:
            with self._lock:
                self.discarded += 1
            return
        self.record(AuditSample(m.batch, m.seq, m.predicted, max(0, peak - m.baseline)))

    def record(self, sample: AuditSample) -> None:
        """Count one measured chunk; warn and call ``on_breach`` when it broke the model."""
        ratio = sample.ratio
        with self._lock:
            self.count += 1
            self.ratio_sum += ratio
            index = next((i for i, edge in enumerate(RATIO_BUCKETS) if ratio <= edge),
                         len(RATIO_BUCKETS))
            self.buckets[index] += 1
            self.last = sample
            if self.worst is None or ratio > self.worst.ratio:
                self.worst = sample
            breach = (sample.measured_bytes > self.floor_bytes
                      and ratio > 1 + self.tolerance)
            if breach:
                self.breaches += 1
            report = breach and self.clock() >= self._next_breach
            if report:
                self._next_breach = self.clock() + self.breach_interval_s
        if report:
            log.warning(
                "a (%d x %d) chunk grew RSS by %d MiB, %.0f%% over the cost model's %d MiB "
                "(tolerance %.0f%%): the fit no longer describes this server; re-probing in "
                "the background", sample.batch, sample.seq, sample.measured_bytes >> 20,
                100 * (ratio - 1), sample.predicted_bytes >> 20, 100 * self.tolerance)
            if self.on_breach is not None:
                self.on_breach(sample)

    def histogram(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (le, count) pairs, +Inf last, and the sum: Prometheus's histogram."""
        with self._lock:
            out, running = [], 0
            for edge, n in zip((*map(str, RATIO_BUCKETS), "+Inf"), self.buckets, strict=True):
                running += n
                out.append((edge, running))
            return out, self.ratio_sum

    def summary(self) -> dict[str, object]:
        """For the heartbeat and /health: samples, breaches, the last and the worst ratio."""
        with self._lock:
            return {"samples": self.count, "discarded": self.discarded, "breaches": self.breaches,
                    "last_ratio": None if self.last is None else round(self.last.ratio, 3),
                    "max_ratio": None if self.worst is None else round(self.worst.ratio, 3)}
