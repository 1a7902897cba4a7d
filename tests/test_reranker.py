"""Tests for bgeserve.engine.reranker: the in-process cross-encoder on its own engine."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bgeserve.engine.pairs import PairConfig
from bgeserve.engine.reranker import Reranker
from bgeserve.errors import ModelUnavailable, TooLarge
from bgeserve.results import RerankOptions
from bgeserve.testing.randmodel import random_texts
from bgeserve.tuning.costmodel import CostModel
from tests.oracle import rerank_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pairs() -> tuple[str, list[str]]:
    docs = random_texts(81, 7, 1, 60) + ["", " ".join(random_texts(82, 8, 30, 40))]
    return random_texts(80, 1, 3, 10)[0], docs


@pytest.fixture(scope="module")
def reranker(tiny_reranker_export, tmp_path_factory):
    with Reranker(tiny_reranker_export, "fp32", cache_dir=tmp_path_factory.mktemp("cache"),
                  offline=True) as r:
        yield r


def test_scores_match_flagreranker_sync_and_async(reranker, flag_reranker, pairs) -> None:
    """rerank / arerank: raw logits and sigmoid scores within 1e-4 of FlagReranker
    (max_length 8192), in input order; the ranking is FlagReranker's."""
    query, docs = pairs
    ref = rerank_reference(flag_reranker, [[query, d] for d in docs])
    raw = reranker.rerank(query, docs)
    np.testing.assert_allclose(raw.scores, ref, atol=1e-4, rtol=0)
    norm = asyncio.run(reranker.arerank(query, docs, normalize=True))
    np.testing.assert_allclose(norm.scores, 1 / (1 + np.exp(-ref)), atol=1e-4, rtol=0)
    assert raw.ranking() == sorted(range(len(docs)), key=lambda i: -ref[i])
    assert raw.model == "bge-reranker-v2-m3" and raw.tokens > 0
    assert raw.windows.tolist() == [1] * len(docs) and not raw.truncated.any()


def test_a_stock_onnx_snapshot_scores_the_same(tiny_reranker_stock, flag_reranker, pairs,
                                               tmp_path) -> None:
    """A hub-style snapshot (onnx/model.onnx, logits [B, 1], plain attention) scores as
    FlagReranker does too."""
    query, docs = pairs
    ref = rerank_reference(flag_reranker, [[query, d] for d in docs])
    with Reranker(tiny_reranker_stock, "fp32", cache_dir=tmp_path, offline=True) as r:
        got = r.rerank(query, docs)
    np.testing.assert_allclose(got.scores, ref, atol=1e-4, rtol=0)


def test_long_documents_windows_or_truncate(tiny_reranker_export, tmp_path, pairs) -> None:
    """With 64-token pairs: windows (the default) score the long document over several rows
    and never lower than its cut; ``truncate`` cuts and flags it."""
    query, docs = pairs
    with Reranker(tiny_reranker_export, "fp32", pairs=PairConfig(max_length=64),
                  cache_dir=tmp_path, offline=True) as r:
        windows = r.rerank(query, docs)
        cut = r.rerank(query, docs, long_documents="truncate")
    assert windows.windows[-1] > 1 and not windows.truncated[-1]
    assert cut.truncated[-1] and cut.windows[-1] == 1
    assert windows.scores[-1] >= cut.scores[-1] - 1e-6
    assert windows.tokens > cut.tokens


def test_a_repeated_document_runs_once_and_scores_alike(tiny_reranker_export, tmp_path,
                                                         pairs) -> None:
    """The same document twice (windows and all) runs its rows once: equal scores, the first
    ranked first. Run apart, in other chunks, copies scored apart by ~3e-6 and a later copy
    could outrank its first (QA)."""
    query, docs = pairs
    docs = [*docs, *docs[::-1], docs[0]]
    n = len(pairs[1])
    with Reranker(tiny_reranker_export, "fp32", pairs=PairConfig(max_length=64),
                  cache_dir=tmp_path, offline=True) as r:
        plan, job = r.make_job(query, docs, RerankOptions())
        unique = {row.tobytes() for row in plan.rows}
        assert job.remaining == len(unique) < len(plan.rows)
        got = r.rerank(query, docs)
    for i in range(n):
        assert got.scores[i] == got.scores[2 * n - 1 - i], i
    assert got.scores[0] == got.scores[-1]
    ranking = got.ranking()
    for i in range(n):
        assert ranking.index(i) < ranking.index(2 * n - 1 - i)


def test_a_window_over_the_budget_is_413(reranker, pairs) -> None:
    """When one window cannot fit the memory budget the request is refused (413), naming the
    pair length (the server's reranker: BGE_M3_RERANK_MAX_LENGTH), before anything runs."""
    query, docs = pairs
    saved = reranker.engine.cost_model
    reranker.engine.set_cost_model(CostModel(1e6, 1e3, 64 << 20))
    try:
        with pytest.raises(TooLarge, match=r"Lower PairConfig\(max_length=\.\.\.\) \(windows"):
            reranker.rerank(query, docs)
    finally:
        reranker.engine.set_cost_model(saved)


def test_no_documents_is_an_empty_result(reranker) -> None:
    """Nothing to score gives an empty result at once."""
    got = reranker.rerank("q", [])
    assert len(got) == 0 and got.tokens == 0


def test_refuses_a_bge_m3_graph(tiny_export, tmp_path) -> None:
    """An embedding engine is not a reranker."""
    from bgeserve.engine import Engine

    with (Engine(tiny_export, "fp32", cache_dir=tmp_path, offline=True, start=False) as engine,
          pytest.raises(ModelUnavailable, match="not a reranker")):
        Reranker(engine=engine)


@pytest.mark.parametrize(("option", "value"), [
    ("max_tokens_per_doc", 0), ("max_tokens_per_doc", -5), ("max_tokens_per_doc", 2.5),
    ("long_documents", "all"), ("truncation_direction", "up")])
def test_bad_options_are_refused_naming_them(reranker, option, value) -> None:
    """A document limit of 0 or less cut every document to nothing (every score the same) and
    was accepted by the library, though a 400 over HTTP; every option is checked alike."""
    from bgeserve.errors import InvalidInput

    with pytest.raises(InvalidInput, match=option) as caught:
        reranker.rerank("q", ["a", "b"], **{option: value})
    assert caught.value.param == option


@pytest.mark.parametrize("max_length", [64, 512])
def test_min_tokens_bounds_the_rows_from_below(tiny_reranker_export, tmp_path, max_length) -> None:
    """Admission refuses rerank requests on ``min_tokens`` before tokenizing them: it must never
    exceed the tokens of the rows ``make_job`` builds (windows, cuts, a query past its limit,
    other scripts, empty texts), and must not be vacuous (most of the rows' tokens for plain
    words)."""
    from bgeserve.results import RerankOptions

    long_query = " ".join(random_texts(90, 1, 60, 80))
    docs = random_texts(91, 12, 1, 120) + ["", "混合检索 données été " * 40, "x" * 3000,
                                            " ".join(random_texts(92, 10, 40, 60))]
    cases = [RerankOptions(), RerankOptions(long_documents="truncate"),
             RerankOptions(max_tokens_per_doc=5),
             RerankOptions(long_documents="truncate", truncation_direction="left")]
    with Reranker(tiny_reranker_export, "fp32", pairs=PairConfig(max_length=max_length),
                  cache_dir=tmp_path, offline=True, start=False) as r:
        for query in ("what is it?", long_query, "", "检索"):
            for options in cases:
                plan, _ = r.make_job(query, docs, options)
                real = sum(len(row) for row in plan.rows)
                bound = r.min_tokens(query, docs, options)
                assert 0 < bound <= real, (query[:20], options)
                # Counting stops early when asked (a prefix's count), still a lower bound.
                for stop in (0, 10, bound // 2, bound - 1):
                    assert 0 < r.min_tokens(query, docs, options, stop_above=stop) <= bound
        # Plain words: the bound holds a good part of the rows' tokens (this tiny vocabulary
        # cuts a word into ~2 tokens; windows repeat the query and overlap), and counting
        # stops only once past stop_above.
        plain = ["the cat sat on the mat and then it ran " * k for k in range(1, 30)]
        for options in cases:
            plan, _ = r.make_job("where is the cat", plain, options)
            real = sum(len(row) for row in plan.rows)
            bound = r.min_tokens("where is the cat", plain, options)
            assert 0.25 * real <= bound <= real, (bound, real)
            for stop in (0, 10, bound // 2, bound - 1):
                assert stop < r.min_tokens("where is the cat", plain, options,
                                           stop_above=stop) <= bound
