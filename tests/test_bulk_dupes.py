"""``bgeserve.bulk.dupes``: ids that come more than once are counted and named (no model)."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest

from bgeserve.bulk.dupes import Duplicates
from bgeserve.bulk.output import OutputDir
from bgeserve.bulk.shards import write_shard


def test_ids_repeated_within_a_run_are_counted_and_named(caplog: pytest.LogCaptureFixture):
    """Every repeat counts (a third "a" is a second repeat); the warning names the ids."""
    ids = Duplicates()
    ids.add(["a", "b", "a"])
    ids.add(["c", "a", "b"])
    assert ids.count == 3 and ids.examples == ["a", "b"]
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        ids.warn()
    assert "3 rows have an id written before" in caplog.text and "'a', 'b'" in caplog.text


def test_ids_of_earlier_shards_count_as_written(tmp_path: Path):
    """A rerun that writes rows again (an input moved to another path is a new source) counts
    them against the ids the finished shards hold."""
    write_shard(tmp_path, pa.table({"id": ["x", "y"]}), {"s": [[0, 2]]}, [])
    write_shard(tmp_path, pa.table({"id": pa.array([], pa.string())}), {"s": [[2, 3]]}, [])
    with OutputDir(tmp_path) as out:
        _, shards = out.scan()
    ids = Duplicates.of_shards(shards)
    ids.add(["y", "z"])
    assert ids.count == 1 and ids.examples == ["y"]


def test_earlier_shards_are_read_no_further_than_the_bound(tmp_path: Path, monkeypatch):
    """Resuming a big job reads the finished shards' ids one shard at a time, and stops once
    as many as are remembered were read (all of them went into one list first)."""
    import pyarrow.parquet as pq

    for start in range(0, 6, 2):
        write_shard(tmp_path, pa.table({"id": [f"i{start}", f"i{start + 1}"]}),
                    {"s": [[start, start + 2]]}, [])
    with OutputDir(tmp_path) as out:
        _, shards = out.scan()
    read = []
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: read.append(a) or real(*a, **k))
    ids = Duplicates.of_shards(shards, max_tracked=3)
    assert len(read) == 2 and ids.full and ids.count == 0


def test_no_repeats_no_warning(caplog: pytest.LogCaptureFixture):
    """Distinct ids: nothing is logged."""
    ids = Duplicates()
    ids.add(["a", "b"])
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        ids.warn()
    assert ids.count == 0 and not caplog.records


def test_the_ids_remembered_are_bounded():
    """Past ``max_tracked`` ids no more are remembered (the memory a job needs stays bounded
    whatever its rows); later ids are still checked against those remembered."""
    ids = Duplicates(["e1", "e2"], max_tracked=4)
    assert ids.count == 0  # an earlier run's shards: their own repeats were told then
    ids.add(["a", "b", "c", "d"])  # c and d are past the bound: not remembered
    ids.add(["a", "e1", "c", "d"])
    assert ids.count == 2 and ids.examples == ["a", "e1"]
    assert len(ids._seen) == 4


def test_shards_of_this_run_are_counted_against_the_earlier_ones(tmp_path: Path):
    """A Ray job's write tasks return no ids: the driver reads its new shards' ids back, and
    they count against the earlier shards' ids (whose own repeats were told then) and each
    other's."""
    write_shard(tmp_path, pa.table({"id": ["x", "x", "y"]}), {"s": [[0, 3]]}, [])
    with OutputDir(tmp_path) as out:
        _, shards = out.scan()
    ids = Duplicates.of_shards(shards)
    assert ids.count == 0
    new = [write_shard(tmp_path, pa.table({"id": ["y", "z"]}), {"s": [[3, 5]]}, []),
           write_shard(tmp_path, pa.table({"id": ["z"]}), {"s": [[5, 6]]}, [])]
    ids.add_shards(new)
    assert ids.count == 2 and ids.examples == ["y", "z"]
