"""The real ``Service`` behind ``create_app``, in-process, on the tiny random bge-m3.

Every response is checked against ``bgeserve.Engine`` on the same export: the HTTP layer, the
service and cross-request batching must not change a single vector beyond float noise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import bgeserve.service as service_module
from bgeserve import Engine
from bgeserve.config import Settings
from bgeserve.engine import EngineConfig
from bgeserve.http.app import create_app
from bgeserve.model.artifacts import resolve
from bgeserve.model.dims import model_dims
from bgeserve.service import Service
from bgeserve.tuning.costmodel import CostModel, conservative_coefficients
from tests.oracle import dense_rows

pytestmark = pytest.mark.slow

MAX_SEQ = 64
ATOL = 1e-5
TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "Définition de BM25 — 混合检索",
    "a",
    "What is BGE M3? A multilingual embedding model.",
]
LONG = "retrieval augmented generation with hybrid dense and sparse vectors " * 4


def base_env(model: Path | str, cache: Path, **extra: str) -> dict[str, str]:
    env = {"BGE_M3_MODEL_PATH": str(model), "BGE_M3_CACHE_DIR": str(cache),
           "HF_HUB_OFFLINE": "1", "BGE_M3_DISABLE_AUTO_BUDGET": "1",
           "BGE_M3_MAX_SEQ_LENGTH": str(MAX_SEQ)}
    env.update(extra)
    return env


def wait_health(client: TestClient, status: int = 200, timeout: float = 30.0,
                body_status: str | None = None) -> dict[str, Any]:
    """Poll /health until it answers ``status`` (and, given, the body's ``body_status``: a 503
    is "loading" before it is "fail")."""
    deadline = time.monotonic() + timeout
    while True:
        r = client.get("/health")
        if r.status_code == status and body_status in (None, r.json().get("status")):
            return r.json()
        assert time.monotonic() < deadline, f"/health still {r.status_code}: {r.json()}"
        time.sleep(0.02)


@contextmanager
def serving(env: dict[str, str]) -> Iterator[tuple[TestClient, Service]]:
    """The app with a real Service; yields the client and the service (not yet ready)."""
    made: list[Service] = []

    def factory(settings: Settings) -> Service:
        made.append(Service(settings))
        return made[0]

    with TestClient(create_app(Settings.from_env(env), service_factory=factory)) as client:
        yield client, made[0]


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_export: Path) -> Iterator[Engine]:
    with Engine(tiny_export, "fp32") as e:
        yield e


@pytest.fixture(scope="module")
def short_engine(tiny_export: Path) -> Iterator[Engine]:
    """An engine that truncates at the server's MAX_SEQ, for truncated texts."""
    with Engine(tiny_export, "fp32", config=EngineConfig(max_seq=MAX_SEQ)) as e:
        yield e


@pytest.fixture(scope="module")
def client(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """``create_app(settings)`` with its default factory (the real Service), ready."""
    # Token ids accepted: the token-id tests below send the tiny model's own ids. fp32 pinned:
    # the tests compare the served outputs with the exact engine's (the default would be int8,
    # which the tiny export measured above the bar: test_an_unpinned_start_serves_the_rules_pick).
    env = base_env(tiny_export, tmp_path_factory.mktemp("svc-cache"),
                   BGE_M3_ACCEPT_TOKEN_IDS="1", BGE_M3_MODEL="fp32")
    with TestClient(create_app(Settings.from_env(env))) as c:
        wait_health(c)
        yield c




def n_tokens(engine: Engine, texts: list[str]) -> int:
    return int(engine.tokenizer.encode(texts).lengths.sum())


def worker_threads() -> int:
    return sum(t.name.startswith("bgeserve-worker-") for t in threading.enumerate())


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_answers_say_where_their_time_went_as_teis_headers(client: TestClient,
                                                          engine: Engine) -> None:
    """An answer the model ran for carries TEI's x-compute-* / x-*-time headers (TEI's
    clients and dashboards read them): its characters and tokens exactly, and times in whole
    ms that add up to at most the total; a rerank's count query and documents. A refusal and
    a route that runs no model carry none."""
    r = client.post("/embed", json={"inputs": TEXTS})
    assert r.status_code == 200, r.text
    h = r.headers
    assert h["x-compute-type"] == "cpu"
    assert int(h["x-compute-characters"]) == sum(map(len, TEXTS))
    assert int(h["x-compute-tokens"]) == n_tokens(engine, TEXTS)
    parts = [int(h[f"x-{k}-time"]) for k in ("tokenization", "queue", "inference")]
    assert min(parts) >= 0 and sum(parts) <= int(h["x-total-time"]) + 2
    assert h["x-compute-time"] == h["x-total-time"]
    r = client.post("/v1/embeddings", json={"input": TEXTS[0]})
    assert int(r.headers["x-compute-tokens"]) == r.json()["usage"]["prompt_tokens"]
    r = client.post("/v1/rerank", json={"query": "q", "documents": TEXTS[:2]})
    assert r.status_code == 200, r.text
    assert int(r.headers["x-compute-characters"]) == 1 + len(TEXTS[0]) + len(TEXTS[1])
    assert int(r.headers["x-compute-tokens"]) == r.json()["usage"]["total_tokens"] > 0
    for refused in (client.post("/embed", json={"inputs": []}), client.get("/info")):
        assert "x-compute-tokens" not in refused.headers


def test_request_tokens_count_what_usage_reports_cache_hits_included(client: TestClient) -> None:
    """``bgeserve_request_tokens_total`` is the requests' usage (the mean tokens per input
    divides it by the texts answered); ``bgeserve_tokens_total`` only what the model ran:
    a text answered from the cache adds to the first, not the second."""
    text = "a text sent twice to be answered from the cache the second time"
    before = metric_samples(client.get("/metrics").text)
    usage = 0
    for _ in range(2):
        r = client.post("/v1/embeddings", json={"input": [text, text]})
        usage += r.json()["usage"]["prompt_tokens"]
    after = metric_samples(client.get("/metrics").text)

    def grew(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert grew("bgeserve_request_tokens_total") == usage
    assert grew("bgeserve_tokens_total") == usage / 4  # one run of the text, once
    assert grew("bgeserve_texts_total") == 4


# -- outputs equal the engine's -----------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_dense_matches_engine(client: TestClient, engine: Engine, encoding: str) -> None:
    r = client.post("/v1/embeddings",
                    json={"model": "bge-m3", "input": TEXTS, "encoding_format": encoding})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert all("truncated" not in d for d in body["data"])
    want = engine.embed(TEXTS).dense
    np.testing.assert_allclose(dense_rows(body), want, atol=ATOL, rtol=0)
    assert body["usage"]["prompt_tokens"] == n_tokens(engine, TEXTS)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]


def test_single_string_input(client: TestClient, engine: Engine) -> None:
    r = client.post("/v1/embeddings", json={"input": TEXTS[1]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(dense_rows(r.json())[0], engine.embed(TEXTS[1]).dense[0],
                               atol=ATOL, rtol=0)
    assert r.json()["usage"]["prompt_tokens"] == n_tokens(engine, [TEXTS[1]])


def test_sparse_matches_engine(client: TestClient, engine: Engine) -> None:
    r = client.post("/v1/sparse-embeddings", json={"input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    want = engine.embed(TEXTS, dense=False, sparse=True).sparse
    for item, (ids, weights) in zip(body["data"], want, strict=True):
        assert item["object"] == "sparse_embedding"
        assert "embedding" not in item
        got = item["sparse_values"]
        assert got["indices"] == ids.tolist()
        np.testing.assert_allclose(got["values"], weights, atol=ATOL, rtol=0)
    assert body["usage"]["prompt_tokens"] == n_tokens(engine, TEXTS)


def test_both_with_colbert_matches_engine(client: TestClient, engine: Engine) -> None:
    r = client.post("/v1/embeddings:both",
                    json={"input": TEXTS, "outputs": ["dense", "sparse", "colbert"]})
    assert r.status_code == 200, r.text
    body = r.json()
    want = engine.embed(TEXTS, dense=True, sparse=True, colbert=True)
    np.testing.assert_allclose(dense_rows(body), want.dense, atol=ATOL, rtol=0)
    for i, item in enumerate(body["data"]):
        ids, weights = want.sparse[i]
        assert item["sparse_values"]["indices"] == ids.tolist()
        np.testing.assert_allclose(item["sparse_values"]["values"], weights, atol=ATOL, rtol=0)
        rows = np.asarray(item["colbert"], dtype=np.float32)
        assert rows.shape == want.colbert[i].shape == (want.n_tokens[i] - 1, want.dense.shape[1])
        np.testing.assert_allclose(rows, want.colbert[i], atol=ATOL, rtol=0)
    assert body["usage"]["prompt_tokens"] == int(want.n_tokens.sum())


def test_both_defaults_to_dense_and_sparse(client: TestClient, engine: Engine) -> None:
    r = client.post("/v1/embeddings:both", json={"input": TEXTS[:2]})
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    assert "embedding" in item and "sparse_values" in item and "colbert" not in item


def test_sparse_format_tokens(client: TestClient, engine: Engine) -> None:
    r = client.post("/v1/sparse-embeddings", json={"input": TEXTS[:3], "sparse_format": "tokens"})
    assert r.status_code == 200, r.text
    want = engine.embed(TEXTS[:3], dense=False, sparse=True).sparse
    for item, (ids, weights) in zip(r.json()["data"], want, strict=True):
        got = item["sparse_values"]
        expected: dict[str, float] = {}
        for token, w in zip(engine.tokenizer.id_to_token(ids.tolist()), weights.tolist(),
                            strict=True):
            expected[token] = max(w, expected.get(token, w))
        assert set(got) == set(expected)
        assert set(got) != {str(i) for i in ids.tolist()}  # token strings, not ids
        for token, w in expected.items():
            assert got[token] == pytest.approx(w, abs=ATOL)


# -- truncation and limits ---------------------------------------------------------------------
def test_truncation_flag(client: TestClient, engine: Engine, short_engine: Engine) -> None:
    assert len(engine.tokenizer.encode([LONG]).ids[0]) > MAX_SEQ
    r = client.post("/v1/embeddings", json={"input": [TEXTS[0], LONG]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "truncated" not in body["data"][0]
    assert body["data"][1]["truncated"] is True
    want = short_engine.embed([TEXTS[0], LONG]).dense
    np.testing.assert_allclose(dense_rows(body), want, atol=ATOL, rtol=0)
    # usage counts the tokens actually embedded: the long text contributes MAX_SEQ
    assert body["usage"]["prompt_tokens"] == n_tokens(engine, [TEXTS[0]]) + MAX_SEQ


def test_truncate_false_is_413_naming_the_input(client: TestClient) -> None:
    r = client.post("/v1/embeddings", json={"input": [TEXTS[0], LONG], "truncate": False})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["param"] == "input[1]"
    assert "input[1]" in err["message"] and "BGE_M3_MAX_SEQ_LENGTH" in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == "too_many_tokens"
    # TEI's routes: its tokenizer's validation error, 422
    r = client.post("/embed", json={"inputs": [TEXTS[0], LONG], "truncate": False})
    assert r.status_code == 422 and r.json()["error_type"] == "Validation", r.text
    assert r.json()["error"].startswith("inputs[1] has more than")
    # a short batch with truncate=false is fine
    ok = client.post("/v1/embeddings", json={"input": TEXTS, "truncate": False})
    assert ok.status_code == 200, ok.text


def test_a_text_over_the_character_limit_is_embedded_from_its_leading_words(
        client: TestClient, short_engine: Engine) -> None:
    """Truncated (the default), a text past BGE_M3_MAX_TEXT_CHARS (131,072) is embedded from
    its leading words (cut at a space, or a line break: bge-m3's layout splits there),
    exactly as truncating it whole; on TEI's /embed too. One without a break to cut at is a
    413 saying so, and with truncate false any such text is a 413."""
    long = "hybrid retrieval with dense and sparse vectors " * 3000  # 141,000 characters
    # No space in its first 512 characters (MAX_SEQ * 8, the first cut): cut within the limit
    late = "x" * 600 + " " + long
    page = "混合检索的稠密向量\n" * 15_000  # 150,000 characters of lines without spaces
    r = client.post("/v1/embeddings", json={"input": [TEXTS[0], long, late, page]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d.get("truncated") for d in body["data"]] == [None, True, True, True]
    # each its first MAX_SEQ tokens, as the library's engine (no limit) gives them
    want = short_engine.embed([TEXTS[0], long[:2000], late[:2600], page[:2000]]).dense
    np.testing.assert_allclose(dense_rows(body), want, atol=ATOL, rtol=0)
    tei = client.post("/embed", json={"inputs": long})
    assert tei.status_code == 200, tei.text
    np.testing.assert_allclose(tei.json()[0], want[1], atol=ATOL, rtol=0)
    blob = "混" * 140_000  # no break at all
    r = client.post("/v1/embeddings", json={"input": [TEXTS[0], blob]})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["param"] == "input[1]" and "first 131072 characters have no space or line" in err["message"]
    r = client.post("/embed", json={"inputs": [TEXTS[0], blob]})
    assert r.status_code == 413 and r.json()["error"].startswith("inputs[1] has 140000"), r.text
    similar = {"inputs": {"source_sentence": TEXTS[0], "sentences": [TEXTS[1], blob]}}
    r = client.post("/similarity", json=similar)
    assert r.status_code == 413, r.text
    assert r.json()["error"].startswith("inputs.sentences[1] has 140000"), r.text
    r = client.post("/v1/embeddings", json={"input": [long], "truncate": False})
    assert r.status_code == 413 and "141000 characters" in r.json()["error"]["message"]


def test_rerank_texts_over_the_character_limit_are_scored_from_their_leading_words(
        client: TestClient, short_engine: Engine) -> None:
    """A rerank query (only its leading tokens are read) and documents truncated from the
    right past BGE_M3_MAX_TEXT_CHARS are scored from their leading words, exactly as the
    library scores them whole, on the Jina / Cohere routes and TEI's; a document scored to its
    end (windows, the default) past the limit is a 413 saying how it could be served."""
    long = "hybrid retrieval with dense and sparse vectors " * 3000  # 141,000 characters
    page = "混合检索的稠密向量\n" * 15_000  # 150,000 characters of lines without spaces
    query = "what is " + long
    docs = [TEXTS[0], long, page]
    want = short_engine.rerank(query[:2000], [TEXTS[0], long[:2000], page[:2000]],
                               long_documents="truncate")
    for path, body in (("/v1/rerank", {"query": query, "documents": docs, "truncate": True}),
                       ("/v2/rerank", {"query": query, "documents": docs,
                                       "max_tokens_per_doc": MAX_SEQ - 2}),
                       ("/rerank", {"query": query, "texts": docs, "truncate": True,
                                    "raw_scores": True})):
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
        results = r.json() if path == "/rerank" else r.json()["results"]
        got = {x["index"]: x.get("relevance_score", x.get("score")) for x in results}
        np.testing.assert_allclose([got[i] for i in range(3)], want.scores, atol=1e-5,
                                   rtol=0, err_msg=path)
    r = client.post("/v1/rerank", json={"query": "q", "documents": docs})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["param"] == "documents[1]" and "truncate" in err["message"]
    blob = "混" * 140_000
    r = client.post("/v1/rerank", json={"query": blob, "documents": docs, "truncate": True})
    assert r.status_code == 413 and r.json()["error"]["param"] == "query", r.text
    # TEI's /rerank names a document as its body does
    r = client.post("/rerank", json={"query": "q", "texts": [TEXTS[0], blob], "truncate": True})
    assert r.status_code == 413 and r.json()["error"].startswith("texts[1] has 140000"), r.text


# -- token-id input ----------------------------------------------------------------------------
def test_token_id_input(client: TestClient, engine: Engine) -> None:
    text = TEXTS[1]
    with_specials = engine.tokenizer.encode([text]).ids[0].tolist()
    content = with_specials[1:-1]
    want = engine.embed(text).dense[0]
    for payload in (with_specials, content, [with_specials], [content, with_specials]):
        r = client.post("/v1/embeddings", json={"input": payload})
        assert r.status_code == 200, (payload, r.text)
        body = r.json()
        for row in dense_rows(body):
            np.testing.assert_allclose(row, want, atol=ATOL, rtol=0)
        assert body["usage"]["prompt_tokens"] == len(with_specials) * len(body["data"])


@pytest.mark.parametrize("bad_id", [3000, 249_999, 250_002, -1])
def test_out_of_range_token_id_is_400(client: TestClient, bad_id: int) -> None:
    """The tiny model's vocabulary is 3000: ids valid for bge-m3 but not for it are refused too."""
    r = client.post("/v1/embeddings", json={"input": [[0, 5, bad_id, 2]]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith("input[0]")
    assert str(bad_id) in err["message"]


# -- /health -----------------------------------------------------------------------------------
def test_health_ok(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["max_seq_length"] == MAX_SEQ
    assert body["workers"] == {"live": 1, "loaded": 1, "total": 1, "busy": 0}
    tuning = body["tuning"]
    assert tuning["probe_status"] == "disabled"
    for key in ("a_bytes_per_token", "b_bytes_per_token_sq", "max_workspace_bytes",
                "memory_source", "available_bytes", "model_rss_bytes_per_worker"):
        assert key in tuning, key
    assert tuning["a_bytes_per_token"] > 0 and tuning["b_bytes_per_token_sq"] >= 0
    assert tuning["max_workspace_bytes"] > 0 and tuning["available_bytes"] > 0
    assert tuning["memory_source"] in ("override", "cgroup_v2", "cgroup_v1", "meminfo")
    assert tuning["model_rss_bytes_per_worker"] >= 0
    assert tuning["max_seq_that_fits"] >= MAX_SEQ
    model = body["model"]
    assert model["variant"] == "fp32" and model["layout"] == "bgeserve"
    assert model["backend"].startswith("onnxruntime ")
    assert model["choice"] == "pinned" and model["candidates"] == {}
    # The limits in force, the ColBERT cap derived from the memory (BGE_M3_MAX_COLBERT_MB unset).
    limits = body["limits"]
    assert 1 <= limits["max_colbert_mb"] <= 512 and limits["max_batch"] == 2048
    # the allowance in force: the default (256 MiB), never below one largest body
    assert limits["max_body_bytes"] > 0 and limits["max_inflight_mb"] == 256
    # The resident memory now, this process's (QA: no current figure in /health).
    from bgeserve.tuning import memory

    assert 0.5 < body["memory"]["rss_mb"] / (memory.rss_bytes() / 2**20) < 2


def test_an_unpinned_start_serves_the_rules_pick(tiny_export: Path, tmp_path: Path) -> None:
    """Neither BGE_M3_MODEL nor BGE_M3_EP, BGE_M3_DISABLE_AUTO_BUDGET=1: nothing is measured and
    the rule's pick over the export's manifest serves (on this CPU int8, which the tiny export
    measured above the bar in the encoding this CPU computes as measured)."""
    from bgeserve.model.artifacts import export_variants
    from bgeserve.runtime.select import THIS_MACHINE, cpu_default

    rule = cpu_default(export_variants(tiny_export), THIS_MACHINE)
    with serving(base_env(tiny_export, tmp_path)) as (c, _):
        model = wait_health(c)["model"]
    assert (model["variant"], model["choice"], model["candidates"]) == (rule.variant, "rule", {})


def test_the_start_up_objects_are_frozen_out_of_the_collector(client: TestClient) -> None:
    """Once ready, what the start made is in the permanent generation (gc.freeze): a full
    collection on the event loop walks only what requests made since."""
    import gc

    assert client.get("/health").json()["status"] == "ok"
    assert gc.get_freeze_count() > 0


def gated_load(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The service's model files are found only once the returned event is set: it loads
    until then."""
    gate = threading.Event()
    real_resolve = service_module.resolve

    def slow_resolve(**kwargs: Any) -> Any:
        assert gate.wait(30), "the test never opened the gate"
        return real_resolve(**kwargs)

    monkeypatch.setattr(service_module, "resolve", slow_resolve)
    return gate


def test_health_loading_then_ok(tiny_export: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """While the model loads /health is 503 loading and embeddings are 503 not_ready."""
    gate = gated_load(monkeypatch)
    monkeypatch.setattr(service_module, "LOADING_HOLD_S", 0.05)
    try:
        with serving(base_env(tiny_export, tmp_path)) as (c, _):
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            # Not known before the model's positions are read (it said the setting, 8192).
            assert "max_seq_length" not in r.json()
            e = c.post("/v1/embeddings", json={"input": "x"})
            assert e.status_code == 503 and e.json()["error"]["code"] == "not_ready"
            assert e.headers["retry-after"] == "2"  # a client that honours it polls again
            tei = c.post("/embed", json={"inputs": "x"})
            assert tei.status_code == 503 and tei.headers["retry-after"] == "2"
            gate.set()
            assert wait_health(c)["max_seq_length"] > 0
            assert c.post("/v1/embeddings", json={"input": "x"}).status_code == 200
    finally:
        gate.set()


def test_a_request_while_loading_waits_a_little_for_the_model(
        tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A model request that comes while the model loads is held up to LOADING_HOLD_S: served
    if the load ends meanwhile; else its 503 comes after the hold, so a client that retries at
    once (Hugging Face's JS client ignores Retry-After) polls no faster than one that honours
    it; one warning a try (the access line), not two. Probes are not held."""
    gate = gated_load(monkeypatch)
    monkeypatch.setattr(service_module, "LOADING_HOLD_S", 2.0)
    try:
        with serving(base_env(tiny_export, tmp_path)) as (c, _):
            started = time.monotonic()
            assert c.get("/health").status_code == 503  # a probe: at once
            assert c.post("/v1/nothing", json={}).status_code == 404  # no model route: at once
            assert time.monotonic() - started < 1.0
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="bgeserve"):
                started = time.monotonic()
                e = c.post("/v1/embeddings", json={"input": "x"})
                held = time.monotonic() - started
            assert e.status_code == 503 and e.json()["error"]["code"] == "not_ready"
            assert held >= 2.0, held
            warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(warnings) == 1 and "503" in warnings[0], warnings

            monkeypatch.setattr(service_module, "LOADING_HOLD_S", 30.0)
            answers: list[Any] = []
            poster = threading.Thread(target=lambda: answers.append(
                c.post("/v1/embeddings", json={"input": "x"})))
            started = time.monotonic()
            poster.start()
            time.sleep(0.3)  # the request is held now
            gate.set()
            poster.join(30)
            assert answers and answers[0].status_code == 200, answers
            assert time.monotonic() - started < 25  # the load's end, not the hold's
            assert wait_health(c)["status"] == "ok"
            started = time.monotonic()
            assert c.post("/v1/embeddings", json={"input": "x"}).status_code == 200
            assert time.monotonic() - started < 5  # ready: nothing held
    finally:
        gate.set()


def test_health_fail_with_missing_model(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with serving(base_env(missing, tmp_path / "cache")) as (c, service):
        body = wait_health(c, status=503)
        deadline = time.monotonic() + 10
        while body["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.02)
            body = c.get("/health").json()
        assert body["status"] == "fail"
        assert str(missing) in body["error"]
        assert service.fatal_error is not None
        e = c.post("/v1/embeddings", json={"input": "x"})
        assert e.status_code == 503
        assert e.json()["error"]["code"] == "not_ready"
        assert "retry-after" not in e.headers  # retrying this server will not do


# -- /metrics ----------------------------------------------------------------------------------
def test_metrics_move(client: TestClient, engine: Engine) -> None:
    before = metric_samples(client.get("/metrics").text)
    # Texts no other test sends: a text seen before is answered by the embedding cache.
    texts = ["metrics one", "metrics two two", "metrics " + LONG]
    assert client.post("/v1/embeddings", json={"input": texts}).status_code == 200
    assert client.post("/v1/embeddings", json={"input": []}).status_code == 400
    # Answered by a guard from Content-Length, before routing: still labelled by its route
    # (it was "unmatched", as an unknown path is).
    over = b" " * ((32 << 20) + 1)
    assert client.post("/v1/embeddings", content=over,
                       headers={"content-type": "application/json"}).status_code == 413
    assert client.post("/v1/nothing", json={"input": "x"}).status_code == 404
    # A browser's CORS preflight is no embedding request (QA: counted as a 200 of the route)
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST"}
    assert client.options("/v1/embeddings", headers=preflight).status_code == 200
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = metric_samples(r.text)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    ok_route = {"route": "/v1/embeddings", "status": "200"}
    assert delta("bgeserve_http_requests_total", **ok_route) == 1
    assert delta("bgeserve_http_requests_total", route="/v1/embeddings", status="400") == 1
    assert delta("bgeserve_http_requests_total", route="/v1/embeddings", status="413") == 1
    assert delta("bgeserve_http_requests_total", route="unmatched", status="404") == 1
    assert delta("bgeserve_http_requests_total", route="preflight", status="200") == 1
    assert delta("bgeserve_http_request_duration_seconds_count", route="/v1/embeddings") == 3
    assert delta("bgeserve_texts_total") == 3
    assert delta("bgeserve_truncated_texts_total") == 1
    expected_tokens = n_tokens(engine, texts[:2]) + MAX_SEQ
    assert delta("bgeserve_tokens_total") == expected_tokens
    assert delta("bgeserve_embed_duration_seconds_count") == 1
    assert delta("bgeserve_inference_duration_seconds_count") >= 1
    assert after[("bgeserve_probe_status", (("status", "disabled"),))] == 1
    assert after[("bgeserve_workers", (("state", "live"),))] == 1
    assert after[("bgeserve_queue_texts", ())] == 0
    assert after[("bgeserve_process_rss_bytes", ())] > 0
    assert after[("bgeserve_workspace_budget_bytes", ())] > 0
    assert ("bgeserve_rejected_requests_total", ()) in after


# -- the memory budget -------------------------------------------------------------------------
def test_memory_budget_refuses_long_texts_only(tiny_export: Path, tmp_path: Path,
                                               engine: Engine, short_engine: Engine) -> None:
    """A tight budget: what fits runs (split into small chunks), what cannot fit is a 413."""
    with serving(base_env(tiny_export, tmp_path, BGE_M3_MODEL="fp32")) as (c, service):
        wait_health(c)
        tuning = c.get("/health").json()["tuning"]
        a, b = tuning["a_bytes_per_token"], tuning["b_bytes_per_token_sq"]
        # Budget for one 24-token text: a longer one (the probe having found a costlier model
        # than the conservative one, say) must be refused rather than run into an OOM.
        tight = CostModel(a, b, int(CostModel(a, b, 0).cost(1, 24)))
        assert service.engine is not None
        service.engine.set_cost_model(tight)
        long_ok = "x y z " * 8  # over 24 tokens, under MAX_SEQ
        assert 24 < len(engine.tokenizer.encode([long_ok]).ids[0]) <= MAX_SEQ
        r = c.post("/v1/embeddings", json={"input": [TEXTS[0], long_ok]})
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["param"] == "input[1]" and "BGE_M3_MAX_SEQ_LENGTH" in err["message"]
        shorts = [t for t in TEXTS if len(engine.tokenizer.encode([t]).ids[0]) <= 24]
        assert len(shorts) >= 3
        r = c.post("/v1/embeddings", json={"input": shorts})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(dense_rows(r.json()), engine.embed(shorts).dense,
                                   atol=ATOL, rtol=0)


def test_token_budget_setting_is_enforced(tiny_export: Path, tmp_path: Path,
                                          short_engine: Engine) -> None:
    """BGE_M3_TOKEN_BUDGET pins the budget; the server only starts when max_seq fits it."""
    dims = model_dims(resolve(model_path=tiny_export, variant="fp32", cache_dir=tmp_path,
                              offline=True))
    a, b = conservative_coefficients(**dims)
    budget = int(CostModel(a, b, 0).cost(1, MAX_SEQ))
    # fp32 pinned: compared with the exact engine below, and with the tuning on an unpinned
    # start would time its candidates (the tiny int8 passes the bar and may win).
    env = base_env(tiny_export, tmp_path, BGE_M3_TOKEN_BUDGET=str(budget), BGE_M3_MODEL="fp32")
    del env["BGE_M3_DISABLE_AUTO_BUDGET"]
    with serving(env) as (c, service):
        body = wait_health(c)
        assert body["tuning"]["probe_status"] == "disabled"
        assert body["tuning"]["max_workspace_bytes"] == budget
        assert (body["tuning"]["a_bytes_per_token"], body["tuning"]["b_bytes_per_token_sq"]) == (
            a, b)
        # every text fits alone; two MAX_SEQ texts do not fit together and are split
        texts = [LONG, LONG + " again", TEXTS[0]]
        r = c.post("/v1/embeddings", json={"input": texts})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(dense_rows(r.json()), short_engine.embed(texts).dense,
                                   atol=ATOL, rtol=0)
        r = c.post("/v1/embeddings", json={"input": [TEXTS[0], LONG], "truncate": False})
        assert r.status_code == 413
        assert "BGE_M3_MAX_SEQ_LENGTH" in r.json()["error"]["message"]
    # one token less of budget and a MAX_SEQ text no longer fits: refused at start
    env["BGE_M3_TOKEN_BUDGET"] = str(budget - 1)
    workers_before = worker_threads()
    with serving(env) as (c, service):
        body = wait_health(c, status=503)
        deadline = time.monotonic() + 10
        while body["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.02)
            body = c.get("/health").json()
        assert body["status"] == "fail"
        assert "BGE_M3_MAX_SEQ_LENGTH" in body["error"]
        assert service.engine is None
    # the sessions loaded before the refusal were released with their worker threads
    deadline = time.monotonic() + 10
    while worker_threads() > workers_before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker_threads() == workers_before


def test_heartbeat_logs_rss_workers_queue_and_probe(tiny_export: Path, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Every BGE_M3_HEARTBEAT_SECS a 'heartbeat' record carries RSS, workers, queue, probe."""
    env = base_env(tiny_export, tmp_path, BGE_M3_HEARTBEAT_SECS="1")
    with caplog.at_level(logging.INFO, "bgeserve.service"), serving(env) as (client, _):
        wait_health(client)
        deadline = time.monotonic() + 10
        beats: list[logging.LogRecord] = []
        while time.monotonic() < deadline and not any(
                hasattr(r, "loaded_workers") for r in beats):
            time.sleep(0.1)
            beats = [r for r in caplog.records if r.getMessage() == "heartbeat"]
    beat = next(r for r in beats if hasattr(r, "loaded_workers"))
    assert beat.rss_mb > 0 and beat.live_workers == beat.loaded_workers == 1
    assert beat.queue_texts == 0 and beat.probe_status == "disabled"


def test_a_repeated_request_is_answered_by_the_cache(client: TestClient) -> None:
    """The same texts again run no chunk, come back identical, and count as cache hits."""
    body = {"input": ["cached once", "cached twice over", "cached once"],
            "encoding_format": "base64"}
    first = client.post("/v1/embeddings:both", json=body)
    before = metric_samples(client.get("/metrics").text)
    again = client.post("/v1/embeddings:both", json=body)
    after = metric_samples(client.get("/metrics").text)

    def delta(name: str) -> float:
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    assert first.status_code == again.status_code == 200
    assert again.json()["data"] == first.json()["data"]
    assert first.json()["data"][0]["embedding"] == first.json()["data"][2]["embedding"]
    assert delta("bgeserve_cache_hits_total") == 2 and delta("bgeserve_cache_repeats_total") == 1
    assert delta("bgeserve_inference_duration_seconds_count") == 0
    assert again.json()["usage"] == first.json()["usage"]


def test_a_late_canary_is_judged_by_the_engines_running_chunks_and_drain_rate(
        tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service hands /health/deep what the engine runs now and the measured drain rate: a
    canary late behind a chunk within its time is 200 "busy", behind one far past it 503."""
    import asyncio

    from bgeserve.engine.workers import Running

    env = base_env(tiny_export, tmp_path, BGE_M3_MODEL="fp32")
    with serving(env) as (client, service):
        wait_health(client)
        assert service.deep is not None and service.engine is not None
        assert service.drain.rate() > 0  # the start-up canary measured it

        async def late() -> Any:
            await asyncio.sleep(10)

        monkeypatch.setattr(service.deep, "embed", late)
        chunk = [Running(30.0, 512, False)]  # under the 60 s floor at any rate
        monkeypatch.setattr(service.engine, "running", lambda: chunk)
        r = client.get("/health/deep", params={"timeout": 1})
        assert r.status_code == 200 and r.json()["status"] == "busy", r.json()
        chunk[0] = Running(1000.0, 512, False)
        r = client.get("/health/deep", params={"timeout": 1})
        assert r.status_code == 503 and "longer than 1s" in r.json()["reason"], r.json()
