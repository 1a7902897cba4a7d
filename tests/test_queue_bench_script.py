"""scripts/queue_bench.py runs this tree's queue and prints one row per case."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_it_prints_a_row_per_case_with_every_chunk_counted() -> None:
    out = subprocess.run([sys.executable, "scripts/queue_bench.py", "--texts", "40",
                          "--chunk-tokens", "256,2048", "--queries", "0", "--rounds", "1"],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=120).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 40 |")]
    assert len(rows) == 2, out
    assert rows[0].split("|")[4].strip() == "40"  # 256 tokens a chunk: every text alone
    assert 1 <= int(rows[1].split("|")[4]) < 40
    assert float(rows[0].split("|")[5]) > 0
