"""``ShardSink``: the Embedder's output blocks as bulk shards (Ray Data datasink).

``write_parquet`` writes each file in place under a per-run uuid: a file being written already
ends in ``.parquet``, and a rerun would write the same rows again under new names. This sink
writes what each write task receives as shards through ``bgeserve.bulk.shards``, one per aligned
block of rows as the local job cuts them (temporary
name, renamed when complete, rows recorded in the footer, named by its rows so a retried task
replaces its own file). Bad rows (null ``n_tokens``) go to no shard; their ids come back to
the driver in the write results, with each shard's path (the driver reads its ids to count
repeats) and the model identity its rows carried.

Each row carries the identity of the model files its actor loaded (``MODEL_COLUMN``, dropped
here). A write whose rows were made with other model files than the folder's shards (the
identity the manifest records, or on a first run the one its first write pinned) is refused
before its shard is written: a node with another model at ``BGE_M3_MODEL_PATH`` never mixes
its vectors into the output.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from ray.data.datasource import Datasink

from bgeserve.bulk import columns
from bgeserve.bulk.coverage import spans_of
from bgeserve.bulk.output import check_identity, pin_identity
from bgeserve.bulk.shards import write_shard
from bgeserve.errors import InvalidInput

MODEL_COLUMN = "_model"  # the Embedder's identity_column: which model files made the row
INTERNAL = ("_source", "_row", "_error", MODEL_COLUMN)
UNCUT = 1 << 62  # rows per shard when not cut: one aligned block per source


class ShardWriteFailed(OSError):
    """A shard the sink could not write (the output folder unwritable, the disk full): the
    command's one line (``bulk`` reads it as the OSError it is)."""


def mixed_models(folder: Path, first: str, other: str) -> InvalidInput:
    """The error of a run whose actors loaded different model files."""
    return InvalidInput(
        f"the Embedder actors of this run loaded different model files for {folder} ({first} "
        f"on one, {other} on another; the settings are the same): BGE_M3_MODEL_PATH (or the "
        "cache) holds another model on some node, or another variant was chosen there. Put the "
        "same model at that path on every node, pin BGE_M3_MODEL, or write to a new --output",
        param="BGE_M3_MODEL_PATH")


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
    """Writes shards into ``folder``; ``results`` holds each write's counts, bad rows, shard
    and model identity. ``identity``: the one the manifest records (None on a first run)."""

    def __init__(self, folder: Path, outputs: tuple[str, ...], identity: str | None = None,
                 rows_per_shard: int | None = None, max_bytes: int | None = None):
        self.folder = Path(folder)
        self.outputs = outputs
        self.identity = identity
        self.rows_per_shard = rows_per_shard
        self.max_bytes = max_bytes  # a shard's ColBERT vectors at most (None: unbounded)
        self.results: list[dict[str, Any]] = []

    def write(self, blocks: Iterable[pa.Table], ctx: Any) -> dict[str, Any]:
        """One shard per aligned block of rows (``rows_per_shard`` of a source) in what this
        write task got, or per part of one within ``max_bytes``: Ray hands one task all the
        blocks of a read (a whole file), which were written as one shard (QA: --shard-rows
        ignored, a resume redid whole files), held whole as one table (review: a read's
        ColBERT vectors in the task's memory, copied twice). Blocks are taken one at a time,
        each shard written as soon as the next rows belong to another or pass ``max_bytes``."""
        result: dict[str, Any] = {"rows": 0, "tokens": 0, "bad": [], "shards": 0,
                                  "paths": [], "identity": None}
        for part in self._shards(blocks):
            # Each shard's rows are checked before it is written: no shard of another model.
            result["identity"] = self.check_identity(part)
            good, coverage, bad = shard_table(part)
            schema = columns.schema(self.outputs, _width(good.schema))
            good = good.select(schema.names).cast(schema)
            try:
                path = write_shard(self.folder, good, coverage, bad)
            except OSError as exc:
                raise ShardWriteFailed(exc.errno, exc.strerror, exc.filename) from exc
            result["rows"] += good.num_rows
            result["tokens"] += int(pc.sum(good.column("n_tokens")).as_py() or 0)
            result["bad"] += bad
            result["shards"] += 1
            result["paths"].append(str(path))
        return result

    def _shards(self, blocks: Iterable[pa.Table]) -> Iterator[pa.Table]:
        """The rows of ``blocks`` by (source, aligned block), in order: the local job's cut
        (``bulk.job.blocks``), so a resumed run and shard names agree with it; an aligned
        block's rows cut where their ColBERT vectors pass ``max_bytes`` (``bulk.model.runs``
        over the task's rows of it: cut the same wherever Ray's blocks end within the task, so
        a task run again writes the same shards, not overlapping ones: review; the limit is
        the driver's, pinned for every actor, so the blocks themselves come alike)."""
        held: list[pa.Table] = []
        held_key: tuple[str, int] | None = None
        held_rows = held_bytes = 0
        limit = math.inf if self.max_bytes is None else self.max_bytes
        for block in blocks:
            for key, piece in self._aligned(block):
                if held and key != held_key:
                    yield pa.concat_tables(held, promote_options="default")
                    held, held_rows, held_bytes = [], 0, 0
                held_key, start = key, 0
                for i, size in enumerate(self._row_bytes(piece)):
                    if held_rows + i - start and held_bytes + size > limit:
                        held.append(piece.slice(start, i - start))
                        yield pa.concat_tables(held, promote_options="default")
                        held, held_rows, held_bytes, start = [], 0, 0, i
                    held_bytes += size
                held.append(piece.slice(start))
                held_rows += piece.num_rows - start
        if held:
            yield pa.concat_tables(held, promote_options="default")

    def _row_bytes(self, piece: pa.Table) -> list[int]:
        """Each row's ColBERT vectors in bytes (none to cut by: no rows)."""
        if self.max_bytes is None or "colbert" not in piece.column_names:
            return []
        vectors = pc.list_value_length(piece.column("colbert")).fill_null(0)
        return (vectors.to_numpy() * (_width(piece.schema) * 4)).tolist()

    def _aligned(self, table: pa.Table) -> Iterator[tuple[tuple[str, int], pa.Table]]:
        """``table``'s runs of rows of one (source, aligned block), as slices (no copy): a
        read's rows come in order."""
        if not table.num_rows:
            return
        size = self.rows_per_shard or UNCUT
        keys = list(zip(table.column("_source").to_pylist(),
                        (r // size for r in table.column("_row").to_pylist()), strict=True))
        start = 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or keys[i] != keys[start]:
                yield keys[start], table.slice(start, i - start)
                start = i

    def check_identity(self, table: pa.Table) -> str:
        """The model identity ``table``'s rows carry; InvalidInput when they carry several, or
        another than the manifest's (or, on a first run, than the one pinned by the first
        write)."""
        found = pc.unique(table.column(MODEL_COLUMN)).to_pylist()
        if not found or None in found:
            raise ValueError(f"rows without a model identity ({MODEL_COLUMN!r} is null)")
        if len(found) > 1:
            raise mixed_models(self.folder, *sorted(found)[:2])
        identity = found[0]
        if self.identity is not None:
            check_identity(self.folder, self.identity, identity)
        else:
            pinned = pin_identity(self.folder, identity)
            if pinned != identity:
                raise mixed_models(self.folder, pinned, identity)
        return identity

    def on_write_complete(self, write_result: Any) -> None:
        self.results = list(write_result.write_returns)

    def get_name(self) -> str:
        return "BgeserveShards"
