"""Tests for bgeserve.testing.randmodel: the deterministic random-weight bge-m3 builder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bgeserve.testing import randmodel
from bgeserve.testing.randmodel import (
    MARKER,
    build_random_model,
    cached_random_model,
    main,
    random_texts,
)

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("randmodel") / "tiny-seed0")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_random_texts_are_deterministic_prefix_stable_and_bounded() -> None:
    """Same seed gives the same texts, a shorter list is a prefix, word counts stay in range."""
    texts = random_texts(5, 40, min_words=3, max_words=9)
    assert texts == random_texts(5, 40, min_words=3, max_words=9)
    assert random_texts(5, 10, min_words=3, max_words=9) == texts[:10]
    assert texts != random_texts(6, 40, min_words=3, max_words=9)
    # CJK words join without spaces, so a text may split into fewer words, never more.
    assert all(1 <= len(t.split()) <= 9 for t in texts)


def test_random_texts_mix_scripts() -> None:
    """Generated text covers Latin diacritics, Cyrillic, Greek, Arabic, CJK, digits and emoji."""
    joined = "".join(random_texts(0, 300))
    ranges = {
        "latin diacritics": (0xC0, 0x17F), "cyrillic": (0x400, 0x4FF), "greek": (0x370, 0x3FF),
        "arabic": (0x600, 0x6FF), "cjk": (0x4E00, 0x9FFF), "digits": (0x30, 0x39),
        "emoji": (0x1F300, 0x1FAFF),
    }
    missing = [name for name, (lo, hi) in ranges.items()
               if not any(lo <= ord(ch) <= hi for ch in joined)]
    assert missing == []


def test_same_seed_builds_identical_model_and_other_seed_differs(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI rebuilds seed 0 byte-for-byte (same tensors, same tokenizer.json); seed 1 differs."""
    again = tmp_path / "again"
    assert main(["--size", "tiny", "--seed", "0", "--out", str(again)]) == 0
    assert capsys.readouterr().out.strip() == str(again)
    assert _files(again) == _files(model_dir)
    first = safetensors_torch.load_file(model_dir / "model.safetensors")
    second = safetensors_torch.load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)

    other = build_random_model(tmp_path / "other", seed=1)
    third = safetensors_torch.load_file(other / "model.safetensors")
    assert not torch.equal(first["encoder.layer.0.attention.self.query.weight"],
                           third["encoder.layer.0.attention.self.query.weight"])
    assert (other / "tokenizer.json").read_bytes() != (model_dir / "tokenizer.json").read_bytes()


def test_cli_refuses_an_existing_directory(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Building over a non-empty directory fails with exit code 2 and a message naming it."""
    assert main(["--out", str(model_dir)]) == 2
    assert str(model_dir) in capsys.readouterr().err


def test_layout_files_and_metadata(model_dir: Path) -> None:
    """The directory holds bge-m3's files; config and metadata agree on shape and vocabulary."""
    assert {p.name for p in model_dir.iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "sparse_linear.pt", "colbert_linear.pt", MARKER,
    }
    config = json.loads((model_dir / "config.json").read_text())
    meta = json.loads((model_dir / MARKER).read_text())
    assert config["model_type"] == "xlm-roberta"
    assert config["architectures"] == ["XLMRobertaModel"]
    assert config["max_position_embeddings"] == 8194
    assert (config["hidden_size"], config["num_hidden_layers"]) == (32, 2)
    assert config["vocab_size"] == meta["vocab_size"] == 3000
    assert (meta["size"], meta["seed"]) == ("tiny", 0)
    assert meta["parameters"] == sum(
        t.numel() for t in safetensors_torch.load_file(model_dir / "model.safetensors").values()
    )


def test_special_token_ids_and_template(model_dir: Path, tokenizer: Tokenizer) -> None:
    """<s>=0, <pad>=1, </s>=2, <unk>=3, <mask> last; encodings start with 0 and end with 2."""
    size = tokenizer.get_vocab_size()
    ids = {t: tokenizer.token_to_id(t) for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")}
    assert ids == {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": size - 1}
    encoded = tokenizer.encode("Hello wörld, привет мир 你好")
    assert encoded.ids[0] == 0 and encoded.ids[-1] == 2
    pair = tokenizer.encode("a", "b").ids
    assert pair[0] == 0 and pair[-1] == 2 and pair.count(2) == 3
    raw = json.loads((model_dir / "tokenizer.json").read_text())
    assert raw["model"]["type"] == "Unigram" and raw["model"]["unk_id"] == 3
    assert raw["padding"] is None and raw["truncation"] is None


def test_generated_texts_of_every_script_are_not_unknown(tokenizer: Tokenizer) -> None:
    """Texts from other seeds (unseen by training) encode with almost no <unk>."""
    encodings = tokenizer.encode_batch(random_texts(99, 200))
    ids = [i for e in encodings for i in e.ids[1:-1]]
    assert all(set(e.ids[1:-1]) - {3} for e in encodings)
    assert ids.count(3) <= len(ids) // 100


def test_transformers_tokenizer_gives_tokenizer_json_ids(
    model_dir: Path, tokenizer: Tokenizer
) -> None:
    """AutoTokenizer (what FlagEmbedding uses) and tokenizer.json give identical ids."""
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert auto.model_max_length == 8192
    texts = random_texts(7, 100) + ["", "  two  spaces\tand\nnewline ", "a <mask> b", "ﬁ Ｗ ① 😀"]
    assert [auto(t)["input_ids"] for t in texts] == [e.ids for e in tokenizer.encode_batch(texts)]


def test_flagembedding_loads_the_model_and_its_heads(model_dir: Path, tokenizer: Tokenizer) -> None:
    """BGEM3FlagModel gives 32-d dense, non-empty lexical weights, n-1 ColBERT rows, our heads."""
    flag = pytest.importorskip("FlagEmbedding")
    model = flag.BGEM3FlagModel(str(model_dir), use_fp16=False, devices="cpu")
    texts = random_texts(11, 6, min_words=3)
    out = model.encode(texts, return_dense=True, return_sparse=True, return_colbert_vecs=True,
                       max_length=8192)
    assert out["dense_vecs"].shape == (6, 32)
    assert all(len(weights) > 0 for weights in out["lexical_weights"])
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    assert [v.shape for v in out["colbert_vecs"]] == [(n - 1, 32) for n in lengths]
    # FlagEmbedding silently invents random heads when it cannot load the .pt files.
    for head in ("sparse_linear", "colbert_linear"):
        saved = torch.load(model_dir / f"{head}.pt", weights_only=True)
        loaded = getattr(model.model, head).state_dict()
        assert all(torch.equal(saved[k], loaded[k]) for k in ("weight", "bias"))


def test_transformers_loads_without_missing_keys_and_runs_8192_tokens(
    model_dir: Path, tokenizer: Tokenizer
) -> None:
    """XLMRobertaModel loads every key and runs a text of exactly 8192 tokens (8194 positions)."""
    transformers = pytest.importorskip("transformers")
    model, info = transformers.XLMRobertaModel.from_pretrained(
        str(model_dir), output_loading_info=True
    )
    assert not any(info.values())
    # Whitespace splits words before the Unigram model, so token counts add up word by word.
    words = random_texts(0, 1, min_words=5000, max_words=5000)[0].split()
    text, total = [], 2
    for word, encoding in zip(words, tokenizer.encode_batch(words, add_special_tokens=False)):
        if total + len(encoding.ids) > 8192:
            break
        text.append(word)
        total += len(encoding.ids)
    words_in_vocab = [p[1:] for p, _ in json.loads(tokenizer.to_str())["model"]["vocab"]
                      if p.startswith("▁") and len(p) > 1]
    filler = next(w for w in words_in_vocab
                  if len(tokenizer.encode(w, add_special_tokens=False).ids) == 1)
    ids = tokenizer.encode(" ".join(text + [filler] * (8192 - total))).ids
    assert len(ids) == 8192 and ids[0] == 0 and ids[-1] == 2
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state
    assert hidden.shape == (1, 8192, 32)
    assert bool(torch.isfinite(hidden).all())


def test_cached_random_model_reuses_a_build_and_survives_a_lost_race(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A complete cached directory is returned as is; losing the rename race uses the winner's."""
    shutil.copytree(model_dir, tmp_path / "tiny-seed0")
    def no_build(*args: object) -> Path:
        raise AssertionError("rebuilt a model that was already cached")

    with monkeypatch.context() as patch:
        patch.setattr(randmodel, "build_random_model", no_build)
        assert cached_random_model(tmp_path) == tmp_path / "tiny-seed0"

    real_rename = os.rename

    def lose_race(src: str | Path, dst: str | Path) -> None:
        shutil.copytree(model_dir, dst)  # the other process finishes first
        real_rename(src, dst)

    monkeypatch.setattr(randmodel.os, "rename", lose_race)
    path = cached_random_model(tmp_path, seed=3)
    assert path == tmp_path / "tiny-seed3"
    assert json.loads((path / MARKER).read_text())["seed"] == 0  # the winner's copy
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
