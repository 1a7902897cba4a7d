"""TEI's routes in-process (``bgeserve/http/tei.py``) against ``FakeService``: request and
response shapes field by field against TEI's documented OpenAPI, and TEI's error shape and
statuses for every error on those paths, the framework's own included.

The reference is huggingface/text-embeddings-inference ``docs/openapi.json`` at commit
0d124dc9773be6ac5a9a57d8439aba9bbbf33273 (v1.9.3). Its schemas are transcribed below into
JSON Schema 2020-12 (OpenAPI 3.0's ``nullable: true`` becomes a ``"null"`` type; ``required``
and property types as documented), so every response is checked against what TEI promises.
Statuses follow TEI's code where its document and code differ (router/src/http/server.rs: a
batch over the limit is 422, not the documented 413).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jsonschema
import numpy as np
import pytest
from starlette.testclient import TestClient

from bgeserve.config import Settings
from bgeserve.errors import EngineFailed, ModelUnavailable, NotReady, Overloaded, TooLarge
from bgeserve.http.app import TEI_PATHS, create_app
from tests.fakes import FakeService, fake_tokens

# -- TEI docs/openapi.json @ 0d124dc, components.schemas (transcribed) ---------------------------
_FLOATS = {"type": "array", "items": {"type": "number"}}
_UINT = {"type": "integer", "minimum": 0}
_NULLABLE_UINT = {"type": ["integer", "null"], "minimum": 0}
TEI_SCHEMAS: dict[str, dict[str, Any]] = {
    "EmbedResponse": {"type": "array", "items": _FLOATS},
    "EmbedAllResponse": {"type": "array", "items": {"type": "array", "items": _FLOATS}},
    "EmbedSparseResponse": {"type": "array", "items": {"type": "array", "items": {
        "type": "object", "required": ["index", "value"],
        "properties": {"index": _UINT, "value": {"type": "number"}}}}},  # SparseValue
    "SimilarityResponse": {"type": "array", "items": {"type": "number"}},
    "TokenizeResponse": {"type": "array", "items": {"type": "array", "items": {  # SimpleToken
        "type": "object", "required": ["id", "text", "special"],
        "properties": {"id": _UINT, "special": {"type": "boolean"}, "start": _NULLABLE_UINT,
                       "stop": _NULLABLE_UINT, "text": {"type": "string"}}}}},
    "DecodeResponse": {"type": "array", "items": {"type": "string"}},
    "Info": {
        "type": "object",
        "required": ["model_id", "model_dtype", "served_model_name", "model_type",
                     "max_concurrent_requests", "max_input_length", "max_batch_tokens",
                     "max_client_batch_size", "auto_truncate", "tokenization_workers",
                     "version"],
        "properties": {
            "auto_truncate": {"type": "boolean"}, "docker_label": {"type": ["string", "null"]},
            "max_batch_requests": _NULLABLE_UINT, "max_batch_tokens": _UINT,
            "max_client_batch_size": _UINT, "max_concurrent_requests": _UINT,
            "max_input_length": _UINT, "model_dtype": {"type": "string"},
            "model_id": {"type": "string"}, "model_sha": {"type": ["string", "null"]},
            "model_type": {"oneOf": [  # ModelType: classifier | embedding | reranker
                {"type": "object", "required": ["classifier"]},
                {"type": "object", "required": ["embedding"], "properties": {"embedding": {
                    "type": "object", "required": ["pooling"],
                    "properties": {"pooling": {"type": "string"}}}}},
                {"type": "object", "required": ["reranker"]}]},
            "served_model_name": {"type": "string"}, "sha": {"type": ["string", "null"]},
            "tokenization_workers": _UINT, "version": {"type": "string"}}},
    "ErrorResponse": {
        "type": "object", "required": ["error", "error_type"],
        "properties": {"error": {"type": "string"}, "error_type": {
            "type": "string",
            "enum": ["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]}}},
}
# The statuses TEI documents per route (paths.*.responses), and the ones bgeserve adds for
# what TEI has no answer for (auth 401, 405, 415, 408, a loading or failed model 503, 504).
TEI_DOCUMENTED = {"/embed": {200, 400, 413, 422, 424, 429},
                  "/embed_sparse": {200, 400, 413, 422, 424, 429},
                  "/embed_all": {200, 400, 413, 422, 424, 429},
                  "/similarity": {200, 400, 413, 422, 424, 429},
                  "/tokenize": {200, 400, 413, 422}, "/decode": {200, 400, 413, 422},
                  "/info": {200}}
BGESERVE_EXTRA = {401, 405, 408, 415, 503, 504}


def check(schema: str, body: Any) -> None:
    jsonschema.validate(body, TEI_SCHEMAS[schema])


@contextmanager
def serve(service: FakeService | None = None, **settings: Any) -> Iterator[TestClient]:
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


def tei_error(r: Any, status: int, error_type: str) -> str:
    """The response is ``status`` with exactly TEI's error body; its message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-request-id"]
    body = r.json()
    check("ErrorResponse", body)
    assert set(body) == {"error", "error_type"}
    assert body["error_type"] == error_type
    assert body["error"] and "Traceback" not in body["error"]
    return body["error"]  # type: ignore[no-any-return]


# -- /embed -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/embed", "/", "/invocations"])
def test_embed_is_a_list_of_vectors_even_for_one_text(client: TestClient, path: str) -> None:
    """``inputs`` as one string or a list gives ``[[f32]]``, the service's vectors in order;
    ``POST /`` (huggingface_hub's ``InferenceClient(base_url)``) and ``/invocations`` (its
    SageMaker name) are ``/embed``."""
    for inputs in ("one text", ["a b", "c", "d e f"]):
        r = client.post(path, json={"inputs": inputs})
        assert r.status_code == 200, r.text
        body = r.json()
        check("EmbedResponse", body)
        texts = [inputs] if isinstance(inputs, str) else inputs
        want = np.stack([FakeService.expected_dense(t) for t in texts])
        np.testing.assert_array_equal(np.array(body, dtype=np.float32), want)


def test_embed_reads_tei_options(client: TestClient) -> None:
    """TEI's fields: ``truncate`` (null: BGE_M3_TRUNCATE), ``normalize: true``, ``dimensions``
    equal to the width, both truncation directions' spellings, unknown fields ignored
    (huggingface_hub sends a ``parameters`` object for some tasks)."""
    body = {"inputs": "x y", "truncate": None, "normalize": True, "dimensions": 1024,
            "truncation_direction": "Right", "prompt_name": None, "parameters": {}}
    assert client.post("/embed", json=body).status_code == 200
    assert client.fake.calls[-1].options.truncate is True  # type: ignore[attr-defined]
    assert client.post("/embed", json={"inputs": "x", "truncate": False}).status_code == 200
    assert client.fake.calls[-1].options.truncate is False  # type: ignore[attr-defined]
    # Haystack's TEI embedders send normalize=false by default: the normalised vectors
    r = client.post("/embed", json={"inputs": "x y", "normalize": False})
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(np.array(r.json(), dtype=np.float32),
                                  np.stack([FakeService.expected_dense("x y")]))
    for direction in ("right", "Left", "left"):
        r = client.post("/embed", json={"inputs": "x", "truncation_direction": direction})
        assert r.status_code == 200, r.text


def test_left_truncation_embeds_the_texts_last_tokens() -> None:
    """``truncation_direction: left`` embeds the ids the service cut from the left."""
    with serve(max_seq_length=4) as c:
        r = c.post("/embed", json={"inputs": "w1 w2 w3 w4 w5", "truncation_direction": "Left"})
        assert r.status_code == 200, r.text
        sent = c.fake.calls[-1].inputs  # type: ignore[attr-defined]
    assert sent == [[0, *fake_tokens("w4 w5"), 2]]
    np.testing.assert_array_equal(np.array(r.json()[0], np.float32),
                                  FakeService.expected_dense(sent[0]))


def test_a_direction_without_truncation_cuts_nothing() -> None:
    """Token ids are cut from the right only; without truncation nothing is cut, and
    ``truncation_direction: left`` beside ``truncate: false`` is no reason to refuse them
    (schemathesis: a schema-valid body refused)."""
    with serve(accept_token_ids=True) as c:
        r = c.post("/embed", json={"inputs": [5, 6], "truncate": False,
                                   "truncation_direction": "left"})
        assert r.status_code == 200, r.text
        assert c.fake.calls[-1].inputs == [[5, 6]]  # type: ignore[attr-defined]
        assert "left needs texts" in tei_error(c.post("/embed", json={
            "inputs": [5, 6], "truncate": True, "truncation_direction": "left"}), 422,
            "Validation")


@pytest.mark.parametrize(("body", "param"), [
    ({"inputs": "x", "prompt_name": "query"}, "prompt_name"),
    ({"inputs": "x", "dimensions": 0}, "dimensions"),
    ({"inputs": "x", "dimensions": 512}, "dimensions"),
    ({"inputs": "x", "truncation_direction": "up"}, "truncation_direction"),
    ({"inputs": "x", "truncation_direction": {}}, "truncation_direction"),
    ({"inputs": "x", "truncate": "yes"}, "truncate"),
    ({"inputs": 3}, "inputs"),
    ({"inputs": ["a", 1]}, "inputs[1]"),
    ({}, "inputs"),
])
def test_embed_validation_errors_are_tei_422(client: TestClient, body: dict, param: str) -> None:
    """What bge-m3 cannot do or a malformed field is TEI's 422 Validation naming the field;
    nothing is embedded."""
    assert param.split("[")[0] in tei_error(client.post("/embed", json=body), 422, "Validation")
    assert client.fake.calls == []  # type: ignore[attr-defined]


# -- /embed_sparse, /embed_all, /similarity ----------------------------------------------------------
def test_embed_sparse_is_index_value_pairs(client: TestClient) -> None:
    """``[[{index, value}]]``: the service's weights, ids ascending; an empty text has none."""
    texts = ["hybrid search hybrid", "", "x"]
    r = client.post("/embed_sparse", json={"inputs": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    check("EmbedSparseResponse", body)
    for text, items in zip(texts, body, strict=True):
        ids, weights = FakeService.expected_sparse(text)
        assert [i["index"] for i in items] == ids.tolist()
        np.testing.assert_array_equal(np.array([i["value"] for i in items], np.float32), weights)
        assert all(set(i) == {"index", "value"} for i in items)
    assert body[1] == []
    # Rendered a text at a time, byte for byte what one orjson.dumps of it all wrote.
    import orjson

    whole = []
    for text in texts:
        ids, weights = FakeService.expected_sparse(text)
        whole.append([{"index": i, "value": w} for i, w in zip(ids.tolist(), weights,
                                                                 strict=True)])
    assert r.content == orjson.dumps(whole, option=orjson.OPT_SERIALIZE_NUMPY)


def test_embed_sparse_takes_bgeserves_selection_options(client: TestClient) -> None:
    """``sparse_top_k`` keeps the largest weights, still ascending by id."""
    text = "a b c d e f g"
    r = client.post("/embed_sparse", json={"inputs": text, "sparse_top_k": 2})
    ids, weights = FakeService.expected_sparse(text)
    keep = np.sort(np.argsort(-weights, kind="stable")[:2])
    assert [i["index"] for i in r.json()[0]] == ids[keep].tolist()


def test_embed_all_is_the_colbert_vectors(client: TestClient) -> None:
    """``[[[f32]]]``: one ColBERT vector per token after ``<s>``, per input."""
    texts = ["a b c", "d"]
    r = client.post("/embed_all", json={"inputs": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    check("EmbedAllResponse", body)
    for text, rows in zip(texts, body, strict=True):
        want = FakeService.expected_colbert(text, len(fake_tokens(text)) + 2)
        np.testing.assert_array_equal(np.array(rows, np.float32), want)


@pytest.mark.parametrize("path", ["/similarity", "/", "/invocations"])
def test_similarity_is_the_cosine_with_the_source(client: TestClient, path: str) -> None:
    """``/similarity`` (and ``POST /`` with that body, as huggingface_hub sends it, with its
    empty ``parameters``): one cosine per sentence, from one batch."""
    body = {"inputs": {"source_sentence": "q", "sentences": ["a", "b c"]}, "parameters": {}}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    check("SimilarityResponse", r.json())
    src = FakeService.expected_dense("q")
    want = [float(FakeService.expected_dense(t) @ src) for t in ("a", "b c")]
    np.testing.assert_allclose(r.json(), want, rtol=0, atol=1e-6)
    assert client.fake.calls[-1].inputs == ["q", "a", "b c"]  # type: ignore[attr-defined]


def test_similarity_of_an_identical_sentence_is_at_most_one(client: TestClient) -> None:
    """float32 rounding makes the dot of a unit vector with itself 1.0000001 for some texts
    ("w0", "w33" of the fake): the cosine is clipped to [-1, 1], as clients check."""
    body = {"inputs": {"source_sentence": "w33", "sentences": ["w33", "w0", "b"]}}
    r = client.post("/similarity", json=body)
    assert r.status_code == 200, r.text
    assert r.json()[0] == 1.0 and all(-1.0 <= x <= 1.0 for x in r.json())


def test_similarity_batch_counts_the_source() -> None:
    """The batch limit counts the sentences plus the source sentence, as TEI does."""
    with serve(max_batch=2) as c:
        body = {"inputs": {"source_sentence": "q", "sentences": ["a", "b"]}}
        message = tei_error(c.post("/similarity", json=body), 422, "Validation")
        # The count is what the client sent (2 sentences), not the batch's 3 (QA: "batch of
        # 2049 inputs" for 2,048 sentences).
        assert "BGE_M3_MAX_BATCH" in message and "2 sentences" in message, message
        assert "batch of 3" not in message
        body["inputs"]["sentences"] = ["a"]
        assert c.post("/similarity", json=body).status_code == 200


@pytest.mark.parametrize(("inputs", "status", "error_type", "param"), [
    ({"source_sentence": "q"}, 422, "Validation", "inputs.sentences"),
    ({"source_sentence": "q", "sentences": "a"}, 422, "Validation", "inputs.sentences"),
    ({"source_sentence": "q", "sentences": []}, 400, "Empty", "inputs.sentences"),
    ({"source_sentence": "q", "sentences": ["a", 5]}, 422, "Validation", "inputs.sentences[1]"),
    ({"source_sentence": "", "sentences": ["a"]}, None, None, None),
])
def test_similarity_errors_name_the_sentence(client: TestClient, inputs: dict, status: int | None,
                                             error_type: str | None, param: str | None) -> None:
    """A missing or mistyped ``sentences`` is TEI's 422 (its body type refuses it), an empty
    one its 400 Empty; a bad sentence is named by its place in ``sentences`` (the batch puts
    the source sentence first: it said ``inputs[2]``)."""
    r = client.post("/similarity", json={"inputs": inputs})
    if status is None:
        assert r.status_code == 200, r.text
        return
    message = tei_error(r, status, error_type)
    assert param in message and "inputs[" not in message, message


def test_a_text_over_the_character_limit_is_413_only_where_tokenized_whole() -> None:
    """A text over BGE_M3_MAX_TEXT_CHARS: cut from the right (the default) it goes to the
    engine, which keeps its leading words; not truncated, or cut from the left (its last
    words are kept: tokenized whole), it is TEI's 413 Validation, naming it."""
    texts = ["ok", "0123456789x"]
    with serve(max_text_chars=10) as c:
        for body in ({}, {"truncate": True}, {"truncation_direction": "Right"}):
            r = c.post("/embed", json={"inputs": texts, **body})
            assert r.status_code == 200, (body, r.text)
        assert c.fake.calls[-1].inputs == texts
        r = c.post("/similarity", json={"inputs": {"source_sentence": "q", "sentences": texts}})
        assert r.status_code == 200, r.text
        for path in ("/embed", "/embed_sparse", "/embed_all"):
            for body in ({"truncate": False}, {"truncation_direction": "left"},
                         {"truncate": True, "truncation_direction": "Left"}):
                message = tei_error(c.post(path, json={"inputs": texts, **body}), 413,
                                    "Validation")
                assert "inputs[1] has 11 characters" in message, (path, body, message)
        r = c.post("/similarity", json={"inputs": {"source_sentence": "q", "sentences": texts},
                                        "parameters": {"truncate": False}})
        assert "inputs.sentences[1] has 11" in tei_error(r, 413, "Validation")
        # /tokenize gives every token of a text: always tokenized whole
        tei_error(c.post("/tokenize", json={"inputs": texts}), 413, "Validation")


@pytest.mark.parametrize("path", ["/similarity", "/"])
def test_similarity_names_a_sentence_the_engine_refused(path: str) -> None:
    """A sentence refused by the engine (over the sequence length, over the budget) is named by
    its place in ``sentences``, not in the batch the source sentence heads."""
    error = TooLarge("input[2] has more than the 8 tokens allowed", param="input[2]")
    body = {"inputs": {"source_sentence": "q", "sentences": ["a", "b c"]}}
    with serve(FakeService(fail_with=error)) as c:
        message = tei_error(c.post(path, json=body), 413, "Validation")
    assert message.startswith("inputs.sentences[1] has more than"), message


# -- /tokenize, /decode, /info ----------------------------------------------------------------
def test_tokenize_gives_byte_offsets_and_special_tokens(client: TestClient) -> None:
    """``[[{id, text, special, start, stop}]]``: UTF-8 byte offsets (TEI's), specials with null
    offsets; ``add_special_tokens: false`` leaves them out."""
    text = "héllo 混合 x"
    r = client.post("/tokenize", json={"inputs": text})
    assert r.status_code == 200, r.text
    body = r.json()
    check("TokenizeResponse", body)
    first, *words, last = body[0]
    assert first == {"id": 0, "text": "<s>", "special": True, "start": None, "stop": None}
    assert last["special"] is True and last["start"] is None
    raw = text.encode()
    assert [(w["start"], w["stop"]) for w in words] == [(0, 6), (7, 13), (14, 15)]
    for w in words:
        assert raw[w["start"]:w["stop"]].decode() == w["text"]
        assert list(w) == ["id", "text", "special", "start", "stop"]
    plain = client.post("/tokenize", json={"inputs": [text, "a"], "add_special_tokens": False})
    assert [t["text"] for t in plain.json()[0]] == ["héllo", "混合", "x"]
    assert len(plain.json()) == 2


@pytest.mark.parametrize(("body", "status", "error_type"), [
    ({"inputs": [1, 2]}, 422, "Validation"),
    ({"inputs": "x", "prompt_name": "q"}, 422, "Validation"),
    ({"inputs": "x", "add_special_tokens": 1}, 422, "Validation"),
    ({"inputs": []}, 400, "Empty"),
])
def test_tokenize_errors(client: TestClient, body: dict, status: int, error_type: str) -> None:
    """Token ids, prompts and a wrong flag are 422; an empty batch is 400 Empty."""
    tei_error(client.post("/tokenize", json=body), status, error_type)


def test_tokenize_and_decode_are_429_when_the_queue_has_no_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """They wait for the embedding requests' tokenizing slots: with no room in the queue at
    all they are refused from the headers, as /embed is (QA: under a flood they waited out
    the deadline, 504s, never a 429)."""
    fake = FakeService()
    monkeypatch.setattr(fake, "refuse_now", lambda: Overloaded("queue full", retry_after=3))
    with serve(fake) as client:
        for path, body in (("/tokenize", {"inputs": "x"}), ("/decode", {"ids": [0, 7]})):
            r = client.post(path, json=body)
            assert r.status_code == 429 and r.json()["error_type"] == "Overloaded", r.text
            assert r.headers["retry-after"] == "3"
    assert fake.calls == []


def test_decode_one_or_many_sequences(client: TestClient) -> None:
    """``ids`` as one sequence or several gives ``[str]``; ``skip_special_tokens`` (default
    true) decides whether special ids are decoded."""
    r = client.post("/decode", json={"ids": [0, 7, 8, 2]})
    assert r.status_code == 200, r.text
    check("DecodeResponse", r.json())
    assert r.json() == ["w7 w8"]
    r = client.post("/decode", json={"ids": [[0, 7], [9]], "skip_special_tokens": False})
    assert r.json() == ["w0 w7", "w9"]
    # an empty sequence is TEI's 400 Empty (its tokenizer refuses one), alone or in a batch
    assert "ids is empty" in tei_error(client.post("/decode", json={"ids": []}), 400, "Empty")
    assert "ids[1] is empty" in tei_error(client.post("/decode", json={"ids": [[7], []]}), 400,
                                          "Empty")


@pytest.mark.parametrize(("body", "status", "error_type", "named"), [
    ({"ids": ["a"]}, 422, "Validation", "ids[0]"),
    ({"ids": [-1]}, 422, "Validation", "ids[0]"),
    ({"ids": [1, -1]}, 422, "Validation", "ids[1]"),  # named ids[0], the sequence (fuzz QA)
    ({"ids": [[1], [2, "x"]]}, 422, "Validation", "ids[1][1]"),
    ({"ids": [[1], 5]}, 422, "Validation", "ids[1]"),
    ({}, 422, "Validation", "ids"),
    ({"ids": {"0": 1}}, 422, "Validation", "ids"),  # not an array: not "empty" either
    ({"ids": 7}, 422, "Validation", "ids"),
    ({"ids": "7"}, 422, "Validation", "ids"),
])
def test_decode_errors(client: TestClient, body: dict, status: int, error_type: str,
                       named: str) -> None:
    """Ids that are not token ids are 422, naming the item."""
    assert named in tei_error(client.post("/decode", json=body), status, error_type)


def test_info_has_every_field_tei_documents(client: TestClient) -> None:
    """``GET /info`` is TEI's ``Info``: an embedding model with CLS pooling, the limits."""
    r = client.get("/info")
    assert r.status_code == 200, r.text
    body = r.json()
    check("Info", body)
    assert body["model_type"] == {"embedding": {"pooling": "cls"}}
    assert body["served_model_name"] == "bge-m3"
    assert body["max_input_length"] == 8192 and body["max_client_batch_size"] == 2048
    assert body["auto_truncate"] is True


def test_reranker_info_reports_a_reranker_for_what_rerank_scores_with() -> None:
    """``GET /reranker/info`` is TEI's ``Info`` of a reranker: a client that checks the type
    before it reranks (Dify's TEI provider refuses an embedding model) is pointed there, and
    ``/reranker/rerank`` answers as ``/rerank``; ``/info`` stays bge-m3's embedding model.
    The cross-encoder's id and pair length when one is loaded, else bge-m3's."""
    reranker_type = {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    with serve() as client:
        body = client.get("/reranker/info").json()
        check("Info", body)
        assert body["model_type"] == reranker_type
        assert body["model_id"] == "BAAI/bge-m3" and body["served_model_name"] == "bge-m3"
        query = {"query": "q", "texts": ["a", "bb"], "return_text": True}
        assert client.post("/reranker/rerank", json=query).json() == client.post(
            "/rerank", json=query).json()
        assert client.post("/reranker/rerank", json={"query": "q", "texts": []}).json()[
            "error_type"] == "Empty"
    with serve(FakeService(rerank_ids=("bge-reranker-v2-m3", "BAAI/bge-reranker-v2-m3"))) as c:
        body = c.get("/reranker/info").json()
        check("Info", body)
        assert body["model_type"] == reranker_type
        assert body["model_id"] == "BAAI/bge-reranker-v2-m3"
        assert body["served_model_name"] == "bge-reranker-v2-m3"
        assert body["max_input_length"] == 512
        assert c.get("/info").json()["model_type"] == {"embedding": {"pooling": "cls"}}


# -- errors: TEI's shape on every TEI path -------------------------------------------------------
def test_tei_paths_are_the_tei_routes() -> None:
    """The paths answered in TEI's error style are exactly TEI's routes (``POST /`` and its
    SageMaker name ``/invocations`` and TEI's ``/rerank`` included)."""
    assert TEI_PATHS == {"/", "/invocations", "/embed", "/embed_sparse", "/embed_all",
                         "/similarity", "/tokenize", "/decode", "/info", "/rerank", "/ping",
                         "/reranker/info", "/reranker/rerank"}


@pytest.mark.parametrize("path", ["/embed", "/embed_sparse", "/embed_all", "/",
                                  "/invocations"])
def test_empty_inputs_is_400_empty(client: TestClient, path: str) -> None:
    """``inputs: []`` is TEI's 400 ``Empty``."""
    tei_error(client.post(path, json={"inputs": []}), 400, "Empty")


@pytest.mark.parametrize("path", ["/embed", "/tokenize", "/decode", "/similarity"])
def test_not_json_is_400(client: TestClient, path: str) -> None:
    """A body that is not a JSON object is 400 (axum's extractor in TEI), in TEI's shape."""
    for raw in (b"{", b"[1]", b""):
        tei_error(client.post(path, content=raw, headers={"content-type": "application/json"}),
                  400, "Validation")


def test_batch_over_the_limit_is_422_naming_the_variable() -> None:
    """More inputs than BGE_M3_MAX_BATCH is 422 Validation (TEI's code) naming the variable."""
    with serve(max_batch=2) as c:
        message = tei_error(c.post("/embed", json={"inputs": ["a", "b", "c"]}), 422,
                            "Validation")
    assert "BGE_M3_MAX_BATCH" in message


def test_token_ids_are_refused_unless_accepted() -> None:
    """TEI takes token ids in ``inputs``; bgeserve refuses them (422 naming the fix) unless
    BGE_M3_ACCEPT_TOKEN_IDS is set, and then embeds them."""
    with serve() as c:
        message = tei_error(c.post("/embed", json={"inputs": [[5, 6]]}), 422, "Validation")
        assert "BGE_M3_ACCEPT_TOKEN_IDS=1" in message and c.fake.calls == []  # type: ignore[attr-defined]
    with serve(accept_token_ids=True) as c:
        assert c.post("/embed", json={"inputs": [5, 6]}).status_code == 200
        assert c.fake.calls[-1].inputs == [[5, 6]]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("error", "status", "error_type"), [
    (Overloaded("queue full", retry_after=2.5), 429, "Overloaded"),
    (EngineFailed("session.run failed: /secret/path"), 424, "Backend"),
    (NotReady("still loading"), 503, "Unhealthy"),
    (ModelUnavailable("cannot open /secret/model.onnx"), 503, "Unhealthy"),
    (TooLarge("over the memory budget"), 413, "Validation"),
])
@pytest.mark.parametrize("path", ["/embed", "/embed_sparse", "/embed_all"])
def test_service_errors_map_to_tei_statuses(path: str, error: Exception, status: int,
                                            error_type: str) -> None:
    """Service errors get TEI's statuses (backend 424, overloaded 429 with Retry-After,
    unhealthy 503); internals stay out of the message."""
    with serve(FakeService(fail_with=error)) as c:
        r = c.post(path, json={"inputs": "x"})
    message = tei_error(r, status, error_type)
    assert status in TEI_DOCUMENTED[path] | BGESERVE_EXTRA
    assert "/secret" not in message
    if status == 429:
        assert r.headers["retry-after"] == "3"


@pytest.mark.parametrize(("path", "error", "said"), [
    ("/embed", TooLarge("input[2] has more than the 8 tokens allowed", param="input[2]"),
     "inputs[2] has more than"),
    ("/rerank", TooLarge("documents[1] is too long", param="documents[1]"), "texts[1] is too"),
    ("/embed", TooLarge("over the budget (input[9] spelled elsewhere)", param="outputs"),
     "(input[9] spelled elsewhere)"),
])
def test_tei_errors_name_the_field_as_tei_spells_it(path: str, error: Exception,
                                                    said: str) -> None:
    """The engine names texts ``input[i]`` / ``documents[i]`` (OpenAI's and Cohere's fields);
    on TEI's routes the message names TEI's own (``inputs[i]``, ``texts[i]``); only the
    field at fault is renamed."""
    body = {"query": "q", "texts": ["a", "b"]} if path == "/rerank" else {"inputs": "x"}
    with serve(FakeService(fail_with=error)) as c:
        message = tei_error(c.post(path, json=body), 413, "Validation")
    assert said in message


def test_framework_errors_use_tei_shape(client: TestClient) -> None:
    """A wrong method (405 with Allow) and a non-JSON Content-Type (415) on TEI paths are in
    TEI's shape; the OpenAI paths keep bgeserve's envelope."""
    r = client.get("/embed")
    tei_error(r, 405, "Validation")
    assert r.headers["allow"] == "POST"
    tei_error(client.post("/info"), 405, "Validation")
    tei_error(client.post("/embed", content=b"x", headers={"content-type": "text/plain"}), 415,
              "Validation")
    assert set(client.get("/v1/embeddings").json()) == {"error"}
    assert client.get("/v1/embeddings").json()["error"]["code"] == "method_not_allowed"


def test_tei_routes_not_served_are_404_in_tei_shape(client: TestClient) -> None:
    """TEI's ``/predict`` and ``/vertex`` are not served: a 404 in TEI's shape pointing at
    docs/tei.md; an unknown non-TEI path keeps bgeserve's envelope."""
    for path in ("/predict", "/vertex"):
        assert "docs/tei.md" in tei_error(client.post(path, json={"inputs": "x"}), 404,
                                          "Validation")
    r = client.post("/nothing", json={"inputs": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_body_over_the_limit_is_413_in_tei_shape() -> None:
    """The body limit (BGE_M3_MAX_BODY_BYTES) answers 413 in TEI's shape on TEI paths."""
    with serve(max_body_bytes=1024) as c:
        message = tei_error(c.post("/embed", json={"inputs": "x" * 2000}), 413, "Validation")
    assert "BGE_M3_MAX_BODY_BYTES" in message


def test_auth_refusal_is_401_in_tei_shape() -> None:
    """With BGE_M3_API_KEY, a missing key on a TEI path is 401 in TEI's shape."""
    with serve(api_keys=("k",)) as c:
        r = c.post("/embed", json={"inputs": "x"})
        tei_error(r, 401, "Validation")
        assert r.headers["www-authenticate"] == "Bearer"
        ok = c.post("/embed", json={"inputs": "x"}, headers={"authorization": "Bearer k"})
        assert ok.status_code == 200


def test_teis_health_checks_answer_as_health_without_a_key() -> None:
    """TEI's public health routes besides /health: the Inference API's ``GET /`` and
    SageMaker's ``GET /ping`` (it was a 404: a SageMaker deployment failed its probe). A key
    is not asked of them; ``POST /`` embeds and still needs one."""
    with serve(api_keys=("k",)) as c:
        for path in ("/", "/ping", "/health"):
            r = c.get(path)
            assert r.status_code == 200 and r.json()["status"] == "ok", (path, r.text)
        tei_error(c.post("/", json={"inputs": "x"}), 401, "Validation")
        tei_error(c.post("/ping", json={}, headers={"authorization": "Bearer k"}), 405,
                  "Validation")
    with serve(FakeService(status="loading")) as c:
        assert c.get("/ping").status_code == c.get("/").status_code == 503


@pytest.mark.parametrize("path", ["/", "/invocations"])
def test_root_takes_a_rerank_body(path: str) -> None:
    """``POST /`` (SageMaker's ``/invocations``) is TEI's route for its model type: a
    reranker deployment's clients post ``{query, texts}`` there (it was 422 "inputs is
    required"); a body with ``inputs`` stays an embedding request."""
    docs = ["alpha beta", "gamma", "beta alpha delta"]
    with serve() as c:
        r = c.post(path, json={"query": "alpha", "texts": docs, "return_text": True})
        assert r.status_code == 200, r.text
        assert r.json() == c.post("/rerank", json={"query": "alpha", "texts": docs,
                                                   "return_text": True}).json()
        assert sorted(x["index"] for x in r.json()) == [0, 1, 2]
        tei_error(c.post(path, json={"query": "alpha", "texts": []}), 400, "Empty")
        tei_error(c.post(path, json={"query": "alpha"}), 422, "Validation")
        r = c.post(path, json={"inputs": "x", "query": "alpha", "texts": docs})
        check("EmbedResponse", r.json())


def test_a_text_over_the_sequence_length_is_422_as_teis_tokenizer_says() -> None:
    """With truncation off, a text over the sequence length is TEI's tokenizer's validation
    error, 422 (it was 413, which TEI's OpenAPI calls a batch too large: a client following it
    splits the batch and retries); the OpenAI routes keep 413."""
    error = TooLarge("input[0] has more than the 8 tokens allowed", param="input[0]",
                     code="too_many_tokens")  # the engine's (tests/test_service.py)
    with serve(FakeService(fail_with=error)) as c:
        assert "inputs[0] has more than" in tei_error(
            c.post("/embed", json={"inputs": "x", "truncate": False}), 422, "Validation")
        message = tei_error(c.post("/similarity", json={"inputs": {
            "source_sentence": "q", "sentences": ["a"]}}), 422, "Validation")
        assert message.startswith("inputs.source_sentence has more than")
        r = c.post("/v1/embeddings", json={"input": "x", "truncate": False})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_tokens"


def test_unexpected_errors_are_500_in_tei_shape() -> None:
    """A bug (not a BgeServeError) is a generic 500 in TEI's shape naming the request id."""
    with serve(FakeService(fail_with=RuntimeError("boom /secret"))) as c:
        r = c.post("/embed", json={"inputs": "x"}, headers={"x-request-id": "rid-1"})
    message = tei_error(r, 500, "Backend")
    assert "rid-1" in message and "/secret" not in message


# -- GET /v1/models/{id} ------------------------------------------------------------------------
def test_models_retrieve_every_accepted_name() -> None:
    """``GET /v1/models/{id}`` (``client.models.retrieve``) answers bge-m3, BAAI/bge-m3 (with
    its slash) and aliases; another name is 404 model_not_found in the OpenAI envelope."""
    with serve(model_aliases=("text-embedding-3-small",)) as c:
        for name in ("bge-m3", "BAAI/bge-m3", "text-embedding-3-small"):
            r = c.get(f"/v1/models/{name}")
            assert r.status_code == 200, r.text
            assert r.json() == {"id": name, "object": "model", "owned_by": "BAAI", "created": 0}
        error = c.get("/v1/models/gpt-4").json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
