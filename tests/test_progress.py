"""Tests for bgeserve.progress: start-up steps and transfers, logged and shown in /health."""

from __future__ import annotations

import json
import logging

import pytest

from bgeserve.logs import JsonFormatter
from bgeserve.progress import Progress


def _json_lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [json.loads(JsonFormatter().format(r)) for r in caplog.records]


def test_steps_are_logged_with_their_names_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    """Each step is one JSON log line naming it (and its place among the steps), and the
    snapshot /health shows says which step runs and how far the steps have got."""
    progress = Progress()
    with caplog.at_level(logging.INFO, "bgeserve.progress"):
        progress.step("download")
        snapshot = progress.snapshot()
        progress.step("prepare: int8", 2, 4)
        progress.note("[export 3.0s] smoothing")

    lines = _json_lines(caplog)
    assert snapshot == {"step": "download", "progress": 0.0}
    assert lines[0]["step"] == "download" and lines[0]["msg"] == "start-up step: download"
    assert (lines[1]["step"], lines[1]["step_index"], lines[1]["steps"]) == ("prepare: int8", 2, 4)
    assert lines[2]["msg"] == "prepare: int8: [export 3.0s] smoothing"
    assert progress.snapshot() == {"step": "prepare: int8", "progress": 0.25, "index": 2, "of": 4}
    progress.done()
    assert progress.snapshot() == {}


def test_transfers_log_bytes_at_most_once_a_period_and_at_the_end(
        caplog: pytest.LogCaptureFixture) -> None:
    """A transfer enters the download step; bytes done / total are logged for the first
    report, then no more often than the period, and always when the file completes; the
    snapshot follows every report."""
    progress = Progress(period=3600)
    with caplog.at_level(logging.INFO, "bgeserve.progress"):
        progress.step("hashing the model files")
        for done in (1 << 20, 2 << 20, 3 << 20):
            progress.transfer("onnx/model.onnx_data", done, 4 << 20)
        middle = progress.snapshot()
        progress.transfer("onnx/model.onnx_data", 4 << 20, 4 << 20)

    records = _json_lines(caplog)
    lines = [line for line in records if "bytes_done" in line]
    assert [r["msg"] for r in records].count("start-up step: download") == 1
    assert [(x["bytes_done"], x["bytes_total"]) for x in lines] == [(1 << 20, 4 << 20),
                                                                   (4 << 20, 4 << 20)]
    assert lines[0]["file"] == "onnx/model.onnx_data" and "(25%)" in lines[0]["msg"]
    assert middle == {"step": "download", "progress": 0.75, "file": "onnx/model.onnx_data",
                      "bytes_done": 3 << 20, "bytes_total": 4 << 20}


def test_an_unknown_total_is_logged_as_such(caplog: pytest.LogCaptureFixture) -> None:
    """A file whose size the hub did not say is logged with bytes done and no total."""
    progress = Progress()
    with caplog.at_level(logging.INFO, "bgeserve.progress"):
        progress.transfer("x.bin", 5 << 20, None)
    (line,) = [r for r in _json_lines(caplog) if "bytes_done" in r]
    assert line["bytes_done"] == 5 << 20 and "bytes_total" not in line and "of ? MiB" in line["msg"]


def test_export_steps_are_json_step_lines_with_their_place_and_time(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bgeserve export`'s steps go through the same Progress as prepare's: each step a line
    with its name and place among the steps, and its time when it ends (no bare prints)."""
    import subprocess

    from bgeserve.export import main as export_main

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    with caplog.at_level(logging.INFO):
        export_main._run_step(["int8", "a", "b"], "3/5 int8")
        export_main._progress.step("hashing")
    lines = _json_lines(caplog)
    assert (lines[0]["step"], lines[0]["step_index"], lines[0]["steps"]) == ("int8", 3, 5)
    assert lines[1]["step"] == "int8" and lines[1]["msg"].startswith("3/5 int8: ")
    assert isinstance(lines[1]["seconds"], float)
    assert lines[2]["step"] == "hashing"
