"""A bulk job: what to read, what to write, and the blocks of rows still to do.

A block is the rows of one source in one aligned range ``[k·shard_rows, (k+1)·shard_rows)``
that no finished shard holds yet; each block becomes one shard. Aligned ranges make a fresh
run and a resumed run cut a file the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bgeserve.bulk.coverage import Coverage
from bgeserve.bulk.output import MANIFEST, OutputDir
from bgeserve.bulk.progress import Summary
from bgeserve.bulk.readers import read, starts_array
from bgeserve.bulk.sources import Rows, Source
from bgeserve.errors import InvalidInput

SHARD_ROWS = 1024
# ColBERT keeps one vector (4 KiB for bge-m3) per token: 64 texts of 512 tokens are 128 MiB.
SHARD_ROWS_COLBERT = 64


@dataclass(frozen=True)
class BulkJob:
    """``bgeserve bulk``'s arguments."""

    inputs: tuple[str, ...]
    output: Path
    text_column: str = "text"
    id_column: str = "id"
    outputs: tuple[str, ...] = ("dense", "sparse")
    shard_rows: int | None = None  # None: SHARD_ROWS, or SHARD_ROWS_COLBERT with colbert

    @property
    def rows_per_shard(self) -> int:
        if self.shard_rows:
            return self.shard_rows
        return SHARD_ROWS_COLBERT if "colbert" in self.outputs else SHARD_ROWS

    def spec(self, model: dict[str, Any]) -> dict[str, Any]:
        """What the shards' rows depend on (the manifest's ``spec``)."""
        return {"text_column": self.text_column, "id_column": self.id_column,
                "outputs": list(self.outputs), "model": model}


def concat(parts: list[Rows]) -> Rows:
    """One ``Rows`` of several of the same source."""
    if len(parts) == 1:
        return parts[0]
    return Rows(parts[0].source, np.concatenate([p.rows for p in parts]),
                [i for p in parts for i in p.ids], [t for p in parts for t in p.texts],
                [e for p in parts for e in p.errors])


def blocks(source: Source, job: BulkJob, coverage: Coverage) -> Iterator[Rows]:
    """The rows of ``source`` that no shard holds, one aligned block at a time."""
    size = job.rows_per_shard
    pending: list[Rows] = []
    current = -1
    for piece in read(source, job.text_column, job.id_column):
        piece = piece.select(~coverage.covered(source.key, piece.rows))
        if not len(piece):
            continue
        block_of = piece.rows // size
        for k in np.unique(block_of):
            part = piece.select(block_of == k)
            if k != current and pending:
                yield concat(pending)
                pending = []
            current = int(k)
            pending.append(part)
    if pending:
        yield concat(pending)


def total_rows(sources: list[Source]) -> int | None:
    """Rows in the inputs when cheap to know (Parquet footers; uncompressed JSONL lines),
    else None."""
    import pyarrow.parquet as pq

    total = 0
    for s in sources:
        if s.is_empty():
            continue
        if s.compressed:
            return None  # counting its lines would decompress it twice
        if s.format == "parquet":
            total += pq.read_metadata(s.path).num_rows
        elif s.format == "jsonl":
            if starts_array(s):
                return None  # its rows are its items: counting them is reading it
            with open(s.path, "rb") as f:
                total += sum(1 for line in f if line.strip())
        else:
            return None
    return total


def missing_column(bad: Iterable[Sequence[Any]], job: BulkJob) -> int:
    """How many of ``bad`` (source, row, id, reason) lack the text or the id key."""
    missing = {f"no {job.text_column!r}", f"no {job.id_column!r}"}
    return sum(why in missing for *_, why in bad)


def refuse_nothing_embedded(summary: Summary, job: BulkJob, out: OutputDir,
                            written: Iterable[Path], missing: int) -> None:
    """InvalidInput when no row was embedded, now or before, and every row was bad: naming
    the flags where every row lacked the text or id key (``missing`` of them: a mistyped
    --text-column on JSONL, where no header is checked up front), else the first reasons
    (every line of a file not JSON: it exited 0 with 0 rows). The shards this run wrote
    (``written``) hold nothing but those bad rows: they are removed, so the corrected rerun
    starts afresh instead of being refused as another job."""
    if summary.rows or summary.skipped or not summary.bad:
        return
    for path in written:
        path.unlink(missing_ok=True)
    if not out.has_shards():  # earlier runs' shards stay guarded by it
        (out.path / MANIFEST).unlink(missing_ok=True)
    if missing >= summary.bad:
        raise InvalidInput(f"no row of the inputs has both keys {job.text_column!r} and "
                           f"{job.id_column!r} ({summary.bad} rows, none embedded): name the "
                           "texts' key with --text-column and the ids' with --id-column",
                           param="--text-column")
    examples = "; ".join(f"{e['source']} row {e['row']}: {e['reason']}"
                         for e in summary.bad_examples[:3])
    raise InvalidInput(f"no row of the inputs could be embedded ({summary.bad} bad rows, "
                       f"none embedded; rows are numbered from 0): {examples}", param="INPUT")
