"""``engine.inputs``: the library's input shapes, and what it refuses (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from bgeserve.engine.inputs import normalize_inputs, rerank_inputs
from bgeserve.errors import InvalidInput


@pytest.mark.parametrize("inputs, expected", [
    ("one", (["one"], None)),
    (["a", "b"], (["a", "b"], None)),
    (("a", "b"), (["a", "b"], None)),
    ((t for t in ["a", "b"]), (["a", "b"], None)),
    (np.array(["a", "b"]), (["a", "b"], None)),
    ([0, 5, 2], (None, [[0, 5, 2]])),
    ([[0, 5], [7]], (None, [[0, 5], [7]])),
    ([np.array([0, 5])], (None, [[0, 5]])),
    ([], ([], None)),
])
def test_the_accepted_shapes(inputs: object, expected: tuple) -> None:
    texts, ids = normalize_inputs(inputs)  # type: ignore[arg-type]
    assert (texts, None if ids is None else [list(map(int, x)) for x in ids]) == expected


@pytest.mark.parametrize("inputs, param, words", [
    (b"hello", "input", "bytes"),  # it embedded the token ids [104, 101, 108, 108, 111]
    (bytearray(b"hello"), "input", "bytes"),
    (memoryview(b"hello"), "input", "bytes"),
    (["a", b"b"], "input[1]", "bytes"),
    ({"hello": 1, "x": 2}, "input", "dict"),  # it embedded the keys
    ({"a", "b"}, "input", "set"),  # in no order the caller knows
    (None, "input", "NoneType"),  # a bare TypeError
    (5, "input", "int"),
    (["a", 5], "input[1]", "input\\[1\\] is int, not a string"),
    (["a", None], "input[1]", "input\\[1\\] is NoneType, not a string"),
])
def test_what_is_refused_names_the_input(inputs: object, param: str, words: str) -> None:
    with pytest.raises(InvalidInput, match=words) as info:
        normalize_inputs(inputs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_rerank_documents_are_a_list_of_strings() -> None:
    """One string for ``documents`` was scored as one document per character."""
    assert rerank_inputs("q", ("a", "b")) == ["a", "b"]
    assert rerank_inputs("q", (d for d in ["a"])) == ["a"]
    for documents, param in (("abc", "documents"), ({"a": 1}, "documents"),
                             (None, "documents"), (["a", 5], "documents[1]")):
        with pytest.raises(InvalidInput) as info:
            rerank_inputs("q", documents)
        assert info.value.param == param
    with pytest.raises(InvalidInput, match="query"):
        rerank_inputs(["q"], ["a"])
