"""The cost model checked against what chunks really cost, while serving.

The probe fits ``workspace(batch, seq)`` once; nothing said afterwards whether serving chunks
stay inside it (another allocator behaviour, a runtime upgrade, shapes the probe never saw).
``WorkspaceAudit`` takes, at most once per ``interval_s``, one chunk that runs alone (so the
process's peak is its own): the caller resets the peak RSS before ``session.run`` and reads it
after (``tuning.memory``; two small /proc accesses), and ``record``s the growth next to the
cost model's prediction for that shape. It keeps the ratio measured / predicted as a
histogram (for /metrics) and a summary (for the heartbeat). A chunk over its prediction by
more than the probe's own validation tolerance (25 %, the held-out limit), and over the
probe's noise floor, is logged as a warning and handed to ``on_breach`` (the service starts a
re-probe in the background), at most once per ``breach_interval_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

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


class WorkspaceAudit:
    """Sampled measured-vs-predicted workspace of chunks (thread-safe)."""

    def __init__(self, *, interval_s: float = 1.0, tolerance: float = TOLERANCE,
                 floor_bytes: int = NOISE_FLOOR, breach_interval_s: float = 300.0,
                 on_breach: Callable[[AuditSample], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.tolerance = tolerance
        self.floor_bytes = floor_bytes
        self.breach_interval_s = breach_interval_s
        self.on_breach = on_breach
        self.clock = clock
        self._lock = threading.Lock()
        self._next_due = float("-inf")
        self._next_breach = float("-inf")
        self.buckets = [0] * (len(RATIO_BUCKETS) + 1)  # the last one is +Inf
        self.count = 0
        self.ratio_sum = 0.0
        self.breaches = 0
        self.last: AuditSample | None = None
        self.worst: AuditSample | None = None

    def due(self) -> bool:
        """Whether to measure the chunk about to run (claims the slot: True once per
        interval). Call it only for a chunk that will run alone."""
        with self._lock:
            now = self.clock()
            if now < self._next_due:
                return False
            self._next_due = now + self.interval_s
            return True

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
            return {"samples": self.count, "breaches": self.breaches,
                    "last_ratio": None if self.last is None else round(self.last.ratio, 3),
                    "max_ratio": None if self.worst is None else round(self.worst.ratio, 3)}
