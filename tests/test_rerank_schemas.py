"""Tests for bgeserve.http.rerank_schemas: the Jina / Cohere and TEI rerank bodies."""

from __future__ import annotations

import orjson
import pytest

from bgeserve.config import Settings
from bgeserve.errors import InvalidInput, TooLarge
from bgeserve.http.errors import ModelNotFound
from bgeserve.http.rerank_schemas import (
    RerankRequest,
    parse_rerank_request,
    parse_tei_rerank_request,
)
from bgeserve.results import RerankOptions

IDS = ("bge-reranker-v2-m3", "bge-m3")


def parse(body: dict, settings: Settings | None = None) -> RerankRequest:
    return parse_rerank_request(orjson.dumps(body), settings or Settings(), IDS)


def tei(body: dict, settings: Settings | None = None) -> RerankRequest:
    return parse_tei_rerank_request(orjson.dumps(body), settings or Settings())


def test_jina_body_with_defaults() -> None:
    """LangChain's JinaRerank body: documents as strings, top_n null → every document; the
    defaults are sigmoid scores, windows for long documents, bge-m3's hybrid mode."""
    got = parse({"query": "q", "documents": ["a", "b"], "model": "bge-m3", "top_n": None})
    assert got == RerankRequest("q", ["a", "b"], RerankOptions(model="bge-m3", normalize=False))
    assert got.options.long_documents == "max" and got.options.mode == "hybrid"
    assert got.options.weights == (0.4, 0.2, 0.4)


def test_cohere_bodies() -> None:
    """Cohere v1 documents may be ``{"text": ...}`` objects; v2 sends max_tokens_per_doc
    (null from LangChain) and fields bgeserve ignores; top_n 0 means every document."""
    got = parse({"query": "q", "documents": [{"text": "a", "id": 3}, "b"], "top_n": 0,
                 "return_documents": True, "rank_fields": ["text"], "max_chunks_per_doc": 3,
                 "max_tokens_per_doc": None, "priority": 1})
    assert got.documents == ["a", "b"] and got.top_n is None and got.return_documents
    assert got.objects == [{"text": "a", "id": 3}, None]  # echoed whole
    assert parse({"query": "q", "documents": ["a"], "max_tokens_per_doc": 7,
                  "top_n": 2.0}).options.max_tokens_per_doc == 7


def test_rank_fields_pick_what_an_object_is_ranked_on() -> None:
    """Cohere v1's rank_fields: the values of those fields a document has, in their order,
    one per line (a string as it is, another value as its JSON); one with none of them is
    ranked on its text. An object needs its text (it is echoed in Cohere's shape), and
    rank_fields must be field names: else a 400 naming it."""
    docs = [{"title": "T", "text": "a", "year": 2024, "tags": ["x"]}, {"text": "b"}, "c"]
    got = parse({"query": "q", "documents": docs,
                 "rank_fields": ["title", "year", "missing", "tags", "text"]})
    assert got.documents == ['T\n2024\n["x"]\na', "b", "c"]
    assert got.objects == [*docs[:2], None]
    for fields in (None, [], ["missing"]):
        assert parse({"query": "q", "documents": docs, "rank_fields": fields}).documents == [
            "a", "b", "c"]
    for body, param in (({"documents": [{"title": "T"}], "rank_fields": ["title"]},
                         "documents[0]"),
                        ({"documents": [{"text": 3}]}, "documents[0]"),
                        ({"documents": ["a"], "rank_fields": "title"}, "rank_fields"),
                        ({"documents": ["a"], "rank_fields": [1]}, "rank_fields")):
        with pytest.raises(InvalidInput) as info:
            parse({"query": "q", **body})
        assert info.value.param == param, body
    # orjson reads 1,024 levels of nesting but writes 254: an answer echoing this object (or
    # rank_fields writing it) was a 500 after scoring; it is refused before.
    deep = "[" * 300 + "]" * 300
    for extra in (', "return_documents": true', ', "rank_fields": ["meta"]'):
        raw = f'{{"query": "q", "documents": ["a", {{"text": "b", "meta": {deep}}}]{extra}}}'
        with pytest.raises(InvalidInput, match="nested less deeply") as info:
            parse_rerank_request(raw.encode(), Settings(), IDS)
        assert info.value.param == "documents[1]"


def test_scoring_options() -> None:
    """normalize, mode, weights, long_documents; truncate wins over long_documents."""
    got = parse({"query": "q", "documents": ["a"], "normalize": False, "mode": "sparse+dense",
                 "weights": [1, 0, 2], "long_documents": "truncate"}).options
    assert (got.normalize, got.mode, got.weights, got.long_documents) == (
        False, "sparse+dense", (1.0, 0.0, 2.0), "truncate")
    assert parse({"query": "q", "documents": ["a"], "truncate": True,
                  "long_documents": "max"}).options.long_documents == "truncate"
    assert parse({"query": "q", "documents": ["a"], "truncate": False,
                  "long_documents": "truncate"}).options.long_documents == "max"
    # BGE_M3_RERANK_NORMALIZE sets the default (Cohere's and Jina's clients cannot send it:
    # QA, their scores came as logits, under a LlamaIndex cutoff of 0.1 no node was kept)
    sigmoid = Settings(rerank_normalize=True)
    assert parse({"query": "q", "documents": ["a"]}, sigmoid).options.normalize
    assert not parse({"query": "q", "documents": ["a"], "normalize": False}, sigmoid).options.normalize
    assert parse({"query": "q", "documents": ["a"], "normalize": True}).options.normalize


@pytest.mark.parametrize(("body", "param"), [
    ({"documents": ["a"]}, "query"),
    ({"query": 3, "documents": ["a"]}, "query"),
    ({"query": "q"}, "documents"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": "a"}, "documents"),
    ({"query": "q", "documents": ["a", {"content": "b"}]}, "documents[1]"),
    ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ({"query": "q", "documents": ["a"], "top_n": "2"}, "top_n"),
    ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ({"query": "q", "documents": ["a"], "mode": "bm25"}, "mode"),
    ({"query": "q", "documents": ["a"], "weights": [1, 1]}, "weights"),
    ({"query": "q", "documents": ["a"], "weights": [0, 0, 0]}, "weights"),
    ({"query": "q", "documents": ["a"], "weights": [1, -1, 1]}, "weights"),
    ({"query": "q", "documents": ["a"], "long_documents": "split"}, "long_documents"),
    ({"query": "q", "documents": ["a"], "max_tokens_per_doc": 0}, "max_tokens_per_doc"),
])
def test_bad_fields_name_themselves(body: dict, param: str) -> None:
    """Every malformed field is a 400 whose param names it."""
    with pytest.raises(InvalidInput) as info:
        parse(body)
    assert info.value.param == param


def test_unknown_model_is_404_and_limits_hold() -> None:
    """A model the server does not serve is model_not_found; more documents than
    BGE_M3_MAX_BATCH, or a document over BGE_M3_MAX_TEXT_CHARS, are refused naming the knob."""
    with pytest.raises(ModelNotFound, match="bge-reranker-v2-m3"):
        parse({"query": "q", "documents": ["a"], "model": "rerank-english-v3.0"})
    with pytest.raises(InvalidInput, match="BGE_M3_MAX_BATCH"):
        parse({"query": "q", "documents": ["a"] * 3}, Settings(max_batch=2))
    small = Settings(max_text_chars=10)
    with pytest.raises(TooLarge, match="BGE_M3_MAX_TEXT_CHARS") as info:
        parse({"query": "q", "documents": ["a", "a" * 11]}, small)
    assert info.value.param == "documents[1]"
    assert "max_tokens_per_doc" in info.value.message
    with pytest.raises(TooLarge, match="truncation_direction: right") as info:
        tei({"query": "q", "texts": ["a" * 11], "truncate": True,
             "truncation_direction": "left"}, small)
    assert "max_tokens_per_doc" not in info.value.message  # no such field in TEI's body
    # Read only to its leading tokens, a long text is left to the tokenizer, which serves it
    # from its leading words (or refuses it, saying why): the query always (FlagReranker's
    # cap), a document truncated from the right or cut by max_tokens_per_doc.
    for body in ({"query": "q" * 11, "documents": ["a"]},
                 {"query": "q", "documents": ["a" * 11], "truncate": True},
                 {"query": "q", "documents": ["a" * 11], "long_documents": "truncate"},
                 {"query": "q", "documents": ["a" * 11], "max_tokens_per_doc": 4}):
        assert parse(body, small).documents[0] == body["documents"][0]
    for body in ({"query": "q" * 11, "texts": ["a"]},
                 {"query": "q", "texts": ["a" * 11], "truncate": True}):
        assert tei(body, small).documents[0] == body["texts"][0]
    with pytest.raises(InvalidInput) as info:
        parse({"query": "q", "documents": []})
    assert info.value.code == "empty_input"


def test_tei_body() -> None:
    """TEI: texts, sigmoid unless raw_scores, return_text, truncate (cut) else windows, and
    truncation_direction in either case. ``truncate`` null follows BGE_M3_TRUNCATE, as TEI's
    follows its --auto-truncate (it took false: windows, where /info said auto_truncate)."""
    got = tei({"query": "q", "texts": ["a", "b"]})
    assert got.options.normalize and got.options.long_documents == "truncate"
    assert not got.return_documents and got.top_n is None
    for truncate, settings, expected in ((None, Settings(truncate=False), "max"),
                                         (False, Settings(), "max"),
                                         (True, Settings(truncate=False), "truncate")):
        got = tei({"query": "q", "texts": ["a"], "truncate": truncate}, settings)
        assert got.options.long_documents == expected, (truncate, settings.truncate)
    got = tei({"query": "q", "texts": ["a"], "raw_scores": True, "return_text": True,
               "truncate": True, "truncation_direction": "Left"})
    assert (got.options.normalize, got.return_documents, got.options.long_documents,
            got.options.truncation_direction) == (False, True, "truncate", "left")
    with pytest.raises(InvalidInput) as info:
        tei({"query": "q", "texts": [{"text": "a"}]})
    assert info.value.param == "texts[0]"
    with pytest.raises(InvalidInput):
        tei({"query": "q", "texts": ["a"], "truncation_direction": "up"})


def test_a_non_string_direction_is_a_400() -> None:
    """truncation_direction of another JSON type is refused, not a crash (found by
    schemathesis: a dict is unhashable)."""
    for bad in ({}, [], 1):
        with pytest.raises(InvalidInput) as info:
            tei({"query": "q", "texts": ["a"], "truncation_direction": bad})
        assert info.value.param == "truncation_direction"
