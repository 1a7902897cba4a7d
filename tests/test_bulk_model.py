"""``bgeserve.bulk.model``: what a job's manifest records of the model (no model loaded)."""

from __future__ import annotations

import os
from pathlib import Path

from bgeserve.bulk.model import model_identity
from bgeserve.config import Settings
from bgeserve.model.artifacts import Layout, ModelArtifacts


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


def _rule_settings(export: Path, cache: Path, **extra: str):
    from bgeserve.bulk.model import resolve_settings

    return resolve_settings({"BGE_M3_MODEL_PATH": str(export), "BGE_M3_CACHE_DIR": str(cache),
                             "BGE_M3_MAX_SEQ_LENGTH": "128", **extra})


def test_a_resumed_job_runs_the_variant_its_shards_were_made_with(
        tiny_export: Path, tmp_path: Path) -> None:
    """Left to choose, a local run serves the variant measured fastest and a Ray job the
    rule's: a folder moved from one to the other was refused as another model's shards. The
    recorded variant is pinned (for the actors too); BGE_M3_MODEL given, it decides (and
    another variant is refused as before); nothing recorded, nothing changes."""
    from bgeserve.bulk.model import resume_settings
    from bgeserve.ray.pipeline import actor_env

    rule = _rule_settings(tiny_export, tmp_path)
    assert rule.variant_choice == "rule"
    other = "int8" if rule.variant != "int8" else "fp32"
    resumed = resume_settings(rule, f"{other} sha256:abc")
    assert (resumed.variant, resumed.variant_choice) == (other, "pinned")
    assert resumed.model_path == rule.model_path and resumed.max_seq_length == 128
    assert actor_env(resumed)["BGE_M3_MODEL"] == other
    # The rule's own variant is pinned too: a local run would otherwise measure another.
    same = resume_settings(rule, f"{rule.variant} sha256:abc")
    assert (same.variant, same.variant_choice) == (rule.variant, "pinned")
    assert resume_settings(rule, None) is rule
    assert resume_settings(rule, "garbage") is rule
    pinned = _rule_settings(tiny_export, tmp_path, BGE_M3_MODEL="fp16")
    assert resume_settings(pinned, f"{other} sha256:abc") is pinned


def test_a_resumed_job_keeps_every_setting_but_the_variant(tiny_export: Path,
                                                          tmp_path: Path) -> None:
    """Rebuilt from variables, a value equal to its default lost what being given means:
    BGE_M3_MAX_CHUNK=64 beside the deprecated BGE_M3_ONNX_BATCH_SIZE=8 ran chunks of 64, and
    the resumed run chunks of 8 (review; int8's vectors move with their batch-mates)."""
    import dataclasses

    from bgeserve.bulk.model import resume_settings
    from bgeserve.service.plan import profile_max_batch

    rule = _rule_settings(tiny_export, tmp_path, BGE_M3_MAX_CHUNK="64",
                          BGE_M3_ONNX_BATCH_SIZE="8")
    other = "int8" if rule.variant != "int8" else "fp32"
    resumed = resume_settings(rule, f"{other} sha256:abc")
    assert profile_max_batch(rule) == profile_max_batch(resumed) == 64
    assert dataclasses.replace(resumed, variant=rule.variant) == rule


def test_a_recorded_variant_the_settings_cannot_run_is_said_so(
        tiny_export_bf16: Path, tmp_path: Path) -> None:
    """bf16 runs on OpenVINO: pinned for a resume, the runtime follows it, unless BGE_M3_EP
    names another (also the default, cpu), which is refused naming the shards' variant."""
    import pytest

    from bgeserve.bulk.model import resume_settings
    from bgeserve.errors import ConfigError
    from bgeserve.service.plan import THIS_MACHINE

    if not THIS_MACHINE.openvino():
        pytest.skip("the openvino package is not installed")
    rule = _rule_settings(tiny_export_bf16, tmp_path, BGE_M3_EP="cpu")
    with pytest.raises(ConfigError, match="shards were made with the bf16 variant, which cannot "
                       "run here .*BGE_M3_EP.*write to a new --output"):
        resume_settings(rule, "bf16 sha256:abc")
    free = _rule_settings(tiny_export_bf16, tmp_path)
    resumed = resume_settings(free, "bf16 sha256:abc")
    assert (resumed.variant, resumed.execution_provider) == ("bf16", "openvino")
