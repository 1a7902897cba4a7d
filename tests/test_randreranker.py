"""Tests for bgeserve.testing.randreranker: the random-weight bge-reranker-v2-m3 builder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bgeserve.testing.randmodel import MARKER, SIZES, main
from bgeserve.testing.randreranker import ARCHITECTURE, build_random_reranker

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


def test_layout_is_bge_reranker_v2_m3s(tiny_reranker: Path) -> None:
    """config.json says XLMRobertaForSequenceClassification with one label and bge-m3's
    positions; model.safetensors holds exactly that class's keys and shapes (roberta.* without
    a pooler, classifier.dense / classifier.out_proj)."""
    from safetensors import safe_open

    config = json.loads((tiny_reranker / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert config["id2label"] == {"0": "LABEL_0"}
    assert config["max_position_embeddings"] == 8194 and config["type_vocab_size"] == 1
    cfg = transformers.XLMRobertaConfig.from_pretrained(tiny_reranker)
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in
                transformers.XLMRobertaForSequenceClassification(cfg).state_dict().items()}
    with safe_open(str(tiny_reranker / "model.safetensors"), "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert got == want
    assert not any(k.startswith("roberta.pooler") for k in got)
    assert got["classifier.out_proj.weight"] == (1, config["hidden_size"])
    assert json.loads((tiny_reranker / MARKER).read_text())["kind"] == "reranker"


def test_full_size_config_has_the_hub_models_shape() -> None:
    """The full size is bge-reranker-v2-m3's encoder: 24 layers, hidden 1024, 16 heads, FFN
    4096, 250,002 ids; the parameter count of the hub model (567,755,777) follows from it."""
    cfg = transformers.XLMRobertaConfig(**{**SIZES["full"], "architectures": [ARCHITECTURE]},
                                        num_labels=1)
    with torch.device("meta"):
        model = transformers.XLMRobertaForSequenceClassification(cfg)
    assert sum(p.numel() for p in model.state_dict().values()) == 567_755_777


def test_tokenizer_is_the_embedding_models(tiny_reranker: Path, tiny_model: Path) -> None:
    """A reranker and a bge-m3 of one size and seed share their tokenizer files byte for byte,
    as the real models do (so one tokenization serves both)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tiny_reranker / name).read_bytes() == (tiny_model / name).read_bytes()


def test_logits_vary_with_the_text(flag_reranker) -> None:
    """The random head gives logits that differ across pairs by more than float noise (a
    reranker test on near-constant scores would prove nothing)."""
    from bgeserve.testing.randmodel import random_texts

    docs = random_texts(3, 12, 3, 40)
    scores = flag_reranker.compute_score([["a query", d] for d in docs], max_length=8192)
    assert max(scores) - min(scores) > 1.0
    assert len({round(s, 4) for s in scores}) == len(scores)


def test_cli_builds_the_same_files(tiny_reranker: Path, tmp_path: Path, capsys) -> None:
    """``build-random-model --kind reranker`` builds the same files for the same seed and
    prints the directory."""
    out = tmp_path / "again"
    assert main(["--kind", "reranker", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tiny_reranker.iterdir())
    for path in tiny_reranker.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_refuses_an_existing_directory(tiny_reranker: Path) -> None:
    """An existing, non-empty directory is never overwritten."""
    with pytest.raises(FileExistsError):
        build_random_reranker(tiny_reranker)
