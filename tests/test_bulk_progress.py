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
