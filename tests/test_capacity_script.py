"""``scripts/capacity.py``: the capacity arithmetic and the KEDA simulation (pure)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "capacity.py"
spec = importlib.util.spec_from_file_location("capacity", SCRIPT)
capacity = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
sys.modules["capacity"] = capacity  # dataclasses look their module up there
spec.loader.exec_module(capacity)  # type: ignore[union-attr]


def test_replicas_cover_the_corpus_within_the_hours():
    """ceil(tokens / (hours × 3600 × rate × utilization)), at least one."""
    assert capacity.replicas_needed(10e6 * 512, 24, 20_413, 0.7) == 5
    assert capacity.replicas_needed(1, 24, 20_413, 0.7) == 1
    n = capacity.replicas_needed(10e6 * 512, 24, 740.8, 0.7)
    assert n * 24 * 3600 * 740.8 * 0.7 >= 10e6 * 512 > (n - 1) * 24 * 3600 * 740.8 * 0.7


def test_the_table_gives_every_measured_replica_a_row_and_its_keda_threshold():
    """One row per replica kind, the threshold being rate × backlog seconds."""
    text = capacity.table(10e6, 512, 24, 0.7, 2.0)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(capacity.REPLICAS)
    assert "| 40,826 |" in text  # H200: 20,413 tokens/s × 2 s


def test_keda_adds_replicas_for_a_burst_and_drains_it():
    """A burst far over the threshold scales the fleet out after the start-up delay and the
    queue empties sooner than on one replica."""
    rate, burst = 1000.0, 200_000.0
    trace = capacity.simulate(rate, rate * 2, burst, 0.0, 400, 15, 20, 1, 8)
    assert max(n for _, _, n in trace) == 8
    drained = next(t for t, q, _ in trace if q == 0)
    assert drained < burst / rate / 2
    assert all(n == 1 for t, _, n in trace if t < 20)  # nothing serves before it has started
