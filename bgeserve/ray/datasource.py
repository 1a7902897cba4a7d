"""``BulkSource``: a bulk job's input files as a Ray Data datasource.

Ray's own ``read_json`` / ``read_csv`` / ``read_parquet`` cannot serve here: they give no row
number (so a rerun could not name the rows finished shards hold), and ``read_json`` fails a
whole block on one row whose text is not a string, the row this job must report and skip. So
each read task runs ``bgeserve.bulk``'s own reader over one file, skipping the rows the
shards hold, and yields one Arrow block per shard-sized block of rows, with the columns
``id``, ``text``, ``_source``, ``_row`` and ``_error`` (why a row has no text).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from bgeserve.bulk.coverage import Coverage
from bgeserve.bulk.job import BulkJob, blocks
from bgeserve.bulk.sources import Rows, Source

BLOCK_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("_source", pa.string()),
                          ("_row", pa.int64()), ("_error", pa.string())])


def rows_table(rows: Rows) -> pa.Table:
    """One block of rows as Arrow."""
    return pa.table({"id": rows.ids, "text": rows.texts, "_source": [rows.source] * len(rows),
                     "_row": rows.rows, "_error": rows.errors}, schema=BLOCK_SCHEMA)


def _read(source: Source, job: BulkJob, coverage: Coverage) -> Iterator[pa.Table]:
    for rows in blocks(source, job, coverage):
        yield rows_table(rows)


class BulkSource(Datasource):
    """One read task per input file; each ships only its own file's finished spans."""

    def __init__(self, sources: list[Source], job: BulkJob, coverage: Coverage):
        super().__init__()
        self._sources = sources
        self._job = job
        self._coverage = {s.key: coverage.only(s.key) for s in sources}

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(s.path.stat().st_size for s in self._sources)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: object = None) -> list[ReadTask]:
        tasks = []
        for s in self._sources:
            meta = BlockMetadata(num_rows=None, size_bytes=s.path.stat().st_size,
                                 exec_stats=None, input_files=(str(s.path),))
            read = functools.partial(_read, s, self._job, self._coverage[s.key])
            tasks.append(ReadTask(read, meta, schema=BLOCK_SCHEMA))
        return tasks

    def get_name(self) -> str:
        return "BgeserveBulk"
