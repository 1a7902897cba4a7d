"""``bgeserve.bulk.progress``: log lines while a job runs (no model)."""

from __future__ import annotations

import io
import logging

import pytest

from bgeserve.bulk.progress import Progress


def test_progress_is_logged_while_a_shard_is_still_running(caplog: pytest.LogCaptureFixture):
    """A shard of long texts takes minutes: ``tick`` logs the rows its engine job answered so
    far, every ``every_s``, before any shard is written (nothing was logged until then)."""
    progress = Progress(None, bar=False, stream=io.StringIO(), every_s=0.0)
    with caplog.at_level(logging.INFO, logger="bgeserve.bulk"):
        progress.tick(in_flight=40, tokens=4000)
    assert "bulk: 40 rows (40 in the shard being written)" in caplog.text
    assert progress.summary.rows == 0  # counted for good only when the shard is written


def test_ticks_are_logged_no_more_often_than_every_s(caplog: pytest.LogCaptureFixture):
    """Waiting on a shard ticks often; the log gets one line per ``every_s``."""
    progress = Progress(None, bar=False, stream=io.StringIO(), every_s=3600.0)
    with caplog.at_level(logging.INFO, logger="bgeserve.bulk"):
        for n in range(5):
            progress.tick(in_flight=n)
    assert "in the shard being written" not in caplog.text


def test_a_log_line_says_how_far_and_how_long_to_go_where_the_total_is_known(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """With the rows known up front (Parquet footers, plain JSONL), a log line gives the
    total, the share done (bad rows count as done) and the time left at the pace so far (QA:
    only a count and a rate were shown)."""
    from bgeserve.bulk import progress as module

    clock = iter([0.0, 100.0, 250.0])
    monkeypatch.setattr(module.time, "monotonic", lambda: next(clock))
    progress = Progress(1000, bar=False, stream=io.StringIO(), every_s=0.0)
    with caplog.at_level(logging.INFO, logger="bgeserve.bulk"):
        progress.add(rows=180, tokens=9000, bad=20)  # 200 of 1000 in 100 s: 400 s to go
        progress.tick(in_flight=50)  # 250 of 1000 in 250 s: 750 s to go
    lines = [r for r in caplog.records if r.getMessage().startswith("bulk: ")]
    assert lines[0].getMessage().startswith("bulk: 200 of 1000 rows, 20.0% done (0 in the shard")
    assert lines[0].getMessage().endswith("20 bad, 1 shards, about 6m 40s to go")
    assert lines[1].getMessage().startswith("bulk: 250 of 1000 rows, 25.0% done (50 in the")
    assert lines[1].getMessage().endswith(", about 12m 30s to go")
    assert (lines[1].total, lines[1].eta_s) == (1000, 750)  # type: ignore[attr-defined]
    assert module._duration(7500) == "2h 05m" and module._duration(12) == "12s"
