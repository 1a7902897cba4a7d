"""Tests for bgeserve.model.rerank_artifacts: which reranker files are served, from where."""

from __future__ import annotations

import json
import shutil

import pytest

from bgeserve.errors import ConfigError, ModelUnavailable
from bgeserve.model.artifacts import Layout, resolve
from bgeserve.model.rerank_artifacts import (
    HUB_DATA,
    RERANK_REPO,
    RERANK_REVISION,
    resolve_reranker,
)

pytestmark = pytest.mark.slow


def test_an_export_resolves_to_its_score_graph(tiny_reranker_export, tmp_path) -> None:
    """A reranker export gives the score layout for each variant it has; bge-m3's resolver
    refuses it (and the reranker's refuses a bge-m3 export), each naming the right variable."""
    art = resolve_reranker(model_path=tiny_reranker_export, variant="int8", cache_dir=tmp_path)
    assert art.layout is Layout.SCORE and art.onnx_path.name == "model.onnx"
    assert art.onnx_path.parent.name == "int8"
    with pytest.raises(ModelUnavailable, match="BGE_M3_RERANK_MODEL_PATH"):
        resolve(model_path=tiny_reranker_export, variant="fp32", cache_dir=tmp_path)


def test_a_variant_the_reranker_export_lacks_names_the_rerankers_setting(
        tiny_reranker_export, tmp_path) -> None:
    """The variant is BGE_M3_RERANK_VARIANT's: the error named BGE_M3_MODEL (bge-m3's)."""
    with pytest.raises(ModelUnavailable) as info:
        resolve_reranker(model_path=tiny_reranker_export, variant="fp16", cache_dir=tmp_path)
    assert info.value.param == "BGE_M3_RERANK_VARIANT"
    assert "set BGE_M3_RERANK_VARIANT" in info.value.message
    assert "BGE_M3_MODEL " not in info.value.message


def test_a_bge_m3_export_is_not_a_reranker(tiny_export, tmp_path) -> None:
    """Pointing the reranker at bge-m3's export says which variable takes which."""
    with pytest.raises(ModelUnavailable, match="BGE_M3_MODEL_PATH"):
        resolve_reranker(model_path=tiny_export, variant="fp32", cache_dir=tmp_path)


def test_a_reranker_export_is_not_bge_m3(tiny_reranker_export, tmp_path) -> None:
    """A library user who gives Engine the reranker is told the class, not only the server's
    variable (QA)."""
    from bgeserve.engine import Engine

    with pytest.raises(ModelUnavailable, match=r"BGE_M3_RERANK_MODEL_PATH at it \(in Python: "
                       r"bgeserve\.Reranker\)"):
        Engine(tiny_reranker_export, "fp32", cache_dir=tmp_path)


def test_a_tiny_reranker_stock_serves_its_logits(tiny_reranker_stock, tmp_path) -> None:
    """A snapshot with onnx/model.onnx gives the logits layout; a variant it lacks is a
    ConfigError listing what it has."""
    art = resolve_reranker(model_path=tiny_reranker_stock, variant="fp32", cache_dir=tmp_path)
    assert art.layout is Layout.LOGITS and art.tokenizer_path == tiny_reranker_stock / "tokenizer.json"
    with pytest.raises(ConfigError, match="it has fp32"):
        resolve_reranker(model_path=tiny_reranker_stock, variant="int8", cache_dir=tmp_path)


def test_a_stock_snapshots_tokens_follow_its_model_type(tiny_reranker_stock, tmp_path) -> None:
    """XLM-R's positions start past the pad id (514 hold 512 tokens); a BERT cross-encoder's
    stock graph starts at 0, and was held to 510 tokens of its 512 (QA)."""
    from bgeserve.model.dims import model_max_seq

    src = tmp_path / "snapshot"
    shutil.copytree(tiny_reranker_stock, src)
    config = json.loads((src / "config.json").read_text())
    for model_type, positions, tokens in (("xlm-roberta", 514, 512), ("bert", 512, 512),
                                          (None, 514, 512)):
        changed = {**config, "max_position_embeddings": positions}
        if model_type is None:  # a config without it is taken as bge-m3's
            changed.pop("model_type", None)
        else:
            changed["model_type"] = model_type
        (src / "config.json").write_text(json.dumps(changed))
        art = resolve_reranker(model_path=src, variant="fp32", cache_dir=tmp_path)
        assert model_max_seq(art) == tokens, model_type


def test_pytorch_weights_alone_say_to_export(tiny_reranker, tmp_path) -> None:
    """No ONNX graph: the error gives the export command; a non-reranker is named as such."""
    with pytest.raises(ModelUnavailable, match="bgeserve export --model"):
        resolve_reranker(model_path=tiny_reranker, variant="fp32", cache_dir=tmp_path)
    other = tmp_path / "m3"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["XLMRobertaModel"]}))
    with pytest.raises(ModelUnavailable, match="not a reranker"):
        resolve_reranker(model_path=other, variant="fp32", cache_dir=tmp_path)
    with pytest.raises(ModelUnavailable, match=r"\(BGE_M3_RERANK_MODEL_PATH\) does not exist"):
        resolve_reranker(model_path=tmp_path / "nowhere", variant="fp32", cache_dir=tmp_path)


@pytest.mark.parametrize("with_data", [True, False])
def test_the_hub_model_comes_at_the_pinned_commit(tiny_reranker_stock, tmp_path, monkeypatch,
                                                  with_data) -> None:
    """No directory: onnx/model.onnx, its data file where the hub has one (404 means none),
    tokenizer.json and config.json from BAAI/bge-reranker-v2-m3 at the pinned revision."""
    from huggingface_hub import constants

    from tests.test_artifacts import FakeHub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    files = {(RERANK_REPO, RERANK_REVISION, name): (tiny_reranker_stock / name).read_bytes()
             for name in ("onnx/model.onnx", "tokenizer.json", "config.json")}
    if with_data:
        files[(RERANK_REPO, RERANK_REVISION, HUB_DATA)] = b"weights"
    hub = FakeHub(files)
    try:
        art = resolve_reranker(model_path=None, variant="fp32", cache_dir=tmp_path,
                               endpoint=hub.url, progress=False, hub_cache=tmp_path / "hub")
    finally:
        hub.stop()
    assert art.layout is Layout.LOGITS and RERANK_REVISION in art.source
    assert [p.name for p in art.external_data] == (["model.onnx_data"] if with_data else [])
    assert (art.tokenizer_path.parent / "config.json").is_file()
    with pytest.raises(ConfigError, match="fp32 ONNX graph only"):
        resolve_reranker(model_path=None, variant="int8", cache_dir=tmp_path)


def test_the_hub_reranker_unreachable_names_the_rerankers_own_path(tmp_path) -> None:
    """Offline with nothing cached, the refusal points at BGE_M3_RERANK_MODEL_PATH (it named
    bge-m3's BGE_M3_MODEL_PATH, which the reranker does not read)."""
    with pytest.raises(ModelUnavailable) as info:
        resolve_reranker(model_path=None, variant="fp32", cache_dir=tmp_path / "bgeserve",
                         offline=True, progress=False, hub_cache=tmp_path / "hub")
    assert "Set BGE_M3_RERANK_MODEL_PATH to a local copy" in info.value.message
    assert "BGE_M3_MODEL_PATH" not in info.value.message.replace("BGE_M3_RERANK_MODEL_PATH", "")
