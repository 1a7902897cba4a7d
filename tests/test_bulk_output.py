"""``bgeserve.bulk.output`` and ``shards``: the output folder's lock, manifest and finished
shards (no model)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bgeserve.bulk.coverage import OverlappingShards
from bgeserve.bulk.output import OutputDir
from bgeserve.bulk.shards import read_info, shard_name, write_shard
from bgeserve.bulk.sources import Source
from bgeserve.errors import InvalidInput

SPEC = {"text_column": "text", "id_column": "id", "outputs": ["dense"], "model": {"v": 1}}


def table(n: int) -> pa.Table:
    return pa.table({"id": [str(i) for i in range(n)], "n_tokens": pa.array([3] * n, pa.int32())})


def test_a_shard_is_renamed_into_place_and_its_footer_names_its_rows(tmp_path: Path):
    """write_shard leaves one finished *.parquet (no temporary file), whose footer holds the
    spans and bad rows; pyarrow reads the folder as the rows alone."""
    path = write_shard(tmp_path, table(3), {"/in/a.jsonl": [[0, 4]]},
                       [["/in/a.jsonl", 2, "x", "no 'text'"]])
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    info = read_info(path)
    assert info is not None and info.rows == 3
    assert info.coverage == {"/in/a.jsonl": [[0, 4]]}
    assert info.bad == [["/in/a.jsonl", 2, "x", "no 'text'"]]
    assert pq.read_table(tmp_path).num_rows == 3


def test_the_same_rows_get_the_same_name():
    """A shard's name depends on its rows only: a retried write replaces its own file."""
    a = shard_name({"/in/a.jsonl": [[0, 4]], "/in/b.csv": [[5, 9]]})
    assert a == shard_name({"/in/b.csv": [[5, 9]], "/in/a.jsonl": [[0, 4]]})
    assert a != shard_name({"/in/a.jsonl": [[0, 5]]})
    assert a.startswith("a-0000000000-") and a.endswith(".parquet")


def test_scan_collects_coverage_and_removes_leftover_temporary_files(tmp_path: Path):
    """Finished shards give the coverage; a killed job's temporary file is deleted."""
    write_shard(tmp_path, table(2), {"s": [[0, 2]]}, [])
    write_shard(tmp_path, table(1), {"s": [[2, 3]], "t": [[0, 1]]}, [])
    (tmp_path / ".s-0000000003-abc.parquet.1234.tmp").write_bytes(b"half")
    with OutputDir(tmp_path) as out:
        coverage, shards = out.scan()
    assert len(shards) == 2 and coverage.rows("s") == 3 and coverage.rows("t") == 1
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_scan_refuses_foreign_parquet_and_overlapping_shards(tmp_path: Path):
    """A Parquet file that is no shard, or two shards holding one row, stop the job."""
    pq.write_table(table(1), tmp_path / "mine.parquet")
    with OutputDir(tmp_path) as out, pytest.raises(InvalidInput, match="not a bgeserve"):
        out.scan()
    os.remove(tmp_path / "mine.parquet")
    write_shard(tmp_path, table(2), {"s": [[0, 2]]}, [])
    write_shard(tmp_path, table(2), {"s": [[1, 3]]}, [])
    with OutputDir(tmp_path) as out, pytest.raises(OverlappingShards):
        out.scan()


def test_a_second_job_on_the_folder_is_refused(tmp_path: Path):
    """Two jobs never write one folder at once."""
    with OutputDir(tmp_path), pytest.raises(InvalidInput, match="another bulk job"):
        OutputDir(tmp_path)
    OutputDir(tmp_path).close()  # the lock went with the first


def test_the_manifest_refuses_other_options_and_changed_inputs(tmp_path: Path):
    """A rerun must have the job's spec; an input whose size or mtime changed is refused; a
    new input is added."""
    src = tmp_path / "a.jsonl"
    src.write_text('{"id": 1, "text": "x"}\n')
    out_dir = tmp_path / "out"
    with OutputDir(out_dir) as out:
        out.check_manifest(SPEC, [Source(src, "jsonl")])
        write_shard(out_dir, table(1), {str(src): [[0, 1]]}, [])
        with pytest.raises(InvalidInput, match="outputs"):
            out.check_manifest({**SPEC, "outputs": ["dense", "sparse"]}, [Source(src, "jsonl")])
        with pytest.raises(InvalidInput, match="model"):
            out.check_manifest({**SPEC, "model": {"v": 2}}, [Source(src, "jsonl")])
        other = tmp_path / "b.jsonl"
        other.write_text("")
        out.check_manifest(SPEC, [Source(src, "jsonl"), Source(other, "jsonl")])
        src.write_text('{"id": 1, "text": "x"}\n{"id": 2, "text": "y"}\n')
        with pytest.raises(InvalidInput, match="changed since this job started"):
            out.check_manifest(SPEC, [Source(src, "jsonl")])


def test_a_manifest_without_shards_is_replaced_not_obeyed(tmp_path: Path):
    """A first run that failed before writing a shard (a wrong BGE_M3_MODEL_PATH) leaves a
    manifest; the corrected rerun replaces it instead of being refused as another job."""
    src = tmp_path / "a.jsonl"
    src.write_text('{"id": 1, "text": "x"}\n')
    with OutputDir(tmp_path / "out") as out:
        out.check_manifest({**SPEC, "model": {"v": "wrong"}}, [Source(src, "jsonl")])
        out.check_manifest(SPEC, [Source(src, "jsonl")])  # no shard yet: accepted
        write_shard(out.path, table(1), {str(src): [[0, 1]]}, [])
        with pytest.raises(InvalidInput, match="model"):
            out.check_manifest({**SPEC, "model": {"v": "wrong"}}, [Source(src, "jsonl")])


def test_another_model_at_the_same_path_is_refused(tmp_path: Path):
    """Shards of one model's files and a rerun with other files at the same path (same
    settings) are refused, naming BGE_M3_MODEL_PATH; a manifest of an older bgeserve, with no
    identity, is accepted and gets this run's."""
    src = tmp_path / "a.jsonl"
    src.write_text('{"id": 1, "text": "x"}\n')
    sources = [Source(src, "jsonl")]
    with OutputDir(tmp_path / "out") as out:
        out.check_manifest(SPEC, sources, "sha256:aaa")
        write_shard(out.path, table(1), {str(src): [[0, 1]]}, [])
        out.check_manifest(SPEC, sources, "sha256:aaa")
        out.check_manifest(SPEC, sources, None)  # not known yet: checked again once it is
        with pytest.raises(InvalidInput, match="BGE_M3_MODEL_PATH"):
            out.check_manifest(SPEC, sources, "sha256:bbb")
        manifest = out.path / "_bulk.json"
        old = orjson.loads(manifest.read_bytes())
        assert old["model_identity"] == "sha256:aaa"
        del old["model_identity"]
        manifest.write_bytes(orjson.dumps(old))
        out.check_manifest(SPEC, sources, "sha256:bbb")
        assert orjson.loads(manifest.read_bytes())["model_identity"] == "sha256:bbb"


def test_an_input_that_looks_moved_is_warned_about(tmp_path: Path, caplog):
    """A new input with the name, size and mtime of one the manifest holds under another path
    is embedded again (shards name inputs by path): a warning says so and names both."""
    (tmp_path / "x").mkdir()
    src = tmp_path / "x" / "a.jsonl"
    src.write_text('{"id": 1, "text": "x"}\n')
    with OutputDir(tmp_path / "out") as out:
        out.check_manifest(SPEC, [Source(src, "jsonl")])
        write_shard(out.path, table(1), {str(src): [[0, 1]]}, [])
        moved = tmp_path / "y" / "a.jsonl"
        moved.parent.mkdir()
        src.rename(moved)
        with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
            out.check_manifest(SPEC, [Source(moved, "jsonl")], write=False)
            out.check_manifest(SPEC, [Source(moved, "jsonl")])  # checked again: warned once
    assert caplog.text.count(f"{moved} looks like {src} moved") == 1


def test_an_output_that_is_a_file_or_cannot_be_made_is_refused(tmp_path: Path):
    """--output naming a file, or a folder that cannot be made, is an InvalidInput naming
    --output and the path (it was an OSError traceback)."""
    (tmp_path / "f").write_text("")
    with pytest.raises(InvalidInput, match="is a file, not a folder") as exc:
        OutputDir(tmp_path / "f")
    assert exc.value.param == "--output"
    with pytest.raises(InvalidInput, match="cannot make the folder"):
        OutputDir(tmp_path / "f" / "below")


def test_a_failed_run_removes_the_folder_it_made(tmp_path: Path):
    """A run refused before its first shard leaves no folder behind if it made it, and never
    removes a folder that was there before."""
    with pytest.raises(InvalidInput), OutputDir(tmp_path / "new") as out:
        out.check_manifest(SPEC, [])
        raise InvalidInput("refused")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    with pytest.raises(InvalidInput), OutputDir(tmp_path / "old"):
        raise InvalidInput("refused")
    assert (tmp_path / "old").is_dir()


def test_a_pinned_identity_guards_shards_until_the_manifest_records_it(tmp_path: Path):
    """A Ray run pins its model's identity before its first shard (the manifest is written
    before any actor has loaded the model): the first pin wins; a rerun after that run was
    killed checks it and records it in the manifest, and the pin goes."""
    from bgeserve.bulk.output import PIN, pin_identity

    src = tmp_path / "a.jsonl"
    src.write_text('{"id": 1, "text": "x"}\n')
    sources = [Source(src, "jsonl")]
    with OutputDir(tmp_path / "out") as out:
        assert out.check_manifest(SPEC, sources) is None  # a first run: nothing known yet
        assert pin_identity(out.path, "sha256:aaa") == "sha256:aaa"
        assert pin_identity(out.path, "sha256:bbb") == "sha256:aaa"  # the first one stays
        assert not list(out.path.glob("*.tmp")) and not list(out.path.glob(".*.tmp"))
        write_shard(out.path, table(1), {str(src): [[0, 1]]}, [])
    with OutputDir(tmp_path / "out") as out:  # the run was killed: its manifest has no identity
        with pytest.raises(InvalidInput, match="other model files.*sha256:aaa then"):
            out.check_manifest(SPEC, sources, "sha256:bbb")
        assert out.check_manifest(SPEC, sources, write=False) == "sha256:aaa"
        assert (out.path / PIN).exists()  # not recorded yet: still the guard
        assert out.check_manifest(SPEC, sources) == "sha256:aaa"
        assert orjson.loads((out.path / "_bulk.json").read_bytes())["model_identity"] == \
            "sha256:aaa"
        assert not (out.path / PIN).exists()


def test_a_pin_without_shards_is_dropped(tmp_path: Path):
    """A pin with no shard beside it guards nothing: the next run's manifest removes it, and a
    failed first run removes it with the folder it made."""
    from bgeserve.bulk.output import PIN, pin_identity

    with OutputDir(tmp_path / "out") as out:
        pin_identity(out.path, "sha256:aaa")
        assert out.check_manifest(SPEC, [], "sha256:bbb") == "sha256:bbb"
        assert not (out.path / PIN).exists()
    with pytest.raises(InvalidInput), OutputDir(tmp_path / "new") as out:
        out.check_manifest(SPEC, [])
        pin_identity(out.path, "sha256:aaa")
        raise InvalidInput("refused")
    assert not (tmp_path / "new").exists()


def test_an_identity_by_names_sizes_and_mtimes_is_not_compared_with_content(tmp_path: Path):
    """A folder an earlier bgeserve recorded by the graph files' names, sizes and mtimes (a
    snapshot served as it is) resumes: that says nothing of the content the identity is now.
    Two content identities still must agree."""
    from bgeserve.bulk.output import check_identity

    check_identity(tmp_path, "fp32 model.onnx:5:1796300000000000000", "fp32 sha256:abc")
    with pytest.raises(InvalidInput, match="other model files"):
        check_identity(tmp_path, "fp32 sha256:abc", "fp32 sha256:abd")


def test_a_pin_without_hard_links_is_an_exclusive_create(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch):
    """A file system without hard links (gcsfuse, blobfuse: EPERM / ENOTSUP) still pins the
    first identity, and a second one reads it (every Ray first run failed there)."""
    import errno

    from bgeserve.bulk import output

    def no_link(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(output.os, "link", no_link)
    assert output.pin_identity(tmp_path, "fp32 sha256:a") == "fp32 sha256:a"
    assert output.pin_identity(tmp_path, "fp32 sha256:b") == "fp32 sha256:a"
    assert sorted(p.name for p in tmp_path.iterdir()) == [output.PIN]


def test_the_variant_and_runtime_each_run_resolved_are_not_compared_where_content_is(
        tmp_path: Path):
    """The manifest's model settings hold the rule's pick, which differs from machine to
    machine (review: a job moved from a VNNI machine, int8, to one without, fp32, was refused
    before the rerun could go on with the shards' variant). Where the shards' model files are
    known by their sha256, that identity decides; the path and the rest still count, and a
    folder whose identity is not by content still compares the variant."""
    src = tmp_path / "a.jsonl"
    src.write_text('{"id": 1, "text": "x"}\n')
    sources = [Source(src, "jsonl")]

    def spec(variant: str, ep: str = "cpu", path: str = "/m") -> dict:
        return {**SPEC, "model": {"path": path, "variant": variant, "execution_provider": ep,
                                  "max_seq": 8192}}

    for identity, compared in (("int8 sha256:abc", False), ("int8 model.onnx:5:17963", True),
                               (None, True)):
        with OutputDir(tmp_path / f"out-{compared}-{identity is None}") as out:
            out.check_manifest(spec("int8"), sources, identity)
            write_shard(out.path, table(1), {str(src): [[0, 1]]}, [])
            if compared:
                with pytest.raises(InvalidInput, match="variant"):
                    out.check_manifest(spec("fp32"), sources, write=False)
            else:
                assert out.check_manifest(spec("fp32"), sources, write=False) == identity
                assert out.check_manifest(spec("bf16", "openvino"), sources, write=False) \
                    == identity
            with pytest.raises(InvalidInput, match="model"):
                out.check_manifest(spec("int8", path="/other"), sources, write=False)
