"""Tests for bgeserve.engine.crossencoder: pair plans from texts, scores from logits."""

from __future__ import annotations

import numpy as np
import pytest

from bgeserve.engine.crossencoder import finish_pairs, plan_pairs, sigmoid
from bgeserve.engine.pairs import PairConfig
from bgeserve.results import RerankOptions
from bgeserve.testing.randmodel import random_texts


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


LONG_QUERY = " ".join(random_texts(90, 400, 3, 10))
LONG_DOCS = [" ".join(random_texts(91, 300, 5, 20)), "a short document",
             "\n".join(random_texts(92, 300, 5, 20))]  # lines: cut at a line break


@pytest.mark.parametrize("query", [LONG_QUERY, "a short query"])
@pytest.mark.parametrize("options", [
    RerankOptions(long_documents="truncate"),
    RerankOptions(max_tokens_per_doc=30),
    RerankOptions(max_tokens_per_doc=150),  # windows over the first 150 tokens
    RerankOptions(max_tokens_per_doc=150, long_documents="truncate", truncation_direction="left"),
], ids=["truncate", "cut-30", "cut-150-windows", "cut-150-left"])
def test_texts_past_the_limit_read_from_the_left_give_the_rows_of_the_whole_texts(
        tiny_model, monkeypatch, query, options) -> None:
    """A query (FlagReranker's cap) and documents read only to their leading tokens
    (truncated from the right, cut by max_tokens_per_doc) past BGE_M3_MAX_TEXT_CHARS are
    tokenized from their leading words, never past the limit, and give exactly the rows,
    flags and windows of tokenizing them whole."""
    from bgeserve.engine.tokenizer import Tokenizer

    path = tiny_model / "tokenizer.json"
    limited = Tokenizer.load(path, 1 << 30, max_whole_chars=2_000)
    whole = Tokenizer.load(path, 1 << 30)
    whole._cut_exact = False  # the oracle: every text tokenized whole
    assert min(map(len, (LONG_QUERY, LONG_DOCS[0], LONG_DOCS[2]))) > 10_000
    config = PairConfig(256)  # the query capped at 192 tokens; rows of 256
    seen: list[int] = []
    real = limited._tk.encode_batch
    monkeypatch.setattr(limited, "_tk", type("Spy", (), {
        "encode_batch": lambda self, batch, **kw: seen.extend(map(len, batch))
        or real(batch, **kw)})())
    got = plan_pairs(limited, query, LONG_DOCS, config, options)
    want = plan_pairs(whole, query, LONG_DOCS, config, options)
    assert max(seen) <= 2_000
    assert [r.tolist() for r in got.rows] == [r.tolist() for r in want.rows]
    assert got.truncated.tolist() == want.truncated.tolist() == [True, False, True]
    assert got.windows.tolist() == want.windows.tolist()
    assert got.query_truncated == want.query_truncated == (query == LONG_QUERY)


def test_documents_past_the_limit_scored_to_their_end_are_refused(tiny_model) -> None:
    """Windows (the default) or truncation from the left read a document to its end: one
    past the limit is TooLarge naming it, saying how it could be served."""
    from bgeserve.engine.tokenizer import Tokenizer
    from bgeserve.errors import TooLarge

    limited = Tokenizer.load(tiny_model / "tokenizer.json", 1 << 30, max_whole_chars=2_000)
    for options in (RerankOptions(), RerankOptions(long_documents="truncate",
                                                   truncation_direction="left")):
        with pytest.raises(TooLarge, match="truncate it from the right") as info:
            plan_pairs(limited, "q", ["short", LONG_DOCS[0]], PairConfig(256), options)
        assert info.value.param == "documents[1]"
