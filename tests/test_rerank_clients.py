"""The rerank clients people use, pointed at a live server (tiny bge-m3 + tiny reranker) by
base URL: LangChain's JinaRerank and CohereRerank, LlamaIndex's JinaRerank and CohereRerank,
LlamaIndex's TEI reranker and a TEI-shaped client, each getting FlagEmbedding's order and scores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from bgeserve.testing.randmodel import random_texts
from tests.oracle import rerank_reference
from tests.serverproc import ServerProc

pytestmark = pytest.mark.slow
TOP_N = 3


@pytest.fixture(scope="module")
def server(tiny_export: Path, tiny_reranker_export: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    env = {"BGE_M3_MODEL_PATH": str(tiny_export), "BGE_M3_MODEL": "fp32",
           "BGE_M3_RERANK_MODEL_PATH": str(tiny_reranker_export), "BGE_M3_RERANK_VARIANT": "fp32",
           "BGE_M3_CACHE_DIR": str(tmp_path_factory.mktemp("rerank-live")),
           "BGE_M3_DISABLE_AUTO_BUDGET": "1"}
    with ServerProc(env) as proc:
        proc.wait_health(timeout=120)
        yield proc


@pytest.fixture(scope="module")
def case(flag_reranker) -> tuple[str, list[str], np.ndarray]:
    """A query, 8 documents, and FlagReranker's scores for them (max_length 8192): its raw
    logits, what /v1/rerank answers unless the request says normalize: true."""
    query = random_texts(91, 1, 3, 8)[0]
    docs = random_texts(92, 8, 2, 50)
    return query, docs, rerank_reference(flag_reranker, [[query, d] for d in docs])


def expect(case, got: list[tuple[str, float]]) -> None:
    """``got`` (text, score) is FlagReranker's top ``TOP_N``, in order, scores within 1e-4."""
    _, docs, ref = case
    order = np.argsort(-ref)[:TOP_N]
    assert [t for t, _ in got] == [docs[i] for i in order]
    np.testing.assert_allclose([s for _, s in got], ref[order], atol=1e-4, rtol=0)


def test_health_reports_both_models(server: ServerProc) -> None:
    """/health has bge-m3 and the reranker, each with its own tuning and workers."""
    body = server.health().json()
    assert body["status"] == "ok" and body["model"]["name"] == "bge-m3"
    rr = body["reranker"]
    assert rr["status"] == "ok" and rr["name"] == "bge-reranker-v2-m3" and rr["layout"] == "score"
    assert "shared with bge-m3" in rr["tuning"]["memory_source"]
    assert "shared with the reranker" in body["tuning"]["memory_source"]


def test_langchain_jina(server: ServerProc, case, monkeypatch) -> None:
    """langchain_community's JinaRerank (its URL is a module constant, patched here)."""
    import langchain_community.document_compressors.jina_rerank as jina
    from langchain_community.document_compressors import JinaRerank
    from langchain_core.documents import Document

    monkeypatch.setattr(jina, "JINA_API_URL", f"{server.url}/v1/rerank")
    query, docs, _ = case
    out = JinaRerank(jina_api_key="unused", model="bge-reranker-v2-m3", top_n=TOP_N
                     ).compress_documents([Document(page_content=d) for d in docs], query)
    expect(case, [(d.page_content, d.metadata["relevance_score"]) for d in out])


def test_langchain_cohere(server: ServerProc, case) -> None:
    """langchain_cohere's CohereRerank: the Cohere v2 SDK, POST /v2/rerank."""
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    query, docs, _ = case
    out = CohereRerank(cohere_api_key="unused", model="bge-reranker-v2-m3", top_n=TOP_N,
                       base_url=server.url
                       ).compress_documents([Document(page_content=d) for d in docs], query)
    expect(case, [(d.page_content, d.metadata["relevance_score"]) for d in out])


@pytest.mark.parametrize("kind", ["jina", "cohere"])
def test_llamaindex(server: ServerProc, case, kind: str) -> None:
    """LlamaIndex's JinaRerank (base_url …/v1) and CohereRerank (base_url, v2 SDK)."""
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    if kind == "jina":
        from llama_index.postprocessor.jinaai_rerank import JinaRerank

        post = JinaRerank(model="bge-reranker-v2-m3", api_key="unused", top_n=TOP_N,
                          base_url=f"{server.url}/v1")
    else:
        from llama_index.postprocessor.cohere_rerank import CohereRerank

        post = CohereRerank(model="bge-reranker-v2-m3", api_key="unused", top_n=TOP_N,
                            base_url=server.url, max_retries=0)
    query, docs, _ = case
    nodes = [NodeWithScore(node=TextNode(text=d)) for d in docs]
    out = post.postprocess_nodes(nodes, query_bundle=QueryBundle(query))
    expect(case, [(n.node.get_content(), n.score) for n in out])


def test_llamaindex_tei(server: ServerProc, case) -> None:
    """LlamaIndex's TEI reranker: POST {base_url}/rerank, TEI's sigmoid scores (its
    ``auth_token`` goes out as the whole Authorization header: test_http.test_auth)."""
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.postprocessor.tei_rerank import TextEmbeddingInference

    query, docs, ref = case
    post = TextEmbeddingInference(base_url=server.url, top_n=TOP_N)
    out = post.postprocess_nodes([NodeWithScore(node=TextNode(text=d)) for d in docs],
                                 query_bundle=QueryBundle(query))
    order = np.argsort(-ref)[:TOP_N]
    assert [n.node.get_content() for n in out] == [docs[i] for i in order]
    np.testing.assert_allclose([n.score for n in out], 1 / (1 + np.exp(-ref[order])), atol=1e-4)


def test_tei_shaped_client(server: ServerProc, case) -> None:
    """TEI's /rerank body and answer: every text, sorted, sigmoid scores (raw_scores false)."""
    query, docs, ref = case
    r = httpx.post(f"{server.url}/rerank", json={"query": query, "texts": docs,
                                                 "return_text": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["index"] for x in body] == np.argsort(-ref).tolist()
    sigmoid = 1 / (1 + np.exp(-ref))  # FlagReranker's normalize=True
    np.testing.assert_allclose([x["score"] for x in body], np.sort(sigmoid)[::-1], atol=1e-4)
    assert all(x["text"] == docs[x["index"]] for x in body)


def test_the_reranker_info_route_names_the_cross_encoder(server: ServerProc, case) -> None:
    """``/reranker/info``: the loaded cross-encoder as TEI reports a reranker (its pair
    length, its variant), for clients that check it before they POST ``/reranker/rerank``,
    which scores as ``/rerank`` does."""
    info = httpx.get(f"{server.url}/reranker/info", timeout=30).json()
    assert info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"},
                                               "label2id": {"LABEL_0": 0}}}
    assert info["model_id"] == "BAAI/bge-reranker-v2-m3" and info["model_sha"] is None
    assert info["served_model_name"] == "bge-reranker-v2-m3"
    assert info["model_dtype"] == "float32"
    rr = server.health().json()["reranker"]
    assert info["max_input_length"] == rr["max_length"]
    query, docs, _ = case
    body = {"query": query, "texts": docs}
    assert httpx.post(f"{server.url}/reranker/rerank", json=body, timeout=60).json() == \
        httpx.post(f"{server.url}/rerank", json=body, timeout=60).json()


def test_bge_m3_scores_through_the_same_route(server: ServerProc, flag_model, case) -> None:
    """``model: bge-m3`` on /v1/rerank: bge-m3's hybrid score (weights 0.4/0.2/0.4), as
    BGEM3FlagModel.compute_score gives it, in its order."""
    query, docs, _ = case
    ref = np.asarray(flag_model.compute_score(
        [[query, d] for d in docs], batch_size=1, max_query_length=8192, max_passage_length=8192,
        weights_for_different_modes=[0.4, 0.2, 0.4])["colbert+sparse+dense"])
    body = httpx.post(f"{server.url}/v1/rerank", json={"model": "bge-m3", "query": query,
                                                       "documents": docs}, timeout=60).json()
    assert body["model"] == "bge-m3"
    assert [x["index"] for x in body["results"]] == np.argsort(-ref).tolist()
    np.testing.assert_allclose([x["relevance_score"] for x in body["results"]],
                               np.sort(ref)[::-1], atol=1e-4)


def test_metrics_count_pairs_windows_and_latency(server: ServerProc, case) -> None:
    """/metrics counts rerank requests, pairs, windows, tokens and latency per scorer, and the
    reranker's own workers, runs (they were in no histogram) and queue (texts and tokens,
    empty when idle)."""
    from prometheus_client.parser import text_string_to_metric_families

    query, docs, _ = case
    httpx.post(f"{server.url}/v1/rerank", json={"query": query, "documents": docs}, timeout=60)
    samples = {(s.name, s.labels.get("scorer", s.labels.get("state"))): s.value
               for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
               for s in f.samples}
    scorer = "bge-reranker-v2-m3"
    assert samples[("bgeserve_rerank_requests_total", scorer)] >= 1
    assert samples[("bgeserve_rerank_pairs_total", scorer)] >= len(docs)
    assert samples[("bgeserve_rerank_windows_total", scorer)] >= len(docs)
    assert samples[("bgeserve_rerank_tokens_total", scorer)] > 0
    assert samples[("bgeserve_rerank_duration_seconds_count", scorer)] >= 1
    assert samples[("bgeserve_reranker_workers", "total")] == 1
    assert samples[("bgeserve_reranker_inference_duration_seconds_count", None)] >= 1
    assert samples[("bgeserve_reranker_queue_texts", None)] == 0
    assert samples[("bgeserve_reranker_queue_tokens", None)] == 0


def test_the_probe_child_measures_a_reranker(tiny_reranker_export: Path, tmp_path: Path) -> None:
    """The probe's process opens the reranker when its spec says so, and fits its cost."""
    from bgeserve.service import probe_child

    result = probe_child.run({
        "model_path": str(tiny_reranker_export), "reranker": True, "variant": "fp32",
        "cache_dir": str(tmp_path), "provider": "cpu", "threads": 1, "max_seq": 512,
        "shapes": [[1, 64], [2, 64], [1, 128], [2, 128], [1, 256], [4, 128]],
        "held_out": [2, 256], "guard_a": 1e5, "guard_b": 10.0, "guard_budget": 1 << 32})
    assert result["samples"], result
