"""Tests for bgeserve.service.preparation: when a start prepares, what it serves, what it says.

Decisions are checked without a model; the pipeline runs on the tiny model's hub snapshots;
the last tests start real servers on a fake hub (tests/fakehub.py): the first start downloads
and prepares with its progress in /health and the log, the second serves from the cache.
"""

from __future__ import annotations

import errno
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from bgeserve.config import Settings
from bgeserve.engine import Engine
from bgeserve.model import prepared as prepared_module
from bgeserve.model.artifacts import BAAI_REPO, BAAI_REVISION, HUB_SOURCES
from bgeserve.model.layout import Layout
from bgeserve.model.prepared import PrepareSource
from bgeserve.model.ptload import HeadWeights
from bgeserve.progress import Progress
from bgeserve.service import preparation, prepare_plan, recipe
from bgeserve.service.preparation import Preparation
from bgeserve.service.prepare_plan import peak_bytes
from tests.fakehub import FakeHub
from tests.graphs import BAAI_OUTPUTS, graph_bytes
from tests.oracle import FP32, INT8, assert_matches, reference
from tests.serverproc import ServerProc


@pytest.mark.parametrize(("env", "status", "why"), [
    ({"BGE_M3_PREPARE": "0"}, "disabled", "BGE_M3_PREPARE=0"),
    ({"BGE_M3_EP": "cuda"}, "not_needed", "fp16 graph"),
    ({"BGE_M3_MODEL": "fp16"}, "not_needed", "fp16"),
])
def test_starts_that_do_not_prepare_keep_their_settings(env, status, why, tmp_path,
                                                        caplog) -> None:
    """BGE_M3_PREPARE=0, a GPU EP and the fp16 variant serve as configured, saying why, in
    /health's status and in the log."""
    s = Settings.from_env({"BGE_M3_MODEL_PATH": str(tmp_path / "nowhere"), **env})
    prep = Preparation()

    with caplog.at_level("INFO", logger="bgeserve.prepare"):
        assert prep.apply(s, tmp_path) is s
    assert prep.status["status"] == status and why in prep.status["reason"]
    assert [r.getMessage() for r in caplog.records] == [
        f"serving the snapshot as it is, not prepared ({prep.status['reason']})"]


def test_an_export_is_served_without_a_word_about_preparing(tmp_path, caplog) -> None:
    """A `bgeserve export` has nothing to prepare: no log line says it was not."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "manifest.json").write_text(json.dumps({
        "format": "bgeserve-export", "variants": {"fp32": {"path": "fp32/model.onnx"}}}))
    s = Settings.from_env({"BGE_M3_MODEL_PATH": str(export)})
    prep = Preparation()

    with caplog.at_level("INFO", logger="bgeserve.prepare"):
        assert prep.apply(s, tmp_path) is s
    assert prep.status["status"] == "not_needed" and "export" in prep.status["reason"]
    assert caplog.records == []


@pytest.mark.parametrize(("env", "bf16", "int32", "nncf", "want"), [
    ({}, False, False, True, ["fp32", "int8"]),
    ({}, True, False, True, ["fp32", "int8", "bf16"]),
    # VNNI / AMX-INT8: OpenVINO's int8 is fast there and its 8-bit weights compute right
    ({}, False, True, True, ["fp32", "int8", "ov-int8"]),
    ({}, True, True, True, ["fp32", "int8", "bf16", "ov-int8"]),
    ({}, True, True, False, ["fp32", "int8", "bf16"]),  # no NNCF: not made, nothing fails
    # asked for: made on any CPU (7-bit weights without VNNI), and nothing else but the
    # reference (QA: BGE_M3_MODEL=fp32 still made int8, bf16 and ov-int8: minutes, GiBs)
    ({"BGE_M3_MODEL": "ov-int8"}, False, False, True, ["fp32", "ov-int8"]),
    ({"BGE_M3_MODEL": "bf16"}, False, False, True, ["fp32", "bf16"]),
    ({"BGE_M3_MODEL": "fp32"}, True, True, True, ["fp32"]),
    ({"BGE_M3_MODEL": "int8"}, True, True, True, ["fp32", "int8"]),
    # one preparing does not make (the hub's GPU graph), or cannot make here (no NNCF): not
    # tried, so not recorded as failed, and made by a later start that can (review)
    ({"BGE_M3_MODEL": "fp16"}, True, True, True, ["fp32"]),
    ({"BGE_M3_MODEL": "ov-int8"}, True, True, False, ["fp32"]),
    ({"BGE_M3_EP": "openvino"}, False, False, True, ["fp32", "int8", "bf16"]),
    # ov-int8 runs on OpenVINO too, but bf16 is not what was asked for
    ({"BGE_M3_MODEL": "ov-int8", "BGE_M3_EP": "openvino"}, False, False, True,
     ["fp32", "ov-int8"]),
])
def test_the_variants_a_start_prepares_follow_the_cpu(env, bf16, int32, nncf, want,
                                                      monkeypatch) -> None:
    """fp32 and int8 always; bf16 where the CPU computes in bf16; ov-int8 where it sums int8
    products in int32 and NNCF is installed; either one when it is the variant asked for."""
    monkeypatch.setattr(prepare_plan.openvino, "available", lambda: True)
    monkeypatch.setattr(prepare_plan.openvino, "native_bf16", lambda: bf16)
    monkeypatch.setattr(prepare_plan, "sums_int8_in_int32", lambda: int32)
    monkeypatch.setattr(prepare_plan.importlib.util, "find_spec",
                        lambda name: object() if nncf and name == "nncf" else None)
    assert prepare_plan.wanted(Settings.from_env(env)) == want


def test_an_export_is_served_as_it_is(tiny_export, tmp_path) -> None:
    """BGE_M3_MODEL_PATH at a `bgeserve export` needs no preparing."""
    s = Settings.from_env({"BGE_M3_MODEL_PATH": str(tiny_export)})
    prep = Preparation()
    assert prep.apply(s, tmp_path) is s and prep.status["status"] == "not_needed"


@pytest.mark.slow
def test_too_little_memory_serves_the_snapshot_as_it_is(hub_snapshots, tmp_path) -> None:
    """Where even the fp32 step would not fit, nothing is prepared: the stock graph is served
    and the reason names the memory needed and available."""
    s = Settings.from_env({"BGE_M3_MODEL_PATH": str(hub_snapshots["baai"]),
                           "BGE_M3_AVAILABLE_MEMORY_BYTES": str(256 << 20)})
    prep = Preparation()

    assert prep.apply(s, tmp_path) is s
    assert prep.status["status"] == "skipped" and "256 MiB are available" in prep.status["reason"]
    assert [p for p in (tmp_path / "prepared").iterdir() if p.is_dir()] == []


@pytest.mark.slow
def test_a_graph_that_cannot_be_rewritten_falls_back_to_it(tiny_model, tmp_path) -> None:
    """A graph with BAAI's outputs but no encoder in it: the step fails, the stock graph is
    served, and the status names the failing step."""
    root = tmp_path / "odd"
    (root / "onnx").mkdir(parents=True)
    (root / "onnx" / "model.onnx").write_bytes(graph_bytes(BAAI_OUTPUTS))
    for name in ("tokenizer.json", "sparse_linear.pt", "colbert_linear.pt"):
        shutil.copyfile(tiny_model / name, root / name)
    s = Settings.from_env({"BGE_M3_MODEL_PATH": str(root)})
    prep = Preparation()

    assert prep.apply(s, tmp_path / "cache") is s
    assert prep.status["status"] == "failed" and "'graphs' failed" in prep.status["reason"]
    assert list((tmp_path / "cache" / "prepared").glob(".*.tmp")) == []  # staging cleaned up


def _source(root: Path) -> PrepareSource:
    root.mkdir(parents=True, exist_ok=True)
    for name, content in (("model.onnx", b"g"), ("model.onnx_data", b"w" * 64),
                          ("tokenizer.json", b"{}")):
        (root / name).write_bytes(content)
    import numpy as np

    heads = HeadWeights(np.ones(4, np.float32), 0.0, np.eye(4, dtype=np.float32),
                        np.zeros(4, np.float32))
    return PrepareSource(root / "model.onnx", Layout.BAAI, root / "tokenizer.json", heads,
                         "test source", (root / "model.onnx_data",))


def _write_export(out: Path, variants, prepared: dict) -> None:
    """What a fake ``run_recipe`` leaves: a graph and weights per variant, a tokenizer, and a
    manifest recording their sizes as ``export/prepare.py`` writes them."""
    entries = {}
    for variant in variants:
        (out / variant).mkdir(parents=True, exist_ok=True)
        (out / variant / "model.onnx").write_bytes(b"g" * 10)
        (out / variant / "model.onnx_data").write_bytes(b"w" * 90)
        entries[variant] = {"path": f"{variant}/model.onnx", "bytes": 10, "total_bytes": 100,
                            "agreement": {"dense_cos_min": 1.0}}
    (out / "tokenizer.json").write_text("{}")
    (out / "manifest.json").write_text(json.dumps(
        {"format": "bgeserve-export", "variants": entries, "tokenizer": "tokenizer.json",
         "prepared": prepared}))


def test_the_cache_is_keyed_by_the_sources_content(tmp_path, monkeypatch) -> None:
    """Prepared once, found the next time (no steps run), prepared again when a source file's
    content changes; asking for a variant the cached export lacks prepares again, from the
    cached one (``reuse``: what it has is linked, tests/test_prepare.py), with only the
    missing variant weighed against memory."""
    calls: list[Path] = []
    reused: list[Path | None] = []
    skips: list[dict[str, str]] = []

    def fake_recipe(source, out, variants, **kwargs):
        calls.append(out)
        reused.append(kwargs["reuse"])
        skips.append(kwargs["skip"])
        _write_export(out, variants, {"skipped": {}})
        return {"variants": list(variants), "skipped": {}, "seconds": 0.0}

    monkeypatch.setattr(preparation, "run_recipe", fake_recipe)
    source = _source(tmp_path / "src")
    s = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(64 << 30)})
    prep = Preparation()

    first, _ = prep.find_or_make(s, tmp_path / "cache", source, ["fp32", "int8"])
    assert prep.status["status"] == "prepared" and len(calls) == 1
    again, _ = prep.find_or_make(s, tmp_path / "cache", source, ["fp32", "int8"])
    assert (again, prep.status["status"], len(calls)) == (first, "cached", 1)
    # Found in the cache, it is served however little memory a new preparation would have.
    short = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": "1"})
    assert prep.find_or_make(short, tmp_path / "cache", source, ["fp32", "int8"])[0] == first
    assert reused == [None]
    # bf16 asked for later, with memory for bf16 (2.75 W + 512 MiB) but not for int8 (3.35 W
    # + 512 MiB): the cached int8 is kept, not skipped; bf16 alone is weighed.
    weights = source.weight_bytes
    tight = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(
        prepare_plan.peak_bytes("bf16", weights) + 1)})
    assert prepare_plan.peak_bytes("int8", weights) > prepare_plan.peak_bytes("bf16", weights) + 1
    added, _ = prep.find_or_make(tight, tmp_path / "cache", source, ["fp32", "int8", "bf16"])
    assert prep.status["status"] == "prepared" and len(calls) == 2
    assert added == first and reused[-1] == first and skips[-1] == {}
    # Asking for fewer than it has (`prepare --variant ov-int8` after a start): what it had is
    # asked for too (linked), not dropped from the export that replaces it.
    fewer, _ = prep.find_or_make(s, tmp_path / "cache", source, ["fp32", "ov-int8"])
    assert fewer == first and len(calls) == 3 and reused[-1] == first
    assert set(json.loads((first / "manifest.json").read_text())["variants"]) == {
        "fp32", "int8", "bf16", "ov-int8"}
    for wanted in (["fp32", "int8"], ["fp32", "bf16"], ["fp32", "int8", "bf16", "ov-int8"]):
        assert prep.find_or_make(s, tmp_path / "cache", source, wanted)[0] == first
        assert prep.status["status"] == "cached" and len(calls) == 3
    (tmp_path / "src" / "model.onnx_data").write_bytes(b"x" * 64)
    changed, _ = prep.find_or_make(s, tmp_path / "cache", source, ["fp32"])
    assert changed != first and prep.status["status"] == "prepared" and len(calls) == 4
    assert reused[-1] is None  # a new key: nothing to reuse
    prep.find_or_make(s, tmp_path / "cache", source, ["fp32", "int8"], force=True)
    assert len(calls) == 5 and reused[-1] is None  # forced: everything made again


def test_a_variant_left_out_for_room_is_made_when_a_later_start_has_it(tmp_path,
                                                                        monkeypatch) -> None:
    """int8 left out for memory: a start as tight serves the cached fp32 without preparing
    again; a start with room adds int8 (reusing fp32); a variant whose own step failed is not
    retried (that takes --force)."""
    calls: list[tuple[Path | None, dict[str, str]]] = []
    failing: set[str] = set()

    def fake_recipe(source, out, variants, **kwargs):
        skip, reuse = kwargs["skip"], kwargs["reuse"]
        calls.append((reuse, dict(skip)))
        failed = {v: "step failed" for v in variants if v in failing and v not in skip}
        made = [v for v in variants if v not in skip and v not in failed]
        _write_export(out, made, {"skipped": {**skip, **failed}, "limited": sorted(skip)})
        return {"variants": made, "skipped": {**skip, **failed}, "seconds": 0.0}

    monkeypatch.setattr(preparation, "run_recipe", fake_recipe)
    source = _source(tmp_path / "src")
    weights = source.weight_bytes
    tight = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(
        peak_bytes("fp32", weights) + 1)})
    roomy = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(64 << 30)})
    cache = tmp_path / "cache"
    prep = Preparation()

    first, outcome = prep.find_or_make(tight, cache, source, ["fp32", "int8", "bf16"])
    assert len(calls) == 1 and set(calls[0][1]) == {"int8", "bf16"}
    assert set(outcome["skipped"]) == {"int8", "bf16"}
    again, _ = prep.find_or_make(tight, cache, source, ["fp32", "int8", "bf16"])
    assert (again, prep.status["status"], len(calls)) == (first, "cached", 1)

    # Room for bf16 (2.75 W + 512 MiB) but not int8 (3.35 W + 512 MiB): bf16 alone is added.
    middle = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(
        peak_bytes("bf16", weights) + 1)})
    failing.add("bf16")  # ... and its step fails this time
    prep.find_or_make(middle, cache, source, ["fp32", "int8", "bf16"])
    assert prep.status["status"] == "prepared" and len(calls) == 2
    assert calls[1][0] == first and set(calls[1][1]) == {"int8"}
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["prepared"]["limited"] == ["int8"]
    assert manifest["prepared"]["skipped"]["bf16"] == "step failed"

    # With room for everything: bf16, whose step failed, is not tried again by itself ...
    failing.clear()
    prep.find_or_make(roomy, cache, source, ["fp32", "bf16"])
    assert prep.status["status"] == "cached" and len(calls) == 2
    # ... and int8, left out for memory, is made.
    prep.find_or_make(roomy, cache, source, ["fp32", "int8"])
    assert prep.status["status"] == "prepared" and len(calls) == 3 and calls[2][1] == {}
    manifest = json.loads((first / "manifest.json").read_text())
    assert set(manifest["variants"]) == {"fp32", "int8"} and manifest["prepared"]["limited"] == []
    prep.find_or_make(roomy, cache, source, ["fp32", "int8"])
    assert prep.status["status"] == "cached" and len(calls) == 3


def test_a_failed_addition_serves_the_export_made_before(tmp_path, monkeypatch) -> None:
    """Adding a variant to a cached export fails in a step that ends the preparation: the
    cached export still serves (not the stock graph), and the status says what failed."""
    made: list[Path] = []

    def fake_recipe(source, out, variants, **kwargs):
        if made:
            raise preparation.PrepareFailed("graphs", "disk full")
        made.append(out)
        _write_export(out, ["fp32"], {"skipped": {}})
        return {"variants": ["fp32"], "skipped": {}, "seconds": 0.0}

    monkeypatch.setattr(preparation, "run_recipe", fake_recipe)
    source = _source(tmp_path / "src")
    s = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(64 << 30)})
    prep = Preparation()
    first, _ = prep.find_or_make(s, tmp_path / "cache", source, ["fp32"])

    again, _ = prep.find_or_make(s, tmp_path / "cache", source, ["fp32", "int8"])
    assert again == first and prep.status["status"] == "cached"
    assert prep.status["reason"] == "adding int8 failed: disk full"
    assert [p.name for p in (tmp_path / "cache" / "prepared").iterdir() if p.is_dir()] == [
        first.name]  # the staging directory is gone
    with pytest.raises(preparation.PrepareFailed):  # forced: nothing made before to serve
        prep.find_or_make(s, tmp_path / "cache", source, ["fp32", "int8"], force=True)


@pytest.mark.slow
def test_a_variant_that_does_not_fit_is_skipped_and_fp32_still_served(
        hub_snapshots, tmp_path, flag_model) -> None:
    """With room for the fp32 steps but not int8's, the export holds fp32 (matching
    FlagEmbedding), the manifest says why int8 is missing, and the start serves fp32 from it
    (an optimum-style snapshot: last_hidden_state at opset 14); a later start with room adds
    int8 (and what else this CPU wants) to it."""
    snapshot = hub_snapshots["optimum"]
    weights = sum(p.stat().st_size for p in (snapshot / "onnx").iterdir())
    room = (peak_bytes("fp32", weights) + peak_bytes("int8", weights)) // 2
    s = Settings.from_env({"BGE_M3_MODEL_PATH": str(snapshot),
                           "BGE_M3_AVAILABLE_MEMORY_BYTES": str(room)})
    prep = Preparation(Progress())

    served = prep.apply(s, tmp_path / "cache")

    manifest = json.loads((served.model_path / "manifest.json").read_text())
    assert list(manifest["variants"]) == ["fp32"] and served.variant == "fp32"
    assert "MiB available" in manifest["prepared"]["skipped"]["int8"]
    assert prep.status["status"] == "prepared" and prep.status["variants"] == ["fp32"]
    # Every variant this CPU wants besides fp32 was left out (bf16 and ov-int8 join int8 on a
    # CPU with native bf16 and VNNI: prepare_plan.wanted).
    assert manifest["prepared"]["limited"] == sorted(
        v for v in prepare_plan.wanted(s) if v != "fp32")
    texts = ["a short text", " ".join(["words of a longer text"] * 60), ""]
    with Engine(served.model_path, "fp32", cache_dir=tmp_path, offline=True) as engine:
        assert_matches(engine.embed(texts, dense=True, sparse=True, colbert=True),
                       reference(flag_model, texts), FP32)

    # A later start with room makes int8 into the same cached export, fp32 kept.
    roomy = Settings.from_env({"BGE_M3_MODEL_PATH": str(snapshot), "BGE_M3_MODEL": "int8",
                               "BGE_M3_AVAILABLE_MEMORY_BYTES": str(64 << 30)})
    again = Preparation(Progress())
    served = again.apply(roomy, tmp_path / "cache")
    manifest = json.loads((served.model_path / "manifest.json").read_text())
    assert again.status["status"] == "prepared" and served.variant == "int8"
    assert sorted(manifest["variants"]) == sorted(prepare_plan.wanted(roomy))
    assert "int8" in manifest["variants"]
    assert manifest["prepared"]["reused"] == ["fp32"] and manifest["prepared"]["limited"] == []
    with Engine(served.model_path, "int8", cache_dir=tmp_path, offline=True) as engine:
        assert_matches(engine.embed(texts, dense=True, sparse=True, colbert=True),
                       reference(flag_model, texts), INT8)


# --- a real server on a fake hub ---------------------------------------------------------------


@pytest.fixture
def hub_of_snapshot(hub_snapshots, monkeypatch):
    """A fake hub serving the tiny BAAI-layout snapshot at BAAI/bge-m3's pinned commit."""
    root = hub_snapshots["baai"]
    source = HUB_SOURCES["fp32"]
    files = {(BAAI_REPO, BAAI_REVISION, name): (root / name).read_bytes()
             for name in (source.onnx, source.tokenizer, "sparse_linear.pt",
                          "colbert_linear.pt", "onnx/model.onnx_data")}
    files[(BAAI_REPO, BAAI_REVISION, "onnx/Constant_7_attr__value")] = b""  # unused here
    hub = FakeHub(files)
    yield hub
    hub.stop()


def _until_ready(server: ServerProc, timeout: float) -> tuple[dict, list[dict]]:
    import httpx

    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.returncode is not None:
            raise AssertionError(f"server exited {server.returncode}: {server.output()}")
        try:
            body = httpx.get(server.url + "/health", timeout=5).json()
        except httpx.HTTPError:
            time.sleep(0.2)
            continue
        seen.append(body)
        if body["status"] in ("ok", "fail"):
            return body, seen
        time.sleep(0.2)
    raise AssertionError(f"not ready after {timeout}s: {seen[-1:]}")


@pytest.mark.slow
def test_first_start_downloads_and_prepares_the_second_serves_from_the_cache(
        hub_of_snapshot, tmp_path, no_torch_path) -> None:
    """No BGE_M3_CACHE_DIR, no model path, a user's HOME: the first start downloads into the
    Hugging Face cache, prepares (its steps and progress in /health while loading, JSON log
    lines with bytes and step names), serves the prepared export; the second start, offline,
    serves it from ~/.cache/bgeserve in seconds."""
    import httpx

    home = tmp_path / "home"
    env = {"HOME": str(home), "XDG_CACHE_HOME": "", "HF_ENDPOINT": hub_of_snapshot.url,
           "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0",
           "NO_PROXY": "127.0.0.1,localhost", "BGE_M3_DISABLE_AUTO_BUDGET": "1",
           "PYTHONPATH": no_torch_path}
    with ServerProc(env) as server:
        health, seen = _until_ready(server, 600)
        records = server.json_logs()
        info = httpx.get(server.url + "/info", timeout=30).json()
    # TEI's /info names the hub revision the prepared export was made from.
    assert (info["model_id"], info["model_sha"]) == (BAAI_REPO, BAAI_REVISION)
    assert health["status"] == "ok", health
    model = health["model"]
    assert model["layout"] == "bgeserve" and model["prepare"]["status"] == "prepared"
    assert str(home / ".cache" / "bgeserve" / "prepared") in model["source"]
    steps = [b.get("step") for b in seen if b["status"] == "loading"]
    assert any(s and s.startswith("prepare: ") for s in steps), steps
    assert all(0.0 <= b["progress"] <= 1.0 for b in seen if "progress" in b)
    data = [r for r in records if r.get("file") == "onnx/model.onnx_data"]
    assert data and data[-1]["bytes_done"] == data[-1]["bytes_total"] > 0
    assert any(r.get("step") == "prepare: int8" for r in records)

    hub_of_snapshot.stop()
    hub_of_snapshot.stop = lambda: None  # type: ignore[method-assign]
    started = time.monotonic()
    with ServerProc({**env, "HF_HUB_OFFLINE": "1"}) as server:
        health, _ = _until_ready(server, 120)
    assert time.monotonic() - started < 60
    assert health["status"] == "ok" and health["model"]["prepare"]["status"] == "cached"
    assert health["model"]["source"] == model["source"]



def test_a_full_disk_leaves_variants_out_before_anything_is_written(tmp_path,
                                                                    monkeypatch) -> None:
    """Free space for fp32 and int8 but not bf16: bf16 is skipped (the reason names
    BGE_M3_CACHE_DIR), and ov-int8 before it; not even room for fp32: nothing is prepared.
    Room counts int8's scratch (the smoothed fp32 copy and the quantized graph, beside the
    files left) and, from another file system, the plain graph's copy of the weights."""
    import shutil as shutil_module

    weights = 1 << 30
    usage = shutil_module.disk_usage(tmp_path)
    disk, scratch = prepare_plan.DISK, prepare_plan.SCRATCH["int8"]
    room = int((disk["fp32"] + disk["int8"] + scratch + 0.1) * weights)
    free = room

    monkeypatch.setattr(prepare_plan.shutil, "disk_usage", lambda path: usage._replace(free=free))
    skips = prepare_plan.disk_skips(tmp_path, weights, ["fp32", "int8", "bf16"])
    assert list(skips) == ["bf16"] and "BGE_M3_CACHE_DIR" in skips["bf16"]
    skips = prepare_plan.disk_skips(tmp_path, weights, ["fp32", "int8", "bf16", "ov-int8"])
    assert list(skips) == ["ov-int8", "bf16"]
    # Enough for the files int8 leaves, not for making it (ENOSPC mid-step before).
    free = int((disk["fp32"] + disk["int8"] + 0.1) * weights)
    assert list(prepare_plan.disk_skips(tmp_path, weights, ["fp32", "int8"])) == ["int8"]
    free = room  # ... and the plain graph's copy of the weights from another file system
    assert list(prepare_plan.disk_skips(tmp_path, weights, ["fp32", "int8"],
                                        copied=weights)) == ["int8"]
    free = weights // 2
    with pytest.raises(prepare_plan.Skip, match="BGE_M3_CACHE_DIR"):
        prepare_plan.disk_skips(tmp_path, weights, ["fp32", "int8"])
    # A small model's sizes read in MiB, not "~0.0 GiB".
    free = 1 << 20
    with pytest.raises(prepare_plan.Skip, match=r"needs ~2 MiB .* 1 MiB are free"):
        prepare_plan.disk_skips(tmp_path, 2 << 20, ["fp32"])


def test_sizes_read_in_a_unit_that_shows_them() -> None:
    """MiB below 1 GiB (what a small model's messages need), GiB from there."""
    assert prepare_plan.size(1000) == "0 MiB" and prepare_plan.size(900 << 20) == "900 MiB"
    assert prepare_plan.size(3 * (1 << 30) // 2) == "1.5 GiB"


def _read_only(monkeypatch, root: Path) -> None:
    """Writes under ``root`` fail as on a read-only mount (EROFS): chmod would not stop the
    tests' root user in CI."""
    real_open, path_open, path_mkdir = open, Path.open, Path.mkdir

    def refuse(path) -> None:
        if Path(path).absolute().is_relative_to(root.absolute()):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    def opener(file, mode="r", *args, **kwargs):
        if set(mode) & set("wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def path_opener(self, mode="r", *args, **kwargs):
        if set(mode) & set("wax+"):
            refuse(self)
        return path_open(self, mode, *args, **kwargs)

    def mkdir(self, *args, **kwargs):
        refuse(self)
        return path_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(prepared_module, "open", opener, raising=False)
    monkeypatch.setattr(Path, "open", path_opener)
    monkeypatch.setattr(Path, "mkdir", mkdir)


def _counting_recipe(monkeypatch) -> list[Path]:
    """``run_recipe`` replaced by one that writes a fake export; returns the list of its runs."""
    calls: list[Path] = []

    def fake_recipe(source, out, variants, **kwargs):
        calls.append(out)
        _write_export(out, variants, {"skipped": {}})
        return {"variants": list(variants), "skipped": {}, "seconds": 0.0}

    monkeypatch.setattr(preparation, "run_recipe", fake_recipe)
    return calls


def test_a_read_only_cache_that_holds_the_export_serves_it(tmp_path, monkeypatch,
                                                           caplog) -> None:
    """A cache prepared before (``bgeserve prepare`` in an init container) and mounted
    read-only: the export is found and served without a lock, the digests are hashed without
    being saved (a warning); one without the export says how to make it."""
    calls = _counting_recipe(monkeypatch)
    source = _source(tmp_path / "src")
    cache = tmp_path / "cache"
    s = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(64 << 30)})
    first, _ = Preparation().find_or_make(s, cache, source, ["fp32", "int8"])
    (cache / "prepared" / "digests.json").unlink()  # e.g. the snapshot copied: hashed again
    for lock in (cache / "prepared").glob(".*.lock"):
        lock.unlink()
    _read_only(monkeypatch, cache)
    prep = Preparation()

    with caplog.at_level("WARNING", logger="bgeserve.prepare"):
        found, _ = prep.find_or_make(s, cache, source, ["fp32", "int8", "bf16"])

    assert found == first and len(calls) == 1
    assert prep.status == {"status": "cached", "key": first.name, "read_only": True}
    assert any("digests.json" in r.getMessage() for r in caplog.records)
    assert not (cache / "prepared" / "digests.json").exists()
    _read_only(monkeypatch, tmp_path / "other")
    with pytest.raises(preparation.PrepareFailed, match="cannot be written.*bgeserve prepare"):
        prep.find_or_make(s, tmp_path / "other", source, ["fp32"])


def test_a_damaged_export_is_prepared_again(tmp_path, monkeypatch, caplog) -> None:
    """A graph cut short or a weight file deleted in the cached export: a warning names the
    file and the export is prepared again; in a read-only cache the reason says how to mend
    it."""
    calls = _counting_recipe(monkeypatch)
    source = _source(tmp_path / "src")
    cache = tmp_path / "cache"
    s = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(64 << 30)})
    prep = Preparation()
    first, _ = prep.find_or_make(s, cache, source, ["fp32", "int8"])

    (first / "int8" / "model.onnx").write_bytes(b"g" * 3)
    with caplog.at_level("WARNING", logger="bgeserve.prepare"):
        again, _ = prep.find_or_make(s, cache, source, ["fp32", "int8"])
    assert (again, prep.status["status"], len(calls)) == (first, "prepared", 2)
    assert any("damaged" in r.getMessage() and "int8/model.onnx is 3 bytes" in r.getMessage()
               for r in caplog.records)

    (first / "fp32" / "model.onnx_data").unlink()
    caplog.clear()
    with caplog.at_level("WARNING", logger="bgeserve.prepare"):
        prep.find_or_make(s, cache, source, ["fp32", "int8"])
    assert prep.status["status"] == "prepared" and len(calls) == 3
    assert any("fp32/ holds model.onnx: 10 bytes" in r.getMessage()
               for r in caplog.records)

    (first / "fp32" / "model.onnx_data").unlink()
    _read_only(monkeypatch, cache)
    with pytest.raises(preparation.PrepareFailed,
                       match=r"damaged .*bgeserve prepare --force.* or delete"):
        prep.find_or_make(s, cache, source, ["fp32", "int8"])
    assert len(calls) == 3


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def test_stop_ends_the_prepare_child_its_step_and_its_staging(tmp_path, monkeypatch) -> None:
    """The server shutting down mid-preparation: the prepare child and the step it runs end
    (SIGTERM to their process group) and the staging directory is removed, instead of both
    running on, orphaned, for minutes."""
    pids = tmp_path / "pids"
    child = tmp_path / "python"  # stands in for `python -m bgeserve.export.prepare`
    child.write_text(f"#!/bin/sh\nsleep 120 &\necho $$ $! > {pids}\n"
                     'echo \'{"event": "step", "name": "graphs", "index": 1, "of": 4}\'\n'
                     "wait\n")
    child.chmod(0o755)
    monkeypatch.setattr(recipe, "sys", type("Sys", (), {"executable": str(child)}))
    source = _source(tmp_path / "src")
    s = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(64 << 30)})
    prep = Preparation()
    failures: list[BaseException] = []

    def start() -> None:
        try:
            prep.find_or_make(s, tmp_path / "cache", source, ["fp32"])
        except Exception as exc:  # noqa: BLE001 - what the start saw, checked below
            failures.append(exc)

    loader = threading.Thread(target=start)
    loader.start()
    deadline = time.monotonic() + 30
    while not (pids.exists() and pids.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "the fake prepare child never started"
        time.sleep(0.05)
    started = time.monotonic()
    prep.stop()
    assert time.monotonic() - started < recipe.STOP_GRACE_SECS + 2
    loader.join(10)
    assert all(_gone(int(pid)) for pid in pids.read_text().split())
    assert list((tmp_path / "cache" / "prepared").glob(".*.tmp")) == []
    assert len(failures) == 1 and isinstance(failures[0], preparation.PrepareFailed)


def test_prepare_interrupted_is_one_line_and_exit_130(tmp_path: Path, monkeypatch, capsys):
    """Ctrl-C in `bgeserve prepare` is one line and exit 130, not a KeyboardInterrupt
    traceback (the staging directory is removed on the way out, by find_or_make)."""
    import signal

    from bgeserve.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preparation, "prepare_command", interrupted)
    monkeypatch.setenv("BGE_M3_CACHE_DIR", str(tmp_path / "cache"))
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["prepare"]) == 130
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err


def test_step_peaks_fit_a_small_model_in_a_small_container_and_cover_the_measured_ones() -> None:
    """The estimates against what was measured: full-size bge-m3 (W = 2.27 GB) int8 ~7.5 GiB,
    ov-int8 7,068 MiB; the tiny model (W = 1.5 MB) 340 MiB at its largest step, which a 1 GiB
    floor refused to prepare in a 1 GiB container (whose stock graph then could not start)."""
    full, tiny = 2_270_000_000, 1_500_000
    assert peak_bytes("int8", full) >= int(7.5 * (1 << 30))
    assert peak_bytes("ov-int8", full) >= 7068 << 20
    for step in ("fp32", "int8", "bf16", "ov-int8"):
        assert 340 << 20 < peak_bytes(step, tiny) < 900 << 20, step


def test_waiting_for_another_preparation_shows_on_health(tmp_path, monkeypatch) -> None:
    """While another process prepares the same model, /health's step says so (it stayed at
    "hashing the model files", progress 0, for the minutes a full-size preparation takes)."""
    seen: list[dict] = []
    prep = Preparation()

    class Contended(prepared_module.PreparedStore):
        def lock(self, key, on_wait=None):
            on_wait()  # as the store calls it when the lock is held elsewhere
            seen.append(prep.progress.snapshot())
            return super().lock(key)

    def fake_recipe(source, out, variants, **kwargs):
        _write_export(out, variants, {"skipped": {}, "limited": []})
        return {"variants": variants, "skipped": {}, "seconds": 0.0}

    monkeypatch.setattr(preparation, "PreparedStore", Contended)
    monkeypatch.setattr(preparation, "run_recipe", fake_recipe)
    roomy = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(64 << 30)})
    prep.find_or_make(roomy, tmp_path / "cache", _source(tmp_path / "src"), ["fp32"])
    assert seen[0]["step"] == "waiting for another bgeserve preparing this model"
    assert prep.progress.snapshot()["step"] != seen[0]["step"]  # not once the wait is over


def test_a_step_killed_for_memory_is_tried_again_only_with_more_memory(tmp_path,
                                                                        monkeypatch) -> None:
    """A step the kernel killed (its estimate passed, its real peak did not) is recorded with
    the memory it had: a start with as much serves the export as it is (it was lost for good,
    or would be killed again at every start); one with over 1.25x that tries it again."""
    calls: list[tuple[list[str], dict[str, str]]] = []
    kill: set[str] = {"int8"}

    def fake_recipe(source, out, variants, **kwargs):
        skip = kwargs["skip"]
        calls.append((list(variants), dict(skip)))
        dead = {v: "prepare step 'int8' failed: killed (SIGKILL: most likely out of memory)"
                for v in variants if v in kill and v not in skip}
        made = [v for v in variants if v not in skip and v not in dead]
        _write_export(out, made, {"skipped": {**skip, **dead}, "limited": sorted(skip)})
        return {"variants": made, "skipped": {**skip, **dead}, "seconds": 0.0}

    monkeypatch.setattr(preparation, "run_recipe", fake_recipe)
    source = _source(tmp_path / "src")
    at = 8 << 30
    same = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(at)})
    more = Settings.from_env({"BGE_M3_AVAILABLE_MEMORY_BYTES": str(int(at * 1.3))})
    cache, prep = tmp_path / "cache", Preparation()

    first, _ = prep.find_or_make(same, cache, source, ["fp32", "int8"])
    assert len(calls) == 1 and "SIGKILL" in prep.status["skipped"]["int8"]
    assert json.loads((first / prepare_plan.KILLED_FILE).read_text()) == {"int8": at}
    again, _ = prep.find_or_make(same, cache, source, ["fp32", "int8"])
    assert (again, prep.status["status"], len(calls)) == (first, "cached", 1)
    # bf16 added with the same memory: int8 stays out (a reason, not another kill), recorded.
    added, _ = prep.find_or_make(same, cache, source, ["fp32", "int8", "bf16"])
    assert len(calls) == 2 and "killed (out of memory)" in calls[1][1]["int8"]
    assert json.loads((added / prepare_plan.KILLED_FILE).read_text()) == {"int8": at}
    kill.clear()  # with more memory it fits
    final, _ = prep.find_or_make(more, cache, source, ["fp32", "int8", "bf16"])
    assert len(calls) == 3 and "int8" not in calls[2][1] and prep.status["status"] == "prepared"
    assert not (final / prepare_plan.KILLED_FILE).exists()
