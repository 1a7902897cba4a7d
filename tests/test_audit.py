"""WorkspaceAudit: sampled chunks' measured workspace against the cost model's prediction."""

from __future__ import annotations

import logging

import pytest

from bgeserve.tuning.audit import RATIO_BUCKETS, AuditSample, MiB, WorkspaceAudit


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_one_chunk_per_interval_is_measured() -> None:
    """due() claims the slot: True once, then False until the interval has passed."""
    clock = Clock()
    audit = WorkspaceAudit(interval_s=1.0, clock=clock)
    assert audit.due() and not audit.due()
    clock.t = 0.9
    assert not audit.due()
    clock.t = 1.0
    assert audit.due()


def test_ratios_fill_a_cumulative_histogram_and_the_summary() -> None:
    """measured/predicted goes in the first bucket whose edge is >= it; the summary keeps the
    last and the worst."""
    audit = WorkspaceAudit()
    for measured in (50, 100, 120, 400):
        audit.record(AuditSample(4, 128, 100 * MiB, measured * MiB))
    buckets, total = audit.histogram()
    as_dict = dict(buckets)
    assert as_dict["0.5"] == 1 and as_dict["1.0"] == 2 and as_dict["1.25"] == 3
    assert as_dict["3.0"] == 3 and as_dict["+Inf"] == 4
    assert [le for le, _ in buckets] == [*map(str, RATIO_BUCKETS), "+Inf"]
    assert total == pytest.approx(0.5 + 1.0 + 1.2 + 4.0)
    assert audit.summary() == {"samples": 4, "discarded": 0, "breaches": 1, "last_ratio": 4.0,
                               "max_ratio": 4.0}


def test_a_breach_warns_and_calls_back_once_per_interval(caplog: pytest.LogCaptureFixture):
    """Over the prediction by more than the tolerance (and over the noise floor): a warning
    naming the shape and the knob-free cause, and on_breach; repeated breaches inside the
    interval are counted but not reported again."""
    clock = Clock()
    seen: list[AuditSample] = []
    audit = WorkspaceAudit(on_breach=seen.append, breach_interval_s=60, clock=clock)
    caplog.set_level(logging.WARNING, logger="bgeserve.tuning")
    audit.record(AuditSample(8, 512, 100 * MiB, 124 * MiB))  # inside the 25 % tolerance
    audit.record(AuditSample(8, 512, 1 * MiB, 10 * MiB))  # 10x, but under the noise floor
    assert seen == [] and audit.breaches == 0
    audit.record(AuditSample(8, 512, 100 * MiB, 130 * MiB))
    audit.record(AuditSample(8, 512, 100 * MiB, 200 * MiB))
    assert [s.measured_bytes for s in seen] == [130 * MiB] and audit.breaches == 2
    assert "(8 x 512) chunk grew RSS by 130 MiB, 30% over" in caplog.text
    clock.t = 61
    audit.record(AuditSample(1, 8192, 100 * MiB, 300 * MiB))
    assert len(seen) == 2


class FakeMemory:
    """tuning.memory's RSS and peak, driven by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rss = 500 * MiB
        self.peak = self.rss
        self.resets = 0
        from bgeserve.tuning import audit as module

        monkeypatch.setattr(module.memory, "rss_bytes", lambda: self.rss)
        monkeypatch.setattr(module.memory, "peak_rss_bytes", lambda: self.peak)
        monkeypatch.setattr(module.memory, "reset_peak_rss", self._reset)

    def _reset(self) -> bool:
        self.resets += 1
        self.peak = self.rss
        return True

    def run(self, workspace: int, keep: int = 0) -> None:
        """A session.run that peaks ``workspace`` above RSS and keeps ``keep`` afterwards."""
        self.peak = max(self.peak, self.rss + workspace)
        self.rss += keep


def test_a_lone_chunk_is_measured_around_its_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """begin resets the peak; end records peak - RSS before against the prediction."""
    mem = FakeMemory(monkeypatch)
    audit = WorkspaceAudit(lambda b, s: 100 * MiB)
    m = audit.begin(4, 256)
    assert m is not None and mem.resets == 1
    mem.run(80 * MiB)
    audit.end(m)
    assert audit.last == AuditSample(4, 256, 100 * MiB, 80 * MiB)
    assert audit.begin(4, 256) is None  # not due again within the interval
    audit.end(None)


def test_overlapping_or_polluted_measurements_are_discarded(monkeypatch):
    """A chunk that starts while one is measured spoils it; RSS that stays up after the run
    (another thread allocated) spoils it; no cost model, no measurement."""
    mem = FakeMemory(monkeypatch)
    clock = Clock()
    audit = WorkspaceAudit(lambda b, s: 100 * MiB, clock=clock)
    first = audit.begin(1, 128)
    second = audit.begin(1, 128)  # a second worker starts meanwhile
    assert first is not None and second is None
    mem.run(60 * MiB)
    audit.end(second)
    audit.end(first)
    clock.t = 2
    third = audit.begin(2, 64)
    mem.run(30 * MiB, keep=20 * MiB)  # a big request body parsed meanwhile
    audit.end(third)
    assert audit.count == 0 and audit.discarded == 2
    clock.t = 4
    assert WorkspaceAudit(lambda b, s: None, clock=clock).begin(1, 8) is None
