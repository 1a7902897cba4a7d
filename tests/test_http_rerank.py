"""The rerank routes (bgeserve.http.rerank) in-process against ``FakeService``."""

from __future__ import annotations

import numpy as np
import pytest

from bgeserve.errors import EngineFailed, Overloaded, TooLarge
from tests.fakes import FakeService
from tests.test_http import assert_error, serve

DOCS = ["alpha beta", "gamma", "delta epsilon zeta", "long text here"]


def fake_order(query: str, docs: list[str]) -> list[int]:
    q = FakeService.expected_dense(query)
    scores = [float(q @ FakeService.expected_dense(d)) for d in docs]
    return sorted(range(len(docs)), key=lambda i: (-scores[i], i))


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_jina_and_cohere_paths_answer_sorted_results(path: str) -> None:
    """Both paths: results sorted by score, cut to top_n, documents only on request, usage
    and the scorer's id; the options reach the service (normalize defaults to false: the
    cross-encoder's logits, as the issue and FlagReranker's default give them)."""
    with serve(FakeService(rerank_ids=("bge-reranker-v2-m3",))) as client:
        r = client.post(path, json={"model": "bge-reranker-v2-m3", "query": "q",
                                    "documents": DOCS, "top_n": 2, "return_documents": True})
        assert r.status_code == 200, r.text
        body = r.json()
        order = fake_order("q", DOCS)
        assert [x["index"] for x in body["results"]] == order[:2]
        assert body["results"][0]["document"] == {"text": DOCS[order[0]]}
        assert body["model"] == "bge-reranker-v2-m3" and body["usage"]["total_tokens"] > 0
        assert body["id"] == r.headers["x-request-id"]
        query, docs, options = client.fake.rerank_calls[-1]  # type: ignore[attr-defined]
        assert (query, docs, options.normalize) == ("q", DOCS, False)


def test_long_documents_are_flagged_per_result() -> None:
    """Windowed documents carry ``windows``; with truncate: true, cut ones ``truncated``."""
    with serve() as client:
        windows = client.post("/v1/rerank", json={"query": "q", "documents": DOCS}).json()
        cut = client.post("/v1/rerank", json={"query": "q", "documents": DOCS,
                                               "truncate": True}).json()
    by_index = {x["index"]: x for x in windows["results"]}
    assert by_index[3]["windows"] == 3 and "truncated" not in by_index[3]
    assert {x["index"]: x for x in cut["results"]}[3]["truncated"] is True
    assert windows["model"] == "bge-m3"  # no reranker loaded: bge-m3 scores


def test_model_picks_the_scorer_and_unknown_models_are_404() -> None:
    """``bge-m3`` (and its aliases) or the reranker's ids; anything else is model_not_found,
    and the reranker's ids are not accepted when none is loaded."""
    with serve(FakeService(rerank_ids=("bge-reranker-v2-m3", "BAAI/bge-reranker-v2-m3"))) as c:
        assert c.post("/v1/rerank", json={"model": "bge-m3", "query": "q",
                                          "documents": DOCS}).json()["model"] == "bge-m3"
        assert c.post("/v1/rerank", json={"query": "q", "documents": DOCS}).json()[
            "model"] == "bge-reranker-v2-m3"
        assert_error(c.post("/v1/rerank", json={"model": "rerank-english-v3.0", "query": "q",
                                                "documents": DOCS}), 404, "model_not_found",
                     "model")
        models = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert "bge-reranker-v2-m3" in models and "bge-m3" in models
        for name in models:  # every listed id can be retrieved (client.models.retrieve)
            for route in (f"/v1/models/{name}", f"/models/{name}"):
                r = c.get(route)
                assert r.status_code == 200 and r.json()["id"] == name, (route, r.text)
    with serve() as c:
        assert_error(c.post("/v1/rerank", json={"model": "bge-reranker-v2-m3", "query": "q",
                                                "documents": DOCS}), 404, "model_not_found")
        assert_error(c.get("/v1/models/bge-reranker-v2-m3"), 404, "model_not_found", "model")


def test_rerank_errors_carry_detail_for_jina_clients() -> None:
    """On /v1/rerank and /v2/rerank an error also carries the message as ``detail`` (LlamaIndex's
    JinaRerank raises ``RuntimeError(resp["detail"])``: a KeyError that lost the message
    before); the embedding routes keep OpenAI's shape alone, TEI's /rerank TEI's."""
    with serve() as c:
        for path in ("/v1/rerank", "/v2/rerank"):
            r = c.post(path, json={"model": "jina-reranker-v1-base-en", "query": "q",
                                   "documents": DOCS})
            body = r.json()
            assert r.status_code == 404 and set(body) == {"error", "detail"}
            assert body["detail"] == body["error"]["message"]
            assert "jina-reranker-v1-base-en" in body["detail"]
            r = c.post(path, content=b"{", headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["detail"] == r.json()["error"]["message"]
        assert set(c.post("/v1/embeddings", json={"model": "x", "input": "a"}).json()) == {
            "error"}
        assert set(c.post("/rerank", json={"query": "q"}).json()) == {"error", "error_type"}


def test_bad_bodies_are_enveloped_400s() -> None:
    """A missing query, empty documents, bad weights: 400 in the one envelope naming the field."""
    with serve() as client:
        assert_error(client.post("/v1/rerank", json={"documents": DOCS}), 400, param="query")
        assert_error(client.post("/v1/rerank", json={"query": "q", "documents": []}), 400,
                     "empty_input", "documents")
        assert_error(client.post("/v2/rerank", json={"query": "q", "documents": DOCS,
                                                      "weights": [1]}), 400, param="weights")
        assert_error(client.post("/v1/rerank", content=b"{", headers={
            "content-type": "application/json"}), 400, "invalid_json")


def test_service_errors_keep_their_status() -> None:
    """A window over the budget is 413, a full queue 429 with Retry-After, a failure 500."""
    for error, status in ((TooLarge("window too long", param="documents"), 413),
                          (Overloaded("queue full", retry_after=2), 429),
                          (EngineFailed("boom"), 500)):
        with serve(FakeService(fail_with=error)) as client:
            r = client.post("/v1/rerank", json={"query": "q", "documents": DOCS})
            assert_error(r, status)
            if status == 429:
                assert r.headers["retry-after"] == "2"


def test_tei_rerank_shape() -> None:
    """``/rerank``: a bare sorted array of {index, score, text?}; raw_scores turns the
    sigmoid off; truncate cuts."""
    with serve() as client:
        r = client.post("/rerank", json={"query": "q", "texts": DOCS, "return_text": True,
                                         "raw_scores": True, "truncate": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body] == fake_order("q", DOCS)
        assert body[0]["text"] == DOCS[body[0]["index"]]
        assert np.isclose(body[0]["score"], float(FakeService.expected_dense("q")
                                                   @ FakeService.expected_dense(DOCS[body[0][
                                                       "index"]])))
        _, _, options = client.fake.rerank_calls[-1]  # type: ignore[attr-defined]
        assert not options.normalize and options.long_documents == "truncate"
        assert "text" not in client.post("/rerank", json={"query": "q", "texts": DOCS}).json()[0]


def test_tei_rerank_errors_in_teis_shape() -> None:
    """``/rerank`` errors: {"error", "error_type"} with TEI's statuses (empty 400, validation
    422, overload 429, backend 424)."""
    with serve() as client:
        r = client.post("/rerank", json={"query": "q", "texts": []})
        assert r.status_code == 400 and r.json() == {"error": r.json()["error"],
                                                       "error_type": "Empty"}
        r = client.post("/rerank", json={"query": "q"})
        assert r.status_code == 422 and r.json()["error_type"] == "Validation"
        assert "texts" in r.json()["error"]
    for error, status, kind in ((Overloaded("full"), 429, "Overloaded"),
                                (EngineFailed("boom"), 424, "Backend"),
                                (TooLarge("long"), 413, "Validation")):
        with serve(FakeService(fail_with=error)) as client:
            r = client.post("/rerank", json={"query": "q", "texts": DOCS})
            assert r.status_code == status and r.json()["error_type"] == kind, r.text
