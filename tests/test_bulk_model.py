"""``bgeserve.bulk.model``: what a job's manifest records of the model (no model loaded)."""

from __future__ import annotations

import os
from pathlib import Path

from bgeserve.bulk.model import chosen_settings, model_identity, model_spec
from bgeserve.config import Settings
from bgeserve.model.artifacts import Layout, ModelArtifacts
from bgeserve.ray.pipeline import actor_env
from tests.test_choice import GOOD, OPENVINO, FakeTimer, default_settings, fake_export


def _snapshot(root: Path, graph: bytes, data: bytes) -> ModelArtifacts:
    (root / "onnx").mkdir(parents=True)
    (root / "onnx/model.onnx").write_bytes(graph)
    (root / "onnx/model.onnx_data").write_bytes(data)
    return ModelArtifacts(root / "onnx/model.onnx", root / "tokenizer.json", Layout.BAAI, "fp32",
                          None, f"snapshot {root}", (root / "onnx/model.onnx_data",))


def test_a_snapshots_identity_is_its_files_content_not_their_mtimes(tmp_path: Path) -> None:
    """A snapshot served as it is (no export manifest) is known by its graph files' sha256:
    the same files copied to another node (another mtime) are the same model, a random model
    of the same layout and size at the same path is not. (Names, sizes and mtimes made a Ray
    job's second node refuse the first's shards.)"""
    a = _snapshot(tmp_path / "a", b"graph", b"weights")
    b = _snapshot(tmp_path / "b", b"graph", b"weights")
    os.utime(b.onnx_path, (1, 1))
    c = _snapshot(tmp_path / "c", b"graph", b"WEIGHTS")  # same sizes, other weights
    cache = tmp_path / "cache"

    def identity(art: ModelArtifacts) -> str:
        settings = Settings(model_path=art.onnx_path.parent.parent, cache_dir=cache)
        return model_identity(settings, art)

    assert identity(a) == identity(b) != identity(c)
    assert identity(a).startswith("fp32 sha256:") and identity(a).count("+") == 1
    assert (cache / "prepared/digests.json").is_file()  # hashed once, remembered


def test_a_job_tokenizes_any_text_whole_where_the_server_limits_it() -> None:
    """The server's engine refuses to tokenize whole a text past BGE_M3_MAX_TEXT_CHARS (a
    request's); a bulk job's engine embeds every row as the library does (a long page without
    spaces among them)."""
    from bgeserve.bulk.model import UNBOUNDED, job_settings
    from bgeserve.service.plan import engine_config

    settings = Settings(max_text_chars=5_000)
    assert engine_config(settings).max_text_chars == 5_000
    assert engine_config(job_settings(settings)).max_text_chars == UNBOUNDED


def test_a_job_runs_and_records_the_variant_serve_would_serve(tmp_path: Path) -> None:
    """The driver takes the measured (cached) choice, not the rule's pick: the manifest named
    int8 while the service ran fp32, and ``--ray`` pinned int8 on its actors, so a local job
    continued with --ray was refused as another model's shards."""
    export = fake_export(tmp_path / "export", {"fp32": {}, "int8": {"agreement": GOOD}})
    cache = tmp_path / "cache"
    rule = default_settings(export, cache)
    assert rule.variant == "int8"  # the rule's pick on this machine
    timer = FakeTimer({"fp32": 500.0, "int8": 300.0})
    chosen = chosen_settings(rule, timer=timer, machine=OPENVINO)
    assert chosen.variant == "fp32" and {a["variant"] for a in timer.asked} == {"fp32", "int8"}
    assert model_spec(chosen)["variant"] == "fp32"
    assert actor_env(chosen)["BGE_M3_MODEL"] == "fp32"
    untouched = FakeTimer({})
    assert chosen_settings(rule, timer=untouched, machine=OPENVINO).variant == "fp32"  # cached
    assert not untouched.asked


def test_the_bulk_command_decides_the_variant_before_the_job(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """``bgeserve bulk`` takes its settings through ``chosen_settings``, local or --ray."""
    import argparse

    from bgeserve.bulk import main as bulk_main
    from bgeserve.bulk import model as bulk_model

    asked: list[Settings] = []

    def refuse(settings: Settings) -> Settings:
        asked.append(settings)
        raise ValueError("decided here")

    monkeypatch.setattr(bulk_model, "chosen_settings", refuse)
    parser = argparse.ArgumentParser()
    bulk_main.add_arguments(parser)
    (tmp_path / "in.jsonl").write_text('{"id": 1, "text": "a"}\n')
    args = parser.parse_args([str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")])
    assert bulk_main.run(args) == 2 and asked
    assert "decided here" in capsys.readouterr().err
