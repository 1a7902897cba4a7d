"""``bgeserve bulk`` in this process: blocks → the engine → shards.

The engine's workers run while this thread reads, tokenizes and writes: a few blocks are in
flight at once (``IN_FLIGHT``), so the next block's texts are queued before the current one's
finish and the sessions never wait for the files. Each block is one engine job, packed with
its neighbours by the same scheduler the server uses.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa

from bgeserve.bulk import columns
from bgeserve.bulk.coverage import spans_of
from bgeserve.bulk.dupes import Duplicates
from bgeserve.bulk.job import (
    BulkJob,
    blocks,
    missing_column,
    refuse_nothing_embedded,
    total_rows,
)
from bgeserve.bulk.model import BulkModel, model_spec, resume_settings
from bgeserve.bulk.output import (
    OutputDir,
    earlier_bad_rows,
    log_bad_rows,
    log_earlier_bad_rows,
)
from bgeserve.bulk.progress import Progress, Summary
from bgeserve.bulk.shards import write_shard
from bgeserve.bulk.sources import Rows, check_columns, discover
from bgeserve.config import Settings
from bgeserve.engine.jobs import Job
from bgeserve.errors import NotReady
from bgeserve.results import Embeddings, EmbedOptions

log = logging.getLogger("bgeserve.bulk")
IN_FLIGHT = 3  # blocks submitted to the engine at once
MAX_BAD_EXAMPLES = 20


@dataclass
class _Pending:
    rows: Rows
    good: list[int]  # positions in rows of the texts submitted
    job: Job | None

    def done_so_far(self) -> tuple[int, int]:
        """Texts of the engine job answered so far (read unlocked: only a progress figure),
        and their tokens, estimated as that share of the job's."""
        if self.job is None:
            return 0, 0
        pending = self.job.pending()
        total = len(pending)
        rows = total - self.job.remaining
        tokens = sum(len(self.job.ids[i]) for i in pending)
        return rows, tokens * rows // max(total, 1)


@dataclass
class _Run:
    """What every shard of a run writes to or counts in."""

    job: BulkJob
    out: OutputDir
    width: int
    progress: Progress
    ids: Duplicates
    written: list[Path] = field(default_factory=list)
    missing_column: int = 0  # bad rows that lack the text or id column


def bad_rows(rows: Rows) -> list[list[Any]]:
    """``[source, row, id, reason]`` of each bad row, logged in one line per block."""
    bad = [[rows.source, int(rows.rows[i]), rows.ids[i], rows.errors[i]] for i in rows.bad()]
    log_bad_rows(rows.source, bad)
    return bad


def _vectors(p: _Pending, progress: Progress) -> Embeddings:
    """The block's vectors, logging progress while a long block runs (its rows count as
    they are answered, not only once the whole shard is written)."""
    assert p.job is not None
    while not p.job.future.done():
        wait([p.job.future], timeout=progress.every_s)
        progress.tick(*p.done_so_far())
    return p.job.future.result()


def finish(p: _Pending, run: _Run) -> None:
    """Wait for a block's vectors and write its shard."""
    job, progress = run.job, run.progress
    schema = columns.schema(job.outputs, run.width)
    rows = p.rows
    if p.job is not None:
        emb = _vectors(p, progress)
        ids = [rows.ids[i] for i in p.good]
        data = {"id": pa.array(ids, pa.string()), **columns.arrays(emb, job.outputs, run.width)}
        table = pa.Table.from_arrays([data[name] for name in schema.names], schema=schema)
        tokens = emb.prompt_tokens
        run.ids.add(cast(list[str], ids))
    else:
        table, tokens = schema.empty_table(), 0
    bad = bad_rows(rows)
    run.written.append(write_shard(run.out.path, table, {rows.source: spans_of(rows.rows)}, bad))
    progress.add(len(p.good), tokens, len(bad))
    run.missing_column += missing_column(bad, job)
    examples = progress.summary.bad_examples
    for source, row, row_id, why in bad[:max(0, MAX_BAD_EXAMPLES - len(examples))]:
        examples.append({"source": source, "row": row, "id": row_id, "reason": why})


def parts(model: BulkModel, block: Rows, options: EmbedOptions, limit: int | None
          ) -> Iterator[tuple[Rows, list[int], Job | None]]:
    """``block`` as engine jobs not yet queued, (rows, positions of the texts in the job, the
    job), each job's ColBERT vectors within ``limit`` bytes where its texts allow (None: no
    limit): a block of long texts is cut into consecutive parts, each its own shard
    (``BulkModel.spans``)."""
    for start, end, good, job in model.spans(block.texts, block.errors, options, limit):
        rows = block if end - start == len(block) else block.take(np.arange(start, end))
        yield rows, good, job


def _ready(p: _Pending) -> bool:
    return p.job is None or p.job.future.done()


def run(job: BulkJob, settings: Settings, bar: bool | None = None) -> Summary:
    """Embed every row of ``job``'s inputs that ``job.output`` does not hold yet."""
    with OutputDir(job.output) as out:
        sources = discover(job.inputs, exclude=out.path)
        for s in sources:
            check_columns(s, job.text_column, job.id_column)
        spec = job.spec(model_spec(settings))
        # Checked before the model loads (a refusal costs no load), recorded only once it
        # has: a first run with a wrong model path leaves no manifest behind.
        recorded = out.check_manifest(spec, sources, write=False)
        coverage, shards = out.scan()
        log_earlier_bad_rows(shards)
        total = total_rows(sources)
        skipped = sum(coverage.rows(s.key) for s in sources)
        skipped_bad = earlier_bad_rows(shards, {s.key for s in sources})
        log.info("bulk: %d input files, %s rows, %d already in %s%s", len(sources),
                 total if total is not None else "?", skipped, out.path,
                 f" ({skipped_bad} of them bad rows, skipped then)" if skipped_bad else "")
        options = columns.embed_options(job.outputs)
        # pyarrow imports pandas (when installed) at its first conversion of Python values:
        # seconds on a small machine, paid here with the model's load, not in the first shard.
        pa.array(["start"])
        with BulkModel(resume_settings(settings, recorded)) as model:
            out.check_manifest(spec, sources, model.identity)
            progress = Progress(None if total is None else total - skipped, skipped, bar=bar)
            progress.summary.skipped_bad = skipped_bad
            state = _Run(job, out, model.width, progress, Duplicates.of_shards(shards))
            pending: deque[_Pending] = deque()
            # At most IN_FLIGHT + 1 blocks are held at once: each a share of the limit.
            limit = model.colbert_limit // (IN_FLIGHT + 1) if options.colbert else None
            try:
                for source in sources:
                    for block in blocks(source, job, coverage):
                        for rows, good, engine_job in parts(model, block, options, limit):
                            if engine_job is not None:
                                model.engine.submit(engine_job)
                            pending.append(_Pending(rows, good, engine_job))
                            while len(pending) > IN_FLIGHT or (pending and _ready(pending[0])):
                                finish(pending.popleft(), state)
                while pending:
                    finish(pending.popleft(), state)
            except BaseException:
                # Interrupted or failed: what is queued is dropped, finished shards stay.
                model.engine.abort(NotReady("the bulk job stopped"))
                raise
            state.ids.warn()
            progress.summary.duplicate_ids = state.ids.count
            summary = progress.close()
        refuse_nothing_embedded(summary, job, out, state.written, state.missing_column)
        return summary
