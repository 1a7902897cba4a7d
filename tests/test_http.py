"""The HTTP layer in-process (Starlette TestClient, lifespan running) against ``FakeService``."""

from __future__ import annotations

import ast
import base64
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import orjson
import pytest
from starlette.testclient import TestClient

from bgeserve.config import Settings
from bgeserve.errors import (
    DeadlineExceeded,
    EngineFailed,
    InvalidInput,
    ModelUnavailable,
    NotReady,
    OutOfMemory,
    Overloaded,
    TooLarge,
)
from bgeserve.http import guards
from bgeserve.http.app import create_app, model_ids
from bgeserve.http.context import CHARGE_BODY, sanitize_request_id
from bgeserve.logs import RequestIdFilter, request_id_var
from tests.fakes import FakeService, fake_tokens

JSON = {"content-type": "application/json"}


@contextmanager
def serve(service: FakeService | None = None, **settings: Any) -> Iterator[TestClient]:
    """A TestClient over a fresh app; ``settings`` override ``Settings`` fields."""
    cfg = Settings(**settings)
    fake = service or FakeService()
    fake.settings = cfg
    with TestClient(create_app(cfg, lambda _: fake), raise_server_exceptions=False) as client:
        client.fake = fake  # type: ignore[attr-defined]
        yield client


@pytest.fixture
def client() -> Iterator[TestClient]:
    with serve() as c:
        yield c


def assert_error(r: Any, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The response is ``status`` with the envelope, and a request id."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-request-id"]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert error["message"] and "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


# ---------------------------------------------------------------- dense


def test_dense_float(client: TestClient) -> None:
    """Dense vectors come back in input order with real token usage."""
    texts = ["hello world", "a b c", ""]
    r = client.post("/v1/embeddings", json={"input": texts, "model": "bge-m3"})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and body["model"] == "bge-m3"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for text, item in zip(texts, body["data"]):
        assert item["object"] == "embedding" and "truncated" not in item
        got = np.array(item["embedding"], dtype=np.float32)
        np.testing.assert_array_equal(got, FakeService.expected_dense(text))
    tokens = sum(len(fake_tokens(t)) + 2 for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_dense_base64_equals_float(client: TestClient) -> None:
    """base64 is the little-endian float32 bytes of exactly the float vector."""
    req = {"input": ["x y", "z"], "model": "bge-m3"}
    floats = client.post("/v1/embeddings", json=req).json()["data"]
    b64 = client.post("/v1/embeddings", json={**req, "encoding_format": "base64"}).json()["data"]
    for f, b in zip(floats, b64):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(f["embedding"], dtype=np.float32))


@pytest.mark.parametrize(
    ("value", "sent"),
    [
        ("one text", ["one text"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[0, 5], [250001]], [[0, 5], [250001]]),
        ([7.0, 8], [[7, 8]]),
        ([[1], [2, 3.0]], [[1], [2, 3]]),
    ],
)
def test_input_shapes(value: Any, sent: list) -> None:
    """With BGE_M3_ACCEPT_TOKEN_IDS, a string, token ids, and lists of token ids all reach
    the service as a batch of ints.

    Integral floats count as integers, as in JSON Schema.
    """
    with serve(accept_token_ids=True) as client:
        r = client.post("/v1/embeddings", json={"input": value})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == len(sent)
        inputs = client.fake.calls[-1].inputs  # type: ignore[attr-defined]
    assert inputs == sent
    assert all(type(t) is int for item in inputs if isinstance(item, list) for t in item)


@pytest.mark.parametrize("value", [[1, 2, 3], [[15339, 1917], [9080, 22656, 45918, 252]],
                                   [7.0, 8], [[1], "a"], [[]]])
@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/sparse-embeddings",
                                  "/v1/embeddings:both", "/embeddings"])
def test_token_ids_are_refused_by_default(client: TestClient, path: str, value: Any) -> None:
    """Token-id input (what LangChain's OpenAIEmbeddings sends by default: tiktoken cl100k
    ids) is a 400 naming the LangChain setting and BGE_M3_ACCEPT_TOKEN_IDS; nothing is
    embedded."""
    error = assert_error(client.post(path, json={"input": value}), 400,
                         "token_ids_not_accepted", "input")
    assert "check_embedding_ctx_length=False" in error["message"]
    assert "BGE_M3_ACCEPT_TOKEN_IDS=1" in error["message"]
    assert client.fake.calls == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [[["a"]], [["a", "b"], "c"], [[None]], [[{"text": "a"}]]])
@pytest.mark.parametrize("accept", [False, True])
def test_nested_strings_are_no_token_ids(value: Any, accept: bool) -> None:
    """An array whose first item is an array of non-numbers (nested strings, say) is a 400
    naming input[0][0] and saying what input[0] must be, whatever BGE_M3_ACCEPT_TOKEN_IDS says: not the token-id
    refusal, which would send the caller after a LangChain setting."""
    with serve(accept_token_ids=accept) as c:
        error = assert_error(c.post("/v1/embeddings", json={"input": value}), 400,
                             "invalid_input", "input[0][0]")
        assert "input[0] must be a string or an array of integer token ids" in error["message"]
        assert "LangChain" not in error["message"]
        assert c.fake.calls == []  # type: ignore[attr-defined]


def test_model_names() -> None:
    """bge-m3, BAAI/bge-m3 and configured aliases are accepted; others are 404."""
    with serve(model_aliases=("text-embedding-3-small",)) as c:
        for name in ("bge-m3", "BAAI/bge-m3", "text-embedding-3-small"):
            r = c.post("/v1/embeddings", json={"input": "x", "model": name})
            assert r.status_code == 200 and r.json()["model"] == "bge-m3"
        assert_error(
            c.post("/v1/embeddings", json={"input": "x", "model": "gpt-4"}),
            404, "model_not_found", "model",
        )
        assert_error(c.post("/v1/embeddings", json={"input": "x", "model": 3}), 400, param="model")
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [
            "bge-m3", "BAAI/bge-m3", "text-embedding-3-small"
        ]
        assert models["data"][0] == {
            "id": "bge-m3", "object": "model", "owned_by": "BAAI", "created": 0
        }
        # An OpenAI client given the bare host (no /v1) lists and retrieves there.
        assert c.get("/models").json() == models
        assert c.get("/models/BAAI/bge-m3").json() == c.get("/v1/models/BAAI/bge-m3").json()
        assert_error(c.get("/models/gpt-4"), 404, "model_not_found")


def test_dimensions(client: TestClient) -> None:
    """dimensions=1024 is a no-op; anything else explains that bge-m3 is not Matryoshka."""
    assert client.post("/v1/embeddings", json={"input": "x", "dimensions": 1024}).status_code == 200
    err = assert_error(
        client.post("/v1/embeddings", json={"input": "x", "dimensions": 256}),
        400, "unsupported_dimensions", "dimensions",
    )
    assert "Matryoshka" in err["message"]
    r = client.post("/v1/embeddings", json={"input": "x", "dimensions": 1024.0})
    assert r.status_code == 200
    for bad in ("1024", True, 1024.5):
        assert_error(client.post("/v1/embeddings", json={"input": "x", "dimensions": bad}), 400)


def test_truncation() -> None:
    """Truncated items are flagged; truncate=false turns an over-long text into a 413."""
    with serve(max_seq_length=5) as c:
        r = c.post("/v1/embeddings", json={"input": ["short", "one two three four five"]})
        data = r.json()["data"]
        assert "truncated" not in data[0] and data[1]["truncated"] is True
        assert r.json()["usage"]["prompt_tokens"] == 3 + 5
        r = c.post("/v1/embeddings", json={"input": ["ok", "a b c d e"], "truncate": False})
        assert_error(r, 413, param="input[1]")
        assert c.fake.calls[-1].options.truncate is False  # type: ignore[attr-defined]
    with serve(truncate=False) as c:
        c.post("/v1/embeddings", json={"input": "x"})
        assert c.fake.calls[-1].options.truncate is False  # type: ignore[attr-defined]


# ---------------------------------------------------------------- sparse and both


def test_sparse(client: TestClient) -> None:
    """Sparse items carry ascending indices and their weights, with usage."""
    r = client.post("/v1/sparse-embeddings", json={"input": ["alpha beta gamma", ""]})
    body = r.json()
    assert body["object"] == "list" and body["model"] == "bge-m3" and body["usage"]
    first, empty = body["data"]
    assert first["object"] == "sparse_embedding" and first["index"] == 0
    ids, weights = FakeService.expected_sparse("alpha beta gamma")
    assert first["sparse_values"]["indices"] == ids.tolist()
    np.testing.assert_array_equal(np.float32(first["sparse_values"]["values"]), weights)
    assert empty["sparse_values"] == {"indices": [], "values": []}
    assert client.fake.calls[-1].options.dense is False  # type: ignore[attr-defined]


def test_sparse_top_k_and_min_weight(client: TestClient) -> None:
    """top_k keeps the largest weights, min_weight drops small ones; order stays by index."""
    text = " ".join(f"w{i}" for i in range(40))
    ids, weights = FakeService.expected_sparse(text)
    r = client.post("/v1/sparse-embeddings", json={"input": text, "sparse_top_k": 5})
    sv = r.json()["data"][0]["sparse_values"]
    assert len(sv["indices"]) == 5 and sv["indices"] == sorted(sv["indices"])
    assert sorted(np.float32(sv["values"])) == sorted(weights)[-5:]
    threshold = float(np.median(weights))
    r = client.post("/v1/sparse-embeddings", json={"input": text, "sparse_min_weight": threshold})
    sv = r.json()["data"][0]["sparse_values"]
    assert sv["indices"] == ids[weights >= np.float32(threshold)].tolist()


def test_sparse_tokens_format(client: TestClient) -> None:
    """sparse_format=tokens keys weights by token string, keeping the max on a collision."""
    text = " ".join(f"t{i}" for i in range(300))  # 300 ids into 1000 strings: collisions likely
    ids, weights = FakeService.expected_sparse(text)
    expected: dict[str, float] = {}
    fake: FakeService = client.fake  # type: ignore[attr-defined]
    for token, w in zip(fake.token_strings(ids.tolist()), weights):
        expected[token] = max(expected.get(token, 0.0), float(w))
    assert len(expected) < len(ids)
    r = client.post("/v1/sparse-embeddings", json={"input": text, "sparse_format": "tokens"})
    got = r.json()["data"][0]["sparse_values"]
    assert {k: float(np.float32(v)) for k, v in got.items()} == expected


def test_sparse_dict_format(client: TestClient) -> None:
    """sparse_format=dict is ``{"<token id>": weight}`` (Milvus / pymilvus's
    BGEM3EmbeddingFunction shape), keys in ascending id order."""
    text = "alpha beta gamma alpha"
    ids, weights = FakeService.expected_sparse(text)
    r = client.post("/v1/sparse-embeddings", json={"input": text, "sparse_format": "dict"})
    got = r.json()["data"][0]["sparse_values"]
    assert list(got) == [str(i) for i in ids.tolist()]
    np.testing.assert_array_equal(np.float32(list(got.values())), weights)


@pytest.mark.parametrize("fmt", ["indices", "tokens", "dict"])
def test_sparse_empty_omit_leaves_out_empty_rows(client: TestClient, fmt: str) -> None:
    """sparse_empty=omit leaves out the items whose sparse vector is empty (an empty text,
    or every weight under sparse_min_weight), dense included; the rest keep their input
    index. The default, keep, answers every input."""
    texts = ["a b", "", "c d e"]
    body = {"input": texts, "sparse_format": fmt, "sparse_empty": "omit"}
    r = client.post("/v1/embeddings:both", json=body)
    data = r.json()["data"]
    assert [item["index"] for item in data] == [0, 2]
    for item in data:
        np.testing.assert_array_equal(np.float32(item["embedding"]),
                                      FakeService.expected_dense(texts[item["index"]]))
        assert item["sparse_values"]
    # every weight is <= 1: a min weight of 2 empties every vector
    r = client.post("/v1/sparse-embeddings", json={**body, "sparse_min_weight": 2})
    assert r.status_code == 200 and r.json()["data"] == []
    keep = client.post("/v1/sparse-embeddings", json={"input": texts, "sparse_format": fmt})
    assert [item["index"] for item in keep.json()["data"]] == [0, 1, 2]


def test_both_default_and_colbert(client: TestClient) -> None:
    """:both gives dense + sparse by default, and ColBERT as lists or base64 (f32 / f16)."""
    r = client.post("/v1/embeddings:both", json={"input": "a b"})
    item = r.json()["data"][0]
    assert set(item) == {"object", "index", "embedding", "sparse_values"}
    assert client.fake.calls[-1].options.colbert is False  # type: ignore[attr-defined]
    expected = FakeService.expected_colbert("a b", 4)
    req = {"input": "a b", "outputs": ["colbert"]}
    item = client.post("/v1/embeddings:both", json=req).json()["data"][0]
    assert set(item) == {"object", "index", "colbert"}
    np.testing.assert_array_equal(np.float32(item["colbert"]), expected)
    for dtype, np_dtype in (("float32", "<f4"), ("float16", "<f2")):
        r = client.post(
            "/v1/embeddings:both",
            json={**req, "encoding_format": "base64", "colbert_dtype": dtype},
        )
        raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["colbert"]), dtype=np_dtype)
        np.testing.assert_array_equal(raw.reshape(-1, 1024), expected.astype(np_dtype))


@pytest.mark.parametrize("path", ["/v1/embeddings%3Aboth", "/v1/embeddings%3aboth"])
def test_both_percent_encoded_colon(client: TestClient, path: str) -> None:
    """A percent-encoded colon reaches :both (the router matches the decoded path)."""
    r = client.post(path, json={"input": "x"})
    assert r.status_code == 200 and "sparse_values" in r.json()["data"][0]


@pytest.mark.parametrize(
    ("outputs", "param"),
    [
        ([], "outputs"),
        (["dense", "lexical"], "outputs[1]"),
        ("dense", "outputs"),
        ([1], "outputs[0]"),
    ],
)
def test_both_bad_outputs(client: TestClient, outputs: Any, param: str) -> None:
    """outputs must be a non-empty list drawn from dense, sparse, colbert."""
    r = client.post("/v1/embeddings:both", json={"input": "x", "outputs": outputs})
    assert_error(r, 400, "invalid_input", param)


def test_unknown_fields_ignored(client: TestClient) -> None:
    """Extra fields (OpenAI clients send some) and fields of other routes are ignored."""
    body = {"input": "x", "user": "u", "foo": {"bar": [1]}, "outputs": "nonsense"}
    assert client.post("/v1/embeddings", json=body).status_code == 200
    body = {"input": "x", "encoding_format": "nonsense", "dimensions": 3}
    assert client.post("/v1/sparse-embeddings", json=body).status_code == 200


def test_nulls_mean_defaults(client: TestClient) -> None:
    """An option sent as null takes its default."""
    body = {"input": "x", "model": None, "encoding_format": None, "dimensions": None,
            "truncate": None, "sparse_top_k": None, "outputs": None}
    r = client.post("/v1/embeddings:both", json=body)
    assert r.status_code == 200 and isinstance(r.json()["data"][0]["embedding"], list)


# ---------------------------------------------------------------- validation

BAD_BODIES = [
    ({}, "input"),
    ({"input": None}, "input"),
    ({"input": 3}, "input"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": True}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input[0]"),
    ({"input": ["a", 1]}, "input[1]"),
    ({"input": ["a", ["b"]]}, "input[1]"),
    ({"input": [["a"]]}, "input[0][0]"),
    ({"input": [[1], "a"]}, "input[1]"),
    ({"input": [[1, 2], [3, "4"]]}, "input[1][1]"),
    ({"input": [1, True]}, "input[1]"),
    ({"input": [True]}, "input[0]"),
    ({"input": [1.5]}, "input[0]"),
    ({"input": [[1, 2.5]]}, "input[0][1]"),
    ({"input": [-1]}, "input[0]"),
    ({"input": [5, 250002]}, "input[1]"),
    ({"input": [[1], [250002]]}, "input[1][0]"),
    ({"input": [None]}, "input[0]"),
    ({"input": "x", "encoding_format": "binary"}, "encoding_format"),
    ({"input": "x", "truncate": "yes"}, "truncate"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
def test_schema_errors_are_400(body: dict, param: str) -> None:
    """Every malformed field is a 400 naming the field; the service is never called (token
    ids checked as BGE_M3_ACCEPT_TOKEN_IDS=1 reads them)."""
    with serve(accept_token_ids=True) as client:
        assert_error(client.post("/v1/embeddings", json=body), 400, param=param)
        assert client.fake.calls == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sparse_top_k": 0}, "sparse_top_k"),
        ({"sparse_top_k": 2.5}, "sparse_top_k"),
        ({"sparse_top_k": True}, "sparse_top_k"),
        ({"sparse_min_weight": -0.1}, "sparse_min_weight"),
        ({"sparse_min_weight": "0"}, "sparse_min_weight"),
        ({"sparse_format": "csr"}, "sparse_format"),
        ({"sparse_empty": "drop"}, "sparse_empty"),
    ],
)
def test_sparse_option_errors(client: TestClient, body: dict, param: str) -> None:
    """Sparse options are range- and type-checked."""
    r = client.post("/v1/sparse-embeddings", json={"input": "x", **body})
    assert_error(r, 400, param=param)


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1, 2]", b'"input"', b"null", b'{"input": "\xff\xfe"}', b'{"input": NaN}',
     b'{"input": [' + b"1" * 40 + b"]}"],
)
def test_bad_json_is_400(client: TestClient, raw: bytes) -> None:
    """Invalid JSON, invalid UTF-8, non-objects and oversized integers are 400 invalid_json."""
    assert_error(client.post("/v1/embeddings", content=raw, headers=JSON), 400)


def test_deep_nesting_is_400(client: TestClient) -> None:
    """10,000 nested lists (past orjson's recursion limit) are a 400, not a 500."""
    for raw in (b'{"input": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
                b'{"x": ' + b'{"a":' * 10_000 + b"1" + b"}" * 10_000 + b', "input": "a"}'):
        assert_error(client.post("/v1/embeddings", content=raw, headers=JSON), 400, "invalid_json")
    # nesting that orjson accepts is still a schema error, not a crash
    raw = b'{"input": [' + b"[" * 500 + b"]" * 500 + b"]}"
    assert_error(client.post("/v1/embeddings", content=raw, headers=JSON), 400)
    # ... and so is nesting under orjson's limit but past Python's, in a body orjson refuses
    # for a lone surrogate: the standard library's parse that names its field recursed into
    # a RecursionError (QA: a 500 and a traceback, from ~960 levels)
    deep = b"[" * 1_000 + b"]" * 1_000
    for raw in (b'{"x": "\ud800", "y": ' + deep + b"}",
                b'{"y": ' + deep + b', "x": "\ud800"}',
                b'{"y": ' + b"[" * 1_000 + b'"\ud800"' + b"]" * 1_000 + b"}"):
        assert_error(client.post("/v1/embeddings", content=raw, headers=JSON), 400, "invalid_json")


def test_batch_limit() -> None:
    """max_batch texts are fine; one more is a 400 batch_too_large naming input."""
    with serve(max_batch=4, accept_token_ids=True) as c:
        assert c.post("/v1/embeddings", json={"input": ["a"] * 4}).status_code == 200
        r = c.post("/v1/embeddings", json={"input": ["a"] * 5})
        assert "BGE_M3_MAX_BATCH" in assert_error(r, 400, "batch_too_large", "input")["message"]
        r = c.post("/v1/embeddings", json={"input": [[1]] * 5})
        assert_error(r, 400, "batch_too_large", "input")


def test_ten_thousand_inputs() -> None:
    """A 10,000-item request is accepted when max_batch allows it (parse/render off-loop)."""
    with serve(max_batch=10_000) as c:
        texts = [f"text {i}" for i in range(10_000)]
        r = c.post("/v1/sparse-embeddings", json={"input": texts})
        data = r.json()["data"]
        assert len(data) == 10_000 and data[-1]["index"] == 9_999
        ids, _ = FakeService.expected_sparse(texts[-1])
        assert data[-1]["sparse_values"]["indices"] == ids.tolist()


def test_text_too_long_is_413(client: TestClient) -> None:
    """A text over max_text_chars that would be tokenized whole (truncate false) is a 413
    naming its index; a huge string is refused too. Truncated, it goes to the engine, which
    keeps its leading words (engine/tokenizer.py; tests/test_service.py end to end)."""
    with serve(max_text_chars=10) as c:
        for path in ("/v1/embeddings", "/v1/sparse-embeddings", "/v1/embeddings:both"):
            whole = {"input": ["0123456789"], "truncate": False}
            assert c.post(path, json=whole).status_code == 200
            r = c.post(path, json={"input": ["ok", "0123456789x"], "truncate": False})
            assert_error(r, 413, "too_large", "input[1]")
            for truncating in ({}, {"truncate": True}, {"truncate": None}):
                body = {"input": ["ok", "0123456789x"], **truncating}
                assert c.post(path, json=body).status_code == 200, (path, body)
        assert c.fake.calls[-1].inputs == ["ok", "0123456789x"]
    with serve(max_text_chars=10, truncate=False) as c:  # BGE_M3_TRUNCATE=0: the default
        r = c.post("/v1/embeddings", json={"input": ["ok", "0123456789x"]})
        assert_error(r, 413, "too_large", "input[1]")
    r = client.post("/v1/embeddings", json={"input": "x" * 20_000_000, "truncate": False})
    assert_error(r, 413, "too_large", "input[0]")


def test_token_id_errors_name_no_other_vocabulary() -> None:
    """A negative id is named as negative, not as outside bge-m3's 250,002 ids (the loaded
    model's vocabulary, which a random model's may be smaller than, is the engine's check)."""
    with serve(accept_token_ids=True) as client:
        r = client.post("/v1/embeddings", json={"input": [5, -1]})
        assert_error(r, 400, param="input[1]")
        message = r.json()["error"]["message"]
        assert "negative" in message and "250002" not in message
        # Past any: named as the layout's bound, not as the served model's size (QA).
        r = client.post("/v1/embeddings", json={"input": [5, 999_999]})
        assert_error(r, 400, param="input[1]")
        assert "at most 250002 ids; the served model's may have fewer" in r.json()["error"][
            "message"]


# ---------------------------------------------------------------- framework errors


def test_framework_errors_use_envelope(client: TestClient) -> None:
    """404, 405 (with Allow) and 415 come in the same envelope."""
    r = client.get("/v2/nothing")
    assert_error(r, 404, "not_found")
    # A URL built wrong: also said in a string `detail`, the field clients such as Hugging
    # Face's JS one show (the envelope's object they do not read).
    assert r.json()["detail"] == "no route GET /v2/nothing" == r.json()["error"]["message"]
    r = client.get("/v1/embeddings")
    assert_error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"
    r = client.post("/health")
    assert_error(r, 405)
    assert "GET" in r.headers["allow"]
    r = client.post("/v1/embeddings", content=b"input=x",
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(r, 415, "unsupported_media_type")


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("application/json; charset=utf-8", 200),
        ("Application/JSON; charset=UTF-8", 200),
        ('application/json; charset="utf-8"', 200),
        (None, 200),
        ("application/json; charset=latin-1", 415),
        ("text/plain", 415),
        ("multipart/form-data; boundary=x", 415),
    ],
)
def test_content_type(client: TestClient, content_type: str | None, status: int) -> None:
    """Only (UTF-8) JSON is accepted; a missing Content-Type is read as JSON."""
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/v1/embeddings", content=b'{"input": "x"}', headers=headers)
    assert r.status_code == status, r.text


@pytest.mark.parametrize("route", ["/v1/embeddings", "/embed", "/v1/rerank"])
def test_compressed_bodies_are_415_and_bad_utf8_is_named(client: TestClient, route: str) -> None:
    """A Content-Encoding other than identity is a 415 naming it (a gzip body was a 400 about
    "surrogates", and `br` over a plain body was taken as if uncompressed); bytes that are not
    UTF-8 are a 400 that says so and where."""
    import gzip

    body = b'{"input": "x", "inputs": "x", "query": "q", "documents": ["d"]}'
    for coding, content in (("gzip", gzip.compress(body)), ("br", body)):
        r = client.post(route, content=content,
                        headers={**JSON, "content-encoding": coding})
        assert r.status_code == 415 and coding in r.text, (coding, r.text)
    r = client.post(route, content=body, headers={**JSON, "content-encoding": "identity"})
    assert r.status_code == 200, r.text
    # A header sent twice is both its values (the first alone was read: QA, 200 for a gzip
    # body declared "identity" then "gzip", and for a text/plain one after application/json).
    for name, values in (("content-encoding", ("identity", "gzip")),
                         ("content-type", ("application/json", "text/plain"))):
        headers = [*([] if name == "content-type" else JSON.items()),
                   *((name, value) for value in values)]
        r = client.post(route, content=gzip.compress(body) if "gzip" in values else body,
                        headers=headers)
        assert r.status_code == 415 and values[1] in r.text, (name, r.text)
    r = client.post(route, content=body, headers=[*JSON.items(), ("content-encoding", "identity"),
                                                  ("content-encoding", "identity"),
                                                  ("content-type", "Application/JSON")])
    assert r.status_code == 200, r.text  # the same value twice is that value
    # A transfer coding under the chunking: the parser takes off the chunks alone, and the
    # rest was read as the body (a body that only claimed gzip got 200).
    for coding in ("gzip, chunked", "deflate,chunked", "br"):
        r = client.post(route, content=body, headers={**JSON, "transfer-encoding": coding})
        assert r.status_code == 415 and "Transfer-Encoding" in r.text, (coding, r.text)
    r = client.post(route, content=body, headers={**JSON, "transfer-encoding": "Chunked"})
    assert r.status_code == 200, r.text
    r = client.post(route, content=b'{"input": "caf\xe9"}', headers=JSON)
    assert r.status_code in (400, 422) and "not valid UTF-8 (byte 14" in r.text, r.text


@pytest.mark.parametrize(("route", "raw", "param"), [
    ("/v1/embeddings", rb'{"input": ["ok", "a\ud800b", "x"]}', "input[1]"),
    ("/v1/embeddings", rb'{"input": "\udc00"}', "input"),
    ("/embed", rb'{"inputs": ["ok", "ok", "\ud83d"]}', "inputs[2]"),
    ("/v1/rerank", rb'{"query": "q", "documents": ["d", {"text": "\ud800"}]}',
     "documents[1].text"),
])
def test_a_lone_surrogate_is_named_by_its_field(client: TestClient, route: str, raw: bytes,
                                                param: str) -> None:
    """JSON's "\ud800" alone is a code point but no character (orjson refuses the body as
    "no low surrogate in string"): the 400 names the field that holds it and nothing runs."""
    r = client.post(route, content=raw, headers=JSON)
    assert r.status_code == 400, r.text
    assert f"{param} holds a lone surrogate" in r.text, r.text
    if route.startswith("/v1"):
        assert r.json()["error"]["param"] == param
    assert client.fake.calls == []  # type: ignore[attr-defined]
    # A pair is a character: embedded.
    ok = client.post("/v1/embeddings", content=rb'{"input": "\ud83d\ude00"}', headers=JSON)
    assert ok.status_code == 200, ok.text


def test_body_limit_by_content_length() -> None:
    """A declared Content-Length over the limit is refused before the handler runs."""
    with serve(max_body_bytes=2048) as c:
        r = c.post("/v1/embeddings", json={"input": "x" * 3000})
        err = assert_error(r, 413, "payload_too_large")
        assert "BGE_M3_MAX_BODY_BYTES" in err["message"]
        assert c.fake.calls == []  # type: ignore[attr-defined]
        r = c.post("/v1/embeddings", content=b"x" * 40 * 2**20, headers=JSON)
        assert_error(r, 413, "payload_too_large")


def _scope(headers: list[tuple[bytes, bytes]], fake: FakeService, settings: Settings) -> dict:
    """An ASGI scope for ``POST /v1/embeddings``."""
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/embeddings", "raw_path": b"/v1/embeddings",
        "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        "state": {"service": fake, "settings": settings, "model_ids": ("bge-m3",)},
    }


def _drive(app: Any, scope: dict, chunks: Iterator[bytes]) -> tuple[int, dict, int, int]:
    """Run one request through the ASGI app; returns status, body, the chunks pulled when
    the answer started and the chunks pulled in all (lingering close reads on, linger.py)."""
    pulled = 0
    answered_at = -1
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal pulled
        try:
            chunk = next(chunks)
        except StopIteration:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict) -> None:
        nonlocal answered_at
        if message["type"] == "http.response.start":
            answered_at = pulled
        sent.append(message)

    anyio.run(app, scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, orjson.loads(body), answered_at, pulled


@pytest.mark.parametrize("declared", [False, True])
def test_body_limit_while_streaming(declared: bool) -> None:
    """A 40 MiB body is answered 413 as soon as the running total passes the limit (from the
    declared length, before a byte is read); the rest is then read and dropped, up to twice
    the limit, so that a client writing it all before reading gets the answer."""
    settings = Settings()
    fake = FakeService(settings=settings)
    app = create_app(settings, lambda _: fake)
    mib = 2**20
    headers = [(b"content-type", b"application/json")]
    if declared:
        headers.append((b"content-length", str(40 * mib).encode()))
    else:
        headers.append((b"transfer-encoding", b"chunked"))
    scope = _scope(headers, fake, settings)
    status, body, answered_at, pulled = _drive(app, scope, (b" " * mib for _ in range(40)))
    assert status == 413 and body["error"]["code"] == "payload_too_large"
    assert answered_at == (0 if declared else settings.max_body_bytes // mib + 1)
    assert pulled == 40  # within the 64 MiB lingering bound: read to its end
    assert fake.calls == []


# ---------------------------------------------------------------- service errors


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (InvalidInput("token id 260000 is not in the vocabulary", param="input[3]"), 400,
         "invalid_input"),
        (TooLarge("input[0] costs more memory than the budget", param="input[0]"), 413,
         "too_large"),
        (Overloaded("queue full", retry_after=2.5), 429, "overloaded"),
        (DeadlineExceeded("deadline of 300 s passed"), 504, "timeout"),
        (NotReady("model is loading"), 503, "not_ready"),
        (ModelUnavailable("/secret/path/model.onnx missing"), 503, "model_unavailable"),
        (EngineFailed("ORT: CUDA error at /secret/path"), 500, "engine_failed"),
        (OutOfMemory("ORT: bad_alloc /secret/path"), 500, "out_of_memory"),
    ],
)
def test_service_errors_map_through_the_table(error: Exception, status: int, code: str) -> None:
    """Each service exception becomes its status; internals never reach the caller."""
    with serve(FakeService(fail_with=error)) as c:
        r = c.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "rid-1"})
        err = assert_error(r, status, code)
        assert "/secret/path" not in r.text
        if status < 500:
            assert err["param"] == getattr(error, "param", None)
        if status == 500 or isinstance(error, ModelUnavailable):
            assert "rid-1" in err["message"]
        if isinstance(error, Overloaded):
            assert r.headers["retry-after"] == "3"


@pytest.mark.parametrize(("error", "status"), [
    (DeadlineExceeded("deadline of 300 s passed"), 504),
    (NotReady("the server is shutting down"), 503),
    (EngineFailed("ORT: CUDA error"), 500),
])
def test_a_5xx_answer_is_logged_once_at_warning_or_above(
        error: Exception, status: int, caplog: pytest.LogCaptureFixture) -> None:
    """A 504 or a shutdown's 503 is one warning, the access line with its code (QA: each was
    two, the error's own line first); a 500 keeps its error line: its cause is not the
    client's to see, and the operator needs it."""
    with caplog.at_level(logging.INFO, logger="bgeserve.http"), \
            serve(FakeService(fail_with=error)) as c:
        r = c.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "five"})
    assert r.status_code == status
    lines = [x for x in caplog.records if getattr(x, "request_id", None) == "five"
             and x.levelno >= logging.WARNING]
    access = [x for x in lines if x.getMessage().startswith(f"POST /v1/embeddings {status}")]
    assert len(access) == 1
    assert len(lines) == (2 if status == 500 else 1), [x.getMessage() for x in lines]


def test_retry_after_is_at_least_one() -> None:
    """A sub-second retry_after still says Retry-After: 1."""
    with serve(FakeService(fail_with=Overloaded("busy", retry_after=0.01))) as c:
        assert c.post("/v1/embeddings", json={"input": "x"}).headers["retry-after"] == "1"


def test_unexpected_error_is_generic_500() -> None:
    """A bug in the service is a 500 envelope with the request id and no stack trace."""
    with serve(FakeService(fail_with=RuntimeError("secret internals"))) as c:
        r = c.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "bug-1"})
    err = assert_error(r, 500, "internal_error")
    assert "secret" not in r.text and "bug-1" in err["message"]
    assert r.headers["x-request-id"] == "bug-1"


# ---------------------------------------------------------------- auth


def test_auth() -> None:
    """With keys set, every route but /health (and /metrics) needs a matching bearer key."""
    with serve(api_keys=("k1", "k2")) as c:
        r = c.post("/v1/embeddings", json={"input": "x"})
        assert_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        wrong = ("Bearer nope", "Basic k1", "k1k2", "Bearer", "Bearer k1k2", "Token k1",
                 b"Bearer \xc3\xa9")
        for header in wrong:
            r = c.post("/v1/embeddings", json={"input": "x"}, headers={"authorization": header})
            assert_error(r, 401, "invalid_api_key")
        # The key alone is taken as well (LlamaIndex's TEI reranker sends no scheme).
        for header in ("Bearer k1", "bearer k2", "Bearer  k1 ", "k1", " k2 "):
            r = c.post("/v1/embeddings", json={"input": "x"}, headers={"authorization": header})
            assert r.status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert_error(c.get("/v1/models"), 401)
        assert_error(c.get("/no/such/route"), 401)
    with serve(api_keys=("k1",), metrics_auth=True) as c:
        assert_error(c.get("/metrics"), 401)
        assert c.get("/metrics", headers={"authorization": "Bearer k1"}).status_code == 200


def test_cors_as_teis_any_origin_by_default_named_or_off() -> None:
    """Browser pages may call the server (TEI's CORS: any origin unless named): a preflight is
    answered before the key check (it carries none), answers and refusals carry the header;
    BGE_M3_CORS_ALLOW_ORIGINS names the origins, empty turns CORS off."""
    origin = {"origin": "https://app.example"}
    preflight = {**origin, "access-control-request-method": "POST",  # OpenAI's JS SDK's
                 "access-control-request-headers": "content-type, authorization, x-request-id,"
                                                   " x-stainless-os, x-stainless-retry-count"}
    with serve(api_keys=("k",)) as c:
        r = c.options("/v1/embeddings", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "x-stainless-os" in r.headers["access-control-allow-headers"].lower()
        r = c.post("/v1/embeddings", json={"input": "x"},
                   headers={**origin, "authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        r = c.post("/embed", json={"inputs": "x"}, headers=origin)  # refused: still readable
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
    with serve(cors_allow_origins=("https://app.example",)) as c:
        r = c.post("/v1/embeddings", json={"input": "x"}, headers=origin)
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.post("/v1/embeddings", json={"input": "x"}, headers={"origin": "https://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        # A preflight from another origin: refused in the error envelope (it was text/plain)
        r = c.options("/v1/embeddings", headers={**preflight, "origin": "https://evil.example"})
        error = assert_error(r, 400, "cors_refused", "origin")
        assert "BGE_M3_CORS_ALLOW_ORIGINS" in error["message"]
        assert "access-control-allow-origin" not in r.headers
        r = c.options("/v1/embeddings", headers={**preflight, "access-control-request-method":
                                                 "DELETE"})
        assert assert_error(r, 400, "cors_refused")["param"] is None
    with serve(cors_allow_origins=()) as c:
        assert c.options("/v1/embeddings", headers=preflight).status_code == 405
        r = c.post("/v1/embeddings", json={"input": "x"}, headers=origin)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_no_auth_by_default(client: TestClient) -> None:
    """Without configured keys no header is needed and any header is ignored."""
    r = client.get("/v1/models", headers={"authorization": "Bearer whatever"})
    assert r.status_code == 200


def test_unauthenticated_huge_body_is_401_unread() -> None:
    """Auth is checked before the body limit: a stranger's 40 MiB upload gets a 401."""
    with serve(api_keys=("k",)) as c:
        r = c.post("/v1/embeddings", content=b"x" * 40 * 2**20, headers=JSON)
        assert_error(r, 401)


# ---------------------------------------------------------------- request ids


def test_request_id_echoed_and_passed(client: TestClient) -> None:
    """A good X-Request-ID is echoed and handed to the service."""
    r = client.post("/v1/embeddings", json={"input": "x"}, headers={"X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert client.fake.calls[-1].request_id == "abc-123"  # type: ignore[attr-defined]


def test_request_id_generated(client: TestClient) -> None:
    """Without one, a uuid4 hex is generated, on success and on every kind of error."""
    for r in (client.get("/health"), client.get("/nope"),
              client.post("/v1/embeddings", content=b"{", headers=JSON)):
        rid = r.headers["x-request-id"]
        assert len(rid) == 32 and int(rid, 16) >= 0


@pytest.mark.parametrize("raw", [b"x" * 129, b"", b"  ", b"a\x01b", "é".encode("latin-1")])
def test_request_id_sanitized(raw: bytes) -> None:
    """Over-long, empty or non-printable ids are replaced."""
    rid = sanitize_request_id(raw)
    assert len(rid) == 32 and rid != raw.decode("latin-1")


def test_request_id_on_middleware_errors() -> None:
    """401 and 413 refusals from middleware still echo the request id."""
    with serve(api_keys=("k",), max_body_bytes=1024) as c:
        r = c.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "r401"})
        assert r.headers["x-request-id"] == "r401"
        r = c.post("/v1/embeddings", content=b"x" * 2000,
                   headers={**JSON, "x-request-id": "r413", "authorization": "Bearer k"})
        assert r.status_code == 413 and r.headers["x-request-id"] == "r413"


def test_request_id_filter() -> None:
    """RequestIdFilter stamps records with the current request's id."""
    record = logging.LogRecord("t", logging.INFO, "f", 1, "m", None, None)
    token = request_id_var.set("ctx-id")
    try:
        assert RequestIdFilter().filter(record)
        assert record.request_id == "ctx-id"  # type: ignore[attr-defined]
    finally:
        request_id_var.reset(token)


def test_access_log_carries_request_id(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """One access-log line per request, with the request id on the record."""
    with caplog.at_level(logging.INFO, logger="bgeserve.http"):
        client.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "log-1"})
    lines = [r for r in caplog.records if getattr(r, "request_id", None) == "log-1"]
    assert any("POST /v1/embeddings 200" in r.getMessage() for r in lines)


def test_a_refused_request_logs_one_line_naming_its_error(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A 4xx is one access-log line at info carrying the error's code and parameter (a flood
    of refusals logs a line per request, not two); the error's own line is debug."""
    with caplog.at_level(logging.INFO, logger="bgeserve.http"):
        r = client.post("/v1/embeddings", json={"input": 5}, headers={"x-request-id": "log-2"})
    assert r.status_code == 400
    lines = [r for r in caplog.records if getattr(r, "request_id", None) == "log-2"]
    assert len(lines) == 1, [x.getMessage() for x in lines]
    line = lines[0]
    assert line.getMessage().startswith("POST /v1/embeddings 400 ")
    assert (line.error, line.param) == ("invalid_input", "input")  # type: ignore[attr-defined]
    assert line.getMessage().endswith(" invalid_input (input)")


def test_a_long_path_is_cut_in_the_access_line(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A request target may be 64 KiB and the access line holds the path twice: one client,
    without a key, wrote 120 KB lines (QA), which log shippers split at 16 KiB. The line keeps
    the path's first ``MAX_LOGGED_PATH`` characters and says how many were cut."""
    from bgeserve.http.context import MAX_LOGGED_PATH

    path = "/" + "a" * 20_000
    with caplog.at_level(logging.INFO, logger="bgeserve.http"):
        r = client.get(path, headers={"x-request-id": "log-long"})
    assert r.status_code == 404
    lines = [r for r in caplog.records if getattr(r, "request_id", None) == "log-long"]
    assert len(lines) == 1
    line = lines[0]
    cut = f"{path[:MAX_LOGGED_PATH]}...(+{len(path) - MAX_LOGGED_PATH} chars)"
    assert line.path == cut  # type: ignore[attr-defined]
    assert line.getMessage().startswith(f"GET {cut} 404")
    assert len(line.getMessage()) < 2 * MAX_LOGGED_PATH


def test_the_access_lines_client_is_cut_too() -> None:
    """Behind a proxy uvicorn trusts, the client is the X-Forwarded-For it passed on, which
    a client may have written: 100 KB of it was logged whole (QA)."""
    from bgeserve.http.context import _client

    assert _client({"client": ("203.0.113.7", 5)}) == "203.0.113.7"
    assert _client({"client": ("A" * 100_000, 5)}) == "A" * 64 + "...(+99936 chars)"
    assert _client({}) is None


# ---------------------------------------------------------------- health, metrics, lifespan


@pytest.mark.parametrize(
    ("state", "status"),
    [("ok", 200), ("warn", 200), ("idle", 200), ("loading", 503), ("fail", 503)],
)
def test_health(state: str, status: int) -> None:
    """ok/warn/idle are 200, loading/fail are 503; the body is the service's report."""
    with serve(FakeService(status=state)) as c:
        r = c.get("/health")
        assert r.status_code == status and r.json()["status"] == state
        assert r.json()["workers"] == {"live": 1, "loaded": 1, "total": 1}


def test_metrics(client: TestClient) -> None:
    """/metrics passes the service's exposition and content type through."""
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert b"bgeserve_fake_calls_total" in r.content


def test_lifespan_starts_and_stops_service() -> None:
    """The lifespan starts the service before serving and stops it at shutdown."""
    fake = FakeService()
    with serve(fake) as c:
        assert fake.started and not fake.stopped
        c.get("/health")
    assert fake.stopped


def test_model_ids_deduplicated() -> None:
    """Aliases repeating a built-in name are listed once."""
    assert model_ids("bge-m3", Settings(model_aliases=("bge-m3", "m3"))) == (
        "bge-m3", "BAAI/bge-m3", "m3"
    )


def test_create_app_without_factory_is_lazy() -> None:
    """Without a factory the app builds without importing the service (until the lifespan)."""
    app = create_app(Settings())
    assert {r.path for r in app.routes} >= {"/v1/embeddings", "/health"}


def test_http_imports_only_leaves_and_service() -> None:
    """bgeserve.http depends on config, errors, results (and service, lazily) — nothing deeper."""
    allowed = {"bgeserve.config", "bgeserve.errors", "bgeserve.results", "bgeserve.service",
               "bgeserve.logs", "bgeserve.vocab", "bgeserve.holds", "bgeserve.timings",
               "bgeserve.malloc"}
    package = Path(__file__).resolve().parent.parent / "bgeserve" / "http"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.startswith("bgeserve") and \
                    not node.module.startswith("bgeserve.http"):
                assert node.module in allowed, (path.name, node.module)
            assert not (isinstance(node, ast.ImportFrom) and node.level > 1), path.name


def test_a_trailing_slash_is_an_unknown_route_not_a_redirect(client: TestClient) -> None:
    """No 307 to a URL built from the Host header (plain http behind a TLS proxy)."""
    for method, path in (("post", "/v1/embeddings/"), ("get", "/health/"), ("get", "/v1/models/"),
                         ("get", "/models/")):
        r = getattr(client, method)(path, follow_redirects=False)
        assert_error(r, 404, "not_found")


def test_a_stalled_body_is_408_after_the_idle_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that declares more body than it sends gets 408, not a connection held open."""
    monkeypatch.setattr(guards, "BODY_IDLE_TIMEOUT_S", 0.2)
    settings = Settings()
    fake = FakeService(settings=settings)
    app = create_app(settings, lambda _: fake)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"100")]
    sent: list[dict] = []
    calls = 0

    async def receive() -> dict:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": b'{"input": ', "more_body": True}
        await anyio.sleep(60)  # the rest never comes
        raise AssertionError("not reached")

    async def send(message: dict) -> None:
        sent.append(message)

    async def main() -> None:
        with anyio.fail_after(10):
            await app(_scope(headers, fake, settings), receive, send)

    anyio.run(main)
    assert next(m["status"] for m in sent if m["type"] == "http.response.start") == 408
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert orjson.loads(body)["error"]["code"] == "request_timeout"
    assert fake.calls == []


def test_a_trickled_body_is_408_once_it_falls_behind_the_minimum_rate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client sending a byte now and then never trips the idle timeout, yet held its
    declared share of the bodies-in-progress allowance (two such held 2 MiB: every other
    request 429) for as long as it liked: past the grace, a body falling behind the minimum
    rate is a 408 saying so. One that keeps up is read to its end."""
    monkeypatch.setattr(guards, "BODY_GRACE_S", 0.3)
    monkeypatch.setattr(guards, "BODY_MIN_RATE", 100)
    monkeypatch.setattr(guards, "BODY_IDLE_TIMEOUT_S", 0.5)  # also what a fast start banks
    settings = Settings()
    fake = FakeService(settings=settings)
    app = create_app(settings, lambda _: fake)

    def run(gap: float, pieces: list[bytes]) -> tuple[int, dict, float]:
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(sum(map(len, pieces))).encode())]
        sent: list[dict] = []
        left = list(pieces)

        async def receive() -> dict:
            await anyio.sleep(gap)
            piece = left.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(left)}

        async def send(message: dict) -> None:
            sent.append({**message, "at": time.monotonic()})

        async def main() -> None:
            with anyio.fail_after(10):
                await app(_scope(headers, fake, settings), receive, send)

        began = time.monotonic()
        anyio.run(main)
        start = next(m for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        # when the answer went out (the lingering close then reads what is left, up to 5 s)
        return start["status"], orjson.loads(body), start["at"] - began

    body = b'{"input": "' + b"x" * 40 + b'"}'
    # a byte every 0.1 s (10 bytes/s, never idle): cut off at ~0.3 s + 3 bytes / 100
    status, answer, took = run(0.1, [bytes([b]) for b in body])
    assert status == 408 and "slower than 100 bytes a second" in answer["error"]["message"]
    assert took < 2 and fake.calls == []
    # 20 bytes every 0.1 s (200 bytes/s): the deadline keeps ahead of it
    status, _, _ = run(0.1, [body[i:i + 20] for i in range(0, len(body), 20)])
    assert status == 200 and len(fake.calls) == 1
    # All but 4 bytes at once, then a byte every 0.2 s: on average since the start it had
    # banked 4 s and was read to its end (the QA's 32 MiB less 10 bytes banked 34 minutes:
    # a byte a minute held a small container's whole allowance); now the bank is capped at
    # the idle timeout (0.5 s here), and it is cut off at ~0.7 s
    long = b'{"input": "' + b"x" * 400 + b'"}'
    status, answer, took = run(0.2, [long[:-4], *(bytes([b]) for b in long[-4:])])
    assert status == 408 and "counting for 0.5s at most" in answer["error"]["message"], answer
    assert took < 2 and len(fake.calls) == 1
    # 50 bytes every 0.25 s (200 bytes/s, twice the rate, in spaced pieces): read to its end
    # (review: windows that credited a piece to the window before cut such a client off)
    status, _, _ = run(0.25, [long[i:i + 50] for i in range(0, len(long), 50)])
    assert status == 200 and len(fake.calls) == 2


def test_a_body_still_arriving_at_the_stops_deadline_is_503() -> None:
    """At SIGTERM a request still sending its body is not in the service, whose 503 at
    BGE_M3_SHUTDOWN_TIMEOUT_SECS never reached it: uvicorn's grace then cancelled it, a
    plain-text 500. The stop's deadline (``app.state.uploads``) answers it 503 in the
    envelope; a request arriving after it too, before reading a byte."""
    settings = Settings()
    fake = FakeService(settings=settings)
    app = create_app(settings, lambda _: fake)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"100")]

    def post(stalls: bool) -> tuple[list[dict], Any]:
        sent: list[dict] = []
        calls = 0

        async def receive() -> dict:
            nonlocal calls
            calls += 1
            if calls == 1 and stalls:
                return {"type": "http.request", "body": b'{"input": ', "more_body": True}
            await anyio.sleep(30)  # the rest comes too late
            raise AssertionError("not reached")

        async def send(message: dict) -> None:
            sent.append(message)

        async def call() -> None:
            await app(_scope(headers, fake, settings), receive, send)

        return sent, call

    sent, call = post(stalls=True)

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(call)
                app.state.uploads.abort_after(0.2)

    anyio.run(main)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert start["status"] == 503 and orjson.loads(body)["error"]["code"] == "not_ready"
    assert any(k == b"x-request-id" for k, _ in start["headers"]) and fake.calls == []
    later, call = post(stalls=False)
    anyio.run(call)
    assert next(m["status"] for m in later if m["type"] == "http.response.start") == 503


def test_an_abort_reaches_every_wait_even_one_expiring_in_the_same_pass() -> None:
    """A wait whose own deadline fires in the loop pass of the stop's cannot be rescheduled
    (asyncio raises): the abort must still end every other wait at once, not at its own
    deadline (then uvicorn's grace cancelled them: plain-text 500s)."""
    import asyncio

    from bgeserve.http.guards import Uploads

    async def main() -> tuple[list[str], float]:
        uploads = Uploads()
        results: list[str] = []

        async def waiter(seconds: float) -> None:
            try:
                async with uploads.waiting(seconds):
                    await asyncio.sleep(30)
            except NotReady:
                results.append("503")
            except TimeoutError:
                results.append("timeout")

        tasks = [asyncio.create_task(waiter(0.1))]
        await asyncio.sleep(0)
        asyncio.get_running_loop().call_later(0.1, uploads.abort)
        tasks += [asyncio.create_task(waiter(20)) for _ in range(5)]
        await asyncio.sleep(0)
        began = time.monotonic()
        time.sleep(0.3)  # noqa: ASYNC251 - the loop held: both come due in one pass
        await asyncio.gather(*tasks)
        return results, time.monotonic() - began

    results, took = asyncio.run(main())
    assert results == ["503"] * 6 and took < 5


def test_bodies_in_progress_past_the_allowance_are_429_at_once() -> None:
    """InflightLimit: while one request holds its body, a second that would pass the
    allowance is refused before its body is read; a lone request of any size goes in; the
    allowance comes back when a response is done; chunked bodies count as they arrive."""
    from bgeserve.errors import BgeServeError
    from bgeserve.http.errors import error_response

    release: list[anyio.Event] = []
    entered: list[str] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        try:  # as the real handler: a refusal raised by receive becomes its response
            while (await receive()).get("more_body"):
                pass
        except BgeServeError as exc:
            await error_response(exc)(scope, receive, send)
            return
        entered.append(scope["path"])
        if scope["path"] == "/hold":
            await release[0].wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = guards.InflightLimit(app, allowance=guards.BodyAllowance(150))

    def scope(path: str, length: int | None) -> dict:
        headers = [] if length is None else [(b"content-length", str(length).encode())]
        return {**_scope(headers, FakeService(), Settings()), "path": path}

    async def call(path: str, length: int | None, chunks: list[bytes]) -> int:
        sent: list[dict] = []
        parts = iter(chunks)

        async def receive() -> dict:
            chunk = next(parts, None)
            return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

        async def send(message: dict) -> None:
            sent.append(message)

        await guard(scope(path, length), receive, send)
        return next(m["status"] for m in sent if m["type"] == "http.response.start")

    async def main() -> list[int]:
        release.append(anyio.Event())
        statuses: list[int] = []
        with anyio.fail_after(10):
            return await steps(statuses)

    async def steps(statuses: list[int]) -> list[int]:
        async with anyio.create_task_group() as tg:
            async def hold() -> None:
                statuses.append(await call("/hold", 1000, [b"x" * 1000]))  # alone: let in

            tg.start_soon(hold)
            while guard.allowance.held == 0:
                await anyio.sleep(0.001)
            statuses.append(await call("/small", 10, [b"x" * 10]))  # 1010 > 150: refused
            statuses.append(await call("/chunked", None, [b"x" * 10]))  # streamed: refused
            release[0].set()
        statuses.append(await call("/after", 100, [b"x" * 100]))
        return statuses

    statuses = anyio.run(main)
    assert statuses == [429, 429, 200, 200], statuses
    assert entered == ["/hold", "/after"]
    assert guard.allowance.held == 0
    # /metrics reads both: the bytes held and the refusals (in bgeserve_rejected_requests)
    assert guard.allowance.refused == 2
    from bgeserve.service.metrics import Metrics

    metrics = Metrics()
    metrics.watch_bodies(guard.allowance)
    guard.allowance.held = 123
    assert b"bgeserve_inflight_body_bytes 123.0" in metrics.render()[0]
    assert b"bgeserve_inflight_body_waiting_requests 0.0" in metrics.render()[0]


class _Uploads:
    """InflightLimit behind the real LingeringClose (as app.py stacks them) over an app that
    reads its body and, for ``/hold``, answers only once ``held`` is set (for ``/charge/N``,
    charges N bytes more, as a handler does for what decoding its body adds); each upload's
    body comes in the chunks given, ``WAIT`` waiting for ``gate`` (a lingering close then
    reads it after a refusal). ``wait_s``: how long a body over half the allowance waits for
    room (0: refused at once, as any other)."""

    WAIT = b"<wait>"

    def __init__(self, allowance: int, wait_s: float = 0) -> None:
        from bgeserve.http.linger import LingeringClose

        self.gate, self.held = anyio.Event(), anyio.Event()
        self.guard = guards.InflightLimit(
            self._app, allowance=guards.BodyAllowance(allowance, wait_s=wait_s))
        self.stack = LingeringClose(self.guard, max_bytes=1 << 20, max_seconds=5)

    async def _app(self, scope: dict, receive: Any, send: Any) -> None:
        from bgeserve.errors import BgeServeError
        from bgeserve.http.errors import error_response

        try:
            while (await receive()).get("more_body"):
                pass
            if scope["path"].startswith("/charge/"):
                scope["state"][CHARGE_BODY](int(scope["path"].rpartition("/")[2]))
        except BgeServeError as exc:
            await error_response(exc)(scope, receive, send)
            return
        if scope["path"] == "/hold":
            await self.held.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def post(self, path: str, chunks: list[bytes], length: int | None = None) -> int:
        """The status answered (``length``: the Content-Length, by default the chunks')."""
        sent: list[dict] = []
        parts = iter(chunks)
        if length is None:
            length = sum(len(c) for c in chunks if c != self.WAIT)

        async def receive() -> dict:
            await anyio.lowlevel.checkpoint()
            chunk = next(parts, None)
            if chunk == self.WAIT:
                await self.gate.wait()
                chunk = next(parts, None)
            return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

        async def send(message: dict) -> None:
            sent.append(message)

        headers = [(b"content-length", str(length).encode())]
        await self.stack({**_scope(headers, FakeService(), Settings()), "path": path,
                          "method": "POST"}, receive, send)
        return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_a_body_that_has_not_arrived_holds_no_allowance() -> None:
    """Bodies count by the bytes that arrived, not by their Content-Length: connections that
    declared 32 MiB and sent a byte held the whole allowance, every other POST a 429 (QA: 16
    connections; one where the allowance is its 32 MiB floor). A declared size that would
    pass what the others hold is still refused before its body is read, and bodies let in
    together are refused once their bytes pass the allowance."""
    uploads = _Uploads(150)

    async def main() -> list[int]:
        statuses: list[int] = []
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(4):  # declared 100 each (400 > 150), one byte sent
                    tg.start_soon(uploads.post, "/stalled", [b"x", uploads.WAIT], 100)
                while uploads.guard.allowance.held < 4:
                    await anyio.sleep(0.001)
                statuses.append(await uploads.post("/x", [b"x" * 100]))  # 104 <= 150: served
                statuses.append(await uploads.post("/x", [b"x" * 200]))  # 204 > 150: at once
                uploads.gate.set()
            async with anyio.create_task_group() as tg:  # let in together, 80 + 80 > 150
                async def one() -> None:
                    statuses.append(await uploads.post("/x", [b"x" * 40, b"x" * 40]))
                tg.start_soon(one)
                tg.start_soon(one)
        return statuses

    statuses = anyio.run(main)
    assert statuses[:2] == [200, 429], statuses
    assert sorted(statuses[2:]) == [200, 429], statuses
    assert uploads.guard.allowance.held == 0


def test_a_refused_uploads_bytes_are_given_back_before_its_lingering_close() -> None:
    """Three uploads together past the allowance: the one refused gives its bytes back at
    once. Held through the lingering close that reads the rest of its body, they refused the
    third upload too (review: every upload let in together was a 429)."""
    uploads = _Uploads(150)
    x = b"x" * 20

    async def main() -> dict[str, int]:
        got: dict[str, int] = {}

        async def one(name: str, chunks: list[bytes]) -> None:
            got[name] = await uploads.post(f"/{name}", chunks)
            if name == "c":
                uploads.gate.set()  # only now may b's lingering close end

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "a", [x, x, x])
                tg.start_soon(one, "b", [x, x, x, uploads.WAIT, x])
                tg.start_soon(one, "c", [x, x, x])
        return got

    assert anyio.run(main) == {"a": 200, "b": 429, "c": 200}
    assert uploads.guard.allowance.held == 0 and not uploads.guard.allowance.arriving


def test_the_oldest_body_still_arriving_is_never_cut_off() -> None:
    """A large upload let in alone finishes although small requests let in after it hold
    bytes when its last ones come (review: counted as they arrive, the upload near its end
    was the 429, and steady small traffic could keep a maximum-size body from ever
    finishing); held passes the allowance by at most that body."""
    uploads = _Uploads(160)

    async def main() -> dict[str, int]:
        got: dict[str, int] = {}

        async def one(name: str, path: str, chunks: list[bytes]) -> None:
            got[name] = await uploads.post(path, chunks)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "big", "/big", [b"x" * 100, uploads.WAIT, b"x" * 60])
                while uploads.guard.allowance.held < 100:
                    await anyio.sleep(0.001)
                tg.start_soon(one, "small", "/hold", [b"x" * 10])  # 110 <= 160: let in
                while uploads.guard.allowance.held < 110:
                    await anyio.sleep(0.001)
                uploads.gate.set()  # big's last 60: 170 > 160, but it is the oldest
                while "big" not in got:
                    await anyio.sleep(0.001)
                uploads.held.set()
        return got

    assert anyio.run(main) == {"big": 200, "small": 200}
    assert uploads.guard.allowance.held == 0


class _Line:
    """InflightLimit over an app that reads its body, then answers ``/hold/<name>`` only once
    ``event(name)`` is set; each entry recorded in ``entered``, each status in ``got``."""

    def __init__(self, allowance: int, wait_s: float) -> None:
        self.events: dict[str, anyio.Event] = {}
        self.entered: list[str] = []
        self.got: dict[str, int] = {}
        self.sent: dict[str, list[dict]] = {}  # the messages of each answer
        self.bodies = guards.BodyAllowance(allowance, wait_s=wait_s)
        self.uploads = guards.Uploads()
        self.guard = guards.InflightLimit(self._app, allowance=self.bodies,
                                          uploads=self.uploads)

    def event(self, name: str) -> anyio.Event:
        return self.events.setdefault(name, anyio.Event())

    async def _app(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["path"].startswith("/fail/"):  # ends before it reads its body
            raise RuntimeError("a handler's fault")
        while (await receive()).get("more_body"):
            pass
        name = scope["path"].rpartition("/")[2]
        self.entered.append(name)
        if scope["path"].startswith("/hold/"):
            await self.event(name).wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def post(self, path: str, size: int, parts: tuple[int | str, ...] = ()) -> None:
        try:
            await self._post(path, size, parts)
        except RuntimeError:
            self.got[path.rpartition("/")[2]] = 500

    async def _post(self, path: str, size: int, parts: tuple[int | str, ...] = ()) -> None:
        """A body of ``size`` bytes (its Content-Length), sent as ``parts``: byte counts, and
        names of events to wait for before the next (default: one part)."""
        sent: list[dict] = []
        chunks = iter(parts or (size,))

        async def receive() -> dict:
            chunk = next(chunks, None)
            while isinstance(chunk, str):
                await self.event(chunk).wait()
                chunk = next(chunks, None)
            more = chunk is not None
            return {"type": "http.request", "body": b"x" * (chunk or 0), "more_body": more}

        async def send(message: dict) -> None:
            sent.append(message)

        headers = [(b"content-length", str(size).encode())]
        await self.guard({**_scope(headers, FakeService(), Settings()), "path": path},
                         receive, send)
        name = path.rpartition("/")[2]
        self.got[name] = next(m["status"] for m in sent if m["type"] == "http.response.start")
        self.sent[name] = sent

    async def until(self, check: Callable[[], bool]) -> None:
        while not check():
            await anyio.sleep(0.001)


def test_a_large_body_waits_for_room_in_turn_while_small_requests_come_and_go() -> None:
    """A body over half the allowance waits for room instead of a 429, and is let in the
    moment what the others give back leaves room for it: retrying at each Retry-After, a 30
    MiB upload under a 32 MiB allowance never got in within 300 s while small requests came
    one after another (QA). Small requests that fit still go in meanwhile (nothing is kept
    for it: that refused every POST while a slow upload held part of the room, review), and
    large bodies go in the order they came: one that would fit waits behind one that came
    first (three clients looping on 28 MiB starved a 20 MiB one, review)."""
    from bgeserve.service.metrics import Metrics

    line = _Line(150, wait_s=5)

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(line.post, "/hold/a", 40)
                tg.start_soon(line.post, "/hold/b", 40)
                await line.until(lambda: line.bodies.held == 80)
                tg.start_soon(line.post, "/hold/first", 100)  # 180 > 150: waits
                await line.until(line.bodies.in_line)
                tg.start_soon(line.post, "/hold/c", 30)  # small, 110 <= 150: let in
                await line.until(lambda: line.bodies.held == 110)
                tg.start_soon(line.post, "/hold/second", 80)  # 190 > 150, behind first
                await anyio.sleep(0.05)
                metrics = Metrics()
                metrics.watch_bodies(line.bodies)
                assert b"bgeserve_inflight_body_waiting_requests 2.0" in metrics.render()[0]
                line.event("a").set()  # 70: 170 > 150, still no room for first
                await line.until(lambda: "a" in line.got)
                await anyio.sleep(0.05)
                assert line.entered == ["a", "b", "c"] and not line.got.keys() - {"a"}
                line.event("c").set()  # 40 (+ 80 would fit second, but first came first)
                await line.until(lambda: "first" in line.entered)
                await line.until(lambda: line.bodies.held == 140)
                await anyio.sleep(0.05)
                assert "second" not in line.entered
                for name in ("b", "first", "second"):
                    line.event(name).set()

    anyio.run(main)
    assert line.entered == ["a", "b", "c", "first", "second"]
    assert line.got == dict.fromkeys(["a", "b", "c", "first", "second"], 200)
    assert line.bodies.held == 0 and line.bodies.refused == 0 and not line.bodies.in_line()


def test_a_large_body_let_in_from_the_line_finishes_its_upload() -> None:
    """One let in from the line when it fitted is not cut off by the small bodies let in
    while its bytes arrive (they did not count them), though an older upload is still
    arriving: refused, it lost its turn near its end (429s after part of 30 MiB, QA)."""
    line = _Line(150, wait_s=5)

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(line.post, "/x/old", 20, (10, "old", 10))  # oldest arriving
                tg.start_soon(line.post, "/hold/a", 60)
                await line.until(lambda: line.bodies.held == 70)
                tg.start_soon(line.post, "/hold/large", 100, (50, "large-rest", 50))
                await line.until(line.bodies.in_line)
                line.event("a").set()  # 10: room for it
                await line.until(lambda: line.bodies.held == 60)  # its first 50
                tg.start_soon(line.post, "/hold/small", 70)  # 130 <= 150: let in
                await line.until(lambda: line.bodies.held == 130)
                line.event("large-rest").set()  # 180 > 150, and /x/old is older
                await line.until(lambda: "large" in line.entered)
                for name in ("old", "small", "large"):
                    line.event(name).set()

    anyio.run(main)
    assert line.got == {"a": 200, "old": 200, "small": 200, "large": 200}
    assert line.bodies.held == 0 and line.bodies.entering is None


def test_one_large_body_arrives_at_a_time() -> None:
    """A large body let in (no line, room for it) is the one arriving: another large one
    waits in line although the bytes that arrived leave room for it (not counted yet, they
    would not: two were let in and one cut off part way, review), and goes in once there is
    room; one whose request ends before it reads its body lets the next one in at once."""
    line = _Line(150, wait_s=5)

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(line.post, "/hold/first", 100, (50, "first-rest", 50))
                await line.until(lambda: line.bodies.held == 50)
                tg.start_soon(line.post, "/x/second", 80)  # 50 + 80 <= 150, but first...
                await line.until(line.bodies.in_line)
                await anyio.sleep(0.05)
                assert line.entered == [] and line.bodies.waiting_count() == 1
                line.event("first-rest").set()
                await line.until(lambda: line.entered == ["first"])
                await anyio.sleep(0.05)
                assert line.bodies.waiting_count() == 1  # 100 + 80 > 150
                line.event("first").set()
                await line.until(lambda: "second" in line.got)
                tg.start_soon(line.post, "/fail/third", 100)  # ends before reading
                await line.until(lambda: "third" in line.got)
                began = time.monotonic()
                await line.post("/x/fourth", 90)
                assert time.monotonic() - began < 1

    anyio.run(main)
    assert line.got == {"first": 200, "second": 200, "third": 500, "fourth": 200}
    assert line.entered == ["first", "second", "fourth"]
    assert line.bodies.held == 0 and not line.bodies.in_line()


def test_a_large_body_that_finds_no_room_in_its_wait_is_refused() -> None:
    """The wait is bounded: a 429 with Retry-After that says it waited, counted among the
    refusals; one whose request ends while it waits (its task cancelled) leaves the line,
    and the one behind it goes in as soon as there is room, not after it; a stop ends it."""
    line = _Line(150, wait_s=0.3)

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(line.post, "/hold/a", 100)
                await line.until(lambda: line.bodies.held == 100)
                began = time.monotonic()
                await line.post("/x/late", 100)
                assert 0.25 < time.monotonic() - began < 2
                line.bodies.wait_s = 5
                async with anyio.create_task_group() as gone:
                    gone.start_soon(line.post, "/x/gone", 100)
                    await line.until(line.bodies.in_line)
                    gone.cancel_scope.cancel()
                tg.start_soon(line.post, "/x/next", 100)
                await anyio.sleep(0.05)
                line.event("a").set()
                await line.until(lambda: "next" in line.got)

    anyio.run(main)
    assert line.got == {"late": 429, "a": 200, "next": 200}
    assert line.bodies.refused == 1 and line.bodies.held == 0 and not line.bodies.in_line()
    late = line.sent["late"]
    start = next(m for m in late if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in late if m["type"] == "http.response.body")
    assert (b"retry-after", b"1") in start["headers"]
    assert "this one (0.0 MiB, which waited 0.3s for room)" in orjson.loads(body)["error"][
        "message"], body
    # A stop's deadline ends a wait as it ends those for body bytes: a 503 that says why
    # (past uvicorn's grace, a bare 500).
    line = _Line(150, wait_s=5)

    async def stop() -> None:
        with anyio.fail_after(3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(line.post, "/hold/a", 100)
                await line.until(lambda: line.bodies.held == 100)
                tg.start_soon(line.post, "/x/stopped", 100)
                await line.until(line.bodies.in_line)
                line.uploads.abort()
                await line.until(lambda: "stopped" in line.got)
                line.event("a").set()

    anyio.run(stop)
    assert line.got == {"stopped": 503, "a": 200} and not line.bodies.in_line()
    assert b"shutting down" in b"".join(m.get("body", b"") for m in line.sent["stopped"])


async def _beside_a_holder(uploads: _Uploads, held: int,
                           posts: list[tuple[str, int]]) -> list[int]:
    """The statuses of ``posts`` (path, body bytes), one after another, while a request to
    /hold holds ``held`` bytes of the allowance; then the holder is let go."""
    statuses: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(uploads.post, "/hold", [b"x" * held])
        while uploads.guard.allowance.held < held:
            await anyio.sleep(0.001)
        for path, size in posts:
            statuses.append(await uploads.post(path, [b"x" * size]))
        uploads.held.set()
    return statuses


def test_what_decoding_a_body_adds_is_charged_to_the_allowance() -> None:
    """A handler charges what decoding its body adds (jsoncost.py): a 429 while other bodies
    hold the room, a 413 where even alone it could never fit, and given back with the body."""
    uploads = _Uploads(150)

    async def main() -> list[int]:
        with anyio.fail_after(10):
            # 170 > 150, then 140: served
            statuses = await _beside_a_holder(uploads, 100, [("/charge/60", 10),
                                                             ("/charge/30", 10)])
            statuses.append(await uploads.post("/charge/141", [b"x" * 10]))  # 151 alone: never
            statuses.append(await uploads.post("/charge/140", [b"x" * 10]))  # 150 alone: fits
        return statuses

    assert anyio.run(main) == [429, 200, 413, 200]
    assert uploads.guard.allowance.held == 0
    assert uploads.guard.allowance.refused == 1  # the 429s (bgeserve_rejected_requests_total)

    # A large body that took its turn is not refused after its whole upload for the little
    # that decoding it adds while small requests hold the rest (review); what could never
    # fit is still a 413.
    uploads = _Uploads(150, wait_s=5)

    async def large() -> list[int]:
        with anyio.fail_after(10):  # 160 > 150, then 160 alone
            return await _beside_a_holder(uploads, 40, [("/charge/20", 100),
                                                        ("/charge/60", 100)])

    assert anyio.run(large) == [200, 413]
    assert uploads.guard.allowance.held == 0 and uploads.guard.allowance.refused == 0


def test_a_body_of_many_small_values_is_refused_before_it_is_decoded() -> None:
    """30 MiB of ``[{},{},...]`` decoded to 690 MiB before any check of the batch could refuse
    it (QA: +900 MiB RSS; a few at once on the parsing threads take a container down). Its
    decoding is charged first: past the allowance it is a 413 that says why, without
    decoding; a body of ordinary texts as large is charged nothing and served."""
    decoded: list[int] = []
    real_loads = orjson.loads

    def loads(raw: Any) -> Any:
        decoded.append(len(raw))
        return real_loads(raw)

    texts = [("word, [x] {y}: \\ \"quoted\" " * 60)[:1500] for _ in range(1000)]
    with serve(max_body_bytes=2 << 20, max_inflight_mb=2) as c, \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(orjson, "loads", loads)
        junk = b'{"input":[' + b",".join([b"{}"] * 500_000) + b"]}"  # 1.4 MiB, ~36 MiB decoded
        error = assert_error(c.post("/v1/embeddings", content=junk, headers=JSON), 413,
                             "payload_too_large")
        assert "BGE_M3_MAX_INFLIGHT_MB" in error["message"]
        assert decoded == []  # refused before orjson saw it
        payloads: dict[str, dict[str, Any]] = {
            "/v1/embeddings": {"input": texts}, "/embed": {"inputs": texts},
            "/v1/rerank": {"query": "q", "documents": texts},
            "/v2/embed": {"texts": texts, "input_type": "search_query",
                          "embedding_types": ["float"]}}
        for route, payload in payloads.items():  # each in turn: nothing was left held
            raw = orjson.dumps(payload)
            assert 1 << 20 < len(raw) < 2 << 20
            r = c.post(route, content=raw, headers=JSON)
            assert r.status_code == 200, (route, r.text)
        assert c.post("/embed", content=junk.replace(b"input", b"inputs"),
                      headers=JSON).status_code == 413
    assert len(decoded) == 4


def test_what_a_request_holds_is_released_once_its_answer_is_sent() -> None:
    """InflightLimit's scope: a hold handed over inside the app (the room of a request's
    ColBERT output) is released after the response's last body message, not before."""
    from bgeserve.holds import release_when_answered

    events: list[str] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        assert release_when_answered(lambda: events.append("released"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        await send({"type": "http.response.body", "body": b"}"})

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        events.append(message["type"])

    scope = {**_scope([(b"content-length", b"2")], FakeService(), Settings()), "path": "/x"}
    anyio.run(guards.InflightLimit(app, allowance=guards.BodyAllowance(150)), scope, receive,
              send)
    assert events == ["http.response.start", "http.response.body", "http.response.body",
                      "released"]


def test_what_a_request_holds_waits_until_its_client_has_taken_the_answer() -> None:
    """Under bgeserve's protocol (stalls.py), an answer its client has not taken counts in
    the allowance of bodies, and the room of its ColBERT output stays held until it is taken
    (a burst of non-readers admitted together held 145 MiB of a 16 MiB allowance: QA). The
    protocol gives the connection's older holds back inside the call that takes a new one:
    ``held += hold(...)`` undid them (QA: the allowance stuck full, no connection open)."""
    from bgeserve.http.context import HOLD_UNTIL_TAKEN

    events: list[str] = []
    holds: list[tuple[Any, int]] = []  # the connection's holds not given back yet

    def hold(answer: int, give_back: Any) -> int:
        for older, n in holds:  # taken by now: given back in this call, as _settle does
            older(n)
        holds.clear()
        holds.append((give_back, answer))
        return answer

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        from bgeserve.holds import release_when_answered

        assert release_when_answered(lambda: events.append("released"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x" * 100})

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        pass

    allowance = guards.BodyAllowance(1 << 20)
    guard = guards.InflightLimit(app, allowance=allowance)
    for n in range(1, 4):
        scope = {**_scope([(b"content-length", b"2")], FakeService(), Settings()), "path": "/x"}
        scope["state"][HOLD_UNTIL_TAKEN] = hold
        anyio.run(guard, scope, receive, send)
        assert allowance.held == 100, (n, allowance.held)  # this answer's, the older back
        assert events == ["released"] * (n - 1)  # the room kept until the answer is taken
    give_back, n = holds.pop()
    give_back(60)
    assert allowance.held == 40 and events == ["released"] * 2  # part of it taken
    give_back(40)
    assert allowance.held == 0 and events == ["released"] * 3


@pytest.mark.parametrize("handler_cancelled", [False, True])
def test_abandoned_work_that_ends_in_an_error_is_not_logged_as_never_retrieved(
        handler_cancelled: bool) -> None:
    """A client gone (or the handler cancelled) while its job was being refused: the work
    ends in Overloaded, not cancelled (asyncio.wait_for raises the inner error it meets while
    cancelling). Nobody awaits it; asyncio logged "Task exception was never retrieved" with a
    traceback for each (8 in a 15-minute soak). The error is read, nothing is logged."""
    import asyncio
    import gc

    from bgeserve.http import handlers
    from bgeserve.http.errors import ClientGone

    class GoneRequest:
        async def receive(self) -> dict[str, str]:
            if handler_cancelled:
                await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

    async def refused_as_it_is_cancelled() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0)
            raise Overloaded("queue full", retry_after=1.0) from None

    async def main() -> list[dict[str, Any]]:
        unretrieved: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unretrieved.append(ctx))
        call = handlers.unless_disconnected(GoneRequest(), refused_as_it_is_cancelled())  # type: ignore[arg-type]
        if handler_cancelled:
            outer = asyncio.ensure_future(call)
            await asyncio.sleep(0.01)
            outer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await outer
        else:
            with pytest.raises(ClientGone):
                await call
        for _ in range(5):
            await asyncio.sleep(0.01)
        gc.collect()
        await asyncio.sleep(0)
        return unretrieved

    assert asyncio.run(main()) == []


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/embeddings:both", {"input": ["a b c", "d e", "", "f g h i"], "outputs":
                             ["dense", "sparse", "colbert"], "sparse_format": "tokens"}),
    ("/v1/embeddings:both", {"input": ["a b c", "d e", "f g h i"], "outputs": ["colbert"],
                             "encoding_format": "base64", "colbert_dtype": "float16"}),
    ("/v1/embeddings", {"input": ["a b c", "d e", "f"]}),
    ("/v1/sparse-embeddings", {"input": ["a b c", "", "f"], "sparse_empty": "omit"}),
    ("/embed", {"inputs": ["a b c", "d e", "f"]}),
    ("/embed_all", {"inputs": ["a b c", "d e", "f"]}),
    ("/embed_sparse", {"inputs": ["a b c", "", "d e f g"]}),
    ("/tokenize", {"inputs": ["héllo 混合 x", "", "a b c d"]}),
    ("/tokenize", {"inputs": ["", "a"], "add_special_tokens": False}),
])
def test_a_large_answer_is_streamed_as_the_same_bytes(monkeypatch: pytest.MonkeyPatch,
                                                       route: str, body: dict) -> None:
    """Past STREAM_BYTES an answer goes out as it is rendered (no Content-Length; a ColBERT
    answer rendered whole peaked at ~5x its vectors): the same bytes as the whole answer,
    however small its pieces."""
    from bgeserve.http import render

    with serve() as client:
        whole = client.post(route, json=body)
        assert whole.status_code == 200 and whole.headers["content-length"], whole.text
        orjson.loads(whole.content)  # one JSON document
        for piece in (1, 100, 1 << 30):
            monkeypatch.setattr(render, "PIECE_BYTES", piece)
            monkeypatch.setattr(render, "TOKENS_AT_ONCE", 2)
            monkeypatch.setattr(render, "STREAM_BYTES", -1)
            streamed = client.post(route, json=body)
            assert streamed.status_code == 200
            assert "content-length" not in streamed.headers
            assert streamed.headers["content-type"] == "application/json"
            assert streamed.content == whole.content
            monkeypatch.undo()


def test_only_a_large_answer_over_http_1_1_is_streamed() -> None:
    """Streamed answers are chunked (uvicorn frames one without a length so, whatever the
    client's version): an HTTP/1.0 client, which cannot read that, gets its answer whole."""
    from starlette.requests import Request

    from bgeserve.http import handlers, render

    def request(version: str) -> Request:
        return Request({"type": "http", "http_version": version, "method": "POST",
                        "headers": [], "path": "/"})

    big = render.STREAM_BYTES + 1
    assert handlers.streams(request("1.1"), big)
    assert not handlers.streams(request("1.1"), render.STREAM_BYTES)
    assert not handlers.streams(request("1.0"), big)
