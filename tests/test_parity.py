"""Parity with FlagEmbedding's BGEM3FlagModel on the tiny random model, for every layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bgeserve.engine import Engine, EngineConfig
from bgeserve.engine.scheduler import SchedulerConfig
from bgeserve.export.texts import random_texts
from tests.oracle import BF16, FP16, FP32, INT8, Tolerance, assert_matches, reference

pytestmark = pytest.mark.slow


def _long_text(n_words: int, seed: int) -> str:
    return " ".join(random_texts(seed, 1, n_words, n_words)[0] for _ in range(1))


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Texts of 1 to beyond 8192 tokens, in many scripts, with repeats and edge cases."""
    short = random_texts(2024, 20, 1, 60)
    edge = ["", "a", "the the the the the", "🚀", "  spaced   out  "]
    long = [" ".join(random_texts(s, 40, 30, 40)) for s in (1, 2)]  # ~ 1-3 k tokens
    huge = " ".join(random_texts(99, 400, 30, 40))  # well past 8192 tokens: truncated
    return short + edge + long + [huge]


@pytest.fixture(scope="module")
def ref(flag_model, texts):
    return reference(flag_model, texts)


def _engine(path: Path, variant: str, tmp_path_factory, **sched) -> Engine:
    config = EngineConfig(scheduler=SchedulerConfig(**sched)) if sched else None
    return Engine(path, variant, config=config, cache_dir=tmp_path_factory.mktemp("cache"),
                  offline=True)


CASES = [("export", "fp32", FP32), ("export", "fp16", FP16), ("export", "int8", INT8),
         ("export", "bf16", BF16),  # OpenVINO; skips when openvino is not installed
         ("export", "ov-int8", INT8),  # OpenVINO + NNCF; skips without them
         ("baai", "fp32", FP32), ("xenova", "fp16", FP16), ("xenova", "int8", INT8)]


@pytest.mark.parametrize(("layout", "variant", "tol"), CASES,
                         ids=[f"{a}-{b}" for a, b, _ in CASES])
def test_matches_flagembedding(layout: str, variant: str, tol: Tolerance, texts, ref,
                               request, tmp_path_factory):
    """Dense, sparse and ColBERT agree with FlagEmbedding for texts of 1 to 8192+ tokens."""
    if layout == "export":
        fixture = {"bf16": "tiny_export_bf16", "ov-int8": "tiny_export_ov_int8"}
        path = request.getfixturevalue(fixture.get(variant, "tiny_export"))
    else:
        path = request.getfixturevalue("hub_layouts")[layout]
    with _engine(path, variant, tmp_path_factory, max_chunk=8) as engine:
        ours = engine.embed(texts, dense=True, sparse=True, colbert=True)
    assert ours.truncated.tolist() == [False] * (len(texts) - 1) + [True]
    assert ours.n_tokens[-1] == 8192
    assert_matches(ours, ref, tol)


@pytest.mark.parametrize(("variant", "tol"), [("fp32", FP32), ("fp16", FP16)])
def test_rounded_chunk_lengths_match_flagembedding(variant: str, tol: Tolerance, texts, ref,
                                                  tiny_export, tmp_path_factory):
    """Chunks padded up to a multiple of 32 (the GPU default, BGE_M3_PAD_MULTIPLE): every
    text, the 8192-token one included (capped at max_seq), still matches FlagEmbedding."""
    seen: list[int] = []
    config = EngineConfig(scheduler=SchedulerConfig(max_chunk=8, pad_multiple=32))
    with Engine(tiny_export, variant, config=config, cache_dir=tmp_path_factory.mktemp("cache"),
                offline=True, on_chunk=lambda st: seen.append(st.pad_to)) as engine:
        ours = engine.embed(texts, dense=True, sparse=True, colbert=True)
    assert seen and all(n % 32 == 0 for n in seen) and max(seen) == 8192
    assert_matches(ours, ref, tol)


def test_batch_composition_does_not_change_results(texts, tiny_export, tmp_path_factory):
    """A text embedded alone equals the same text inside any packed, padded chunk."""
    texts = texts[:-1]  # the 8192-token text alone is covered above
    with _engine(tiny_export, "fp32", tmp_path_factory, max_chunk=16) as engine:
        together = engine.embed(texts, dense=True, sparse=True, colbert=True)
        shuffled_order = np.random.default_rng(0).permutation(len(texts))
        shuffled = engine.embed([texts[i] for i in shuffled_order], dense=True, sparse=True,
                                colbert=True)
        for i, text in enumerate(texts):
            alone = engine.embed(text, dense=True, sparse=True, colbert=True)
            ref = {"dense_vecs": alone.dense,
                   "lexical_weights": [{str(k): v for k, v in zip(*map(np.ndarray.tolist,
                                                                      alone.sparse[0]))}],
                   "colbert_vecs": alone.colbert}
            one = together.__class__(together.dense[i:i + 1], together.sparse[i:i + 1],
                                     together.colbert[i:i + 1], together.n_tokens[i:i + 1],
                                     together.truncated[i:i + 1])
            assert_matches(one, ref, FP32)
        back = np.argsort(shuffled_order)
        np.testing.assert_allclose(shuffled.dense[back], together.dense, atol=2e-6)


def test_token_id_input_equals_text_input(tiny_export, tmp_path_factory):
    """Token ids from the tokenizer, with or without <s>/</s>, embed exactly like the text."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tiny_export / "tokenizer.json"))
    text = random_texts(5, 1, 20, 20)[0]
    with_specials = tk.encode(text).ids
    content = tk.encode(text, add_special_tokens=False).ids
    with _engine(tiny_export, "fp32", tmp_path_factory) as engine:
        a = engine.embed(text, sparse=True)
        b = engine.embed([with_specials, content], sparse=True)
    np.testing.assert_allclose(b.dense, np.repeat(a.dense, 2, axis=0), atol=1e-6)
    assert b.n_tokens.tolist() == [len(with_specials)] * 2
