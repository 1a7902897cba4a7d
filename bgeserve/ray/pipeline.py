"""``bgeserve bulk --ray``: the bulk job as a Ray Data pipeline.

    read_datasource(BulkSource)  →  map_batches(Embedder, actor pool)  →  write_datasink(ShardSink)

Ray schedules, streams, retries and scales the pool; bgeserve only supplies the three stages.
The same output folder, manifest and shards as the local job, so a job can be resumed by
either. Inputs and the output folder must be on storage every node sees at the same path.

Actors: by default one per node, with all its CPUs but one (that one reads and writes);
``--cpus-per-actor C`` packs ``(CPUs − 1) // C`` per node. Each actor loads the model and
sizes its budget with the probe on its own node (``Embedder``).

As in the local job, a folder's shards are all made with one model's files: each row carries
the identity of its actor's model, and the sink refuses a write of another than the manifest
records (or, on a first run, than the first write pinned); the manifest records it when the
run ends. Ids written more than once are counted once the run ends, from the id columns of the
folder's shards (read one shard at a time, as the local job reads the earlier ones).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from bgeserve.bulk.dupes import Duplicates
from bgeserve.bulk.job import BulkJob, missing_column, refuse_nothing_embedded
from bgeserve.bulk.local import MAX_BAD_EXAMPLES
from bgeserve.bulk.model import model_spec, resume_settings, settings_env
from bgeserve.bulk.output import OutputDir, earlier_bad_rows, log_earlier_bad_rows
from bgeserve.bulk.progress import Progress, Summary
from bgeserve.bulk.sources import check_columns, discover
from bgeserve.config import Settings
from bgeserve.errors import BgeServeError, InvalidInput
from bgeserve.model.artifacts import check_model_dir
from bgeserve.ray.datasink import MODEL_COLUMN, ShardSink, ShardWriteFailed, mixed_models
from bgeserve.ray.datasource import BulkSource
from bgeserve.ray.embedder import Embedder
from bgeserve.service import plan

log = logging.getLogger("bgeserve.bulk")
IO_CPUS = 0.5  # each read and write task: two fit in the CPU an actor leaves free


def actor_pool(node_cpus: list[int], cpus_per_actor: float | None) -> tuple[float, int]:
    """(CPUs per actor, actors) for nodes with ``node_cpus`` CPUs each."""
    if not node_cpus:
        raise InvalidInput("the Ray cluster has no node with CPUs", param="--ray-address")
    if cpus_per_actor is None:
        return float(max(1, min(node_cpus) - 1)), len(node_cpus)
    largest = max(max(node_cpus) - 1, 1)
    if not 0 < cpus_per_actor <= largest:
        raise InvalidInput(f"--cpus-per-actor {cpus_per_actor:g}: choose 0 < C <= {largest} "
                           "(the largest node's CPUs but one, which reads and writes)",
                           param="--cpus-per-actor")
    count = sum(int(max(c - 1, 1) // cpus_per_actor) for c in node_cpus)
    return cpus_per_actor, max(1, count)


def actor_env(settings: Settings) -> dict[str, str]:
    """The driver's settings as ``BGE_M3_*`` variables for the actors, the variant and runtime
    the driver resolved pinned: nodes left to choose by their own CPUs could mix variants in
    one output; and the ColBERT limit (``colbert_limit``): actors sizing it by their own
    memory would cut their batches, and so Ray's blocks and the shards, each its own way."""
    env = settings_env(settings)
    env["BGE_M3_MODEL"] = settings.variant
    env["BGE_M3_EP"] = settings.execution_provider
    env["BGE_M3_MAX_COLBERT_MB"] = str(colbert_limit(settings) >> 20)
    return env


def colbert_limit(settings: Settings) -> int:
    """The ColBERT vectors a shard holds at most: BGE_M3_MAX_COLBERT_MB, else the server's
    default on the driver, in whole MiB (as the actors are told it)."""
    return max(1, plan.colbert_bytes(settings) >> 20) << 20


def run_identity(folder: Path, results: list[dict[str, Any]]) -> str | None:
    """The one model identity the write ``results`` report (None when no shard was written);
    InvalidInput when the actors disagreed (the sink refuses that before it writes: this is
    the driver's own check)."""
    found = sorted({r["identity"] for r in results if r.get("identity") is not None})
    if len(found) > 1:
        raise mixed_models(folder, found[0], found[1])
    return found[0] if found else None


def _refusal(error: BaseException | None) -> BgeServeError | OSError | None:
    """bgeserve's refusal, or the sink's file error (the output folder unwritable: the command
    says it in one line), inside Ray's wrapper of a task's error, if ``error`` is one; other
    errors (a network one, an actor's) keep Ray's account."""
    from ray.exceptions import RayTaskError

    cause = error.cause if isinstance(error, RayTaskError) else None
    return cause if isinstance(cause, BgeServeError | ShardWriteFailed) else None


@contextlib.contextmanager
def _quiet_refusals() -> Iterator[None]:
    """Ray Data logs an error its sink raised with Ray's whole stack (and, as a bug of its own,
    "... open an issue") before the driver sees it: not bgeserve's refusals, which the command
    prints as one line. A filter on Ray's loggers and their handlers while the job runs."""

    def keep(record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        return _refusal(error) is None  # Ray logs from inside its except blocks

    names = ("ray", "ray.data", "ray.data.exceptions",
             "ray.data._internal.execution.streaming_executor_state")
    loggers = [logging.getLogger(name) for name in names]
    handlers = {h for lg in loggers for h in lg.handlers}
    for item in (*loggers, *handlers):
        item.addFilter(keep)
    try:
        yield
    finally:
        for item in (*loggers, *handlers):
            item.removeFilter(keep)


@contextlib.contextmanager
def _block_bytes(limit: int | None) -> Iterator[None]:
    """Ray's blocks within ``limit`` bytes for the datasets made here (None: Ray's own, 128
    MiB; a dataset keeps the context it was made in): Ray joins what the Embedder gives, parts
    of a batch within the limit, into blocks of its own size, which are what a write task
    holds."""
    from ray.data import DataContext

    context = DataContext.get_current()
    before = context.target_max_block_size
    if limit is not None:
        context.target_max_block_size = min(before or limit, limit)
    try:
        yield
    finally:
        context.target_max_block_size = before


def arena_env(environ: Mapping[str, str], cpus: float) -> dict[str, str]:
    """The actors' malloc arena cap, set when their processes start: a cap set from the
    actor's ``__init__`` (``memory.limit_malloc_arenas``) comes after Ray's own threads have
    made their arenas, and glibc fixes its limit once more than 8 exist. The driver's own
    ``MALLOC_ARENA_MAX`` / ``GLIBC_TUNABLES`` are passed on instead where set."""
    given = {k: environ[k] for k in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES") if environ.get(k)}
    if "MALLOC_ARENA_MAX" in given or "glibc.malloc.arena_max" in given.get(
            "GLIBC_TUNABLES", ""):
        return given
    return {**given, "MALLOC_ARENA_MAX": str(max(2, int(cpus)))}


def run(job: BulkJob, settings: Settings, address: str | None = None,
        cpus_per_actor: float | None = None,
        environ: Mapping[str, str] | None = None) -> Summary:
    """Run ``job`` on the Ray cluster at ``address`` (None: RAY_ADDRESS, else a local one);
    ``environ``: the driver's environment (its malloc settings go to the actors)."""
    import ray

    local = address is None and not (environ or {}).get("RAY_ADDRESS") \
        and not ray.is_initialized()
    with OutputDir(job.output) as out:
        sources = discover(job.inputs, exclude=out.path)
        for s in sources:
            check_columns(s, job.text_column, job.id_column)
        spec = job.spec(model_spec(settings))
        # The identity the shards already in the folder were made with (None on a first run):
        # known to the driver before any actor loads, checked by the sink on every write.
        recorded = out.check_manifest(spec, sources)
        coverage, shards = out.scan()
        log_earlier_bad_rows(shards)
        skipped = sum(coverage.rows(s.key) for s in sources)
        skipped_bad = earlier_bad_rows(shards, {s.key for s in sources})
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if local and len(alive) == 1:
            # This machine alone (ray.init joins a cluster `ray start` began here, which may
            # have other nodes: not checked then), whose files the actors read: a model path
            # not here failed every actor, told in Ray's tracebacks of each (QA: 323 lines).
            check_model_dir(settings.model_path)
        nodes = [int(n["Resources"].get("CPU", 0)) for n in alive
                 if n["Resources"].get("CPU", 0) >= 1]
        cpus, actors = actor_pool(nodes, cpus_per_actor)
        log.info("bulk on Ray: %d input files, %d rows already in %s%s; %d Embedder actors "
                 "of %g CPUs", len(sources), skipped, out.path,
                 f" ({skipped_bad} of them bad rows, skipped then)" if skipped_bad else "",
                 actors, cpus)
        progress = Progress(None, skipped, bar=False)  # Ray Data shows its own progress
        progress.summary.skipped_bad = skipped_bad
        # The Embedder gives a batch in parts of half the limit, Ray's blocks are no larger,
        # and a write task (one block, or a few) cuts its shards at the limit: a shard is
        # held while its Parquet is written, a part of a read at a time.
        limit = colbert_limit(settings) if "colbert" in job.outputs else None
        sink = ShardSink(out.path, job.outputs, recorded, job.rows_per_shard, limit)
        try:
            with _quiet_refusals(), _block_bytes(None if limit is None else limit // 2):
                # One block per shard-sized block of rows: Ray would otherwise split each
                # read's output to reach twice the cluster's CPUs: only smaller shards.
                ds = ray.data.read_datasource(BulkSource(sources, job, coverage),
                                              num_cpus=IO_CPUS, override_num_blocks=len(sources))
                ds = ds.map_batches(
                    Embedder, batch_format="pyarrow", batch_size=None,
                    compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=cpus,
                    runtime_env={"env_vars": arena_env(environ or {}, cpus)},
                    fn_constructor_kwargs={
                        "outputs": job.outputs, "identity_column": MODEL_COLUMN,
                        "env": actor_env(resume_settings(settings, recorded))})
                ds.write_datasink(sink, ray_remote_args={"num_cpus": IO_CPUS})
        except Exception as exc:
            refusal = _refusal(exc)
            if refusal is not None:  # its message, no traceback
                raise refusal from None
            raise
        identity = run_identity(out.path, sink.results)
        if recorded is None and identity is not None:
            out.check_manifest(spec, sources, identity)
        summary = progress.summary
        for result in sink.results:
            summary.rows += result["rows"]
            summary.tokens += result["tokens"]
            summary.shards += result["shards"]
            summary.bad += len(result["bad"])
            for source, row, row_id, why in result["bad"]:
                if len(summary.bad_examples) < MAX_BAD_EXAMPLES:
                    summary.bad_examples.append({"source": source, "row": row, "id": row_id,
                                                 "reason": why})
                log.warning("skipped bad row %d of %s (id %r): %s", row, source, row_id, why)
        ids = Duplicates.of_shards(shards)
        written = [Path(p) for r in sink.results for p in r["paths"]]  # none where it got none
        ids.add_shards(dict.fromkeys(written))
        ids.warn()
        summary.duplicate_ids = ids.count
        summary = progress.close()
        refuse_nothing_embedded(summary, job, out, written,
                                sum(missing_column(r["bad"], job) for r in sink.results))
        return summary
