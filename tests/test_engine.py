"""``Engine`` as a library: the memory budget a plain Engine applies on its own."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from bgeserve.engine import Engine, EngineConfig
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
    """A text whose predicted workspace exceeds the budget is refused, naming the knob."""
    tight = CostModel(a=1_000_000.0, b=0.0, max_workspace_bytes=50_000_000)
    with Engine(tiny_export, "fp32", cache_dir=tmp_path, cost_model=tight) as engine:
        engine.embed("fits")  # a few tokens: ~5 MB predicted
        with pytest.raises(TooLarge, match="BGE_M3_MAX_SEQ_LENGTH") as info:
            engine.embed(["ok", "word " * 200])
        assert info.value.param == "input[1]"


def test_colbert_output_over_the_cap_is_refused_before_running(tiny_export: Path,
                                                               tmp_path: Path) -> None:
    """ColBERT vectors are outside the memory budget: a request whose (tokens - 1) x width
    float32 rows pass max_colbert_bytes is a 413 naming BGE_M3_MAX_COLBERT_MB; dense only of
    the same texts runs."""
    texts = ["word " * 100] * 4
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine:
        rows = int(engine.encode_inputs(texts).lengths.sum()) - len(texts)
        width = engine.embed("x").dense.shape[1]
        engine.config = replace(engine.config, max_colbert_bytes=rows * width * 4 - 1)
        with pytest.raises(TooLarge, match="BGE_M3_MAX_COLBERT_MB") as info:
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
    with pytest.raises(NotReady):
        engine.embed("x")
