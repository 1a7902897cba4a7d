"""The estimate of what decoding a JSON body allocates (http/jsoncost.py), against orjson."""

from __future__ import annotations

import tracemalloc
from typing import Any

import orjson
import pytest

from bgeserve.http import jsoncost
from bgeserve.http.jsoncost import decoded_bytes


def _allocated(raw: bytes) -> int:
    tracemalloc.start()
    try:
        value = orjson.loads(raw)
        allocated = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del value
    return allocated


def _body(item: bytes, n: int = 20_000) -> bytes:
    return b'{"input":[' + b",".join([item] * n) + b"]}"


SHAPES = [b"{}", b"[]", b"[[]]", b"[1]", b'{"a":1}', b'{"a":[]}', b'{"k1":{"k2":{}}}',
          b'{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6}', b'"ab"', b'""', b"0.5", b"1000",
          b"250001", b"1", b"true", b"null", b'{"text":"ab"}', b"[0.5,0.5]",
          b"[" + b",".join([b"1000"] * 9) + b"]", b'"\\u00e9\\ud83d\\ude00"']


@pytest.mark.parametrize("item", SHAPES, ids=lambda s: s.decode()[:24])
def test_the_estimate_bounds_what_orjson_allocates(item: bytes) -> None:
    """An upper bound of what decoding keeps (the strings' characters apart, which are the
    body's own bytes; the estimate also covers orjson's parse tree while it decodes, which
    only RSS shows), and not a wild one: charged more than it takes, a client is refused
    early. Within 5x, but for values decoded to one shared object (``true``, ``null``,
    ``""``, ints below 257), which take only their 8-byte pointer and are charged as a
    number (64) or a string (128): an over-count only bodies of thousands of them meet."""
    raw = _body(item)
    allocated, estimate = _allocated(raw), decoded_bytes(raw)
    assert allocated <= estimate + len(raw), (allocated, estimate)
    shared = item in (b'""', b"1", b"true", b"null")
    assert estimate <= (17 if shared else 5) * allocated, (allocated, estimate)


@pytest.mark.parametrize("make", [
    lambda i: b'{"%x":0}' % i, lambda i: b'{"%x":{}}' % i, lambda i: b'{"%s":0}' % chr(
        0x4E00 + i % 20000).encode(), lambda i: b"%d.5" % i, lambda i: b"1e5",
    lambda i: b"[" + b",".join(b"%d" % (1000 + j + i % 7) for j in range(64)) + b"]",
], ids=["hex keys", "hex keys of dicts", "CJK keys", "floats", "exponents", "token ids"])
def test_the_estimate_bounds_shapes_of_distinct_values(make: Any) -> None:
    """Distinct keys defeat orjson's cache of keys, and a non-empty dict has a keys table of
    its own (review: a first estimate, 64 bytes a dict, was under what these keep)."""
    raw = b'{"input":[' + b",".join(make(i) for i in range(20_000)) + b"]}"
    allocated, estimate = _allocated(raw), decoded_bytes(raw)
    assert allocated <= estimate + len(raw), (allocated, estimate)


def test_the_bodies_that_decode_to_many_objects_are_told_from_texts() -> None:
    """``[{},{},...]`` decodes to 24x its bytes, and its estimate says so; a body of ordinary
    texts of the same size decodes to about its bytes, and its estimate is far below them."""
    junk = _body(b"{}", 1_000_000)
    assert decoded_bytes(junk) >= 20 * len(junk)
    texts = orjson.dumps({"input": ["Lorem ipsum dolor sit amet, consectetur. " * 50] * 1000})
    assert decoded_bytes(texts) < len(texts) // 10
    assert _allocated(texts) < 2 * len(texts)


@pytest.mark.parametrize("text", [
    'commas, colons: [brackets] {braces}, "quotes"' * 40,
    "a backslash at the end \\",
    '\\"escaped\\\\" [,]' * 50,
    "\\\\\\\\\",[{:" * 30,
    "émoji 😀 [, {, :] 数据" * 30,
])
def test_what_is_inside_strings_does_not_count(text: str) -> None:
    """Commas, brackets, colons and quotes inside texts (escaped or next to escaped
    backslashes) count as nothing: the estimate is the one of plain texts of the same
    number. Counted, a body of texts full of them was charged for values it does not hold."""
    def body(texts: list[str]) -> bytes:
        payload: dict[str, Any] = {"input": texts, "truncate": True, "dimensions": 8}
        return orjson.dumps(payload)

    texts = [text] * 300
    assert decoded_bytes(body(texts)) == decoded_bytes(body(["plain"] * len(texts)))


def test_the_estimate_does_not_depend_on_where_the_body_is_cut(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Read in pieces, a body is counted alike wherever a piece ends: in a run of escaped
    backslashes, between a backslash and the quote it escapes, inside a string."""
    texts = ['\\\\\\"', '\\"', "a,b:[c]{d}", '\\', "x" * 7, '"' * 5, "é😀,"] * 40
    raw = orjson.dumps({"input": texts, "more": [[1, 2], {"a": [3]}] * 40})
    whole = decoded_bytes(raw)
    assert whole > len(raw)  # counted outside the strings, in pieces
    for size in range(1, 12):
        monkeypatch.setattr(jsoncost, "_CHUNK", size)
        assert decoded_bytes(raw) == whole, size


def test_bytes_that_are_no_json_are_estimated_without_error() -> None:
    """A body orjson will refuse (an unterminated string, stray escapes) still gets a finite
    estimate, in linear time (a pattern that restarted at every quote took quadratic time)."""
    for raw in (b'["' + b'\\"' * 500_000, b'"' * 1_000_001, b"\\" * 999_999 + b'"', b"\xff\xfe,{[",
                b""):
        assert 0 <= decoded_bytes(raw) < 200 * max(len(raw), 1)
