"""``bgeserve.bulk.job``: the blocks of rows a job still has to do (no model)."""

from __future__ import annotations

import json
from pathlib import Path

from bgeserve.bulk.coverage import Coverage
from bgeserve.bulk.job import BulkJob, blocks, total_rows
from bgeserve.bulk.sources import Source


def jsonl(path: Path, n: int) -> Source:
    path.write_text("".join(json.dumps({"id": i, "text": f"t{i}"}) + "\n" for i in range(n)))
    return Source(path, "jsonl")


def test_blocks_are_aligned_ranges_of_shard_rows(tmp_path: Path):
    """Rows are cut at multiples of shard_rows, whatever the reader's own pieces."""
    src = jsonl(tmp_path / "a.jsonl", 25)
    job = BulkJob(inputs=(), output=tmp_path / "out", shard_rows=10)
    got = [b.rows.tolist() for b in blocks(src, job, Coverage())]
    assert got == [list(range(10)), list(range(10, 20)), list(range(20, 25))]


def test_blocks_skip_the_rows_shards_hold(tmp_path: Path):
    """A resumed job yields exactly the rows no shard holds, still within their ranges."""
    src = jsonl(tmp_path / "a.jsonl", 25)
    coverage = Coverage()
    coverage.add(src.key, [[0, 10], [12, 15]], "s")
    job = BulkJob(inputs=(), output=tmp_path / "out", shard_rows=10)
    got = [b.rows.tolist() for b in blocks(src, job, coverage)]
    assert got == [[10, 11, 15, 16, 17, 18, 19], list(range(20, 25))]
    assert [b.ids for b in blocks(src, job, coverage)][1] == ["20", "21", "22", "23", "24"]


def test_colbert_jobs_default_to_smaller_shards(tmp_path: Path):
    """ColBERT keeps a vector per token, so its shards hold fewer rows."""
    assert BulkJob(inputs=(), output=tmp_path).rows_per_shard == 1024
    assert BulkJob(inputs=(), output=tmp_path, outputs=("dense", "colbert")).rows_per_shard == 64
    assert BulkJob(inputs=(), output=tmp_path, shard_rows=7).rows_per_shard == 7


def test_total_rows_is_known_for_jsonl_and_parquet_only(tmp_path: Path):
    """The progress bar's total: JSONL lines and Parquet footers; unknown with a CSV."""
    src = jsonl(tmp_path / "a.jsonl", 5)
    assert total_rows([src]) == 5
    (tmp_path / "c.csv").write_text("id,text\n1,a\n")
    assert total_rows([src, Source(tmp_path / "c.csv", "csv")]) is None
