"""``bgeserve bulk`` in one process on the tiny random model: the rows, their vectors, bad rows,
and resuming after a job was stopped halfway."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bgeserve import Engine
from bgeserve.bulk import local
from bgeserve.bulk.job import BulkJob
from bgeserve.bulk.model import resolve_settings
from bgeserve.cli import main
from tests.bulkdata import BAD_IDS, assert_rows_match, make_inputs, read_output

pytestmark = pytest.mark.slow


def env(export: Path, cache: Path) -> dict[str, str]:
    return {"BGE_M3_MODEL_PATH": str(export), "BGE_M3_MODEL": "fp32",
            "BGE_M3_CACHE_DIR": str(cache), "BGE_M3_DISABLE_AUTO_BUDGET": "1",
            "BGE_M3_MAX_SEQ_LENGTH": "128", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def engine(tiny_export: Path) -> Iterator[Engine]:
    from bgeserve.engine import EngineConfig

    with Engine(tiny_export, "fp32", config=EngineConfig(max_seq=128)) as e:
        yield e


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("bulk-in")
    return folder, make_inputs(folder)


def test_every_good_row_gets_the_engines_vectors_and_bad_rows_are_reported(
        tiny_export: Path, tmp_path: Path, inputs, engine: Engine,
        caplog: pytest.LogCaptureFixture) -> None:
    """500 texts in three formats → 500 rows equal to Engine.embed; the 4 bad rows are named
    with their ids and reasons in the log and written to no shard."""
    folder, texts = inputs
    settings = resolve_settings(env(tiny_export, tmp_path / "cache"))
    job = BulkJob(inputs=(str(folder),), output=tmp_path / "out", shard_rows=64)
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        summary = local.run(job, settings, bar=False)
    assert summary.rows == 500 and summary.bad == len(BAD_IDS) and summary.skipped == 0
    assert summary.tokens > 0 and summary.peak_rss_bytes > 0
    assert_rows_match(read_output(job.output), texts, engine)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for row_id, why in BAD_IDS.items():
        assert f"(id {row_id!r}): {why}" in logged
    assert {e["id"] for e in summary.bad_examples} == set(BAD_IDS)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        again = local.run(job, settings, bar=False)  # nothing left: no shard written, none lost
    assert (again.rows, again.shards, again.skipped) == (0, 0, 500 + len(BAD_IDS))
    assert summary.skipped_bad == 0 and again.skipped_bad == len(BAD_IDS)  # said apart
    assert read_output(job.output).num_rows == 500
    # The bad rows the shards record are named again (a killed run may not have logged them).
    earlier = [r.getMessage() for r in caplog.records if "an earlier run skipped" in r.getMessage()]
    for row_id, why in BAD_IDS.items():
        assert sum(f"(id {row_id!r}): {why}" in line for line in earlier) == 1, (row_id, earlier)


def test_a_job_stopped_halfway_resumes_without_duplicates_or_losses(
        tiny_export: Path, tmp_path: Path, inputs, engine: Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped after 3 shards (as by Ctrl-C), the rerun keeps them and writes the rest."""
    folder, texts = inputs
    settings = resolve_settings(env(tiny_export, tmp_path / "cache"))
    job = BulkJob(inputs=(str(folder),), output=tmp_path / "out", shard_rows=32)
    written = []
    real = local.write_shard

    def stop_after_three(*args, **kwargs):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(real(*args, **kwargs))
        return written[-1]

    monkeypatch.setattr(local, "write_shard", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        local.run(job, settings, bar=False)
    monkeypatch.setattr(local, "write_shard", real)
    first = read_output(job.output).num_rows
    assert 0 < first < 500
    kept = {p.name: p.stat().st_mtime_ns for p in written}
    summary = local.run(job, settings, bar=False)
    assert summary.rows == 500 - first  # skipped: the rows and bad rows the shards held
    assert summary.skipped + summary.rows + summary.bad == 500 + len(BAD_IDS)
    assert {p.name: p.stat().st_mtime_ns for p in written} == kept  # left untouched
    assert_rows_match(read_output(job.output), texts, engine)


def test_colbert_vectors_match_the_engine(tiny_export: Path, tmp_path: Path, engine: Engine):
    """--outputs dense,colbert: one normalised vector per token (CLS excluded), as embed."""
    import json

    (tmp_path / "in").mkdir()
    texts = {f"t{i}": " ".join(["word"] * (i + 1)) + f" {i}" for i in range(20)}
    (tmp_path / "in" / "a.jsonl").write_text(
        "".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out",
                  outputs=("dense", "colbert"))
    local.run(job, resolve_settings(env(tiny_export, tmp_path / "cache")), bar=False)
    table = read_output(job.output)
    assert "sparse_indices" not in table.column_names
    want = engine.embed(list(texts.values()), dense=True, colbert=True)
    got = dict(zip(table["id"].to_pylist(), table["colbert"].to_pylist(), strict=True))
    for key, vectors in zip(texts, want.colbert, strict=True):
        np.testing.assert_allclose(np.array(got[key], np.float32), vectors, atol=1e-5, rtol=0)


def test_colbert_shards_of_long_texts_keep_their_vectors_within_the_limit(
        tiny_export: Path, tmp_path: Path, engine: Engine) -> None:
    """BGE_M3_MAX_COLBERT_MB bounds the vectors of the blocks in flight: a 64-row block of
    long texts is cut into shards of at most a quarter of it each (all 64 rows were held, and
    written, at once: QA), the short texts' block stays whole; every vector as embed's."""
    import json

    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    texts = {f"t{i:03d}": " ".join(["word"] * (200 if i < 64 else 3)) + f" {i}"
             for i in range(128)}
    (tmp_path / "in" / "a.jsonl").write_text(
        "".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out",
                  outputs=("colbert",))
    settings = resolve_settings({**env(tiny_export, tmp_path / "cache"),
                                 "BGE_M3_MAX_COLBERT_MB": "1"})
    summary = local.run(job, settings, bar=False)
    limit = (1 << 20) // (local.IN_FLIGHT + 1)
    per_text = 127 * 32 * 4  # 128 tokens (max_seq), CLS excluded, 32 floats each
    sizes = sorted(pq.read_metadata(p).num_rows for p in job.output.glob("*.parquet"))
    assert limit // per_text == 16
    assert sizes == [16, 16, 16, 16, 64] and summary.shards == 5
    table = read_output(job.output)
    want = engine.embed(list(texts.values()), dense=False, colbert=True)
    got = dict(zip(table["id"].to_pylist(), table["colbert"].to_pylist(), strict=True))
    for key, vectors in zip(texts, want.colbert, strict=True):
        np.testing.assert_allclose(np.array(got[key], np.float32), vectors, atol=1e-5, rtol=0)


def test_runs_cut_sizes_within_the_limit_unless_one_alone_passes_it() -> None:
    """``bulk.model.runs``: consecutive spans, none empty, each within the limit or one item."""
    from bgeserve.bulk.model import runs

    assert list(runs([3, 3, 3, 0, 5, 9, 1], 6)) == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7)]
    assert list(runs([1, 1], 6)) == [(0, 2)] and list(runs([], 6)) == []


def test_the_command_line_refuses_bad_arguments_with_exit_2(tmp_path: Path, capsys) -> None:
    """Usage errors print one line naming the flag, no traceback."""
    (tmp_path / "a.jsonl").write_text("")
    assert main(["bulk", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o"),
                 "--outputs", "dense,vectors"]) == 2
    assert "--outputs" in capsys.readouterr().err
    assert main(["bulk", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_ctrl_c_ends_the_command_with_130_and_how_to_go_on(
        tmp_path: Path, capsys, monkeypatch) -> None:
    """An interrupt is expected in a long job: one line saying the shards are kept and how to
    resume, exit 130 (it printed a KeyboardInterrupt traceback)."""
    from bgeserve.bulk import local

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "run", interrupted)
    (tmp_path / "a.jsonl").write_text('{"id": "a", "text": "x"}\n')
    assert main(["bulk", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o")]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "run the same command again" in err
    assert "Traceback" not in err


def test_sigterm_ends_the_command_with_143_and_how_to_go_on(
        tiny_export: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """SIGTERM (a container stopped) during a job: one line saying the shards are kept, exit
    143, the queued work dropped (it ended without a word: QA); the handler is put back."""
    import os
    import signal

    from bgeserve.bulk import local

    for name, value in env(tiny_export, tmp_path / "cache").items():
        monkeypatch.setenv(name, value)
    real = local.finish

    def finish(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # after the first shard

    monkeypatch.setattr(local, "finish", finish)
    write_jsonl(tmp_path / "a.jsonl", {f"t{i}": f"text {i}" for i in range(100)})
    before = signal.getsignal(signal.SIGTERM)
    args = ["bulk", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o"), "--shard-rows",
            "10"]
    assert main(args) == 143
    err = capsys.readouterr().err
    assert "terminated (SIGTERM)" in err and "run the same command again" in err
    assert "Traceback" not in err and signal.getsignal(signal.SIGTERM) is before
    assert 10 <= read_output(tmp_path / "o").num_rows < 100
    monkeypatch.setattr(local, "finish", real)
    assert main(args) == 0 and read_output(tmp_path / "o").num_rows == 100


def test_sigterm_under_ray_ends_the_command_as_without(tmp_path: Path, capsys,
                                                         monkeypatch) -> None:
    """ray.init puts its own SIGTERM handler over the command's (sys.exit(15): exit 15 and
    no word, review): that exit is taken as the command's SIGTERM, 143 and the line."""
    from bgeserve.ray import pipeline

    def ray_terminated(*args, **kwargs):
        raise SystemExit(15)

    monkeypatch.setattr(pipeline, "run", ray_terminated)
    monkeypatch.setattr("bgeserve.bulk.model.resolve_settings", lambda environ: None)
    (tmp_path / "a.jsonl").write_text('{"id": "a", "text": "x"}\n')
    args = ["bulk", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o"), "--ray"]
    assert main(args) == 143
    assert "terminated (SIGTERM)" in capsys.readouterr().err


def write_jsonl(path: Path, rows: dict[str, str], key: str = "text") -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": k, key: v}) + "\n" for k, v in rows.items()))
    return path


def test_another_model_put_at_the_same_path_is_refused(tiny_export: Path, tmp_path: Path):
    """Shards of one model, then other model files at the same BGE_M3_MODEL_PATH (same
    settings): the rerun is refused naming BGE_M3_MODEL_PATH (the two were mixed silently)."""
    import json
    import shutil

    from bgeserve.errors import InvalidInput

    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    write_jsonl(tmp_path / "in" / "a.jsonl", {f"t{i}": f"text {i}" for i in range(10)})
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out", shard_rows=4)
    settings = resolve_settings(env(model, tmp_path / "cache"))
    local.run(job, settings, bar=False)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["variants"]["fp32"]["sha256"] = "0" * 64  # what another export's manifest says
    (model / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidInput, match="other model files.*BGE_M3_MODEL_PATH"):
        local.run(job, settings, bar=False)


def test_a_job_resumed_where_another_variant_would_be_chosen_goes_on_with_its_own(
        tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run served the variant measured fastest (its machine's, or a local run's
    where a Ray job serves the rule's); the rerun would choose another: it goes on with the
    shards' variant instead of being refused as another model's (README walkthrough)."""
    import dataclasses
    import json

    from bgeserve.service import choice

    write_jsonl(tmp_path / "in" / "a.jsonl", {f"t{i}": f"text {i}" for i in range(40)})
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out", shard_rows=8)
    settings = resolve_settings({k: v for k, v in env(tiny_export, tmp_path / "cache").items()
                                 if k != "BGE_M3_MODEL"})
    other = "int8" if settings.variant != "int8" else "fp32"
    real = choice.decide

    def measured_other(s, *args, **kwargs):
        decision = real(s, *args, **kwargs)
        return dataclasses.replace(decision, settings=dataclasses.replace(
            decision.settings, variant=other, variant_choice="measured"))

    written = []
    real_write = local.write_shard

    def stop_after_two(*args, **kwargs):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(real_write(*args, **kwargs))
        return written[-1]

    with monkeypatch.context() as patch:
        patch.setattr(choice, "decide", measured_other)
        patch.setattr(local, "write_shard", stop_after_two)
        with pytest.raises(KeyboardInterrupt):
            local.run(job, settings, bar=False)
    recorded = json.loads((job.output / "_bulk.json").read_text())["model_identity"]
    assert recorded.startswith(f"{other} sha256:")
    summary = local.run(job, settings, bar=False)  # the rule's variant would serve here
    assert summary.rows == 40 - 16 and read_output(job.output).num_rows == 40
    assert json.loads((job.output / "_bulk.json").read_text())["model_identity"] == recorded


def test_a_first_run_that_cannot_load_the_model_leaves_nothing_behind(
        tiny_export: Path, tmp_path: Path):
    """A wrong BGE_M3_MODEL_PATH fails the first run; its output folder is gone and the
    corrected rerun runs (it was refused: the manifest named the wrong path)."""
    from bgeserve.errors import BgeServeError

    write_jsonl(tmp_path / "in" / "a.jsonl", {"a": "x", "b": "y"})
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out")
    with pytest.raises(BgeServeError):
        local.run(job, resolve_settings(env(tmp_path / "nope", tmp_path / "cache")), bar=False)
    assert not job.output.exists()
    job.output.mkdir()  # a folder made by hand, then a wrong path: the same
    with pytest.raises(BgeServeError):
        local.run(job, resolve_settings(env(tmp_path / "nope", tmp_path / "cache")), bar=False)
    summary = local.run(job, resolve_settings(env(tiny_export, tmp_path / "cache")), bar=False)
    assert summary.rows == 2


def test_a_mistyped_text_column_exits_2_naming_the_flag_and_blocks_no_rerun(
        tiny_export: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """On JSONL (no header to check first), --text-column txet makes every row bad: exit 2
    naming the flag (it was 0 with 0 rows), and the corrected rerun is not refused."""
    for name, value in env(tiny_export, tmp_path / "cache").items():
        monkeypatch.setenv(name, value)
    write_jsonl(tmp_path / "in" / "a.jsonl", {"a": "x", "b": "y"})
    args = ["bulk", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--progress", "log"]
    assert main([*args, "--text-column", "txet"]) == 2
    assert "--text-column" in capsys.readouterr().err
    assert main(args) == 0
    assert read_output(tmp_path / "out").num_rows == 2
    # Shards of that run are in the folder now: a later run of the same job whose new input
    # lacks the key is refused the same way but leaves the manifest that guards them
    # (removing it let any other job in).
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "b.jsonl").write_text('{"id": "c", "body": "z"}\n')
    later = ["bulk", str(tmp_path / "more"), "--output", str(tmp_path / "out"),
             "--progress", "log"]
    assert main(later) == 2
    assert (tmp_path / "out" / "_bulk.json").is_file()
    assert read_output(tmp_path / "out").num_rows == 2


def test_a_job_whose_every_row_is_bad_exits_2_saying_why(
        tiny_export: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Every line of a file not JSON: exit 2 with the first reasons (it was 0 with 0 rows and
    an empty shard), nothing left behind; the corrected input then runs."""
    for name, value in env(tiny_export, tmp_path / "cache").items():
        monkeypatch.setenv(name, value)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("{bad\n{worse\n")
    # (an id holding a lone surrogate is one more bad row: it crashed the shard's write)
    (tmp_path / "in" / "b.jsonl").write_text('{"id": "b\\ud800", "text": "x"}\n')
    args = ["bulk", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--progress", "log"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no row of the inputs could be embedded (3 bad rows" in err
    assert "a.jsonl row 0: not valid JSON" in err
    out = tmp_path / "out"
    assert not out.exists() or not list(out.glob("*.parquet"))  # nothing left behind
    write_jsonl(tmp_path / "in" / "a.jsonl", {"a": "x"})
    assert main(args) == 0
    assert read_output(tmp_path / "out").num_rows == 1


def test_files_that_are_no_shards_in_the_output_are_warned_about(
        tiny_export: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An output folder holding the user's other files is used (they are left alone), but
    pq.read_table on it then fails: said in a warning naming them."""
    write_jsonl(tmp_path / "in" / "a.jsonl", {"a": "x"})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep")
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        assert local.run(job, resolve_settings(env(tiny_export, tmp_path / "cache")),
                         bar=False).rows == 1
    assert "no shards of this job (notes.txt)" in caplog.text
    assert (tmp_path / "out" / "notes.txt").read_text() == "keep"


def test_repeated_ids_and_a_moved_input_are_reported(
        tiny_export: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Ids repeated across files are written as they come and counted in the summary; an
    input moved between runs is embedded again, warned about and counted."""
    write_jsonl(tmp_path / "in" / "a.jsonl", {"a": "x", "b": "y"})
    write_jsonl(tmp_path / "in" / "b.jsonl", {"b": "z", "c": "w"})
    settings = resolve_settings(env(tiny_export, tmp_path / "cache"))
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        summary = local.run(job, settings, bar=False)
    assert (summary.rows, summary.duplicate_ids) == (4, 1)
    assert "1 rows have an id written before" in caplog.text and "'b'" in caplog.text
    (tmp_path / "in").rename(tmp_path / "moved")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        again = local.run(BulkJob(inputs=(str(tmp_path / "moved"),), output=job.output),
                          settings, bar=False)
    assert (again.rows, again.duplicate_ids) == (4, 4)
    assert "looks like" in caplog.text and "moved" in caplog.text


def test_a_disk_error_is_one_line_naming_the_path_with_exit_2(
        tmp_path: Path, capsys, monkeypatch) -> None:
    """An OSError of the output (the disk filled up while a shard was written; --output is a
    file) is one line, exit 2, no traceback; disk full says a rerun resumes."""
    import errno

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local, "run", disk_full)
    (tmp_path / "a.jsonl").write_text('{"id": "a", "text": "x"}\n')
    assert main(["bulk", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no space left" in err and str(tmp_path / "o") in err and "resumes" in err
    assert "Traceback" not in err
    monkeypatch.undo()
    (tmp_path / "file").write_text("")
    assert main(["bulk", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "file")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_damaged_inputs_give_their_readable_rows_and_the_job_goes_on(
        tiny_export: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A .jsonl.gz cut short and a Parquet file with a damaged row group beside a whole file:
    exit 0, every readable row embedded, the rest bad rows saying why (the job stopped at
    either file on every rerun, the rows read before unwritten: QA); a rerun has nothing left."""
    import gzip
    import zlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "in"
    write_jsonl(folder / "a.jsonl", {"a": "whole file"})
    lines = b"".join(b'{"id": "g%d", "text": "row %d of the cut file"}\n' % (i, i)
                     for i in range(4000))
    packed = gzip.compress(lines, mtime=0)
    cut = packed[:len(packed) // 2]
    (folder / "b.jsonl.gz").write_bytes(cut)
    whole = zlib.decompressobj(wbits=31).decompress(cut).count(b"\n")
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(300)],
                             "text": [f"parquet row {i} " * 8 for i in range(300)]}),
                   folder / "c.parquet", row_group_size=100)
    chunk = pq.read_metadata(folder / "c.parquet").row_group(1).column(1)
    raw = bytearray((folder / "c.parquet").read_bytes())
    at = chunk.dictionary_page_offset or chunk.data_page_offset
    raw[at + 40:at + 1040] = bytes(1000)
    (folder / "c.parquet").write_bytes(bytes(raw))
    job = BulkJob(inputs=(str(folder),), output=tmp_path / "out")
    settings = resolve_settings(env(tiny_export, tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="bgeserve.bulk")
    summary = local.run(job, settings, bar=False)
    table = read_output(tmp_path / "out")
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(["a", *(f"g{i}" for i in range(whole)),
                                  *(f"p{i}" for i in (*range(100), *range(200, 300)))])
    assert (summary.rows, summary.bad) == (len(ids), 101)
    again = local.run(job, settings, bar=False)  # nothing left: the bad rows are recorded
    assert (again.rows, again.bad, again.skipped) == (0, 0, len(ids) + 101)
    assert read_output(tmp_path / "out").num_rows == len(ids)
    logged = caplog.text
    assert "b.jsonl.gz is cut short" in logged
    assert "rows 100-199 (row group 1) cannot be read" in logged
    reasons = {e["reason"].split(" (")[0] for e in summary.bad_examples}
    assert reasons == {"the gzip file ends here, cut short", "in a damaged part of the file"}
