"""``bgeserve bulk --ray`` on a local Ray (2 CPUs) with the tiny random model: a job killed
halfway and run again gives every row exactly once, with the vectors ``Engine.embed`` gives,
and the bad rows reported and written nowhere. Ray is part of the dev extra."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray

from bgeserve import Engine
from bgeserve.bulk.job import BulkJob
from bgeserve.bulk.model import resolve_settings
from bgeserve.bulk.output import PIN
from bgeserve.engine import EngineConfig
from bgeserve.errors import InvalidInput
from bgeserve.model.artifacts import export_variants
from bgeserve.ray.pipeline import actor_pool
from bgeserve.ray.pipeline import run as run_ray
from tests.bulkdata import BAD_IDS, assert_rows_match, make_inputs, read_output

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def env(export: Path, cache: Path) -> dict[str, str]:
    return {"BGE_M3_MODEL_PATH": str(export), "BGE_M3_MODEL": "fp32",
            "BGE_M3_CACHE_DIR": str(cache), "BGE_M3_DISABLE_AUTO_BUDGET": "1",
            "BGE_M3_MAX_SEQ_LENGTH": "128", "HF_HUB_OFFLINE": "1", "BGE_M3_LOG_FORMAT": "text"}


def identity(export: Path) -> str:
    """What the manifest records for the fp32 variant of ``export``."""
    return f"fp32 sha256:{export_variants(export)['fp32']['sha256']}"


def manifest(folder: Path) -> dict:
    return json.loads((folder / "_bulk.json").read_text())


def write_jsonl(path: Path, rows: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in rows.items()))
    return path


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray of 2 CPUs whose workers import this checkout; its GCS address."""
    with pytest.MonkeyPatch.context() as mp:
        # Workers inherit the raylet's environment, which is this process's.
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO),
                                                             os.environ.get("PYTHONPATH")])))
        mp.setenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()


def test_a_local_cluster_without_the_model_there_is_refused_before_it_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster of this machine alone reads its files: a model path that is not there failed
    every actor, told in Ray's tracebacks of each (QA: 323 lines, exit 1); now the local
    job's one-line refusal, before any actor. A cluster elsewhere, or of several nodes, is
    not checked (review: ray.init joins a cluster `ray start` began here)."""
    import ray

    from bgeserve.errors import ModelUnavailable

    write_jsonl(tmp_path / "in" / "a.jsonl", {"a": "x"})
    settings = resolve_settings(env(tmp_path / "nowhere", tmp_path / "cache"))
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: None)
    node = {"Alive": True, "Resources": {"CPU": 2.0}}
    nodes = [node]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)

    def no_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("the job went on")

    monkeypatch.setattr(ray.data, "read_datasource", no_read)
    with pytest.raises(ModelUnavailable, match="does not exist.*BGE_M3_MODEL_PATH|"
                                               "BGE_M3_MODEL_PATH.*does not exist"):
        run_ray(job, settings)
    # Elsewhere (an address; a cluster of several nodes `ray start` began here, which
    # ray.init joins): the nodes' files, not this machine's, Ray's to tell.
    with pytest.raises(AssertionError, match="the job went on"):
        run_ray(job, settings, address="10.0.0.1:6379")
    nodes.append(node)
    with pytest.raises(AssertionError, match="the job went on"):
        run_ray(job, settings)


def test_a_file_error_in_a_task_is_the_commands_one_line() -> None:
    """The output folder unwritable mid-run: the sink's OSError is taken out of Ray's wrapper
    (and kept out of Ray's log) as bgeserve's refusals are, so `bulk` says it in one line
    (QA: 266 lines, a traceback inside its last); other errors stay Ray's."""
    from ray.exceptions import RayTaskError

    from bgeserve.ray.datasink import ShardWriteFailed
    from bgeserve.ray.pipeline import _refusal

    denied = ShardWriteFailed(13, "Permission denied", "/out/x.parquet")
    assert _refusal(RayTaskError("Write", "traceback", denied)) is denied
    refused = InvalidInput("no")
    assert _refusal(RayTaskError("Write", "traceback", refused)) is refused
    for other in (KeyError("k"), ConnectionError("lost"), FileNotFoundError(2, "gone", "/m")):
        assert _refusal(RayTaskError("Map", "traceback", other)) is None  # Ray's to tell
    assert _refusal(denied) is None


def test_actor_pool_leaves_a_cpu_per_node_for_reading_and_writing():
    """Default: one actor per node with all its CPUs but one; --cpus-per-actor packs more."""
    assert actor_pool([2], None) == (1.0, 1)
    assert actor_pool([16, 16], None) == (15.0, 2)
    assert actor_pool([16, 8], 3) == (3, 5 + 2)


def test_actors_start_with_the_malloc_arena_cap():
    """The actors' arena cap is in their environment when their processes start (a cap set
    from __init__ may come too late); the driver's own setting is passed on instead."""
    from bgeserve.ray.pipeline import arena_env

    assert arena_env({}, 15.0) == {"MALLOC_ARENA_MAX": "15"}
    assert arena_env({}, 0.5) == {"MALLOC_ARENA_MAX": "2"}
    assert arena_env({"MALLOC_ARENA_MAX": "4"}, 15.0) == {"MALLOC_ARENA_MAX": "4"}
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=3"}
    assert arena_env(tunables, 15.0) == tunables
    other = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    assert arena_env(other, 15.0) == {**other, "MALLOC_ARENA_MAX": "15"}


def test_a_killed_ray_job_reruns_to_every_row_once(cluster: str, tiny_export: Path,
                                                   tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Kill the driver once some shards are written; the rerun keeps them, writes the rest:
    500 rows equal to Engine.embed (fp32), no duplicates, the 4 bad rows reported by id and
    counted once (this run's, or the killed run's: ``skipped_bad``)."""
    texts = make_inputs(tmp_path / "in")
    out = tmp_path / "out"
    variables = env(tiny_export, tmp_path / "cache")
    cmd = [sys.executable, "-m", "bgeserve", "bulk", str(tmp_path / "in"), "--output", str(out),
           "--shard-rows", "10", "--ray", "--ray-address", cluster]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("BGE_M3_")}
    child_env.update(variables, PYTHONPATH=str(REPO))
    with open(tmp_path / "first.log", "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=log_file,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        # Killed at its first shard (each is renamed into place whole): the job writes a few
        # shards ~50-100 ms apart, and waiting for a second once let the last one land
        # before the kill did (all 500 rows written, nothing left to resume).
        while not any(out.glob("*.parquet")) and proc.poll() is None:
            assert time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    # The killed driver's tasks may still land a shard in the cluster for a moment (a shard
    # after the count made the rerun write 372 rows for 382 missing): counted once no new
    # shard came for a second.
    first, settled = read_output(out).num_rows, time.monotonic() + 1.0
    while time.monotonic() < settled and time.monotonic() < deadline:
        time.sleep(0.1)
        now = read_output(out).num_rows
        if now != first:
            first, settled = now, time.monotonic() + 1.0
    assert 0 < first < 500, f"the kill came too late to test resuming ({first} rows)"

    job = BulkJob(inputs=(str(tmp_path / "in"),), output=out, shard_rows=10)
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        summary = run_ray(job, resolve_settings(variables))
    assert summary.rows == 500 - first and summary.skipped >= first
    assert summary.duplicate_ids == 0
    # Each bad row counted once: in this run's, or among the rows the killed run covered.
    assert summary.bad + summary.skipped_bad == len(BAD_IDS)
    # The killed run's model was pinned before its first shard; the rerun recorded it.
    assert manifest(out)["model_identity"] == identity(tiny_export)
    assert not (out / PIN).exists()
    with Engine(tiny_export, "fp32", config=EngineConfig(max_seq=128)) as engine:
        assert_rows_match(read_output(out), texts, engine)
    reported = (tmp_path / "first.log").read_text() + "\n".join(
        r.getMessage() for r in caplog.records)
    for row_id, why in BAD_IDS.items():
        assert f"(id {row_id!r}): {why}" in reported or f"id {row_id!r}: {why}" in reported
    # --shard-rows holds on Ray too (each file was one shard: QA), and a run with nothing
    # left to do ends with nothing written (it raised a TypeError: QA)
    assert max(pq.read_metadata(p).num_rows for p in out.glob("*.parquet")) <= 10
    done = run_ray(job, resolve_settings(variables))
    assert (done.rows, done.shards, done.bad) == (0, 0, 0)


def test_a_first_ray_run_records_the_model_and_counts_repeated_ids(
        cluster: str, tiny_export: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """The manifest of a first Ray run records the actors' model identity (it recorded none);
    ids repeated across files are counted and named, and a moved input's rows are counted
    against the earlier shards' ids (duplicate_ids was always 0 on Ray)."""
    write_jsonl(tmp_path / "in" / "a.jsonl", {"a": "x", "b": "y"})
    write_jsonl(tmp_path / "in" / "b.jsonl", {"b": "z", "c": "w"})
    settings = resolve_settings(env(tiny_export, tmp_path / "cache"))
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        summary = run_ray(job, settings)
    assert (summary.rows, summary.shards, summary.duplicate_ids) == (4, 2, 1)
    assert "1 rows have an id written before" in caplog.text and "'b'" in caplog.text
    assert manifest(job.output)["model_identity"] == identity(tiny_export)
    assert not (job.output / PIN).exists()
    (tmp_path / "in").rename(tmp_path / "moved")
    again = run_ray(BulkJob(inputs=(str(tmp_path / "moved"),), output=job.output), settings)
    assert (again.rows, again.duplicate_ids) == (4, 4)


def test_a_ray_run_whose_every_row_is_bad_is_refused_and_blocks_no_rerun(
        cluster: str, tiny_export: Path, tmp_path: Path) -> None:
    """As the local run: a mistyped --text-column makes every row bad: refused naming the flag
    (it exited 0 leaving shards of bad rows and a manifest that refused the corrected rerun as
    another job), nothing left behind; the corrected run embeds every row."""
    write_jsonl(tmp_path / "in" / "a.jsonl", {"a": "x", "b": "y"})
    settings = resolve_settings(env(tiny_export, tmp_path / "cache"))
    wrong = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out", text_column="txet")
    with pytest.raises(InvalidInput, match="--text-column"):
        run_ray(wrong, settings)
    assert not list((tmp_path / "out").glob("*.parquet"))
    assert not (tmp_path / "out" / "_bulk.json").exists()
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out")
    assert run_ray(job, settings).rows == 2


def test_a_ray_run_into_a_folder_of_another_model_is_refused_and_writes_nothing(
        cluster: str, tiny_export: Path, tmp_path: Path) -> None:
    """The manifest records other model files than the actors load (another export put at the
    same BGE_M3_MODEL_PATH since): the run is refused with the local job's message before any
    shard is written (the Ray job never checked), and the manifest keeps its record. Ray does
    not log the refusal as its own bug with its whole stack (~200 lines before)."""
    from bgeserve.bulk import local

    write_jsonl(tmp_path / "in" / "a.jsonl", {f"t{i}": f"text {i}" for i in range(6)})
    settings = resolve_settings(env(tiny_export, tmp_path / "cache"))
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out", shard_rows=4)
    local.run(job, settings, bar=False)
    other = "fp32 sha256:" + "0" * 64
    body = manifest(job.output)
    assert body["model_identity"] == identity(tiny_export)
    body["model_identity"] = other
    (job.output / "_bulk.json").write_text(json.dumps(body))
    before = sorted(p.name for p in job.output.iterdir())
    write_jsonl(tmp_path / "in" / "b.jsonl", {f"u{i}": f"more {i}" for i in range(6)})
    records: list[logging.LogRecord] = []
    recorder = logging.Handler()
    recorder.emit = records.append  # type: ignore[method-assign]
    ray_loggers = [logging.getLogger(name) for name in (
        "ray.data.exceptions", "ray.data._internal.execution.streaming_executor_state")]
    for lg in ray_loggers:
        lg.addHandler(recorder)
    try:
        with pytest.raises(InvalidInput, match="other model files.*BGE_M3_MODEL_PATH") as exc:
            run_ray(job, settings)
    finally:
        for lg in ray_loggers:
            lg.removeHandler(recorder)
    assert type(exc.value) is InvalidInput  # the refusal itself, not Ray's wrapper of it
    assert [r.getMessage() for r in records if r.levelno >= logging.ERROR] == []
    assert sorted(p.name for p in job.output.iterdir()) == before
    assert manifest(job.output)["model_identity"] == other


def test_a_ray_colbert_job_keeps_each_shards_vectors_within_the_limit(
        cluster: str, tiny_export: Path, tmp_path: Path) -> None:
    """BGE_M3_MAX_COLBERT_MB bounds the Ray path too: a write task held a whole read's
    vectors (review), which the actors gave a whole block of rows at a time and Ray joined
    into 128 MiB blocks. Now the actors give parts of half the limit (the driver's, pinned
    for every actor), Ray's blocks are no larger, and each shard is within the limit (plus
    the text that passes it); every vector as embed's."""
    import numpy as np

    from bgeserve.ray.pipeline import actor_env

    texts = {f"t{i:03d}": " ".join(["word"] * (200 if i < 128 else 3)) + f" {i}"
             for i in range(192)}
    write_jsonl(tmp_path / "in" / "a.jsonl", texts)
    job = BulkJob(inputs=(str(tmp_path / "in"),), output=tmp_path / "out", outputs=("colbert",),
                  shard_rows=128)
    settings = resolve_settings({**env(tiny_export, tmp_path / "cache"),
                                 "BGE_M3_MAX_COLBERT_MB": "1"})
    assert actor_env(settings)["BGE_M3_MAX_COLBERT_MB"] == "1"
    summary = run_ray(job, settings)
    per_text = 127 * 32 * 4  # 128 tokens (max_seq), CLS excluded, 32 floats each
    shards = [pq.read_table(p) for p in job.output.glob("*.parquet")]
    long_rows = [sum(int(i[1:]) < 128 for i in t["id"].to_pylist()) for t in shards]
    assert summary.rows == 192 and sum(long_rows) == 128
    assert max(long_rows) * per_text <= (1 << 20) + per_text, long_rows  # 128 were one shard
    table = read_output(job.output)
    with Engine(tiny_export, "fp32", config=EngineConfig(max_seq=128)) as engine:
        want = engine.embed(list(texts.values()), dense=False, colbert=True)
    got = dict(zip(table["id"].to_pylist(), table["colbert"].to_pylist(), strict=True))
    for key, vectors in zip(texts, want.colbert, strict=True):
        np.testing.assert_allclose(np.array(got[key], np.float32), vectors, atol=1e-5, rtol=0)
