"""Shards: Parquet files written under a temporary name and renamed when complete.

Every ``*.parquet`` in an output folder is therefore a finished shard. Its footer carries the
rows it accounts for (``coverage``: source → row spans, its bad rows included) and its bad
rows (``bad``: source, row, id, reason), so the rename that publishes the rows also publishes
the record of them. A shard's name is a digest of that coverage: writing the same rows again
(a retried Ray task) replaces the same file instead of adding a second copy.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from bgeserve.bulk.coverage import Spans

META_KEY = b"bgeserve.bulk"
FORMAT = 1
TEMP_SUFFIX = ".tmp"


@dataclass
class ShardInfo:
    """What a finished shard's footer says."""

    path: Path
    rows: int
    coverage: dict[str, Spans]
    bad: list[list[Any]]  # [source, row, id, reason]


def shard_name(coverage: dict[str, Spans]) -> str:
    """``<first source's stem>-<first row>-<digest>.parquet``: readable, and the same for the
    same rows."""
    first = min(coverage, key=lambda s: (s, coverage[s][0][0])) if coverage else "empty"
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(first).stem)[:40] or "shard"
    start = coverage[first][0][0] if coverage else 0
    digest = hashlib.sha1(orjson.dumps(coverage, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]
    return f"{stem}-{start:010d}-{digest}.parquet"


def write_shard(folder: Path, table: pa.Table, coverage: dict[str, Spans],
                bad: list[list[Any]]) -> Path:
    """Write ``table`` as a finished shard of ``folder``; returns its path."""
    meta = dict(table.schema.metadata or {})
    meta[META_KEY] = orjson.dumps({"format": FORMAT, "coverage": coverage, "bad": bad})
    table = table.replace_schema_metadata(meta)
    final = folder / shard_name(coverage)
    # A name of its own per attempt: two attempts at one shard (a Ray retry beside a
    # straggler) never write into one file.
    temp = folder / f".{final.name}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
    try:
        pq.write_table(table, temp, compression="zstd")
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before the name says it is finished
        finally:
            os.close(fd)
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    return final


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_info(path: Path) -> ShardInfo | None:
    """The footer of a shard (None: a Parquet file that is not a bgeserve shard)."""
    meta = pq.read_metadata(path)
    raw = (meta.metadata or {}).get(META_KEY)
    if raw is None:
        return None
    info = orjson.loads(raw)
    return ShardInfo(path, meta.num_rows, info["coverage"], info["bad"])


def is_temp(path: Path) -> bool:
    """A shard still being written (or left by a killed job)."""
    return path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX)
