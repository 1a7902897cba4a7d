"""Input files of a bulk job: which files, and their rows as ``Rows`` (id, text, or why not).

A row is known by its source file and its row number there (JSONL: the line number; CSV: the
data row; Parquet: the row), so a rerun can skip exactly the rows finished shards hold, whatever
the ids. Bad rows (no text, a text that is not a string, no id, a line that is not JSON, a
CSV line with too many or too few cells, a cell that is not UTF-8) come back with
``errors[i]`` saying why, never as an exception: one bad row never stops a job.

Readers are pyarrow's (Parquet's row groups, the streaming CSV reader) and orjson per line for
JSONL: pyarrow's JSON reader infers one type per column and fails the whole block when one row
differs (``"text": 5`` among strings), which is exactly the row this job must report and skip.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from bgeserve.errors import InvalidInput

log = logging.getLogger("bgeserve.bulk")

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet",
           ".csv": "csv"}
# Text formats may be gzipped (``a.jsonl.gz``): row numbers count the decompressed lines, so
# resuming works as for the plain file. Parquet compresses inside the file.
GZIPPED = ("jsonl", "csv")
READ_ROWS = 8192  # rows per read from a JSONL or Parquet file
CSV_BLOCK_BYTES = 4 << 20  # bytes per read from a CSV file


@dataclass(frozen=True)
class Source:
    """One input file: ``key`` (its absolute path) names it in shards and the manifest."""

    path: Path
    format: str

    @property
    def key(self) -> str:
        return str(self.path)

    @property
    def compressed(self) -> bool:
        """A gzipped JSONL or CSV file (its rows are numbered as decompressed)."""
        return self.path.name.lower().endswith(".gz")

    def is_empty(self) -> bool:
        """A 0-byte file: no rows (pyarrow refuses it: "Empty CSV file", "Parquet file size
        is 0 bytes"), as an empty JSONL file has none."""
        return self.path.stat().st_size == 0

    def fingerprint(self) -> dict[str, int]:
        """Size and mtime: a file that changed between runs no longer matches its shards."""
        st = self.path.stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


@dataclass
class Rows:
    """Consecutive-or-not rows of one source: row numbers, ids, texts; ``errors[i]`` is None
    for a good row, else why row ``rows[i]`` cannot be embedded (its text is then None)."""

    source: str
    rows: np.ndarray  # int64 row numbers in the source, ascending
    ids: list[str | None]
    texts: list[str | None]
    errors: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, keep: np.ndarray) -> Rows:
        """The rows where ``keep`` (a boolean mask) is true."""
        return self.take(np.flatnonzero(keep))

    def take(self, idx: np.ndarray) -> Rows:
        """The rows at positions ``idx``, in that order."""
        return Rows(self.source, self.rows[idx], [self.ids[i] for i in idx],
                    [self.texts[i] for i in idx], [self.errors[i] for i in idx])

    def bad(self) -> list[int]:
        """Positions of the bad rows."""
        return [i for i, e in enumerate(self.errors) if e is not None]


def format_of(path: Path) -> str | None:
    """The format a file's name says (``.jsonl``, ``.csv.gz``, ...); None for another name."""
    suffixes = [x.lower() for x in path.suffixes]
    if suffixes[-1:] == [".gz"]:
        fmt = FORMATS.get(suffixes[-2]) if len(suffixes) > 1 else None
        return fmt if fmt in GZIPPED else None
    return FORMATS.get(path.suffix.lower())


def _known_names() -> str:
    return ", ".join([*FORMATS, *(f"{k}.gz" for k, v in FORMATS.items() if v in GZIPPED)])


def discover(inputs: Sequence[str | Path], exclude: Path | None = None) -> list[Source]:
    """Files named, and files with a known suffix under folders named (sorted, hidden files
    and anything under ``exclude`` — the output folder — left out; others named in a
    warning), each once."""
    found: dict[Path, Source] = {}
    skip = exclude.resolve() if exclude is not None else None
    for item in inputs:
        path = Path(item).expanduser().resolve()
        if path.is_dir():
            files = _folder(path, item, skip)
        elif path.is_file():
            if format_of(path) is None:
                raise InvalidInput(f"{item}: unknown format {''.join(path.suffixes)!r}; name "
                                   f"files {_known_names()}", param="INPUT")
            files = [path]
        else:
            raise InvalidInput(f"{item}: no such file or folder", param="INPUT")
        for p in files:
            found.setdefault(p, Source(p, format_of(p) or ""))
    return list(found.values())


def _folder(path: Path, item: str | Path, skip: Path | None) -> list[Path]:
    """The input files under folder ``path`` (named ``item`` by the caller)."""
    candidates = sorted(p for p in path.rglob("*") if p.is_file()
                        and not any(part.startswith(".") for part in p.relative_to(path).parts)
                        and not (skip and p.is_relative_to(skip)))
    files = [p for p in candidates if format_of(p) is not None]
    unknown = [p for p in candidates if format_of(p) is None]
    if unknown:  # a file a user expects read (a.jsonl.bz2, a.tsv) must not vanish silently
        log.warning("%s: skipped %d files of no known format (%s%s); known: %s", item,
                    len(unknown), ", ".join(str(p.relative_to(path)) for p in unknown[:5]),
                    ", ..." if len(unknown) > 5 else "", _known_names())
    if not files:
        raise InvalidInput(f"{item}: no .jsonl, .parquet or .csv files in this folder",
                           param="INPUT")
    return files


def check_columns(source: Source, text_column: str, id_column: str) -> None:
    """Fail fast (before any model loads) when a CSV or Parquet file lacks a column; JSONL
    rows are checked one by one."""
    if source.format == "jsonl" or source.is_empty():
        return
    names = set(_schema(source).names)
    for column, flag in ((text_column, "--text-column"), (id_column, "--id-column")):
        if column not in names:
            raise InvalidInput(f"{source.path} has no column {column!r} (columns: "
                               f"{', '.join(sorted(names))}); name it with {flag}", param=flag)


def _schema(source: Source):
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    try:
        if source.format == "parquet":
            return pq.read_schema(source.path)
        # Its header is what counts here: malformed lines wait for read() to report them.
        with pacsv.open_csv(source.path, parse_options=pacsv.ParseOptions(
                newlines_in_values=True, invalid_row_handler=lambda row: "skip")) as reader:
            return reader.schema
    except (pa.ArrowInvalid, OSError) as exc:
        kind = "Parquet" if source.format == "parquet" else "CSV"
        raise InvalidInput(f"{source.path}: not a {kind} file bgeserve can read ({exc})",
                           param="INPUT") from None


def read(source: Source, text_column: str, id_column: str) -> Iterator[Rows]:
    """Every row of ``source``, in order, in pieces."""
    if source.format == "jsonl":
        yield from _jsonl(source, text_column, id_column)
    elif source.format == "parquet":
        yield from _parquet(source, text_column, id_column)
    else:
        yield from _csv(source, text_column, id_column)


def _jsonl(source: Source, text_column: str, id_column: str) -> Iterator[Rows]:
    rows: list[int] = []
    ids: list[str | None] = []
    texts: list[str | None] = []
    errors: list[str | None] = []
    for line_no, line in enumerate(_lines(source)):
        if line_no == 0:  # a byte-order mark (Windows tools write one) is no JSON
            line = line.removeprefix(b"\xef\xbb\xbf")
        if not line.strip():
            continue  # a blank line (a trailing newline) is no row
        rows.append(line_no)
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            obj = None
            error: str | None = "not valid JSON"
        else:
            error = None if isinstance(obj, dict) else "not a JSON object"
        if error is None:
            row_id, error = _id(obj.get(id_column), id_column)
            text, text_error = _text(obj.get(text_column), text_column)
            error = error or text_error
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


def _lines(source: Source) -> Iterator[bytes]:
    """The lines of a JSONL file, decompressed if it is gzipped."""
    if not source.compressed:
        with open(source.path, "rb") as f:
            yield from f
        return
    try:
        with gzip.open(source.path, "rb") as f:
            yield from f
    except (OSError, EOFError) as exc:  # not gzip, or cut short
        raise InvalidInput(f"{source.path}: not a gzip file bgeserve can read ({exc})",
                           param="INPUT") from None


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
    start = 0
    with pq.ParquetFile(source.path) as f:
        for batch in f.iter_batches(batch_size=READ_ROWS, columns=[id_column, text_column]):
            table = pa.Table.from_batches([batch])
            yield _columns(table, source, start, text_column, id_column)
            start += table.num_rows


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
    malformed: dict[int, str] = {}

    def invalid(row) -> str:
        if row.number is None or row.number < 2:
            return "error"  # no place to give it: the reader's own error names the file
        malformed[row.number - 2] = (f"expected {row.expected_columns} cells, found "
                                     f"{row.actual_columns}")
        return "skip"

    start = 0  # the next data row's number
    try:
        with pacsv.open_csv(source.path, convert_options=convert,
                            read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES,
                                                           use_threads=False),
                            parse_options=pacsv.ParseOptions(newlines_in_values=True,
                                                             invalid_row_handler=invalid)) as reader:
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
    except (pa.ArrowInvalid, OSError) as exc:  # OSError: a .csv.gz that is not gzip
        raise InvalidInput(f"{source.path}: not a CSV file bgeserve can read ({exc})",
                           param="INPUT") from None
    if malformed:
        yield _with_malformed(Rows(source.key, np.empty(0, np.int64), [], [], []), malformed,
                              None)


def _with_malformed(found: Rows, malformed: dict[int, str], before: int | None) -> Rows:
    """``found`` with the malformed rows numbered below ``before`` (None: all) taken from
    ``malformed`` and put in their places as bad rows."""
    taken = sorted(r for r in malformed if before is None or r < before)
    if not taken:
        return found
    n = len(taken)
    merged = Rows(found.source, np.concatenate([found.rows, np.array(taken, np.int64)]),
                  [*found.ids, *[None] * n], [*found.texts, *[None] * n],
                  [*found.errors, *(malformed.pop(r) for r in taken)])
    return merged.take(np.argsort(merged.rows, kind="stable"))


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
