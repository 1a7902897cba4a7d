"""Cohere's embed routes (/v1/embed, /v2/embed) over the fake service: the SDK's shapes, the
packed binary types, truncate's three modes, and what bge-m3 cannot give refused by name."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.fakes import FakeService
from tests.test_http import serve

TEXTS = ["the first text", "another one", ""]


def dense(texts: list[str]) -> np.ndarray:
    return np.stack([FakeService.expected_dense(t) for t in texts])


def test_v1_without_types_is_a_bare_float_list() -> None:
    """v1 with no embedding_types: ``embeddings_floats``, the vectors in input order, the
    texts echoed, billed tokens as usage counts them, the request id as ``id``."""
    with serve() as c:
        r = c.post("/v1/embed", json={"texts": TEXTS, "model": "bge-m3",
                                      "input_type": "search_document"},
                   headers={"x-request-id": "rid-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["response_type"] == "embeddings_floats" and body["id"] == "rid-1"
    assert body["texts"] == TEXTS
    np.testing.assert_array_equal(np.asarray(body["embeddings"], np.float32), dense(TEXTS))
    assert body["meta"]["api_version"] == {"version": "1"}
    assert body["meta"]["billed_units"]["input_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/embed", "/v2/embed"])
def test_by_type(path: str) -> None:
    """float, base64 (little-endian float32), ubinary (sign bits packed, first dimension in
    the high bit) and binary (ubinary - 128), each over every text."""
    with serve() as c:
        r = c.post(path, json={"texts": TEXTS, "input_type": "search_query",
                               "embedding_types": ["ubinary", "float", "binary", "base64"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["response_type"] == "embeddings_by_type"
    assert body["meta"]["api_version"]["version"] == path[2]
    want = dense(TEXTS)
    got = body["embeddings"]
    assert set(got) == {"float", "base64", "binary", "ubinary"}
    np.testing.assert_array_equal(np.asarray(got["float"], np.float32), want)
    decoded = [np.frombuffer(base64.b64decode(s), "<f4") for s in got["base64"]]
    np.testing.assert_array_equal(np.stack(decoded), want)
    ubinary = np.asarray(got["ubinary"])
    assert ubinary.shape == (len(TEXTS), want.shape[1] // 8)
    assert ubinary.min() >= 0 and ubinary.max() <= 255
    bits = np.unpackbits(ubinary.astype(np.uint8), axis=1)[:, :want.shape[1]]
    np.testing.assert_array_equal(bits, (want > 0).astype(np.uint8))
    assert bits[0, 0] == int(want[0, 0] > 0)  # the first dimension is the high bit
    np.testing.assert_array_equal(np.asarray(got["binary"]), ubinary - 128)


def test_v2_without_types_is_float_by_type() -> None:
    """v2 answers by type whatever is asked: ``float`` alone when no type is."""
    with serve() as c:
        body = c.post("/v2/embed", json={"texts": ["x"], "model": "bge-m3",
                                         "input_type": "classification"}).json()
    assert body["response_type"] == "embeddings_by_type" and set(body["embeddings"]) == {"float"}


def test_truncate_modes() -> None:
    """END cuts from the right, START from the left (the texts' ids cut first), NONE makes an
    over-long text an error; absent, BGE_M3_TRUNCATE."""
    long = " ".join(f"w{i}" for i in range(40))
    with serve(max_seq_length=16) as c:
        end = c.post("/v2/embed", json={"texts": [long], "truncate": "END"})
        start = c.post("/v2/embed", json={"texts": [long], "truncate": "START"})
        none = c.post("/v2/embed", json={"texts": [long], "truncate": "NONE"})
        calls = c.fake.calls  # type: ignore[attr-defined]
    assert end.status_code == 200 and start.status_code == 200, (end.text, start.text)
    assert none.status_code == 413 and none.json()["detail"]
    assert calls[0].inputs == [long] and calls[0].options.truncate
    assert isinstance(calls[1].inputs[0], list)  # cut from the left: ids
    assert not calls[2].options.truncate
    with serve(truncate=False) as c:
        c.post("/v1/embed", json={"texts": ["a"]})
        assert not c.fake.calls[0].options.truncate  # type: ignore[attr-defined]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types[0]", "quantization"),
    ({"texts": ["a"], "embedding_types": ["float", "uint8"]}, "embedding_types[1]", "uint8"),
    ({"texts": ["a"], "embedding_types": []}, "embedding_types", "non-empty"),
    ({"texts": ["a"], "input_type": "image"}, "input_type", "text only"),
    ({"texts": ["a"], "truncate": "end"}, "truncate", "NONE, START, END"),
    ({"texts": ["a"], "max_tokens": 512}, "max_tokens", "BGE_M3_MAX_SEQ_LENGTH"),
    ({"texts": ["a"], "output_dimension": 256}, "output_dimension", "Matryoshka"),
    ({"images": ["data:image/png;base64,AAAA"]}, "images", "text only"),
    ({"inputs": [{"content": [{"type": "text", "text": "a"}]}]}, "inputs", "texts"),
    ({"input_type": "search_query"}, "texts", "required"),
    ({"texts": ["a", 1]}, "texts[1]", "must be a string"),  # named "texts" (fuzz QA)
    ({"texts": "a"}, "texts", "array of strings"),
    ({"texts": [1, 2]}, "texts[0]", "array of strings"),
    ({"texts": []}, "texts", "empty"),
])
def test_refusals_name_the_field(body: dict, param: str, words: str) -> None:
    """A 400 naming the field and why, with ``detail`` for Cohere's clients; nothing embedded."""
    with serve() as c:
        r = c.post("/v2/embed", json=body)
        calls = c.fake.calls  # type: ignore[attr-defined]
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert r.json()["detail"] == error["message"]
    assert calls == []


def test_unknown_model_is_404_and_an_alias_is_served() -> None:
    """A Cohere model name is a 404 naming it unless BGE_M3_MODEL_ALIASES serves it."""
    with serve(model_aliases=("embed-english-v3.0",)) as c:
        assert c.post("/v1/embed", json={"texts": ["a"],
                                         "model": "embed-english-v3.0"}).status_code == 200
        r = c.post("/v1/embed", json={"texts": ["a"], "model": "embed-v4.0"})
    assert r.status_code == 404 and "embed-v4.0" in r.json()["detail"]


def test_the_engines_errors_name_the_texts() -> None:
    """The engine names an item ``input[i]``; this body calls it ``texts[i]``, and its advice
    is in Cohere's words (``truncate`` takes "END" / "START" here, not true)."""
    from bgeserve.errors import TooLarge

    fake = FakeService(fail_with=TooLarge(  # the engine's words (Engine._check)
        "input[1] has more than the 8 tokens allowed (BGE_M3_MAX_SEQ_LENGTH); send "
        "truncate=true or split the text", param="input[1]", code="too_many_tokens"))
    with serve(fake) as c:
        r = c.post("/v2/embed", json={"texts": ["a", "b"], "truncate": "NONE"})
    assert r.status_code == 413
    assert r.json()["error"]["param"] == "texts[1]" and r.json()["detail"].startswith("texts[1]")
    assert 'send truncate "END" (or "START") or split' in r.json()["detail"], r.json()
    assert r.json()["error"]["code"] == "too_many_tokens"
