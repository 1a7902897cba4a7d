"""Every script in ``examples/`` against a live ``bgeserve serve`` (tiny random bge-m3), with
the real client packages: their vectors equal the engine's (which, for every text sent here,
are FlagEmbedding's: the first test), hybrid queries in Qdrant (local
mode) and Milvus Lite find the expected documents, and LangChain's *default* settings get the
clear 400 instead of silently wrong vectors.

No network: Qdrant runs in-process (``:memory:``), Milvus Lite from a local ``.db`` file, and
tiktoken (LangChain's default path) reads llama-index-core's bundled ``cl100k_base``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import numpy as np
import openai
import pytest

from bgeserve import Engine
from tests.oracle import FP32, assert_matches, reference
from tests.serverproc import REPO, ServerProc

pytestmark = pytest.mark.slow

ATOL = 1e-5
EXAMPLES = REPO / "examples"
TEXTS = ["What is BGE M3?", "Definition of BM25", "hybrid search 混合检索"]


@pytest.fixture(scope="module")
def engine(tiny_export: Path) -> Iterator[Engine]:
    with Engine(tiny_export, "fp32") as e:
        yield e


@pytest.fixture(scope="module")
def server(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One default server for the module (fp32: vectors compared with the engine's)."""
    env = {"BGE_M3_MODEL_PATH": str(tiny_export), "BGE_M3_MODEL": "fp32",
           "BGE_M3_CACHE_DIR": str(tmp_path_factory.mktemp("examples-cache")),
           "BGE_M3_DISABLE_AUTO_BUDGET": "1", "BGE_M3_MAX_SEQ_LENGTH": "512"}
    with ServerProc(env) as proc:
        proc.wait_health(timeout=60)
        yield proc


@pytest.fixture(scope="module")
def url(server: ServerProc) -> str:
    return server.url


def example(name: str, url: str) -> ModuleType:
    """``examples/<name>.py`` imported afresh with ``BGESERVE_URL=url`` (read at import)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BGESERVE_URL", url)
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def dense(engine: Engine, texts: list[str]) -> np.ndarray:
    out = engine.embed(texts).dense
    assert out is not None
    return out


def sparse(engine: Engine, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    out = engine.embed(texts, dense=False, sparse=True).sparse
    assert out is not None
    return out


def texts_embedded(url: str) -> float:
    """``bgeserve_texts_total`` from /metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("bgeserve_texts_total "):
            return float(line.split()[1])
    raise AssertionError("bgeserve_texts_total is missing")


def top_first(scores: np.ndarray, i: int) -> bool:
    return bool(np.argmax(scores) == i and np.sum(scores == scores[i]) == 1)


def sparse_scores(vectors: list[tuple[np.ndarray, np.ndarray]], i: int) -> np.ndarray:
    """Dot products of sparse vector ``i`` with each of ``vectors``."""
    query = dict(zip(vectors[i][0].tolist(), vectors[i][1].tolist(), strict=True))
    return np.array([sum(query.get(t, 0.0) * w for t, w in zip(ids.tolist(), ws.tolist(),
                                                               strict=True))
                     for ids, ws in vectors])


# -- the reference ----------------------------------------------------------------------------------
def test_the_engine_compared_with_is_flagembedding(url: str, engine: Engine, flag_model) -> None:
    """The vectors every client test compares with are the reference's: for each text the
    tests and examples send, the engine's dense, sparse and ColBERT outputs equal
    FlagEmbedding's BGEM3FlagModel (fp32, SPEC §2 tolerances)."""
    docs = example("qdrant_hybrid", url).DOCS + example("milvus_hybrid", url).DOCS
    texts = [*TEXTS, *docs, "a b", "text number 0", "text number 999"]
    ours = engine.embed(texts, dense=True, sparse=True, colbert=True)
    assert_matches(ours, reference(flag_model, texts), FP32)


# -- LangChain ------------------------------------------------------------------------------------
def test_langchain_default_settings_get_the_clear_400(url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """LangChain's default ``OpenAIEmbeddings`` sends tiktoken cl100k ids: a 400 that names
    ``check_embedding_ctx_length=False`` and BGE_M3_ACCEPT_TOKEN_IDS, and nothing embedded."""
    import llama_index.core
    from langchain_openai import OpenAIEmbeddings

    cache = Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))  # cl100k_base, offline
    before = texts_embedded(url)
    emb = OpenAIEmbeddings(model="bge-m3", base_url=f"{url}/v1", api_key="unused",  # type: ignore[arg-type]
                           max_retries=0)
    for call in (lambda: emb.embed_documents(TEXTS), lambda: emb.embed_query("q")):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        error = caught.value.body
        assert isinstance(error, dict) and error["code"] == "token_ids_not_accepted"
        assert "check_embedding_ctx_length=False" in error["message"]
        assert "BGE_M3_ACCEPT_TOKEN_IDS=1" in error["message"]
    assert texts_embedded(url) == before


def test_langchain_example_gets_the_engines_vectors(url: str, engine: Engine) -> None:
    """With ``check_embedding_ctx_length=False`` (the example) LangChain sends the texts, in
    one request of up to 1,000 (its default chunk_size, under BGE_M3_MAX_BATCH)."""
    emb = example("langchain_embeddings", url).embeddings()
    many = [f"text number {i}" for i in range(1000)]
    np.testing.assert_allclose(emb.embed_documents(TEXTS), dense(engine, TEXTS), atol=ATOL,
                               rtol=0)
    np.testing.assert_allclose(emb.embed_query(TEXTS[0]), dense(engine, TEXTS[:1])[0],
                               atol=ATOL, rtol=0)
    got = np.array(emb.embed_documents(many))
    np.testing.assert_allclose(got[[0, 999]], dense(engine, [many[0], many[999]]), atol=ATOL,
                               rtol=0)


# -- LlamaIndex, OpenAI, TEI client ---------------------------------------------------------------
def test_llamaindex_example_gets_the_engines_vectors(url: str, engine: Engine) -> None:
    """``OpenAILikeEmbedding`` (newlines become spaces before sending, as LlamaIndex does)."""
    emb = example("llamaindex_embeddings", url).embeddings()
    np.testing.assert_allclose(emb.get_text_embedding_batch(TEXTS), dense(engine, TEXTS),
                               atol=ATOL, rtol=0)
    np.testing.assert_allclose(emb.get_query_embedding("a\nb"), dense(engine, ["a b"])[0],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_openai_example_gets_the_engines_vectors(url: str, engine: Engine,
                                                 encoding_format: str | None) -> None:
    """The official client, base64 (its default) and float; ``models.retrieve`` works."""
    module = example("openai_client", url)
    got = module.embed(TEXTS, encoding_format=encoding_format)
    np.testing.assert_allclose(got, dense(engine, TEXTS), atol=ATOL, rtol=0)
    assert module.client().models.retrieve("BAAI/bge-m3").id == "BAAI/bge-m3"


def test_tei_client_example_gets_the_engines_vectors(url: str, engine: Engine) -> None:
    """``huggingface_hub.InferenceClient`` on ``/embed`` and on the bare URL (``POST /``):
    ``feature_extraction`` gives (n, width) float32, the engine's vectors;
    ``sentence_similarity`` the cosines."""
    module = example("tei_client", url)
    want = dense(engine, TEXTS)
    for route in ("/embed", ""):
        got = module.embed(TEXTS, route=route)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
        one = module.embed(TEXTS[0], route=route)
        assert one.shape == (1, want.shape[1])
    cosines = module.similarity(TEXTS[0], TEXTS[1:])
    np.testing.assert_allclose(cosines, want[1:] @ want[0], atol=ATOL, rtol=0)


# -- vector databases -------------------------------------------------------------------------------
def test_qdrant_example_hybrid_search(url: str, engine: Engine) -> None:
    """Qdrant local mode: the stored dense and sparse vectors are the engine's, and an RRF
    hybrid query with a document's own text ranks that document first."""
    module = example("qdrant_hybrid", url)
    docs = module.DOCS
    client = module.build(docs)
    want_dense, want_sparse = dense(engine, docs), sparse(engine, docs)
    # What the server answers for them (build's own answer again: the embedding cache's).
    answered = module.embed_both(docs, url)
    points = client.retrieve(module.COLLECTION, ids=list(range(len(docs))), with_vectors=True)
    for point in sorted(points, key=lambda p: p.id):
        np.testing.assert_allclose(point.vector["dense"], want_dense[point.id], atol=ATOL, rtol=0)
        ids, weights = want_sparse[point.id]
        assert point.vector["sparse"].indices == ids.tolist()
        # The engine's within the parity tolerance (its own packing of the texts differs from
        # the server's by the last float32 bits), and stored unchanged: bit for bit what the
        # server answered.
        np.testing.assert_allclose(point.vector["sparse"].values, weights, atol=ATOL, rtol=0)
        np.testing.assert_array_equal(np.float32(point.vector["sparse"].values),
                                      np.float32(answered[point.id]["sparse_values"]["values"]))
    for i, doc in enumerate(docs):
        # The precondition that makes "first" the expected answer: the document is its own
        # best match by dense and by sparse score.
        assert top_first(want_dense @ want_dense[i], i)
        assert top_first(sparse_scores(want_sparse, i), i)
        hits = module.search(client, doc)
        assert hits[0].payload["text"] == doc, [h.payload["text"] for h in hits]
    client.close()


def test_milvus_example_hybrid_search_skips_empty_sparse_vectors(url: str, engine: Engine,
                                                                  tmp_path: Path) -> None:
    """Milvus Lite: ``sparse_format=dict`` inserts as a SPARSE_FLOAT_VECTOR, the empty text is
    left out by ``sparse_empty=omit`` (Milvus would refuse the whole insert), the stored
    vectors are the engine's, and an RRF hybrid query finds each document first."""
    module = example("milvus_hybrid", url)
    docs = module.DOCS
    assert docs[-1] == ""
    client, skipped = module.build(docs, str(tmp_path / "milvus.db"))
    assert skipped == [len(docs) - 1]
    kept = docs[:-1]
    want_dense, want_sparse = dense(engine, kept), sparse(engine, kept)
    answered = module.embed_both(docs)  # what the server answers (build's answer again)
    rows = client.query(module.COLLECTION, filter="id >= 0", output_fields=["dense", "sparse"])
    assert sorted(r["id"] for r in rows) == list(range(len(kept)))
    for row in rows:
        np.testing.assert_allclose(row["dense"], want_dense[row["id"]], atol=ATOL, rtol=0)
        ids, weights = want_sparse[row["id"]]
        assert sorted(int(k) for k in row["sparse"]) == ids.tolist()
        stored = [row["sparse"][k] for k in sorted(row["sparse"], key=int)]
        np.testing.assert_allclose(stored, weights, atol=ATOL, rtol=0)  # the engine's packing
        given = answered[row["id"]]["sparse_values"]  # {id: weight}, as inserted
        np.testing.assert_array_equal(np.float32(stored),
                                      np.float32([given[k] for k in sorted(given, key=int)]))
    for i, doc in enumerate(kept):
        assert top_first(want_dense @ want_dense[i], i)
        assert top_first(sparse_scores(want_sparse, i), i)
        hits = module.search(client, doc)
        assert hits[0]["entity"]["text"] == doc, [h["entity"]["text"] for h in hits]
    client.close()


def test_milvus_refuses_the_empty_sparse_vector_that_omit_avoids(url: str,
                                                                 tmp_path: Path) -> None:
    """Why ``sparse_empty=omit`` exists: with ``keep`` the empty text's ``{}`` makes Milvus
    refuse the insert."""
    from pymilvus import MilvusException

    module = example("milvus_hybrid", url)
    client, _ = module.build(module.DOCS[:1], str(tmp_path / "m.db"))
    r = httpx.post(f"{url}/v1/embeddings:both", json={"input": [""], "sparse_format": "dict"})
    (item,) = r.json()["data"]
    assert item["sparse_values"] == {}
    with pytest.raises(MilvusException, match="at least one nonzero"):
        client.insert(module.COLLECTION, [{"id": 9, "text": "", "dense": item["embedding"],
                                           "sparse": item["sparse_values"]}])
    client.close()


def test_elasticsearch_example_bodies(url: str, engine: Engine) -> None:
    """The ``sparse_vector`` bodies: token strings to positive weights (the max over ids that
    share a string), or token ids as strings; the query uses the query text's weights."""
    module = example("elasticsearch_bodies", url)
    assert module.mapping()["mappings"]["properties"]["sparse"] == {"type": "sparse_vector"}
    docs = module.documents(TEXTS)
    by_id = module.documents(TEXTS, keys="ids")
    for text, doc, doc_ids, (ids, weights) in zip(TEXTS, docs, by_id, sparse(engine, TEXTS),
                                                   strict=True):
        want: dict[str, float] = {}
        for token, w in zip(engine.tokenizer.id_to_token(ids), weights, strict=True):
            want[token] = max(want.get(token, 0.0), float(w))
        assert doc["text"] == text
        assert set(doc["sparse"]) == set(want)
        np.testing.assert_allclose([doc["sparse"][t] for t in want], list(want.values()),
                                   atol=1e-7, rtol=0)
        assert list(doc_ids["sparse"]) == [str(i) for i in ids.tolist()]
        assert all(w > 0 for w in doc["sparse"].values())
    query = module.query(TEXTS[0])["query"]["sparse_vector"]
    assert query["field"] == "sparse" and set(query["query_vector"]) == set(docs[0]["sparse"])
    np.testing.assert_allclose([query["query_vector"][t] for t in docs[0]["sparse"]],
                               list(docs[0]["sparse"].values()), atol=ATOL, rtol=0)


# -- as-is ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["openai_client", "langchain_embeddings",
                                  "llamaindex_embeddings", "tei_client", "qdrant_hybrid",
                                  "milvus_hybrid", "elasticsearch_bodies"])
def test_every_example_main_runs(url: str, name: str, capsys: pytest.CaptureFixture) -> None:
    """Each example's ``main()`` (what ``python examples/<name>.py`` runs) completes."""
    example(name, url).main()
    assert capsys.readouterr().out.strip()


def test_an_example_runs_as_a_script(server: ServerProc) -> None:
    """``BGESERVE_URL=... python examples/tei_client.py`` as a user runs it (the example with
    the lightest imports: a fresh interpreter importing openai or qdrant costs seconds)."""
    env = {**os.environ, "BGESERVE_URL": server.url}
    done = subprocess.run([sys.executable, str(EXAMPLES / "tei_client.py")], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"{done.stderr}\n{server.health().text}\n{server.output()}"
    assert "feature_extraction: (2, " in done.stdout and "similarity: [" in done.stdout


def test_cohere_clients_get_the_engines_vectors(url: str, engine: Engine) -> None:
    """The Cohere SDK's v1 and v2 embed and LangChain's CohereEmbeddings, pointed at the bare
    host: the engine's vectors; ``ubinary`` / ``binary`` their sign bits packed."""
    import cohere
    from langchain_cohere import CohereEmbeddings

    want = engine.embed(TEXTS).dense
    v2 = cohere.ClientV2(api_key="unused", base_url=url).embed(
        model="bge-m3", texts=TEXTS, input_type="search_document",
        embedding_types=["float", "ubinary", "binary"])
    np.testing.assert_allclose(np.asarray(v2.embeddings.float_), want, atol=ATOL)
    ubinary = np.asarray(v2.embeddings.ubinary, dtype=np.uint8)
    np.testing.assert_array_equal(ubinary, np.packbits(want > 0, axis=1))
    np.testing.assert_array_equal(np.asarray(v2.embeddings.binary), ubinary.astype(int) - 128)
    v1 = cohere.Client(api_key="unused", base_url=url).embed(texts=TEXTS, model="bge-m3",
                                                             input_type="search_query")
    np.testing.assert_allclose(np.asarray(v1.embeddings), want, atol=ATOL)
    lc = CohereEmbeddings(model="bge-m3", base_url=url, cohere_api_key="unused")
    np.testing.assert_allclose(np.asarray(lc.embed_documents(TEXTS)), want, atol=ATOL)
    np.testing.assert_allclose(lc.embed_query(TEXTS[0]), want[0], atol=ATOL)
