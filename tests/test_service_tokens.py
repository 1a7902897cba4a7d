"""TEI's routes on the real ``Service`` (``service/tokens.py``, ``service/info.py``), in-process,
on the tiny random bge-m3: vectors equal the engine's, ``/tokenize`` equals the Hugging Face
tokenizer's ids with its offsets in UTF-8 bytes, left truncation equals transformers'
``truncation_side="left"``, ``/info`` reports the loaded model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from bgeserve import Engine
from bgeserve.config import Settings
from bgeserve.engine import EngineConfig
from bgeserve.http.app import create_app

pytestmark = pytest.mark.slow

MAX_SEQ = 32
ATOL = 1e-5
TEXTS = ["hello world", "Définition de BM25 — 混合检索", "a"]
LONG = "retrieval augmented generation with hybrid dense and sparse vectors " * 4


@pytest.fixture(scope="module")
def engine(tiny_export: Path) -> Iterator[Engine]:
    """The engine at the server's MAX_SEQ."""
    with Engine(tiny_export, "fp32", config=EngineConfig(max_seq=MAX_SEQ)) as e:
        yield e


@pytest.fixture(scope="module")
def hf(tiny_model: Path):
    """transformers' tokenizer of the same model: the oracle for ids, offsets, truncation."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def client(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    env = {"BGE_M3_MODEL_PATH": str(tiny_export), "BGE_M3_MODEL": "fp32",
           "BGE_M3_CACHE_DIR": str(tmp_path_factory.mktemp("tei-cache")),
           "HF_HUB_OFFLINE": "1", "BGE_M3_DISABLE_AUTO_BUDGET": "1",
           "BGE_M3_MAX_SEQ_LENGTH": str(MAX_SEQ)}
    with TestClient(create_app(Settings.from_env(env))) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, c.get("/health").json()
            time.sleep(0.02)
        yield c


def test_embed_routes_give_the_engines_vectors(client: TestClient, engine: Engine) -> None:
    """``/embed``, ``POST /``, ``/embed_sparse`` and ``/embed_all`` carry the engine's dense,
    sparse and ColBERT outputs."""
    want = engine.embed(TEXTS, dense=True, sparse=True, colbert=True)
    for path in ("/embed", "/"):
        got = np.array(client.post(path, json={"inputs": TEXTS}).json(), np.float32)
        np.testing.assert_allclose(got, want.dense, atol=ATOL, rtol=0)
    sparse = client.post("/embed_sparse", json={"inputs": TEXTS}).json()
    for items, (ids, weights) in zip(sparse, want.sparse, strict=True):
        assert [i["index"] for i in items] == ids.tolist()
        np.testing.assert_allclose([i["value"] for i in items], weights, atol=ATOL, rtol=0)
    colbert = client.post("/embed_all", json={"inputs": TEXTS}).json()
    for rows, matrix in zip(colbert, want.colbert, strict=True):
        np.testing.assert_allclose(np.array(rows, np.float32), matrix, atol=ATOL, rtol=0)


def test_truncate_false_is_a_tei_error(client: TestClient) -> None:
    """A text over the maximum input length with ``truncate: false`` is refused in TEI's shape
    (422 Validation, its tokenizer's error; naming BGE_M3_MAX_SEQ_LENGTH)."""
    r = client.post("/embed", json={"inputs": [TEXTS[0], LONG], "truncate": False})
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "Validation"
    assert "BGE_M3_MAX_SEQ_LENGTH" in r.json()["error"]


def test_left_truncation_matches_transformers(client: TestClient, engine: Engine, hf) -> None:
    """``truncation_direction: left`` embeds what transformers' ``truncation_side="left"``
    keeps (``<s>``, the last tokens, ``</s>``); right is the default, and differs."""
    hf.truncation_side = "left"
    ids = hf(LONG, truncation=True, max_length=MAX_SEQ)["input_ids"]
    hf.truncation_side = "right"
    assert len(ids) == MAX_SEQ and len(hf(LONG)["input_ids"]) > MAX_SEQ
    want_left = engine.embed([ids]).dense[0]
    want_right = engine.embed(LONG).dense[0]
    for direction in ("left", "Left"):
        r = client.post("/embed", json={"inputs": LONG, "truncation_direction": direction})
        np.testing.assert_allclose(r.json()[0], want_left, atol=ATOL, rtol=0)
    r = client.post("/embed", json={"inputs": [LONG, TEXTS[0]]})
    np.testing.assert_allclose(r.json()[0], want_right, atol=ATOL, rtol=0)
    assert np.abs(want_left - want_right).max() > 1e-3
    short = client.post("/embed", json={"inputs": TEXTS, "truncation_direction": "left"})
    np.testing.assert_allclose(short.json(), engine.embed(TEXTS).dense, atol=ATOL, rtol=0)


def test_tokenize_is_the_tokenizers_with_byte_offsets(client: TestClient, hf) -> None:
    """Ids are transformers' (specials included), offsets its character offsets in UTF-8
    bytes, ``text`` the slice; the text is not truncated."""
    texts = [*TEXTS, LONG]
    body = client.post("/tokenize", json={"inputs": texts}).json()
    for text, tokens in zip(texts, body, strict=True):
        enc = hf(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        assert [t["id"] for t in tokens] == enc["input_ids"]
        raw = text.encode()
        for token, (lo, hi), special in zip(tokens, enc["offset_mapping"],
                                            enc["special_tokens_mask"], strict=True):
            assert token["special"] is bool(special)
            if special:
                assert token["start"] is None and token["stop"] is None
                assert token["text"] == hf.convert_ids_to_tokens(token["id"])
            else:
                assert (token["start"], token["stop"]) == (len(text[:lo].encode()),
                                                           len(text[:hi].encode()))
                assert raw[token["start"]:token["stop"]].decode() == token["text"]
    assert len(body[-1]) > MAX_SEQ
    plain = client.post("/tokenize", json={"inputs": TEXTS[1], "add_special_tokens": False})
    assert [t["id"] for t in plain.json()[0]] == hf(TEXTS[1], add_special_tokens=False)[
        "input_ids"]


def test_texts_cut_from_the_left_count_as_truncated(client: TestClient) -> None:
    """``bgeserve_truncated_texts_total`` counts a text cut from the left as one cut from the
    right: its ids came to the engine cut already, and were not counted."""
    from prometheus_client.parser import text_string_to_metric_families

    def cut() -> float:
        families = text_string_to_metric_families(client.get("/metrics").text)
        return next(s.value for f in families for s in f.samples
                    if s.name == "bgeserve_truncated_texts_total")

    before = cut()
    for direction in ("left", "right"):
        r = client.post("/embed", json={"inputs": [LONG, TEXTS[0]],
                                        "truncation_direction": direction})
        assert r.status_code == 200, r.text
    assert cut() - before == 2


def test_decode_is_the_tokenizers(client: TestClient, hf) -> None:
    """``/decode`` gives transformers' ``decode`` of each sequence, specials skipped by
    default."""
    ids = [hf(t)["input_ids"] for t in TEXTS]
    r = client.post("/decode", json={"ids": ids})
    assert r.json() == [hf.decode(x, skip_special_tokens=True) for x in ids]
    r = client.post("/decode", json={"ids": ids[0], "skip_special_tokens": False})
    assert r.json() == [hf.decode(ids[0], skip_special_tokens=False)]
    bad = client.post("/decode", json={"ids": [hf.vocab_size + 10]})
    assert bad.status_code == 422 and bad.json()["error_type"] == "Validation"
    # "" tokenized without specials is [], which /decode refuses as TEI's tokenizer does
    empty = client.post("/tokenize", json={"inputs": ["", TEXTS[0]], "add_special_tokens": False})
    ids = [[t["id"] for t in seq] for seq in empty.json()]
    assert ids[0] == []
    r = client.post("/decode", json={"ids": ids})
    assert r.status_code == 400 and r.json()["error_type"] == "Empty"


def test_info_reports_the_loaded_model(client: TestClient) -> None:
    """``/info``: the variant served, the sequence and batch limits in force."""
    info = client.get("/info").json()
    assert info["model_dtype"] == "float32" and info["model_sha"] is None
    assert info["max_input_length"] == MAX_SEQ
    assert info["max_client_batch_size"] == 2048 and info["max_batch_requests"] == 64
    assert info["max_batch_tokens"] >= MAX_SEQ
    assert info["model_type"] == {"embedding": {"pooling": "cls"}}
    assert info["auto_truncate"] is True and info["tokenization_workers"] >= 2


def test_tokenize_decode_and_left_truncation_take_a_tokenizing_slot(
        client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """/tokenize, /decode and left truncation run in the admission's tokenizing slots, as
    embedding requests do (run all at once, 12 /decode floods held 2.2 GiB and stalled /health
    for seconds); a /decode past MAX_DECODE_IDS is a 413 before any id is read."""
    from bgeserve.http.tei_schemas import MAX_DECODE_IDS
    from bgeserve.service.admission import Admission

    ran: list[str] = []
    real = Admission.on_thread

    async def spy(self, work):
        ran.append(getattr(work, "func", work).__name__)
        return await real(self, work)

    monkeypatch.setattr(Admission, "on_thread", spy)
    assert client.post("/tokenize", json={"inputs": "hello"}).status_code == 200
    assert client.post("/decode", json={"ids": [5, 6]}).status_code == 200
    r = client.post("/embed", json={"inputs": LONG, "truncation_direction": "left"})
    assert r.status_code == 200, r.text
    assert ran == ["tokens", "decode", "encode_left"]
    r = client.post("/decode", json={"ids": [[5] * 1024] * (MAX_DECODE_IDS // 1024 + 1)})
    assert r.status_code == 413 and r.json()["error_type"] == "Validation"
    assert str(MAX_DECODE_IDS) in r.json()["error"] and ran[3:] == []
