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
    assert audit.summary() == {"samples": 4, "breaches": 1, "last_ratio": 4.0, "max_ratio": 4.0}


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
