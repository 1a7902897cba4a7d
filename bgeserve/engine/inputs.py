"""The input shapes the engine accepts: a string, strings, token ids, or lists of token ids."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import cast

import numpy as np

from bgeserve.errors import InvalidInput

Inputs = str | Sequence[str] | Sequence[Sequence[int]]


def normalize_inputs(inputs: Inputs) -> tuple[list[str] | None, list[list[int]] | None]:
    """Split the accepted input shapes into (texts, None) or (None, token id lists)."""
    if isinstance(inputs, str):
        return [inputs], None
    # bytes iterate as ints: b"hello" embedded the ids [104, 101, ...] without a word; a dict
    # gave its keys and a set an arbitrary order; None or 5 a bare TypeError.
    if isinstance(inputs, (bytes, bytearray, memoryview)):
        raise InvalidInput("input is bytes: decode it to a string first (data.decode('utf-8'))",
                           param="input")
    if isinstance(inputs, (Mapping, AbstractSet)) or not isinstance(inputs, Iterable):
        raise InvalidInput(f"input must be a string or an ordered sequence (list, tuple, "
                           f"array, iterator), not {type(inputs).__name__}", param="input")
    items = list(inputs)
    if any(isinstance(x, (bytes, bytearray, memoryview)) for x in items):
        i = next(i for i, x in enumerate(items) if isinstance(x, (bytes, bytearray, memoryview)))
        raise InvalidInput(f"input[{i}] is bytes: decode it to a string first", param=f"input[{i}]")
    if items and all(isinstance(x, str) for x in items):
        return cast(list[str], items), None
    if items and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in items):
        return None, [cast(list[int], items)]
    if items and all(not isinstance(x, (str, bytes)) and isinstance(x, Sequence | np.ndarray)
                     for x in items):
        return None, [list(cast(Sequence[int], x)) for x in items]
    if not items:
        return [], None
    if isinstance(items[0], str):  # a list of texts with one that is not: name it (QA)
        i = next(i for i, x in enumerate(items) if not isinstance(x, str))
        raise InvalidInput(f"input[{i}] is {type(items[i]).__name__}, not a string: every "
                           "item of a list of texts must be a string", param=f"input[{i}]")
    raise InvalidInput("input must be a string, a list of strings, a list of token ids or a "
                       "list of lists of token ids", param="input")


def rerank_inputs(query: object, documents: object) -> list[str]:
    """The documents of a library rerank call as a list of strings, or ``InvalidInput``: one
    string for ``documents`` was scored as one document per character."""
    if not isinstance(query, str):
        raise InvalidInput(f"query must be a string, not {type(query).__name__}", param="query")
    if isinstance(documents, str):
        raise InvalidInput("documents must be a list of strings; for one document pass "
                           "[document]", param="documents")
    if isinstance(documents, (Mapping, AbstractSet)) or not isinstance(documents, Iterable):
        raise InvalidInput(f"documents must be a list of strings, not "
                           f"{type(documents).__name__}", param="documents")
    docs = list(documents)
    for i, d in enumerate(docs):
        if not isinstance(d, str):
            raise InvalidInput(f"documents[{i}] must be a string, not {type(d).__name__}",
                               param=f"documents[{i}]")
    return docs
