"""Input files of a bulk job: which files, and their rows as ``Rows`` (id, text, or why not).

A row is known by its source file and its row number there (JSONL: the line number; CSV: the
data row; Parquet: the row), so a rerun can skip exactly the rows finished shards hold, whatever
the ids. Bad rows (no text, a text that is not a string, no id, a line that is not JSON) come
back with ``errors[i]`` saying why, never as an exception: one bad row never stops a job.

Readers are pyarrow's (Parquet's row groups, the streaming CSV reader) and orjson per line for
JSONL: pyarrow's JSON reader infers one type per column and fails the whole block when one row
differs (``"text": 5`` among strings), which is exactly the row this job must report and skip.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from bgeserve.errors import InvalidInput

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet",
           ".csv": "csv"}
READ_ROWS = 8192  # rows per read from a CSV or Parquet file


@dataclass(frozen=True)
class Source:
    """One input file: ``key`` (its absolute path) names it in shards and the manifest."""

    path: Path
    format: str

    @property
    def key(self) -> str:
        return str(self.path)

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
        idx = np.flatnonzero(keep)
        return Rows(self.source, self.rows[idx], [self.ids[i] for i in idx],
                    [self.texts[i] for i in idx], [self.errors[i] for i in idx])

    def bad(self) -> list[int]:
        """Positions of the bad rows."""
        return [i for i, e in enumerate(self.errors) if e is not None]


def discover(inputs: Sequence[str | Path], exclude: Path | None = None) -> list[Source]:
    """Files named, and files with a known suffix under folders named (sorted, hidden files
    and anything under ``exclude`` — the output folder — left out), each once."""
    found: dict[Path, Source] = {}
    skip = exclude.resolve() if exclude is not None else None
    for item in inputs:
        path = Path(item).expanduser().resolve()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file()
                           and p.suffix.lower() in FORMATS
                           and not any(part.startswith(".") for part in p.relative_to(path).parts)
                           and not (skip and p.is_relative_to(skip)))
            if not files:
                raise InvalidInput(f"{item}: no .jsonl, .parquet or .csv files in this folder",
                                   param="INPUT")
        elif path.is_file():
            if path.suffix.lower() not in FORMATS:
                raise InvalidInput(f"{item}: unknown format {path.suffix!r}; name files "
                                   f"{', '.join(FORMATS)}", param="INPUT")
            files = [path]
        else:
            raise InvalidInput(f"{item}: no such file or folder", param="INPUT")
        for p in files:
            found.setdefault(p, Source(p, FORMATS[p.suffix.lower()]))
    return list(found.values())


def check_columns(source: Source, text_column: str, id_column: str) -> None:
    """Fail fast (before any model loads) when a CSV or Parquet file lacks a column; JSONL
    rows are checked one by one."""
    if source.format == "jsonl":
        return
    names = set(_schema(source).names)
    for column, flag in ((text_column, "--text-column"), (id_column, "--id-column")):
        if column not in names:
            raise InvalidInput(f"{source.path} has no column {column!r} (columns: "
                               f"{', '.join(sorted(names))}); name it with {flag}", param=flag)


def _schema(source: Source):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if source.format == "parquet":
        return pq.read_schema(source.path)
    with pacsv.open_csv(source.path) as reader:
        return reader.schema


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
    with open(source.path, "rb") as f:
        for line_no, line in enumerate(f):
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
    id_col, text_col = table.column(id_column), table.column(text_column)
    if pa.types.is_integer(id_col.type) or pa.types.is_string(id_col.type) or \
            pa.types.is_large_string(id_col.type):
        ids = pc.cast(id_col, pa.string()).to_pylist()
        id_errors = [None if i is not None else f"no {id_column!r}" for i in ids]
    else:
        ids = [None] * n
        id_errors = [f"{id_column!r} is {id_col.type}, not a string or an integer"] * n
    if pa.types.is_string(text_col.type) or pa.types.is_large_string(text_col.type):
        texts = text_col.to_pylist()
        text_errors = [None if t is not None else f"no {text_column!r}" for t in texts]
    else:
        texts = [None] * n
        text_errors = [f"{text_column!r} is {text_col.type}, not a string"] * n
    errors = [a or b for a, b in zip(id_errors, text_errors, strict=True)]
    texts = [t if e is None else None for t, e in zip(texts, errors, strict=True)]
    return Rows(source.key, rows, ids, texts, errors)


def _parquet(source: Source, text_column: str, id_column: str) -> Iterator[Rows]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    start = 0
    with pq.ParquetFile(source.path) as f:
        for batch in f.iter_batches(batch_size=READ_ROWS, columns=[id_column, text_column]):
            table = pa.Table.from_batches([batch])
            yield _columns(table, source, start, text_column, id_column)
            start += table.num_rows


def _csv(source: Source, text_column: str, id_column: str) -> Iterator[Rows]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    # Both columns read as text: a CSV has no types, and an id column inferred as integers
    # from the first block would fail the read at the first id that is not one. An empty
    # text cell is a missing text (null), not an empty string.
    convert = pacsv.ConvertOptions(column_types={text_column: pa.string(), id_column: pa.string()},
                                   include_columns=[id_column, text_column],
                                   strings_can_be_null=True, quoted_strings_can_be_null=False)
    start = 0
    with pacsv.open_csv(source.path, convert_options=convert,
                        read_options=pacsv.ReadOptions(block_size=4 << 20)) as reader:
        for batch in reader:
            table = pa.Table.from_batches([batch])
            yield _columns(table, source, start, text_column, id_column)
            start += table.num_rows
