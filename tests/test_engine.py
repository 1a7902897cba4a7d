"""``Engine`` as a library: the memory budget a plain Engine applies on its own."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bgeserve.engine import Engine, EngineConfig
from bgeserve.engine.scheduler import SchedulerConfig
from bgeserve.errors import NotReady, TooLarge
from bgeserve.results import EmbedOptions
from bgeserve.tuning.costmodel import CostModel


def test_plain_engine_budgets_memory_by_itself(tiny_export: Path, tmp_path: Path) -> None:
    """Without a server, an Engine still packs and admits under a measured budget."""
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine:
        cost = engine.cost_model
        assert cost is not None and cost.max_workspace_bytes > 0
        assert cost.b == 0.0  # the export's blocked attention: no quadratic term
        assert engine.embed(["a short text"] * 3).dense.shape == (3, 32)


def test_explicit_cost_model_refuses_what_cannot_fit(tiny_export: Path, tmp_path: Path) -> None:
    """A text whose predicted workspace exceeds the budget is refused, naming the knobs: the
    engine's own to a library caller, the server's variables where the server made the
    config (service/plan.py)."""
    from bgeserve.config import Settings
    from bgeserve.service.plan import engine_config

    tight = CostModel(a=1_000_000.0, b=0.0, max_workspace_bytes=50_000_000)
    with Engine(tiny_export, "fp32", cache_dir=tmp_path, cost_model=tight) as engine:
        engine.embed("fits")  # a few tokens: ~5 MB predicted
        with pytest.raises(TooLarge, match=r"Lower EngineConfig\(max_seq=\.\.\.\), reduce the "
                           r"workers \(EngineConfig\(scheduler=SchedulerConfig\(workers=\.\.\.\)\)\), "
                           "or give the process more memory") as info:
            engine.embed(["ok", "word " * 200])
        assert info.value.param == "input[1]" and "BGE_M3_" not in info.value.message
    served = engine_config(Settings(max_seq_length=8192))
    with Engine(tiny_export, "fp32", cache_dir=tmp_path, cost_model=tight,
                config=served) as engine, \
            pytest.raises(TooLarge, match="Lower BGE_M3_MAX_SEQ_LENGTH, reduce BGE_M3_WORKERS, "
                          "or give the server more memory"):
        engine.embed(["ok", "word " * 200])


def test_colbert_output_over_the_cap_is_refused_before_running(tiny_export: Path,
                                                               tmp_path: Path) -> None:
    """ColBERT vectors are outside the memory budget: a request whose (tokens - 1) x width
    float32 rows pass max_colbert_bytes is a 413 naming it (the server: BGE_M3_MAX_COLBERT_MB);
    dense only of the same texts runs."""
    texts = ["word " * 100] * 4
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine:
        rows = int(engine.encode_inputs(texts).lengths.sum()) - len(texts)
        width = engine.embed("x").dense.shape[1]
        engine.config = replace(engine.config, max_colbert_bytes=rows * width * 4 - 1)
        with pytest.raises(TooLarge, match=r"EngineConfig\(max_colbert_bytes=") as info:
            engine.embed(texts, colbert=True)
        assert info.value.param == "outputs"
        assert engine.embed(texts).dense.shape == (4, width)
        engine.config = replace(engine.config, max_colbert_bytes=rows * width * 4)
        assert len(engine.embed(texts, colbert=True).colbert) == 4


def test_the_deadline_counts_from_arrival(tiny_export: Path, tmp_path: Path) -> None:
    """Time spent before the job exists (queued for a tokenizer thread, tokenizing) counts."""
    config = EngineConfig(request_timeout_s=10.0)
    with Engine(tiny_export, "fp32", cache_dir=tmp_path, config=config) as engine:
        now = time.monotonic()
        job = engine.make_job(["x"], EmbedOptions(), arrived=now - 4.0)
        assert job.deadline is not None and job.deadline <= now + 6.0 + 0.01
        fresh = engine.make_job(["x"], EmbedOptions())
        assert fresh.deadline is not None and fresh.deadline >= now + 10.0 - 0.01


def test_a_closed_engine_cannot_be_restarted(tiny_export: Path, tmp_path: Path) -> None:
    """start() after close() raises at once (it used to load a session the stopped scheduler
    never used, and every embed said the server was shutting down)."""
    engine = Engine(tiny_export, "fp32", cache_dir=tmp_path)
    engine.embed("x")
    engine.close()
    with pytest.raises(NotReady, match="closed"):
        engine.start()
    with pytest.raises(NotReady, match="closed; create a new one"):
        engine.embed("x")  # it said "the engine is not started"


def test_no_texts_give_empty_results_of_the_usual_shapes(tiny_export: Path,
                                                         tmp_path: Path) -> None:
    """embed([]) gives a (0, width) dense array (it gave None) and empty lists."""
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine:
        width = engine.embed(["x"]).dense.shape[1]  # type: ignore[union-attr]
        out = engine.embed([], sparse=True, colbert=True)
        assert out.dense is not None and out.dense.shape == (0, width)
        assert out.dense.dtype == np.float32 and out.sparse == [] and out.colbert == []
        assert engine.embed([], dense=False, sparse=True).dense is None


EXIT_SCRIPT = """
import sys, threading, time
from bgeserve import Engine
engine = Engine(sys.argv[1], "fp32", cache_dir=sys.argv[2])
texts = [" ".join(f"word{i}" for i in range(2000))] * 400
threading.Thread(target=lambda: engine.embed(texts), daemon=True).start()
time.sleep(0.5)
if sys.argv[3] == "close":
    engine.close(timeout=0.05)
print("leaving", flush=True)
"""


@pytest.mark.parametrize("close", ["close", "no close"])
def test_a_script_may_end_while_another_thread_embeds(tiny_export: Path, tmp_path: Path,
                                                      close: str) -> None:
    """Exit while a daemon thread is inside the tokenizer (Rust, the GIL released) or a run:
    the interpreter waits for that call and ends cleanly. It aborted (exit 134, "FATAL:
    exception not rethrown") in 12 of 12 runs, with or without Engine.close(timeout)."""
    import os
    import subprocess
    import sys

    # Unset as in a user's script: with it, tokenizers encodes without releasing the GIL.
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tiny_export), str(tmp_path),
                           close], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaving" in done.stdout


# ------------------------------------------------------------------------- embedding cache
def _engine(export: Path, tmp_path: Path, variant: str = "fp32", chunks: list | None = None,
            **scheduler) -> Engine:
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler)) if scheduler else None
    return Engine(export, variant, cache_dir=tmp_path, config=config,
                  on_chunk=None if chunks is None else chunks.append)


TEXTS = ["the first text", "a second, somewhat longer text of a few more words",
         "the first text", "third", "a second, somewhat longer text of a few more words"]


def test_cached_texts_skip_the_queue_with_the_vectors_they_had(tiny_export: Path,
                                                               tmp_path: Path) -> None:
    """The second embed of the same texts runs no chunk and gives the first embed's outputs bit
    for bit; the repeats inside the first call ran once; the hits are counted."""
    chunks: list = []
    with _engine(tiny_export, tmp_path, chunks=chunks) as engine:
        first = engine.embed(TEXTS, dense=True, sparse=True, colbert=True)
        assert sum(c.batch for c in chunks) == 3  # five texts, three distinct
        chunks.clear()
        again = engine.embed(TEXTS[::-1], dense=True, sparse=True, colbert=True)
        assert chunks == []
        stats = engine.cache_stats()
    assert stats is not None and stats["hits"] == 3 and stats["repeats"] == 2 + 2
    assert np.array_equal(again.dense, first.dense[::-1])
    for i, j in enumerate(range(len(TEXTS) - 1, -1, -1)):
        assert np.array_equal(again.sparse[i][0], first.sparse[j][0])
        assert np.array_equal(again.sparse[i][1], first.sparse[j][1])
        assert np.array_equal(again.colbert[i], first.colbert[j])
    assert np.array_equal(again.n_tokens, first.n_tokens[::-1])


def test_the_cache_gives_the_vectors_an_engine_without_it_gives(tiny_export: Path,
                                                                tmp_path: Path) -> None:
    """With every text run alone, an engine with the cache and one without give identical
    vectors (bit for bit) for a corpus with repeats, before and after the cache fills; in
    packed chunks they agree within the parity tolerance."""
    texts = [f"text number {i % 4} " * (1 + i % 3) for i in range(10)]
    off = replace(EngineConfig(), cache_bytes=0, scheduler=SchedulerConfig(max_chunk=1))
    on = replace(off, cache_bytes=1 << 20)
    with Engine(tiny_export, "fp32", cache_dir=tmp_path, config=off) as plain:
        assert plain.cache is None
        want = plain.embed(texts, dense=True, sparse=True)
    with Engine(tiny_export, "fp32", cache_dir=tmp_path, config=on) as cached:
        for _ in range(2):
            got = cached.embed(texts, dense=True, sparse=True)
            assert np.array_equal(got.dense, want.dense)
            for (gi, gw), (wi, ww) in zip(got.sparse, want.sparse, strict=True):
                assert np.array_equal(gi, wi) and np.array_equal(gw, ww)
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as packed:
        packed_want = packed.embed(texts).dense
    cos = (packed_want * want.dense).sum(1)
    assert cos.min() >= 0.99999


def test_a_text_repeated_in_one_call_gets_one_answer_without_a_cache(tiny_export: Path,
                                                                   tmp_path: Path) -> None:
    """Without a cache (int8's default) a repeated text still runs once and its copies get
    its values bit for bit: each copy ran in its own chunk, with other batch-mates, and
    int8's came back ~0.0165 apart (QA, chaos load)."""
    filler = [f"filler text {i} " * (1 + i % 5) for i in range(40)]
    texts = ["the repeated text", *filler, "the repeated text"]
    chunks: list = []
    with _engine(tiny_export, tmp_path, "int8", chunks, max_chunk=4) as engine:
        assert engine.cache is None
        out = engine.embed(texts, dense=True, sparse=True, colbert=True)
    assert sum(c.batch for c in chunks) == len(texts) - 1  # the copy never ran
    assert np.array_equal(out.dense[0], out.dense[-1])
    assert np.array_equal(out.sparse[0][1], out.sparse[-1][1])
    assert np.array_equal(out.colbert[0], out.colbert[-1])


def test_int8_has_no_cache_unless_each_text_runs_alone(tiny_export: Path,
                                                       tmp_path: Path) -> None:
    """int8's activation scales are taken over the chunk, so its vectors move with their
    batch-mates: no cache by default; with max_chunk=1 there is one."""
    with _engine(tiny_export, tmp_path, "int8") as engine:
        assert engine.cache is None and engine.cache_stats() is None
        assert engine.reserved_bytes == 0
    with _engine(tiny_export, tmp_path, "int8", max_chunk=1) as engine:
        assert engine.cache is not None and engine.reserved_bytes == engine.cache.max_bytes
        engine.embed(["x", "x"])
        assert engine.cache_stats()["repeats"] == 1


def test_one_cache_never_answers_for_another_model(tiny_export: Path, tmp_path: Path) -> None:
    """The cache's namespace names the model files and the variant."""
    with _engine(tiny_export, tmp_path) as fp32, _engine(tiny_export, tmp_path, "fp16") as fp16:
        assert fp32.cache is not None and fp16.cache is not None
        assert fp32.cache.key(np.array([0, 5, 2])) != fp16.cache.key(np.array([0, 5, 2]))
