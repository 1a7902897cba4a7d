"""``bgeserve.ray.datasink.ShardSink`` called as a Ray write task calls it, without a cluster
or a model: a write of rows made with other model files than the folder's is refused before
its shard is written."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bgeserve.bulk.output import PIN, OutputDir
from bgeserve.errors import InvalidInput
from bgeserve.ray.datasink import MODEL_COLUMN, ShardSink
from bgeserve.ray.pipeline import run_identity

A, B = "fp32 sha256:aaa", "fp32 sha256:bbb"


def block(start: int, n: int, *identities: str) -> pa.Table:
    """``n`` embedded rows of source ``s`` from ``start``, as the Embedder gives them, the
    rows' model identities taken in turn from ``identities``."""
    return pa.table({
        "id": [f"i{start + k}" for k in range(n)], "_source": ["s"] * n,
        "_row": pa.array(range(start, start + n), pa.int64()), "_error": pa.nulls(n, pa.string()),
        "n_tokens": pa.array([3] * n, pa.int32()), "truncated": [False] * n,
        "dense": pa.FixedSizeListArray.from_arrays(pa.array([0.5] * (2 * n), pa.float32()), 2),
        MODEL_COLUMN: [identities[k % len(identities)] for k in range(n)]})


def shards(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.parquet"))


def test_a_write_of_another_model_than_the_manifests_is_refused_before_writing(
        tmp_path: Path) -> None:
    """The manifest records A: a write of B's rows raises the manifest's refusal (naming
    BGE_M3_MODEL_PATH) and leaves no shard; A's rows are written, without the column."""
    sink = ShardSink(tmp_path, ("dense",), identity=A)
    with pytest.raises(InvalidInput, match="other model files.*BGE_M3_MODEL_PATH") as exc:
        sink.write([block(0, 3, B)], None)
    assert exc.value.param == "BGE_M3_MODEL_PATH"
    assert shards(tmp_path) == [] and not (tmp_path / PIN).exists()
    result = sink.write([block(0, 3, A)], None)
    assert result["identity"] == A and result["rows"] == 3
    written = pq.read_table(result["paths"][0])
    assert MODEL_COLUMN not in written.column_names and written["id"].to_pylist() == [
        "i0", "i1", "i2"]


def test_on_a_first_run_the_first_write_pins_the_model_for_the_others(tmp_path: Path) -> None:
    """No identity recorded: the first write pins A; a write task of an actor that loaded B
    (another node's files) is refused, as is a write mixing both; the pin is what the next
    run's manifest records if this one is killed."""
    with OutputDir(tmp_path) as out:
        out.check_manifest({"outputs": ["dense"]}, [])
    first, other = ShardSink(tmp_path, ("dense",)), ShardSink(tmp_path, ("dense",))
    results = [first.write([block(0, 2, A)], None)]
    with pytest.raises(InvalidInput, match="loaded different model files.*BGE_M3_MODEL"):
        other.write([block(2, 2, B)], None)
    with pytest.raises(InvalidInput, match="loaded different model files"):
        other.write([block(4, 2, A, B)], None)
    results.append(other.write([block(6, 2, A)], None))
    assert len(shards(tmp_path)) == 2 and run_identity(tmp_path, results) == A
    with OutputDir(tmp_path) as out:
        assert out.check_manifest({"outputs": ["dense"]}, []) == A
    assert orjson.loads((tmp_path / "_bulk.json").read_bytes())["model_identity"] == A


def test_a_write_is_cut_into_the_local_jobs_aligned_shards(tmp_path: Path) -> None:
    """Ray hands one write task every block of a read (a whole file): it was one shard,
    whatever --shard-rows said (QA). Now one shard per aligned block of each source, as the
    local job cuts them; a task given nothing writes nothing and says so."""
    sink = ShardSink(tmp_path, ("dense",), identity=A, rows_per_shard=100)
    other = block(0, 30, A).set_column(1, "_source", pa.array(["t"] * 30))
    result = sink.write([block(40, 200, A), other], None)
    assert (result["rows"], result["shards"], len(result["paths"])) == (230, 4, 4)
    got = {p: pq.read_table(p) for p in result["paths"]}
    assert sorted(t.num_rows for t in got.values()) == [30, 40, 60, 100]
    for table in got.values():  # each shard within one source's aligned hundred
        ids = table["id"].to_pylist()
        assert len({int(i[1:]) // 100 for i in ids}) == 1, ids
    assert sink.write([], None) == {"rows": 0, "tokens": 0, "bad": [], "shards": 0,
                                    "paths": [], "identity": None}


def test_the_driver_refuses_results_of_several_models(tmp_path: Path) -> None:
    """The driver's own check of the write results: one identity, or an error naming both."""
    assert run_identity(tmp_path, [{"identity": None}]) is None
    with pytest.raises(InvalidInput, match=f"{A} on one, {B} on another"):
        run_identity(tmp_path, [{"identity": B}, {"identity": A}, {"identity": None}])


def test_a_write_takes_its_blocks_one_at_a_time(tmp_path: Path) -> None:
    """Each shard is written once the next block's rows belong to another: the task held
    every block of a read as one table first (review: a read's ColBERT vectors at once)."""
    sink = ShardSink(tmp_path, ("dense",), identity=A, rows_per_shard=100)

    def blocks():
        for k in range(4):
            assert len(shards(tmp_path)) == max(0, k - 1)
            yield block(100 * k, 100, A)

    assert sink.write(blocks(), None)["shards"] == 4
    assert len(shards(tmp_path)) == 4


def colbert_block(start: int, n: int) -> pa.Table:
    """``n`` rows from ``start`` with ColBERT vectors of width 2, row r holding r % 7 + 1."""
    counts = [(start + k) % 7 + 1 for k in range(n)]
    vectors = pa.FixedSizeListArray.from_arrays(
        pa.array([0.25] * (2 * sum(counts)), pa.float32()), 2)
    offsets = pa.array([0, *itertools.accumulate(counts)], pa.int32())
    table = block(start, n, A).drop_columns(["dense"])
    return table.append_column("colbert", pa.ListArray.from_arrays(offsets, vectors))


def test_an_aligned_block_is_cut_by_its_rows_vectors_wherever_rays_blocks_end(
        tmp_path: Path) -> None:
    """Past ``max_bytes`` of ColBERT vectors an aligned block's rows are cut as ``runs`` cuts
    their sizes: the same shards, the same names, however Ray split the rows into blocks (a
    cut at block boundaries made other shards when a task ran again: overlapping ones, and a
    resume refused: review); every row once; no limit: one shard."""
    from bgeserve.bulk.model import runs

    sizes = [(r % 7 + 1) * 8 for r in range(100)]  # width 2, float32
    want = [[f"i{k}" for k in range(a, b)] for a, b in runs(sizes, 60)]
    assert len(want) > 10
    names = set()
    for n, cuts in enumerate([[100], [30, 30, 40], [50, 50], [1] * 100]):
        blocks = [colbert_block(sum(cuts[:k]), size) for k, size in enumerate(cuts)]
        folder = tmp_path / str(n)
        folder.mkdir()
        sink = ShardSink(folder, ("colbert",), identity=A, rows_per_shard=100, max_bytes=60)
        paths = sink.write(blocks, None)["paths"]
        assert [pq.read_table(p)["id"].to_pylist() for p in paths] == want, cuts
        names.add(tuple(shards(folder)))
        whole = ShardSink(folder / "whole", ("colbert",), identity=A, rows_per_shard=100)
        (folder / "whole").mkdir()
        assert whole.write(blocks, None)["shards"] == 1
    assert len(names) == 1
