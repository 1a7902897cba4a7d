"""``bgeserve bulk`` in this process: blocks → the engine → shards.

The engine's workers run while this thread reads, tokenizes and writes: a few blocks are in
flight at once (``IN_FLIGHT``), so the next block's texts are queued before the current one's
finish and the sessions never wait for the files. Each block is one engine job, packed with
its neighbours by the same scheduler the server uses.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from bgeserve.bulk import columns
from bgeserve.bulk.coverage import spans_of
from bgeserve.bulk.job import BulkJob, blocks, total_rows
from bgeserve.bulk.model import BulkModel, model_spec
from bgeserve.bulk.output import OutputDir, log_bad_rows, log_earlier_bad_rows
from bgeserve.bulk.progress import Progress, Summary
from bgeserve.bulk.shards import write_shard
from bgeserve.bulk.sources import Rows, check_columns, discover
from bgeserve.config import Settings
from bgeserve.errors import NotReady

log = logging.getLogger("bgeserve.bulk")
IN_FLIGHT = 3  # blocks submitted to the engine at once
MAX_BAD_EXAMPLES = 20


@dataclass
class _Pending:
    rows: Rows
    good: list[int]  # positions in rows of the texts submitted
    future: Future | None


def bad_rows(rows: Rows) -> list[list[Any]]:
    """``[source, row, id, reason]`` of each bad row, logged in one line per block."""
    bad = [[rows.source, int(rows.rows[i]), rows.ids[i], rows.errors[i]] for i in rows.bad()]
    log_bad_rows(rows.source, bad)
    return bad


def finish(p: _Pending, job: BulkJob, out: OutputDir, width: int, progress: Progress) -> None:
    """Wait for a block's vectors and write its shard."""
    schema = columns.schema(job.outputs, width)
    rows = p.rows
    if p.future is not None:
        emb = p.future.result()
        data = {"id": pa.array([rows.ids[i] for i in p.good], pa.string()),
                **columns.arrays(emb, job.outputs, width)}
        table = pa.Table.from_arrays([data[name] for name in schema.names], schema=schema)
        tokens = emb.prompt_tokens
    else:
        table, tokens = schema.empty_table(), 0
    bad = bad_rows(rows)
    write_shard(out.path, table, {rows.source: spans_of(rows.rows)}, bad)
    progress.add(len(p.good), tokens, len(bad))
    examples = progress.summary.bad_examples
    for source, row, row_id, why in bad[:max(0, MAX_BAD_EXAMPLES - len(examples))]:
        examples.append({"source": source, "row": row, "id": row_id, "reason": why})


def _ready(p: _Pending) -> bool:
    return p.future is None or p.future.done()


def run(job: BulkJob, settings: Settings, bar: bool | None = None) -> Summary:
    """Embed every row of ``job``'s inputs that ``job.output`` does not hold yet."""
    with OutputDir(job.output) as out:
        sources = discover(job.inputs, exclude=out.path)
        for s in sources:
            check_columns(s, job.text_column, job.id_column)
        out.check_manifest(job.spec(model_spec(settings)), sources)
        coverage, shards = out.scan()
        log_earlier_bad_rows(shards)
        total = total_rows(sources)
        skipped = sum(coverage.rows(s.key) for s in sources)
        log.info("bulk: %d input files, %s rows, %d already in %s", len(sources),
                 total if total is not None else "?", skipped, out.path)
        options = columns.embed_options(job.outputs)
        # pyarrow imports pandas (when installed) at its first conversion of Python values:
        # seconds on a small machine, paid here with the model's load, not in the first shard.
        pa.array(["start"])
        with BulkModel(settings) as model:
            progress = Progress(None if total is None else total - skipped, skipped, bar=bar)
            pending: deque[_Pending] = deque()
            try:
                for source in sources:
                    for block in blocks(source, job, coverage):
                        good, future = model.submit(block.texts, block.errors, options)
                        pending.append(_Pending(block, good, future))
                        while len(pending) > IN_FLIGHT or (pending and _ready(pending[0])):
                            finish(pending.popleft(), job, out, model.width, progress)
                while pending:
                    finish(pending.popleft(), job, out, model.width, progress)
            except BaseException:
                # Interrupted or failed: what is queued is dropped, finished shards stay.
                model.engine.abort(NotReady("the bulk job stopped"))
                raise
            return progress.close()
