"""A model built the way an outside tester would build one, exported and served exactly.

``XLMRobertaModel(XLMRobertaConfig(...))`` as transformers initialises it (every bias zero,
every LayerNorm the identity), saved with ``save_pretrained`` (``pytorch_model.bin``), heads
as plain ``torch.nn.Linear`` state dicts, and ``max_position_embeddings`` left at XLM-R's 514,
so it holds 512 tokens. The project's own builder (``randmodel``) makes neither choice; each
broke something once: torch.onnx.export shares the equal zero biases through ``Identity``
nodes (the FFN row-blocking refused them), the int8 calibration and validation texts were
512 tokens long (past 510 content positions), and the engine ran texts up to 8,192 tokens
into 512 positions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from bgeserve.engine import Engine
from bgeserve.export.texts import random_texts
from tests.oracle import FP32, INT8, assert_matches, reference

pytestmark = pytest.mark.slow

HIDDEN, POSITIONS = 48, 514


@pytest.fixture(scope="module")
def outsider_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    out = tmp_path_factory.mktemp("outsider-model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tiny_model / name, out / name)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    config = XLMRobertaConfig(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=80,
                              max_position_embeddings=POSITIONS, type_vocab_size=1,
                              pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(7)
    XLMRobertaModel(config).save_pretrained(out, safe_serialization=False)
    torch.save(torch.nn.Linear(HIDDEN, 1).state_dict(), out / "sparse_linear.pt")
    torch.save(torch.nn.Linear(HIDDEN, HIDDEN).state_dict(), out / "colbert_linear.pt")
    return out


@pytest.fixture(scope="module")
def outsider_export(outsider_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bgeserve.export.main import export

    out = tmp_path_factory.mktemp("outsider-export")
    export(str(outsider_model), out, ("fp32", "int8"))
    return out


@pytest.fixture(scope="module")
def texts() -> list[str]:
    long = " ".join(random_texts(3, 60, 30, 40))  # past 512 tokens: truncated
    return [*random_texts(11, 6, 1, 40), "🚀", "", long]


@pytest.mark.parametrize(("variant", "tol"), [("fp32", FP32), ("int8", INT8)])
def test_an_outsiders_model_exports_and_matches_flagembedding(
        outsider_model: Path, outsider_export: Path, texts: list[str], variant: str, tol,
        tmp_path: Path) -> None:
    from FlagEmbedding import BGEM3FlagModel

    flag = BGEM3FlagModel(str(outsider_model), use_fp16=False, devices="cpu")
    ref = reference(flag, texts, max_length=POSITIONS - 2)
    with Engine(outsider_export, variant, cache_dir=tmp_path, offline=True) as engine:
        assert engine.config.max_seq == POSITIONS - 2  # clamped from the default 8,192
        ours = engine.embed(texts, dense=True, sparse=True, colbert=True)
    assert ours.truncated.tolist() == [False] * (len(texts) - 1) + [True]
    assert int(ours.n_tokens.max()) == POSITIONS - 2
    assert_matches(ours, ref, tol)
    assert np.isfinite(ours.dense).all()


def test_the_server_truncates_at_the_models_positions(outsider_export: Path, texts: list[str],
                                                      tmp_path: Path) -> None:
    """BGE_M3_MAX_SEQ_LENGTH left at 8,192: /health says 512 and a long text is truncated
    there, where it was a 500 from the position-embedding Gather."""
    import httpx

    from tests.serverproc import ServerProc
    from tests.test_server_live import START_TIMEOUT, server_env

    env = server_env(outsider_export, tmp_path)
    del env["BGE_M3_MAX_SEQ_LENGTH"]
    with ServerProc(env) as proc:
        health = proc.wait_health(timeout=START_TIMEOUT)
        assert health["max_seq_length"] == POSITIONS - 2
        r = httpx.post(f"{proc.url}/v1/embeddings", json={"input": texts[-1]}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["data"][0].get("truncated") is True
        assert r.json()["usage"]["prompt_tokens"] == POSITIONS - 2
