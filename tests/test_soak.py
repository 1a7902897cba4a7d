"""scripts/soak.py: its checks and verdict, and its 60-second form against a live tiny server.

The short run (``-m soak`` selects it) is the CI form of the 30-minute soak in
docs/reliability.md: the same timeline (capacity, load at 80 % of it with faults, a SIGTERM and
a SIGHUP restart, idle unload/reload cycles) compressed into a minute.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("soak_under_test", SCRIPTS / "soak.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def _body(n: int, vectors: dict[int, list[float]] | None = None) -> dict[str, Any]:
    vectors = vectors or {}
    return {"data": [{"index": i, "embedding": vectors.get(i, [0.0, 1.0])} for i in range(n)]}


def test_a_200_must_hold_each_input_in_order_and_the_canary_unchanged(soak: ModuleType):
    """Indices 0..n-1 in order; the canary's vector equal to the reference (fp32: 1e-5)."""
    ref = np.array([0.6, 0.8], dtype=np.float32)
    texts = ["a", soak.CANARY, "b"]
    good = _body(3, {1: [0.6, 0.8]})
    assert soak.check_body(good, texts, "/v1/embeddings", ref, fp32=True) is None
    swapped = {"data": [good["data"][1], good["data"][0], good["data"][2]]}
    assert "indices" in soak.check_body(swapped, texts, "/v1/embeddings", ref, fp32=True)
    short = _body(2, {1: [0.6, 0.8]})
    assert "indices" in soak.check_body(short, texts, "/v1/embeddings", ref, fp32=True)
    moved = _body(3, {1: [0.6, 0.80003]})
    assert "canary" in soak.check_body(moved, texts, "/v1/embeddings", ref, fp32=True)
    assert soak.check_body(moved, texts, "/v1/embeddings", ref, fp32=False) is None


def _report(**changes: Any) -> dict[str, Any]:
    report = {"failures": {"lost": 0, "5xx": 0, "unreadable": 0, "mismatch": 0,
                           "unexpected": 0},
              "events": [{"event": "SIGTERM", "exit_code": 0}, {"event": "SIGHUP", "exit_code": 0},
                         {"event": "idle", "unloaded": True}],
              "rss_slope_mib_per_min": 0.2}
    report.update(changes)
    return report


def test_the_verdict_names_every_breach(soak: ModuleType):
    """A clean report passes; a lost request, a missed restart, an idle gap without unload or
    a steep RSS slope (when a bar is set) each fail it."""
    args = type("Args", (), {"max_rss_slope": None})()
    assert soak.verdict(_report(), args) == []
    assert soak.verdict(_report(failures={**_report()["failures"], "lost": 2}), args) == [
        "lost: 2"]
    assert "restarts" in soak.verdict(_report(events=[{"event": "idle", "unloaded": True}]),
                                      args)[0]
    assert "idle" in soak.verdict(_report(events=[*_report()["events"][:2],
                                                  {"event": "idle", "unloaded": False}]),
                                  args)[0]
    args.max_rss_slope = 1.0
    assert "slope" in soak.verdict(_report(rss_slope_mib_per_min=1.5), args)[0]
    assert soak.verdict(_report(), args) == []


@pytest.mark.slow
@pytest.mark.soak
def test_a_60_second_soak_passes(tiny_export: Path, tmp_path: Path) -> None:
    """60 s of load at 80 % of capacity with disconnects, malformed, oversized and
    unauthorized requests, a SIGTERM and a SIGHUP restart and idle unload/reload cycles:
    nothing lost, no 5xx, every refusal readable, every result right, both restarts exit 0."""
    report_path = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "soak.py"), "--duration", "60", "--model-path",
         str(tiny_export), "--work-dir", str(tmp_path / "work"), "--report", str(report_path)],
        capture_output=True, text=True, timeout=400, check=False)
    assert report_path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert run.returncode == 0 and report["verdict"] == "PASS", json.dumps(report, indent=1)
    requests = report["requests"]
    for kind in ("normal 200", "drain 200", "malformed 400", "oversized 413",
                 "unauthorized 401"):
        assert requests.get(kind, 0) > 0, (kind, requests)
    assert requests.get("disconnect gone", 0) > 0, requests
    events = {e["event"]: e for e in report["events"]}
    assert events["SIGTERM"]["exit_code"] == 0 and events["SIGHUP"]["exit_code"] == 0
    assert events["SIGTERM"]["in_flight"] >= 2 and events["SIGTERM"]["lost"] == 0
    assert sum(e["event"] == "idle" and e["unloaded"] for e in report["events"]) >= 2
    assert report["tracebacks_in_log"] == 0 and report["final_exit_code"] == 0
