"""The rows of each input format (JSONL, CSV, Parquet, gzipped or not), as ``Rows``.

Bad rows (no text, a text that is not a string, no id, a line that is not JSON, a CSV line
with too many or too few cells, a cell that is not UTF-8) come back with ``errors[i]`` saying
why, never as an exception: one bad row never stops a job. Nor does a damaged file: a gzipped
file cut short (an interrupted copy or download) gives its whole rows, then one bad row where
it ends; a Parquet row group that cannot be read gives each of its rows unread as a bad row,
and the next row group is read. (Gzip data damaged inside, which its CRC tells only at the
end, is refused before the model loads: ``gzipped.check``.)

Readers are pyarrow's (Parquet's row groups, the streaming CSV reader) and orjson per line
for JSONL (per item for a ``.json`` file that is one array): pyarrow's JSON reader infers one
type per column and fails the whole block when one row differs (``"text": 5`` among strings),
which is exactly the row this job must report and skip.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import itertools
import json
import logging
import re
from collections.abc import Iterator

import numpy as np
import orjson

from bgeserve.bulk.gzipped import cut_of, open_bytes
from bgeserve.bulk.sources import Rows, Source
from bgeserve.errors import InvalidInput, surrogate_error

log = logging.getLogger("bgeserve.bulk")

READ_ROWS = 8192  # rows per read from a JSONL or Parquet file
CSV_BLOCK_BYTES = 4 << 20  # bytes per read from a CSV file
HEAD_BYTES = 4096  # bytes per read while looking for a JSON file's first character
ARRAY_READ_BYTES = 1 << 20  # bytes per read from a .json file that is one array


def read(source: Source, text_column: str, id_column: str) -> Iterator[Rows]:
    """Every row of ``source``, in order, in pieces."""
    if source.format == "jsonl":
        yield from _jsonl(source, text_column, id_column)
    elif source.format == "parquet":
        yield from _parquet(source, text_column, id_column)
    else:
        yield from _csv(source, text_column, id_column)


def _jsonl(source: Source, text_column: str, id_column: str) -> Iterator[Rows]:
    """One JSON object a line; or, where a ``.json`` file is one JSON array (as most are), its
    items, row ``i`` the array's item ``i``. (Which one depends on the file's bytes alone, so
    row numbers hold across runs; a changed file is refused by its size and mtime.)"""
    items = _array(source) if starts_array(source) else None
    if items is not None:
        yield from _rows(source, enumerate(items), text_column, id_column)
        return
    parsed = enumerate(map(_parse, _lines(source)))
    yield from _rows(source, ((n, obj) for n, obj in parsed if obj is not _BLANK), text_column,
                     id_column)


_BLANK = object()  # a blank line (a trailing newline): no row


def starts_array(source: Source) -> bool:
    """Whether ``source`` may be one JSON array rather than JSON lines: a ``.json`` file whose
    first byte that is not a byte-order mark or whitespace is ``[`` (a ``.jsonl`` file whose
    first line is an array is JSON lines, that line a bad row)."""
    if not source.path.name.lower().removesuffix(".gz").endswith(".json"):
        return False
    # A bounded read: a minified array is one line, maybe huge.
    with open_bytes(source.path, source.compressed) as f:
        while chunk := f.read(HEAD_BYTES):
            head = chunk.removeprefix(b"\xef\xbb\xbf").lstrip()
            if head:
                return head.startswith(b"[")
    return False


def _loads(data: bytes) -> object:
    """``data``'s JSON value (ValueError or RecursionError if it is none). orjson first; it
    refuses an escaped lone surrogate ("\ud800"), which JSON allows: the stdlib reads it,
    so its row keeps its id and the reason names the character. It also reads an integer
    past 64 bits as a float (QA: a 30-digit id was a bad row, "'id' is float"): the stdlib
    reads such an object's integers whole."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
    if isinstance(value, dict) and any(type(v) is float and abs(v) >= 2.0**63
                                       for v in value.values()):
        return json.loads(data)
    return value


def _parse(line: bytes | _Invalid) -> object:
    """A line's JSON value; ``_BLANK`` for a blank line; ``_Invalid`` saying why for one that
    is not JSON (or the line where a file cut short ends, as ``_lines`` gives it)."""
    if isinstance(line, _Invalid):
        return line
    if not line.strip():
        return _BLANK
    try:
        return _loads(line)
    except (ValueError, RecursionError):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:  # QA: a Latin-1 file's lines were "not valid JSON"
            return _Invalid(f"not valid UTF-8 (byte {exc.start} of the line: a file in "
                            "another encoding must be converted to UTF-8)")
        return _Invalid("not valid JSON")


class _Invalid(str):
    """Why a line is no JSON value (a row with this error)."""


def _array(source: Source) -> Iterator[object] | None:
    """The items of a file that is one JSON array, one at a time, each parsed as a JSON line
    is; None where the whole file is no JSON array (JSON lines whose first is an array: read
    line by line, its bad lines reported as bad rows). An array cut short (a copy or download
    that stopped) gives its whole items, then what follows them: an item where it parses (only
    the ']' missing), else one bad row saying the file ends there; read as lines, an array
    written one item a line lost every row to its commas, and a pretty-printed one all of them.
    Two passes, so that which reading a file gets is known before its first row: one that
    checks the whole file is one array, then its items. Never read whole: a file of a few GB
    parsed whole took several times its size in memory."""
    try:
        with open_bytes(source.path, source.compressed) as f:
            for _ in _item_bytes(f):
                pass
    except _CutShort as exc:
        log.warning("%s is a JSON array cut short (%s): its whole items (%d) are read, then %s",
                    source.path, exc, exc.count, "the item it ends with (only the ']' is "
                    "missing)" if _whole_item(exc.tail) else "one bad row where it ends")
    except _NotOneArray as exc:
        log.warning("%s starts as a JSON array but is not one whole (%s): read as JSON lines, "
                    "each line a row", source.path, exc)
        return None
    return _items(source)


def _items(source: Source) -> Iterator[object]:
    """Each item of a file ``_array`` found to be one array, or one cut short, parsed (a bad
    one: why)."""
    with open_bytes(source.path, source.compressed) as f:
        try:
            for item in _item_bytes(f):
                yield _parse(item) if item.strip() else _Invalid("not valid JSON")
        except _CutShort as exc:
            yield (_parse(exc.tail) if _whole_item(exc.tail) else
                   _Invalid("the file ends here, before its array does (cut short?)"))


def _whole_item(tail: bytes) -> bool:
    """Whether what a cut-short array ends with is one whole item (its ']' alone missing)."""
    return bool(tail.strip()) and not isinstance(_parse(tail), _Invalid)


class _NotOneArray(Exception):
    """The file is not one JSON array: bytes after its end, none, or an end missing."""


class _CutShort(_NotOneArray):
    """The file is one JSON array up to where it ends, before the array does: ``count`` items
    were whole, ``tail`` is what follows the last of them."""

    def __init__(self, message: str, count: int, tail: bytes):
        super().__init__(message)
        self.count, self.tail = count, tail


# A string's bytes up to its closing quote, escapes skipped whole (possessive: no backtracking
# over a text of many MB); where it stops short of a quote, the string goes on in the next read
# (or its last byte is a backslash whose escaped byte does).
_STRING_BODY = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)
_STRUCTURE = re.compile(rb'["\[\]{},]')
_SPACE = b" \t\r\n"


def _item_bytes(f: io.BufferedIOBase) -> Iterator[bytes]:
    """The bytes of each item of the one JSON array ``f`` holds (past a byte-order mark), cut
    at the array's own commas: those outside strings and nested values. An item that is no
    JSON (a trailing comma's empty one, mismatched brackets) is still cut here, and is then
    its row's error, as a bad line is. Hand-written over ijson: its C parser turns an escaped
    lone surrogate into "?" (the other readers report that row) and its Python one keeps the
    whole file in memory."""
    head = f.read(3)  # no seek back: a gzipped file's stream has none
    bom = head == b"\xef\xbb\xbf"
    offset = 3 if bom else 0  # the file's bytes before the current read (for the reason a
    # file is refused)
    reads = iter(lambda: f.read(ARRAY_READ_BYTES), b"")
    started = ended = in_string = escaped = False
    depth = 0  # inside the array's items: 0 between them
    count = 0  # items cut so far
    item = bytearray()
    for chunk in reads if bom or not head else itertools.chain([head], reads):
        n, i, start = len(chunk), 0, 0  # start: where the current item's unsaved bytes begin
        while i < n:
            if in_string:
                if escaped:
                    i, escaped = i + 1, False
                    continue
                i = _STRING_BODY.match(chunk, i).end()  # type: ignore[union-attr]
                if i < n:
                    if chunk[i] == 0x22:  # the closing quote
                        in_string = False
                    else:  # a backslash that is the read's last byte
                        escaped = True
                    i += 1
                continue
            if ended:
                rest = chunk[i:].lstrip(_SPACE)
                if rest:
                    raise _NotOneArray("more after the array's end at byte "
                                       f"{offset + n - len(rest)}")
                break
            if not started:
                rest = chunk[i:].lstrip(_SPACE)
                if not rest:
                    break
                if rest[0] != 0x5B:  # '['
                    raise _NotOneArray("no '[' at its start")
                started, i = True, n - len(rest) + 1
                start = i
                continue
            m = _STRUCTURE.search(chunk, i)
            if m is None:
                break
            c, i = chunk[m.start()], m.end()
            if c == 0x22:  # '"'
                in_string = True
            elif c in b"[{":
                depth += 1
            elif depth:
                depth -= 1 if c in b"]}" else 0
            elif c == 0x7D:  # a '}' closing nothing
                raise _NotOneArray(f"a '}}' closing nothing at byte {offset + m.start()}")
            else:  # the array's own ',' or ']'
                item += chunk[start:m.start()]
                start, ended = i, c == 0x5D
                if not (ended and count == 0 and not item.strip()):  # "[]" has no item
                    yield bytes(item)
                    count += 1
                item.clear()
        if started and not ended:
            item += chunk[start:]
        offset += n
    if not started:
        raise _NotOneArray("it holds no '['")
    if not ended:
        where = "inside a string" if in_string else f"after {count} items"
        raise _CutShort(f"it ends {where}, before the array does", count, bytes(item))


def _rows(source: Source, items: Iterator[tuple[int, object]], text_column: str,
          id_column: str) -> Iterator[Rows]:
    """``Rows`` of (row number, JSON value) pairs: an object's id and text, or why not."""
    rows: list[int] = []
    ids: list[str | None] = []
    texts: list[str | None] = []
    errors: list[str | None] = []
    for row_no, obj in items:
        rows.append(row_no)
        error: str | None
        if isinstance(obj, _Invalid):
            error = str(obj)
        else:
            error = None if isinstance(obj, dict) else "not a JSON object"
        if error is None:
            assert isinstance(obj, dict)
            row_id, error = _id(obj.get(id_column), id_column)
            text, text_error = _text(obj.get(text_column), text_column)
            error = error or text_error
            if error is None:  # only the stdlib's fallback reads one; no UTF-8 writes it
                found = surrogate_error(row_id, id_column) or surrogate_error(text, text_column)
                error = None if found is None else found.message
            if row_id is not None and surrogate_error(row_id, id_column) is not None:
                # The bad-row report (a shard's metadata, the log) is UTF-8: the id as escaped.
                row_id = row_id.encode("utf-8", "backslashreplace").decode("utf-8")
        else:
            row_id, text = None, None
        ids.append(row_id)
        texts.append(text if error is None else None)
        errors.append(error)
        if len(rows) >= READ_ROWS:
            yield Rows(source.key, np.array(rows, dtype=np.int64), ids, texts, errors)
            rows, ids, texts, errors = [], [], [], []
    if rows:
        yield Rows(source.key, np.array(rows, dtype=np.int64), ids, texts, errors)


def _lines(source: Source) -> Iterator[bytes | _Invalid]:
    """The lines of a JSONL file, decompressed if it is gzipped, the first one's byte-order
    mark dropped (Windows tools write one; it is no JSON). A gzipped file cut short ends with
    the line it ends in (or the one after its last whole line) as why it is a bad row."""
    with open_bytes(source.path, source.compressed, whole_lines=True) as f:
        for n, line in enumerate(f):
            yield line.removeprefix(b"\xef\xbb\xbf") if n == 0 else line
        if (cut := cut_of(f)) is not None:
            yield _Invalid(cut)


def _id(value: object, column: str) -> tuple[str | None, str | None]:
    """The id as a string (integers written in decimal), or why there is none."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value), None
    if value is None:
        return None, f"no {column!r}"
    return None, f"{column!r} is {type(value).__name__}, not a string or an integer"


def _text(value: object, column: str) -> tuple[str | None, str | None]:
    """The text, or why there is none."""
    if isinstance(value, str):
        return value, None
    if value is None:
        return None, f"no {column!r}"
    return None, f"{column!r} is {type(value).__name__}, not a string"


def _columns(table, source: Source, start: int, text_column: str, id_column: str) -> Rows:
    """Rows from an Arrow table of the id and text columns (Parquet, CSV)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = table.num_rows
    rows = np.arange(start, start + n, dtype=np.int64)
    id_col, text_col = _plain(table.column(id_column)), _plain(table.column(text_column))
    if pa.types.is_integer(id_col.type) or pa.types.is_string(id_col.type):
        ids = pc.cast(id_col, pa.string()).to_pylist()
        id_errors = [None if i is not None else f"no {id_column!r}" for i in ids]
    else:
        ids = [None] * n
        id_errors = [f"{id_column!r} is {id_col.type}, not a string or an integer"] * n
    if pa.types.is_string(text_col.type):
        texts = text_col.to_pylist()
        text_errors = [None if t is not None else f"no {text_column!r}" for t in texts]
    else:
        texts = [None] * n
        text_errors = [f"{text_column!r} is {text_col.type}, not a string"] * n
    errors = [a or b for a, b in zip(id_errors, text_errors, strict=True)]
    texts = [t if e is None else None for t, e in zip(texts, errors, strict=True)]
    return Rows(source.key, rows, ids, texts, errors)


def _plain(column):
    """``column`` without its encoding: a dictionary (a pandas Categorical) as its values, a
    large_string or string_view as a string; the rows are the same, and the type checks only
    know plain strings and integers."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(column.type):
        column = pc.cast(column, column.type.value_type)
    if pa.types.is_large_string(column.type) or pa.types.is_string_view(column.type):
        column = pc.cast(column, pa.string())
    return column


def _parquet(source: Source, text_column: str, id_column: str) -> Iterator[Rows]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if source.is_empty():
        return
    start = 0  # the row group's first row
    # Checksums where the writer put them (write_page_checksum): a damaged page otherwise
    # decodes as text gone wrong when it is not compressed (QA: embedded silently).
    with pq.ParquetFile(source.path, page_checksum_verification=True) as f:
        for group in range(f.num_row_groups):
            size = f.metadata.row_group(group).num_rows
            done = 0  # its rows read
            batches = f.iter_batches(batch_size=READ_ROWS, row_groups=[group],
                                     columns=[id_column, text_column])
            while True:
                try:
                    batch = next(batches, None)
                # A damaged page (QA: pyarrow's bare "Corrupt snappy compressed data." stopped
                # the job at every rerun): the group's rows unread are bad rows, the next
                # group is read (a reader cannot skip a page within a group).
                except (OSError, pa.ArrowException) as exc:
                    log.warning("%s: rows %d-%d (row group %d) cannot be read (%s): they are "
                                "bad rows", source.path, start + done, start + size - 1, group,
                                exc)
                    yield _unread(source, start + done, start + size,
                                  f"in a damaged part of the file (row group {group}: {exc})",
                                  _ids_of(f, group, id_column, done))
                    break
                if batch is None:
                    break
                table = pa.Table.from_batches([batch])
                yield _columns(table, source, start + done, text_column, id_column)
                done += table.num_rows
            start += size


def _unread(source: Source, first: int, end: int, why: str,
            ids: list[str | None] | None = None) -> Rows:
    """Rows ``first`` to ``end`` (excluded) as bad rows that could not be read (their
    ``ids`` where known)."""
    n = end - first
    return Rows(source.key, np.arange(first, end, dtype=np.int64), ids or [None] * n,
                [None] * n, [why] * n)


def _ids_of(f, group: int, id_column: str, skip: int) -> list[str | None] | None:
    """The ids of row group ``group`` past its first ``skip`` rows, where its id column
    reads whole (the damage is often in the texts alone); else None."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        column = _plain(f.read_row_group(group, columns=[id_column]).column(0))
    except (OSError, pa.ArrowException):
        return None
    if not (pa.types.is_integer(column.type) or pa.types.is_string(column.type)):
        return None
    return pc.cast(column, pa.string()).to_pylist()[skip:]


def _csv(source: Source, text_column: str, id_column: str) -> Iterator[Rows]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    if source.is_empty():
        return
    # Both columns read as bytes: a CSV has no types (an id column inferred as integers from
    # the first block would fail at the first id that is not one), and a cell that is not
    # UTF-8 is one bad row (read as strings, it failed the whole file, every rerun). An empty
    # text cell is a missing text (null), not an empty string.
    convert = pacsv.ConvertOptions(column_types={text_column: pa.binary(), id_column: pa.binary()},
                                   include_columns=[id_column, text_column],
                                   strings_can_be_null=True, quoted_strings_can_be_null=False)
    # A line with too many or too few cells is a bad row too. Parsed on one thread, the
    # reader tells its record number (1: the header), so the rows keep their places.
    malformed: dict[int, tuple[str, str | None]] = {}  # row: (why, its id as read)
    header = functools.cache(functools.partial(_csv_header, source))  # read once, if needed

    def invalid(row) -> str:
        if row.number is None or row.number < 2:
            return "error"  # no place to give it: the reader's own error names the file
        malformed[row.number - 2] = (
            f"expected {row.expected_columns} cells, found {row.actual_columns}",
            _id_cell(row.text, header(), id_column, text_column))
        return "skip"

    start = 0  # the next data row's number
    cut: str | None = None  # why the row where a gzipped file cut short ends is bad
    stream = None
    try:
        with contextlib.ExitStack() as stack:
            # A gzipped file through gzipped.open_bytes (pyarrow raised "Truncated compressed
            # stream" at a cut, losing its last block's rows), a plain one read natively.
            stream = stack.enter_context(open_bytes(
                source.path, source.compressed, whole_lines=True, quoted=True)
            ) if source.compressed else None
            reader = stack.enter_context(pacsv.open_csv(
                stream if stream is not None else source.path, convert_options=convert,
                read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES, use_threads=False),
                parse_options=pacsv.ParseOptions(newlines_in_values=True,
                                                 invalid_row_handler=invalid)))
            for batch in reader:
                table = pa.Table.from_batches([batch])
                rows = np.empty(table.num_rows, dtype=np.int64)
                row = start
                for i in range(table.num_rows):  # the good rows fill the places between
                    while row in malformed:
                        row += 1
                    rows[i], row = row, row + 1
                found = _text_columns(table, rows, source, text_column, id_column)
                if table.num_rows:
                    # Malformed rows before the last good one are this piece's; later ones
                    # wait (they may follow rows of the next piece's block).
                    yield _with_malformed(found, malformed, int(rows[-1]) + 1)
                    start = int(rows[-1]) + 1
            cut = cut_of(stream)
    except (pa.ArrowInvalid, OSError) as exc:  # OSError: a .csv.gz that is not gzip
        cut = cut_of(stream)
        if cut is None:
            raise InvalidInput(f"{source.path}: not a CSV file bgeserve can read ({exc})",
                               param="INPUT") from None
        # The stream ends at a record's end (gzipped.open_bytes' quoted): an error here is in
        # the last whole block's rows, which are then lost with the cut (said).
        log.warning("%s: cannot be read past row %d where it is cut short (%s)", source.path,
                    start, exc)
    end = Rows(source.key, np.empty(0, np.int64), [], [], [])
    if cut is not None:
        end = Rows(source.key, np.array([max([start, *(r + 1 for r in malformed)])], np.int64),
                   [None], [None], [cut])
    if malformed or cut is not None:
        yield _with_malformed(end, malformed, None)


def _with_malformed(found: Rows, malformed: dict[int, tuple[str, str | None]],
                    before: int | None) -> Rows:
    """``found`` with the malformed rows numbered below ``before`` (None: all) taken from
    ``malformed`` and put in their places as bad rows."""
    taken = sorted(r for r in malformed if before is None or r < before)
    if not taken:
        return found
    n = len(taken)
    bad = [malformed.pop(r) for r in taken]
    merged = Rows(found.source, np.concatenate([found.rows, np.array(taken, np.int64)]),
                  [*found.ids, *(row_id for _, row_id in bad)], [*found.texts, *[None] * n],
                  [*found.errors, *(why for why, _ in bad)])
    return merged.take(np.argsort(merged.rows, kind="stable"))


def _csv_header(source: Source) -> list[str]:
    """The column names of a CSV's first line (read again: pyarrow gives only the columns it
    keeps), to name a malformed line's id (it was "id None": QA)."""
    try:
        with open_bytes(source.path, source.compressed) as f:
            # A BufferedReader or a file at run time (typeshed wants a declared buffer).
            # utf-8-sig: a byte order mark is no part of the first name (pyarrow drops it).
            text = io.TextIOWrapper(f, encoding="utf-8-sig",  # type: ignore[type-var]
                                    errors="replace", newline="")
            return next(csv.reader(text), [])
    except (OSError, InvalidInput, csv.Error):
        return []


def _id_cell(line: str | None, header: list[str], id_column: str, text_column: str
             ) -> str | None:
    """The id in a malformed ``line``, counted from the side away from the text, whose
    unquoted commas make the usual extra cells (None where a missing cell leaves it
    unknown)."""
    if not line or id_column not in header:
        return None
    try:
        cells = next(csv.reader(io.StringIO(line, newline="")), [])
    except csv.Error:
        return None
    position = header.index(id_column)
    if text_column in header and position > header.index(text_column):
        if len(cells) < len(header):
            return None  # which cell is missing is not known
        position -= len(header)  # from the end
    return cells[position] if -len(cells) <= position < len(cells) and cells[position] else None


def _text_columns(table, rows: np.ndarray, source: Source, text_column: str,
                  id_column: str) -> Rows:
    """Rows of a CSV piece whose two columns are bytes: each cell decoded as UTF-8, a cell
    that is not UTF-8 making its row bad."""
    n = table.num_rows
    ids, id_bad = _decode(table.column(id_column).to_pylist())
    texts, text_bad = _decode(table.column(text_column).to_pylist())
    errors: list[str | None] = []
    for i in range(n):
        if id_bad[i] or text_bad[i]:
            column = id_column if id_bad[i] else text_column
            errors.append(f"{column!r} is not valid UTF-8")
        elif ids[i] is None:
            errors.append(f"no {id_column!r}")
        elif texts[i] is None:
            errors.append(f"no {text_column!r}")
        else:
            errors.append(None)
    return Rows(source.key, rows, ids,
                [t if e is None else None for t, e in zip(texts, errors, strict=True)], errors)


def _decode(cells: list[bytes | None]) -> tuple[list[str | None], list[bool]]:
    """Each cell as text (None stays None) and whether it was not UTF-8."""
    texts: list[str | None] = []
    bad: list[bool] = []
    for cell in cells:
        try:
            texts.append(None if cell is None else cell.decode("utf-8"))
            bad.append(False)
        except UnicodeDecodeError:
            texts.append(None)
            bad.append(True)
    return texts, bad
