"""The in-process library as a Python user meets it (QA of 2026-12-07): engines dropped without
``close()``, concurrent callers, fork and pickle, bad arguments, a printed result."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bgeserve.engine import Engine
from bgeserve.errors import InvalidInput, NotReady
from bgeserve.results import EmbedOptions, RerankOptions, RerankResult


def settle(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_an_engine_dropped_without_close_releases_its_model(tiny_export: Path,
                                                            tmp_path: Path) -> None:
    """Its threads hold the scheduler, not the engine: a dropped engine was collected while
    its worker thread and loaded session stayed for good (QA: 30 dropped engines, 31 threads;
    README's ``Reranker(path).rerank(...)`` idiom leaked one each)."""
    engine = Engine(tiny_export, "fp32", cache_dir=tmp_path)
    engine.embed("x")
    scheduler = engine._scheduler
    threads = [t for t in scheduler._threads if t is not None]
    assert threads and all(t.is_alive() for t in threads)
    assert scheduler.stats()["loaded"] == 1
    del engine
    gc.collect()
    assert settle(lambda: not any(t.is_alive() for t in threads))
    assert settle(lambda: scheduler.stats()["loaded"] == 0)


def test_close_with_a_chunk_still_running_releases_its_session_when_it_ends(
        tiny_export: Path, tmp_path: Path) -> None:
    """close(timeout) past which a chunk still runs: the worker drops its session as it ends
    (QA: it stayed loaded until the engine was dropped)."""
    engine = Engine(tiny_export, "fp32", cache_dir=tmp_path)
    started = threading.Event()
    real = engine._scheduler._run

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        started.set()
        time.sleep(1.0)
        return real(*args, **kwargs)

    engine._scheduler._run = slow  # type: ignore[method-assign]
    caller = threading.Thread(target=lambda: _quietly(engine.embed, "a text"), daemon=True)
    caller.start()
    assert started.wait(10)
    engine.close(timeout=0.05)
    assert settle(lambda: engine._scheduler.stats()["loaded"] == 0)
    caller.join(10)


def _quietly(fn, *args) -> None:  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except NotReady:
        pass


def test_in_process_callers_are_not_refused_for_a_full_queue(tiny_export: Path,
                                                             tmp_path: Path) -> None:
    """The server's queue is bounded (a 429, BGE_M3_MAX_QUEUE_TOKENS: 1,000,000 tokens); a
    library caller has nobody to retry for it, so its job waits its turn (QA: 3 of 4 threads
    embedding long documents were refused "queue full ... retry shortly")."""
    engine = Engine(tiny_export, "fp32", cache_dir=tmp_path, start=False)  # nothing runs
    n = engine.config.max_seq
    ids = [[0, 10 + i] + [5] * (n - 3) + [2] for i in range(1_000_000 // n + 2)]
    big = engine.make_job(ids, EmbedOptions())
    assert sum(len(x) for x in big.ids) > 1_000_000
    engine._scheduler.submit(big)  # the scheduler's default queue, no worker taking from it
    engine._scheduler.submit(engine.make_job(["one more"], EmbedOptions()))  # was Overloaded
    assert engine.queued_tokens() > 1_000_000


def test_a_forked_child_is_told_to_make_its_own_engine(tiny_export: Path,
                                                       tmp_path: Path) -> None:
    """A fork copies no thread: the parent's engine in the child said "no worker is left to
    run the model (see /health)" (QA). It now names the fork and what to do."""
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine:
        engine.embed("warm")
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()

        def child() -> None:
            try:
                engine.embed("a text never seen")
                queue.put("served")
            except NotReady as exc:
                queue.put(str(exc))

        proc = ctx.Process(target=child)
        proc.start()
        message = queue.get(timeout=60)
        proc.join(60)
        assert "forked child" in message and "create an Engine" in message, message
        assert engine.embed("the parent goes on").dense is not None


def test_an_engine_refuses_pickling_with_what_to_do(tiny_export: Path, tmp_path: Path) -> None:
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine, \
            pytest.raises(TypeError, match="create an Engine in each process"):
        pickle.dumps(engine)
    with pytest.raises(NotReady, match="closed"), engine:  # a closed one: at once, not later
        pass


def test_an_empty_model_path_is_refused_not_read_as_the_hub(tmp_path: Path) -> None:
    """``Engine(os.getenv("MODEL_DIR", ""))`` went to the hub (a multi-GB download)."""
    from bgeserve.engine.reranker import Reranker

    with pytest.raises(ValueError, match="model_path is empty"):
        Engine("", "fp32", cache_dir=tmp_path, offline=True)
    with pytest.raises(ValueError, match="model_path is empty"):
        Reranker(" ", "fp32", cache_dir=tmp_path, offline=True)


def test_rerank_options_take_booleans_and_ranking_a_count() -> None:
    """normalize="false" scored sigmoids (QA); top_n=-1 silently dropped the last document."""
    with pytest.raises(InvalidInput, match="normalize must be True or False"):
        RerankOptions(normalize="false")  # type: ignore[arg-type]
    assert RerankOptions(normalize=np.bool_(True)).normalize
    result = RerankResult(np.array([0.1, 0.9, 0.5]), np.zeros(3, bool), np.ones(3, int), 9,
                          "m")
    assert result.ranking() == result.ranking(0) == [1, 2, 0]
    assert result.ranking(2) == result.ranking(np.int64(2)) == [1, 2]
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="top_n"):
            result.ranking(bad)  # type: ignore[arg-type]


def test_a_result_prints_its_shape_not_its_floats(tiny_export: Path, tmp_path: Path) -> None:
    """The dataclass repr of 2,000 texts with ColBERT was 4.9 MB (QA)."""
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine:
        out = engine.embed(["one text", "and another one"] * 50, sparse=True, colbert=True)
    text = repr(out)
    assert len(text) < 200, text
    assert text.startswith("Embeddings(100 texts, ") and "dense float32[100, " in text
    assert f"colbert {sum(len(c) for c in out.colbert)} vectors" in text  # type: ignore[union-attr]


def test_the_package_is_typed() -> None:
    """PEP 561: mypy reads the library's annotations only with the marker in the package."""
    import bgeserve

    assert (Path(bgeserve.__file__).parent / "py.typed").is_file()
    assert os.path.getsize(Path(bgeserve.__file__).parent / "py.typed") == 0


def test_a_text_list_names_the_item_that_is_not_a_text(tiny_export: Path,
                                                       tmp_path: Path) -> None:
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine, \
            pytest.raises(InvalidInput, match=r"input\[1\] is NoneType, not a string") as caught:
        engine.embed(["a", None, "b"])  # type: ignore[list-item]
    assert caught.value.param == "input[1]"
