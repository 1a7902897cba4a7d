"""``ShardSink``: the Embedder's output blocks as bulk shards (Ray Data datasink).

``write_parquet`` writes each file in place under a per-run uuid: a file being written already
ends in ``.parquet``, and a rerun would write the same rows again under new names. This sink
writes what each write task receives as one shard through ``bgeserve.bulk.shards`` (temporary
name, renamed when complete, rows recorded in the footer, named by its rows so a retried task
replaces its own file). Bad rows (null ``n_tokens``) go to no shard; their ids come back to
the driver in the write results.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from ray.data.datasource import Datasink

from bgeserve.bulk import columns
from bgeserve.bulk.coverage import spans_of
from bgeserve.bulk.shards import write_shard

INTERNAL = ("_source", "_row", "_error")


def shard_table(table: pa.Table) -> tuple[pa.Table, dict[str, list[list[int]]],
                                          list[list[Any]]]:
    """(the rows to write, the spans the shard accounts for, the bad rows)."""
    sources = table.column("_source").to_pylist()
    rows = table.column("_row").to_pylist()
    coverage: dict[str, list[int]] = {}
    for s, r in zip(sources, rows, strict=True):
        coverage.setdefault(s, []).append(r)
    ok = pc.is_valid(table.column("n_tokens"))
    bad_idx = pc.indices_nonzero(pc.invert(ok)).to_pylist()
    ids, errors = table.column("id").to_pylist(), table.column("_error").to_pylist()
    bad = [[sources[i], rows[i], ids[i], errors[i] or "not embedded"] for i in bad_idx]
    keep = [c for c in table.column_names if c not in INTERNAL]
    return (table.filter(ok).select(keep), {s: spans_of(r) for s, r in coverage.items()}, bad)


def _width(schema: pa.Schema) -> int:
    """The vector width the Embedder wrote (1 when there are no vectors)."""
    if "dense" in schema.names:
        return schema.field("dense").type.list_size
    if "colbert" in schema.names:
        return schema.field("colbert").type.value_type.list_size
    return 1


class ShardSink(Datasink):
    """Writes shards into ``folder``; ``results`` holds each write's counts and bad rows."""

    def __init__(self, folder: Path, outputs: tuple[str, ...]):
        self.folder = Path(folder)
        self.outputs = outputs
        self.results: list[dict[str, Any]] = []

    def write(self, blocks: Iterable[pa.Table], ctx: Any) -> dict[str, Any]:
        tables = [b for b in blocks if b.num_rows]
        if not tables:
            return {"rows": 0, "tokens": 0, "bad": [], "shards": 0}
        table = pa.concat_tables(tables, promote_options="default")
        good, coverage, bad = shard_table(table)
        schema = columns.schema(self.outputs, _width(good.schema))
        good = good.select(schema.names).cast(schema)
        write_shard(self.folder, good, coverage, bad)
        tokens = int(pc.sum(good.column("n_tokens")).as_py() or 0)
        return {"rows": good.num_rows, "tokens": tokens, "bad": bad, "shards": 1}

    def on_write_complete(self, write_result: Any) -> None:
        self.results = list(write_result.write_returns)

    def get_name(self) -> str:
        return "BgeserveShards"
