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
