"""Input files of a bulk job: which files (``Source``), and the rows they give (``Rows``).

A row is known by its source file and its row number there (JSONL: the line number; CSV: the
data row; Parquet: the row), so a rerun can skip exactly the rows finished shards hold, whatever
the ids. The files are found and their columns checked here, before any model loads, so a wrong
path or column name fails in a second rather than after the load; reading their rows is
readers.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bgeserve.bulk import gzipped
from bgeserve.errors import InvalidInput

log = logging.getLogger("bgeserve.bulk")

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet",
           ".csv": "csv"}
# Text formats may be gzipped (``a.jsonl.gz``): row numbers count the decompressed lines, so
# resuming works as for the plain file. Parquet compresses inside the file.
GZIPPED = ("jsonl", "csv")


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
        """A 0-byte file, or a gzipped one of no bytes: no rows (pyarrow refuses it: "Empty
        CSV file", "Parquet file size is 0 bytes"), as an empty JSONL file has none."""
        if self.path.stat().st_size == 0:
            return True
        return self.compressed and gzipped.is_empty(self.path)

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
    warning), each file once, however it is reached (QA: a file named and reached through a
    symbolic link in a folder named was embedded twice)."""
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
            found.setdefault(p.resolve(), Source(p, format_of(p) or ""))
    return list(found.values())


def _folder(path: Path, item: str | Path, skip: Path | None) -> list[Path]:
    """The input files under folder ``path`` (named ``item`` by the caller)."""
    candidates = sorted(p for p in path.rglob("*") if p.is_file()
                        and not any(part.startswith(".") for part in p.relative_to(path).parts)
                        and not (skip and p.is_relative_to(skip)))
    files = [p for p in candidates if format_of(p) is not None]
    unknown = [p for p in candidates if format_of(p) is None]
    linked = sorted(p for p in path.rglob("*") if p.is_symlink() and p.is_dir())
    if linked:  # rglob does not go into them (a loop would never end): said, not silent
        log.warning("%s: not read inside %d linked folders (%s%s): name them as inputs to read "
                    "them", item, len(linked), ", ".join(str(p.relative_to(path))
                                                          for p in linked[:5]),
                    ", ..." if len(linked) > 5 else "")
    if unknown:  # a file a user expects read (a.jsonl.bz2, a.tsv) must not vanish silently
        log.warning("%s: skipped %d files of no known format (%s%s); known: %s", item,
                    len(unknown), ", ".join(str(p.relative_to(path)) for p in unknown[:5]),
                    ", ..." if len(unknown) > 5 else "", _known_names())
    if not files:
        raise InvalidInput(f"{item}: no .jsonl, .parquet or .csv files in this folder",
                           param="INPUT")
    return files


def check_columns(source: Source, text_column: str, id_column: str) -> None:
    """Fail fast (before any model loads) when a CSV or Parquet file lacks a column, or a
    gzipped file is damaged inside; JSONL rows are checked one by one."""
    if source.compressed:
        gzipped.check(source.path)
    if source.format == "jsonl" or source.is_empty():
        return
    schema = _schema(source)
    if schema is None:  # a gzipped CSV cut short inside its header: one bad row, when read
        return
    names = set(schema.names)
    for column, flag in ((text_column, "--text-column"), (id_column, "--id-column")):
        if column not in names:
            raise InvalidInput(f"{source.path} has no column {column!r} (columns: "
                               f"{', '.join(sorted(names))}); name it with {flag}", param=flag)


def _schema(source: Source):
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    f = None
    try:
        if source.format == "parquet":
            return pq.read_schema(source.path)
        # Its header is what counts here: malformed lines wait for read() to report them.
        with gzipped.open_bytes(source.path, source.compressed, whole_lines=True,
                                quoted=True) as f, \
                pacsv.open_csv(f, parse_options=pacsv.ParseOptions(
                    newlines_in_values=True, invalid_row_handler=lambda row: "skip")) as reader:
            return reader.schema
    except (pa.ArrowInvalid, OSError) as exc:
        if gzipped.cut_of(f) is not None:  # QA: the job stopped, exit 2 ("Empty CSV file")
            return None
        kind = "Parquet" if source.format == "parquet" else "CSV"
        raise InvalidInput(f"{source.path}: not a {kind} file bgeserve can read ({exc})",
                           param="INPUT") from None
