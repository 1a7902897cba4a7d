"""Tests for bgeserve.engine.crossencoder: pair plans from texts, scores from logits."""

from __future__ import annotations

import numpy as np
import pytest

from bgeserve.engine.crossencoder import finish_pairs, plan_pairs, sigmoid
from bgeserve.engine.pairs import PairConfig
from bgeserve.results import RerankOptions


def test_sigmoid_is_flagrerankers_and_never_overflows() -> None:
    """Equal to 1/(1+exp(-x)) where that is finite; 0 and 1 at the extremes, no warning."""
    x = np.array([-30.0, -1.0, 0.0, 2.5, 30.0])
    np.testing.assert_allclose(sigmoid(x), 1 / (1 + np.exp(-x)), rtol=1e-15, atol=1e-16)
    assert sigmoid(np.array([-1e4, 1e4])).tolist() == [0.0, 1.0]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from bgeserve.engine.tokenizer import Tokenizer

    return Tokenizer.load(tiny_model / "tokenizer.json", max_seq=1 << 30)


def test_plan_builds_pairs_from_texts(tokenizer) -> None:
    """The query and documents are tokenized once; rows are FlagReranker's ``[0]+q+[2,2]+d+
    [2]``; max_tokens_per_doc cuts a document first and flags it."""
    q = tokenizer.encode(["a query"]).ids[0][1:-1]
    d = tokenizer.encode(["first document here"]).ids[0][1:-1]
    plan = plan_pairs(tokenizer, "a query", ["first document here", "x"], PairConfig(64),
                      RerankOptions())
    assert plan.rows[0].tolist() == [0, *q, 2, 2, *d, 2]
    assert not plan.truncated.any()
    cut = plan_pairs(tokenizer, "a query", ["first document here"], PairConfig(64),
                     RerankOptions(max_tokens_per_doc=1))
    assert cut.rows[0].tolist() == [0, *q, 2, 2, d[0], 2] and cut.truncated.tolist() == [True]


def test_finish_keeps_the_best_window_and_normalizes(tokenizer) -> None:
    """Scores: each document's maximum logit, through the sigmoid with ``normalize``."""
    plan = plan_pairs(tokenizer, "q", ["a " * 200, "b"], PairConfig(32), RerankOptions())
    rows = len(plan.rows)
    logits = np.linspace(-2, 2, rows)
    raw = finish_pairs(plan, logits, RerankOptions(), "m")
    assert raw.scores.tolist() == [logits[rows - 2], logits[rows - 1]]
    assert raw.windows.tolist() == [rows - 1, 1] and raw.model == "m"
    norm = finish_pairs(plan, logits, RerankOptions(normalize=True), "m")
    np.testing.assert_allclose(norm.scores, sigmoid(raw.scores))
