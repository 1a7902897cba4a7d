"""Tests for bgeserve.engine.m3rerank: bge-m3 reranking, the query embedded once, windows."""

from __future__ import annotations

import numpy as np
import pytest

from bgeserve.engine.m3rerank import arerank_m3, arun_jobs, finish_m3, groups, plan_m3, rows
from bgeserve.engine.m3score import m3_scores
from bgeserve.engine.tokenizer import Tokenizer
from bgeserve.results import RerankOptions
from bgeserve.testing.randmodel import random_texts

pytestmark = pytest.mark.slow
MODES = ("dense", "sparse", "colbert", "sparse+dense", "colbert+sparse+dense")


@pytest.fixture(scope="module")
def engine(tiny_export, tmp_path_factory):
    from bgeserve.engine import Engine

    with Engine(tiny_export, "fp32", cache_dir=tmp_path_factory.mktemp("cache"),
                offline=True) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer(tiny_export) -> Tokenizer:
    return Tokenizer.load(tiny_export / "tokenizer.json", max_seq=1 << 30)


def rerank(engine, tokenizer, query, docs, max_seq, **options):
    """plan_m3 at ``max_seq`` (below the engine's, to make windows), embedded, finished."""
    opts = RerankOptions(**options)
    plan = plan_m3(tokenizer, query, docs, max_seq, opts)
    dense, sparse, colbert = plan.outputs
    embedded = engine.embed(plan.inputs, dense=dense, sparse=sparse, colbert=colbert)
    return plan, finish_m3(plan, rows(embedded, slice(0, 1)), rows(embedded, slice(1, None)),
                           opts)


@pytest.mark.parametrize("mode", MODES)
def test_matches_compute_score_with_the_query_embedded_once(engine, tokenizer, flag_model,
                                                            mode) -> None:
    """``Engine.rerank``: every mode within 1e-4 of BGEM3FlagModel.compute_score (batch_size
    1, 8192 limits), with one query input for all documents, usage counting each text once."""
    query = random_texts(71, 1, 3, 10)[0]
    docs = random_texts(72, 6, 1, 60) + ["", " ".join(random_texts(73, 30, 30, 40))]
    weights = [0.4, 0.2, 0.4]
    got = engine.rerank(query, docs, mode=mode, weights=tuple(weights))
    plan = plan_m3(tokenizer, query, docs, 8192, RerankOptions(mode=mode))
    assert len(plan.inputs) == 1 + len(docs) and got.windows.tolist() == [1] * len(docs)
    ref = flag_model.compute_score([[query, d] for d in docs], batch_size=1,
                                   max_query_length=8192, max_passage_length=8192,
                                   weights_for_different_modes=weights)[mode]
    np.testing.assert_allclose(got.scores, ref, atol=1e-4, rtol=0)
    assert not got.truncated.any() and got.model == "bge-m3"
    assert got.tokens == sum(len(x) for x in tokenizer.encode([query, *docs]).ids)


def test_truncate_is_compute_scores_cut(engine, tokenizer, flag_model) -> None:
    """``truncate`` at 32 tokens: FlagEmbedding's own cut (max_query/passage_length 32) for
    the query and documents, and the cut documents flagged."""
    query = " ".join(random_texts(74, 3, 10, 12))
    docs = random_texts(75, 3, 30, 60) + ["short"]
    _, got = rerank(engine, tokenizer, query, docs, 32, long_documents="truncate",
                    mode="colbert+sparse+dense", weights=(1.0, 1.0, 1.0))
    ref = flag_model.compute_score([[query, d] for d in docs], batch_size=1,
                                   max_query_length=32, max_passage_length=32)
    np.testing.assert_allclose(got.scores, ref["colbert+sparse+dense"], atol=1e-4, rtol=0)
    assert got.truncated.tolist() == [True, True, True, False] and got.query_truncated


def test_windows_keep_each_documents_best(engine, tokenizer) -> None:
    """``max`` at 32 tokens: a long document is scored per window and its best kept (each
    window checked against scoring it alone); a short one has one window."""
    query = random_texts(76, 1, 3, 6)[0]
    docs = [" ".join(random_texts(77, 4, 30, 40)), "short text"]
    plan, got = rerank(engine, tokenizer, query, docs, 32, mode="dense")
    assert got.windows[0] > 1 and got.windows[1] == 1 and not got.truncated.any()
    q = engine.embed([plan.inputs[0]], dense=True)
    per_window = [m3_scores(q, engine.embed([x], dense=True)).dense[0] for x in plan.inputs[1:]]
    assert got.scores[0] == pytest.approx(max(per_window[:got.windows[0]]), abs=1e-6)
    assert all(len(x) <= 32 for x in plan.inputs)


def test_colbert_groups_bound_what_one_job_holds(engine, tokenizer) -> None:
    """With ColBERT, the inputs are split into consecutive jobs of at most the byte bound (the
    query first); the grouped scores equal the ungrouped ones, sync and async."""
    import asyncio
    from dataclasses import replace

    query = random_texts(78, 1, 3, 6)[0]
    docs = random_texts(79, 12, 20, 60)
    opts = RerankOptions(mode="colbert")
    plan = plan_m3(tokenizer, query, docs, 8192, opts)
    width = engine.width
    bound = 3 * max(len(x) for x in plan.inputs) * width * 4
    parts = groups(plan, width, bound)
    assert len(parts) > 2 and parts[0][0] == 0
    assert [i for g in parts for i in g] == list(range(len(plan.inputs)))
    assert all(sum((len(plan.inputs[i]) - 1) * width * 4 for i in g) <= bound for g in parts)
    whole = engine.rerank(query, docs, mode="colbert")
    small = replace(engine.config, max_colbert_bytes=2 * bound)  # make_jobs halves it
    engine.config, saved = small, engine.config
    try:
        grouped = asyncio.run(arerank_m3(engine, query, docs, opts))
    finally:
        engine.config = saved
    np.testing.assert_allclose(grouped.scores, whole.scores, atol=1e-6)


def test_each_groups_vectors_are_dropped_before_the_next_group_runs(tokenizer) -> None:
    """Every group is scored as it arrives: when a group runs, no vector of the groups before
    it is alive, though their jobs and futures are (all were kept until the last one ran: a
    rerank of 4,000 documents on the tiny model grew RSS by 382 MiB, now 30), dense and sparse
    ones too (memory QA: kept, 2,048 long documents in 128-token windows took a server past
    its 700 MiB cap), and the room for the next group is taken (``before``) only after the
    one before was scored."""
    import asyncio
    import gc
    import weakref
    from types import SimpleNamespace

    from bgeserve.engine.heads import colbert_rows
    from bgeserve.results import Embeddings

    width = 8
    opts = RerankOptions(mode="hybrid")
    plan = plan_m3(tokenizer, random_texts(80, 1, 3, 6)[0], random_texts(81, 12, 20, 60), 8192,
                   opts)
    jobs = [SimpleNamespace(ids=[plan.inputs[i] for i in g])
            for g in groups(plan, width, 3 * max(len(x) for x in plan.inputs) * width * 4)]
    assert len(jobs) > 2
    made: list[weakref.ref] = []
    kept: list[Embeddings] = []
    alive_when_run: list[int] = []
    events: list[str] = []
    rng = np.random.default_rng(0)

    async def await_job(job, future) -> Embeddings:
        gc.collect()
        alive_when_run.append(sum(ref() is not None for ref in made))
        events.append("run")
        # each text's rows copied out of its chunk's output, as Job.write does
        out = rng.standard_normal((len(job.ids), max(map(len, job.ids)), width)).astype(
            np.float32)
        n = np.array([len(x) for x in job.ids])
        colbert = [colbert_rows(out[i], k) for i, k in enumerate(n)]
        sparse = [(np.unique(rng.integers(5, 900, 6)), rng.random(6).astype(np.float32) + 0.1)
                  for _ in n]
        sparse = [(ids, w[:len(ids)]) for ids, w in sparse]
        dense = out[:, 0] / np.linalg.norm(out[:, 0], axis=1, keepdims=True)
        first = 0 if made else 1  # the query's rows stay (copied out by ``rows``)
        made.extend(weakref.ref(x) for x in colbert[first:])
        made.extend(weakref.ref(a) for pair in sparse[first:] for a in pair)
        made.append(weakref.ref(dense))
        part = Embeddings(dense, sparse, colbert, n, np.zeros(len(n), dtype=bool))
        kept.append(part)  # as the group's job and future keep it, to the last group
        return part

    async def before(job) -> None:  # the room of the one before is given back here
        gc.collect()
        alive_when_run.append(sum(ref() is not None for ref in made))
        events.append("before")

    engine = SimpleNamespace(await_job=await_job)
    result = asyncio.run(arun_jobs(engine, plan, jobs, opts, submit=lambda job: None,
                                   before=before))
    assert alive_when_run == [0] * (2 * len(jobs) - 1)
    assert events == ["run"] + ["before", "run"] * (len(jobs) - 1)
    assert len(result.scores) == 12 and np.isfinite(result.scores).all()


@pytest.mark.parametrize(("mode", "weights", "param"), [
    ("sparse+dense", (0.0, 0.0, 5.0), "weights"),
    ("hybrid", (0.0, 0.0, 0.0), "weights"),
    ("bm25", (0.4, 0.2, 0.4), "mode")])
def test_bad_mode_or_weights_are_refused_before_any_text_is_embedded(engine, monkeypatch, mode,
                                                                     weights, param) -> None:
    """Weights the mode divides by 0 with (or an unknown mode) are an InvalidInput naming the
    field before a job is submitted: over HTTP they were a 500 after the whole request had been
    embedded."""
    from bgeserve.errors import InvalidInput

    def submit(*args, **kwargs):
        raise AssertionError("a job was submitted")

    monkeypatch.setattr(engine, "submit", submit)
    with pytest.raises(InvalidInput) as caught:
        engine.rerank("q", ["a", "b"], mode=mode, weights=weights)
    assert caught.value.param == param


@pytest.mark.parametrize("max_seq", [32, 512])
def test_min_tokens_bounds_the_jobs_texts_from_below(tiny_export, max_seq) -> None:
    """Admission refuses bge-m3 rerank requests on ``min_tokens`` before tokenizing them: it
    must never exceed the tokens of the texts ``plan_m3`` embeds (the query, windows, cuts,
    other scripts, empty texts), and must not be vacuous."""
    from bgeserve.engine.m3rerank import min_tokens

    whole = Tokenizer.load(tiny_export / "tokenizer.json", max_seq=1 << 30)
    capped = Tokenizer.load(tiny_export / "tokenizer.json", max_seq=max_seq)  # the engine's
    long_query = " ".join(random_texts(90, 1, 60, 80))
    docs = random_texts(91, 12, 1, 120) + ["", "混合检索 données été " * 40, "x" * 3000,
                                            " ".join(random_texts(92, 10, 40, 60))]
    plain = ["the cat sat on the mat and then it ran " * k for k in range(1, 30)]
    cases = [RerankOptions(), RerankOptions(long_documents="truncate"),
             RerankOptions(max_tokens_per_doc=5),
             RerankOptions(long_documents="truncate", truncation_direction="left")]
    for query, texts in (("what is it?", docs), (long_query, docs), ("", docs), ("检索", docs),
                         ("where is the cat", plain)):
        for options in cases:
            real = sum(len(x) for x in plan_m3(whole, query, texts, max_seq, options).inputs)
            bound = min_tokens(capped, query, texts, max_seq, options)
            assert 0 < bound <= real, (query[:20], options)
            for stop in (0, 10, bound // 2, bound - 1):
                part = min_tokens(capped, query, texts, max_seq, options, stop_above=stop)
                assert 0 < part <= bound
                if texts is plain:  # plain words: counting stops only once past it
                    assert stop < part
            if texts is plain and options.max_tokens_per_doc is None:
                # It counts the query and each document's first window (this tiny vocabulary
                # cuts a word into ~2 tokens).
                plan = plan_m3(whole, query, texts, max_seq, options)
                first = [0] + [1 + int(np.argmax(plan.owner == i)) for i in range(len(texts))]
                assert bound >= 0.25 * sum(len(plan.inputs[i]) for i in first), bound


@pytest.mark.parametrize("options", [
    RerankOptions(long_documents="truncate"), RerankOptions(max_tokens_per_doc=100),
    RerankOptions(max_tokens_per_doc=100, long_documents="truncate",
                  truncation_direction="left")], ids=["truncate", "cut-windows", "cut-left"])
def test_texts_past_the_limit_read_from_the_left_give_the_inputs_of_the_whole_texts(
        tiny_export, options) -> None:
    """bge-m3's scores: a query (cut to a window) and documents read only to their leading
    tokens, past BGE_M3_MAX_TEXT_CHARS, give exactly the inputs, flags and windows of
    tokenizing them whole; a document read to its end past the limit is TooLarge."""
    from bgeserve.errors import TooLarge

    path = tiny_export / "tokenizer.json"
    limited = Tokenizer.load(path, 1 << 30, max_whole_chars=1_000)
    whole = Tokenizer.load(path, 1 << 30)
    whole._cut_exact = False  # the oracle: every text tokenized whole
    query = " ".join(random_texts(93, 300, 3, 10))
    docs = ["\n".join(random_texts(94, 200, 5, 20)), "short", " ".join(random_texts(95, 200))]
    got = plan_m3(limited, query, docs, 64, options)
    want = plan_m3(whole, query, docs, 64, options)
    assert [x.tolist() for x in got.inputs] == [x.tolist() for x in want.inputs]
    assert got.truncated.tolist() == want.truncated.tolist() == [True, False, True]
    assert got.windows.tolist() == want.windows.tolist()
    assert got.query_truncated and want.query_truncated
    with pytest.raises(TooLarge) as info:
        plan_m3(limited, "q", docs, 64, RerankOptions())
    assert info.value.param == "documents[0]"


def test_scoring_runs_off_the_event_loop(engine, tokenizer, monkeypatch) -> None:
    """Each group is scored on a thread: on the loop, ColBERT's products for a few long
    documents held every other request, /health included, for 11-25 s (fuzz QA)."""
    import threading

    from bgeserve.engine import m3rerank

    loop_threads: list[int] = []
    scored_on: list[int] = []
    real = m3rerank.Scoring.add

    def add(self, part) -> None:
        scored_on.append(threading.get_ident())
        real(self, part)

    monkeypatch.setattr(m3rerank.Scoring, "add", add)
    import asyncio

    query, docs = "a query", random_texts(75, 6, 20, 60)

    async def main():
        loop_threads.append(threading.get_ident())
        return await arerank_m3(engine, query, docs, RerankOptions(mode="hybrid"))

    result = asyncio.run(main())
    assert scored_on and loop_threads[0] not in scored_on
    np.testing.assert_allclose(result.scores, engine.rerank(query, docs, mode="hybrid").scores,
                               atol=1e-6)
