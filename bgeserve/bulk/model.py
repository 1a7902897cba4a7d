"""The model of a bulk job: the ``Engine`` the service layer builds from ``BGE_M3_*`` settings.

A bulk job embeds with the server's own engine, made the server's own way (``Service``:
artifacts, the default variant, the memory probe and its cache, the budget), so a Parquet
shard holds what ``POST /v1/embeddings:both`` would have answered. Only what makes sense for
a request and not for a job is changed (``job_settings``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Self, cast

from bgeserve.config import OPENVINO_VARIANTS, VARIANTS, Settings, _env_fields
from bgeserve.engine import Engine
from bgeserve.engine.jobs import Job
from bgeserve.errors import BgeServeError, ConfigError
from bgeserve.model.artifacts import ModelArtifacts, export_variants
from bgeserve.model.prepared import PreparedStore, file_digests
from bgeserve.results import EmbedOptions
from bgeserve.service import Service, plan

log = logging.getLogger("bgeserve.bulk")
UNBOUNDED = 1 << 62


def resolve_settings(environ: Mapping[str, str]) -> Settings:
    """``Settings`` from ``environ`` with the runtime and variant decided as ``serve`` decides
    them (ConfigError naming the variable when they cannot be)."""
    return plan.resolve(Settings.from_env(environ))


def job_settings(settings: Settings) -> Settings:
    """``settings`` for a job that feeds its own engine: no per-request deadline (a shard of
    long texts on fp32 takes minutes), no idle unload, no heartbeat (the job logs progress),
    a queue and ColBERT allowance the job bounds itself (it keeps a few shards in flight),
    and no limit on the characters of a text tokenized whole (a row of a file the user
    chose, a long page without spaces among them, is embedded as the library embeds it)."""
    return dataclasses.replace(settings, request_timeout_secs=0.0, idle_timeout_secs=0.0,
                               heartbeat_secs=0.0, max_queue_tokens=UNBOUNDED,
                               max_colbert_mb=UNBOUNDED >> 20, max_text_chars=UNBOUNDED)


def settings_env(settings: Settings) -> dict[str, str]:
    """The ``BGE_M3_*`` variables that give ``settings`` again (those off their defaults):
    what a Ray actor on another node is handed to build the same engine."""
    env = {}
    for f in _env_fields(Settings):
        value = getattr(settings, f.name)
        if value == f.default or value is None or f.name == "api_keys":  # no secrets
            continue
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, tuple):
            text = ",".join(value)
        else:
            text = str(value)
        env[f.metadata["env"]] = text
    return env


def resume_settings(settings: Settings, recorded: str | None) -> Settings:
    """``settings`` to go on with a folder whose shards were made as ``recorded`` says (a
    ``model_identity``; None: a first run): its variant pinned, unless BGE_M3_MODEL names one
    (a different one is then refused, as any other model). Left to choose, a local run takes
    the variant measured fastest here and a Ray job the rule's (the nodes must agree), so a
    job moved from one to the other, or to another machine, chose another variant than its
    shards' and was refused as another model's."""
    variant = (recorded or "").partition(" ")[0]
    if variant not in VARIANTS or settings.is_explicit("BGE_M3_MODEL"):
        return settings
    provider = settings.execution_provider
    if not settings.is_explicit("BGE_M3_EP"):  # resolved for the rule's variant: the shards'
        provider = "openvino" if variant in OPENVINO_VARIANTS else (
            "cpu" if provider == "openvino" else provider)
    # The settings as they were, the variant pinned (not rebuilt from variables: a value equal
    # to its default would lose what being given means, e.g. BGE_M3_MAX_CHUNK over the
    # deprecated BGE_M3_ONNX_BATCH_SIZE, and the chunks would change).
    pinned = dataclasses.replace(settings, variant=variant, execution_provider=provider,
                                 variant_choice="",
                                 explicit=(settings.explicit or frozenset()) | {"BGE_M3_MODEL"})
    cannot = (f"the output's shards were made with the {variant} variant, which cannot run "
              "here ({}): run the job where it can, or write to a new --output")
    try:
        resumed = plan.resolve(pinned)
    except ConfigError as exc:
        raise ConfigError(cannot.format(exc.message), param="--output") from None
    if resumed.variant != variant:  # BGE_M3_ALLOW_CPU_FALLBACK took another
        raise ConfigError(cannot.format(f"{resumed.variant} would run instead"), param="--output")
    if variant != settings.variant:
        log.info("bulk: the output's shards were made with the %s variant: this run uses it "
                 "too", variant)
    return resumed


def model_spec(settings: Settings) -> dict[str, object]:
    """What decides the vectors (the manifest keeps it: a rerun must not mix models)."""
    return {"path": str(settings.model_path) if settings.model_path else "hub",
            "variant": settings.variant, "execution_provider": settings.execution_provider,
            "max_seq": settings.max_seq_length}


def model_identity(loaded: Settings, artifacts: ModelArtifacts) -> str:
    """Which variant and graph files a job runs, to tell another model put at the same path:
    the graph's sha256 from the manifest of the export ``loaded`` serves (the service's
    settings: for a snapshot or the hub, its prepared export), else the sha256 of the graph
    files themselves (a snapshot served as it is). By content, not by names, sizes and mtimes:
    each node of a Ray job has its own copy of the same files, with its own mtimes."""
    entry = export_variants(loaded.model_path).get(artifacts.variant, {})
    if isinstance(entry.get("sha256"), str):
        return f"{artifacts.variant} sha256:{entry['sha256']}"
    memo = PreparedStore(loaded.cache_dir).digests  # hashed once, remembered as preparing does
    digests = file_digests([artifacts.onnx_path, *artifacts.external_data], memo)
    return f"{artifacts.variant} sha256:{'+'.join(digests.values())}"


def runs(sizes: Sequence[int], limit: int) -> Iterator[tuple[int, int]]:
    """``sizes`` cut into consecutive [start, end) runs, each summing to at most ``limit``
    unless one item alone is more."""
    start, held = 0, 0
    for i, size in enumerate(sizes):
        if held and held + size > limit:
            yield start, i
            start, held = i, 0
        held += size
    if start < len(sizes):
        yield start, len(sizes)


class BulkModel:
    """A loaded engine for a job; ``close()`` (or ``with``) releases it."""

    def __init__(self, settings: Settings):
        # The ColBERT vectors of the blocks in flight together: BGE_M3_MAX_COLBERT_MB, else
        # the server's default (the engine's own check is off: a job bounds its blocks).
        self.colbert_limit = plan.colbert_bytes(settings)
        self.service = Service(job_settings(settings))
        self.service.load_blocking()  # the start-up error (model missing, no memory) raises
        assert self.service.engine is not None
        self.engine: Engine = self.service.engine
        self.width = self.service.dense_width()
        self.identity = model_identity(self.service.settings, self.engine.artifacts)
        tuner = self.service.tuner
        if tuner is not None:
            log.info("model ready: %s, probe %s, %d MiB workspace per worker",
                     self.engine.artifacts.variant, tuner.state.probe_status,
                     tuner.state.max_workspace_bytes >> 20)

    def submit(self, texts: list[str | None], errors: list[str | None],
               options: EmbedOptions) -> tuple[list[int], Future | None]:
        """``submit_job``, answering the job's future (what a Ray actor waits on)."""
        good, job = self.submit_job(texts, errors, options)
        return good, (job.future if job is not None else None)

    def submit_job(self, texts: list[str | None], errors: list[str | None],
                   options: EmbedOptions) -> tuple[list[int], Job | None]:
        """Queue the texts whose ``errors[i]`` is None as one engine job: (their positions,
        the submitted job, whose ``future`` gets the vectors; None when there is none). A
        text the tokenizer refuses (rare: the engine checks a job whole) is found by trying
        the texts one by one; its ``errors[i]`` says why and its ``texts[i]`` becomes None."""
        good, job = self.make_job(texts, errors, options)
        if job is not None:
            self.engine.submit(job)
        return good, job

    def make_job(self, texts: list[str | None], errors: list[str | None],
                 options: EmbedOptions) -> tuple[list[int], Job | None]:
        """``submit_job`` without the queueing."""
        engine = self.engine
        good = [i for i, e in enumerate(errors) if e is None]

        def strings(positions: list[int]) -> list[str]:  # good rows' texts are strings
            return cast(list[str], [texts[i] for i in positions])

        try:
            job = engine.make_job(strings(good), options) if good else None
        except BgeServeError:
            for i in good:
                try:
                    engine.make_job(strings([i]), options)
                except BgeServeError as exc:
                    errors[i], texts[i] = f"refused: {exc}", None
            good = [i for i, e in enumerate(errors) if e is None]
            job = engine.make_job(strings(good), options) if good else None
        return good, job

    def spans(self, texts: list[str | None], errors: list[str | None], options: EmbedOptions,
              limit: int | None) -> Iterator[tuple[int, int, list[int], Job | None]]:
        """The texts as engine jobs not yet queued, consecutive spans of them: (start, end, the
        positions of the span's texts in its job, the job), each job's ColBERT vectors within
        ``limit`` bytes where its texts allow (None: no limit). Only texts that must be cut are
        tokenized twice (QA: a shard of 64 texts of 8,192 tokens held 2 GiB of vectors,
        whatever BGE_M3_MAX_COLBERT_MB said)."""
        good, job = self.make_job(texts, errors, options)
        if limit is None or job is None or self.engine.colbert_bytes(job.ids) <= limit:
            yield 0, len(texts), good, job
            return
        sizes = [0] * len(texts)
        for i, ids in zip(good, job.ids, strict=True):
            sizes[i] = self.engine.colbert_bytes([ids])
        del job  # its tokens: each span makes its own
        for start, end in runs(sizes, limit):
            # The refused texts are marked in ``errors`` already: no span refuses one again.
            part_good, part_job = self.make_job(texts[start:end], errors[start:end], options)
            yield start, end, part_good, part_job

    def close(self) -> None:
        asyncio.run(self.service.stop())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
