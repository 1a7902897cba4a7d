"""What decoding a JSON body costs in memory beyond its own bytes, estimated before decoding.

orjson builds a Python object for every JSON value: 30 MiB of ``[{},{},...]`` decodes to 690
MiB of empty dicts (QA: +900 MiB RSS before any check of the batch could refuse it), and a few
such bodies decoded at once on the parsing threads take any container down. The allowance of
bodies in progress counts bytes as they arrive (guards.py), so a body is charged what its
decoding adds before it is decoded (handlers.py).

The estimate counts the structural characters outside strings (numpy on the bytes, a piece at
a time: ~0.2 s for 32 MiB of small values, ~20 ms for 32 MiB of ordinary texts). It bounds
what decoding holds at its peak, measured by RSS for every shape tried (CPython 3.11, 64-bit,
orjson 3; review: a first estimate of 64 bytes a dict and 40 a value was under it by up to
1.6x): a list or a string 64 bytes, a dict 192 (a non-empty one's keys table), and 64 for each
value after a comma or behind a key (its pointer, a float or large int, orjson's own parse tree
while it decodes). The characters of strings are not counted: they are the body's own bytes
(up to 4x as Python strings of non-BMP text, as with any text the server takes). Token ids
(``BGE_M3_ACCEPT_TOKEN_IDS``) cost ~10x their JSON: they are charged so.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

ARRAY_BYTES = STRING_BYTES = 64  # measured: [] 56, "ab" 51 (kept), plus a pointer to each
OBJECT_BYTES = 192  # {"a": 1} 184 kept
VALUE_BYTES = 64  # a pointer (8), a float or a large int (32), orjson's parse tree (~24)
_CHUNK = 1 << 20  # bytes of a body scanned at once (its scan holds ~7 times this)
_MARKS = b'[{",:'  # what the estimate counts, and the quotes that delimit strings
_OTHER_BYTES = bytes(sorted(set(range(256)) - set(_MARKS)))
# Each mark's kind: 1 opens an array, 2 an object, 3 separates values, 0 is a quote.
_KINDS = np.zeros(256, dtype=np.uint8)
_KINDS[ord("[")] = 1
_KINDS[ord("{")] = 2
_KINDS[[ord(","), ord(":")]] = 3


def decoded_bytes(raw: bytes) -> int:
    """An upper bound of the bytes that ``orjson.loads(raw)`` allocates for ``raw``'s values,
    the characters of its strings apart. Counted first on the raw bytes, where commas and
    brackets inside texts count too (a bound: enough for the bodies of ordinary texts), then,
    if that is over ``len(raw)``, outside the strings alone. Both read ``raw`` a piece at a
    time: the scan of a body holds ~5 pieces, not copies of the body."""
    rough = [0, 0, 0, 0]
    for piece in _pieces(raw):
        for i, n in enumerate(_counts(piece.translate(None, _OTHER_BYTES))):
            rough[i] += n
    estimate = _estimate(*rough)
    if estimate <= len(raw):
        return estimate
    exact = [0, 0, 0, 0]
    for piece in _pieces(raw):
        # Escapes first: with each escaped backslash gone, every backslash and quote left is
        # an escaped quote inside a string; with those gone too, each quote left opens or
        # closes one (in valid JSON; in other bytes the counts are still finite, and orjson
        # refuses them after).
        if b"\\" in piece:
            piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
        for i, n in enumerate(_outside_strings(piece.translate(None, _OTHER_BYTES),
                                               exact[2] & 1)):
            exact[i] += n
    return _estimate(*exact)


def _pieces(raw: bytes) -> Iterator[bytes]:
    """``raw`` in pieces of about ``_CHUNK`` bytes, none ending inside an escape (an odd run of
    backslashes)."""
    start = 0
    while start < len(raw):
        end = min(start + _CHUNK, len(raw))
        piece = raw[start:end]
        if (len(piece) - len(piece.rstrip(b"\\"))) % 2 and end < len(raw):
            end += 1
            piece = raw[start:end]
        yield piece
        start = end


def _estimate(arrays: int, objects: int, quotes: int, separators: int) -> int:
    return (ARRAY_BYTES * arrays + OBJECT_BYTES * objects + STRING_BYTES * (quotes // 2)
            + VALUE_BYTES * separators)


def _counts(marks: bytes) -> tuple[int, int, int, int]:
    """(arrays opened, objects opened, quotes, commas and colons) in ``marks``."""
    return (marks.count(b"["), marks.count(b"{"), marks.count(b'"'),
            marks.count(b",") + marks.count(b":"))


def _outside_strings(marks: bytes, inside: int) -> tuple[int, int, int, int]:
    """``_counts`` of the marks outside strings, given marks whose quotes all open or close
    one, the first inside a string if ``inside`` is 1."""
    part = np.frombuffer(marks, dtype=np.uint8)
    is_quote = part == ord('"')
    # A mark is outside every string where the quotes up to it are even in number (uint8
    # wraps at 256, an even number: the parity survives).
    outside = ((np.cumsum(is_quote, dtype=np.uint8) + inside) & 1) == 0
    kinds = np.bincount(_KINDS[part][outside], minlength=4)
    return int(kinds[1]), int(kinds[2]), int(np.count_nonzero(is_quote)), int(kinds[3])
