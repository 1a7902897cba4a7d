"""``Reranker``: a cross-encoder (bge-reranker-v2-m3) in-process, on an ``Engine`` of its own.

query + documents → FlagReranker's pair rows, windows over long documents (``crossencoder``,
``pairs``) → one job of rows on the engine (each row one text to the packer: cross-request
batching, the memory budget, OOM splits and deadlines as for embeddings) → the logits
(``forward``'s reranker layouts) → each document's best window, sigmoid on request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Self

import numpy as np

from bgeserve.engine import Engine, EngineConfig, check_model_path
from bgeserve.engine.crossencoder import finish_pairs, plan_pairs
from bgeserve.engine.inputs import rerank_inputs
from bgeserve.engine.jobs import Job
from bgeserve.engine.pairs import SPECIALS, PairConfig, PairPlan
from bgeserve.engine.tokenizer import untruncated
from bgeserve.errors import ModelUnavailable, TooLarge
from bgeserve.model.rerank_artifacts import RERANK_MODEL_ID, resolve_reranker
from bgeserve.results import Embeddings, EmbedOptions, RerankOptions, RerankResult


class Reranker:
    """bge-reranker-v2-m3 scores, in input order: ``rerank(query, documents)`` (blocking) or
    ``await arerank(...)``.

    ``Reranker(model_path, variant)`` opens a reranker export or snapshot (None: the pinned hub
    model, downloaded into ``cache_dir``); ``Reranker(engine=...)`` wraps an engine over
    reranker artifacts (the server's way). Pairs hold at most ``pairs.max_length`` tokens
    (default: what the model's positions hold, 8,192). Use it as a context manager, or call
    ``close()``.
    """

    def __init__(self, model_path: str | Path | None = None, variant: str = "fp32", *,
                 engine: Engine | None = None, config: EngineConfig | None = None,
                 pairs: PairConfig | None = None, cache_dir: str | Path | None = None,
                 offline: bool = False, model_id: str = RERANK_MODEL_ID, start: bool = True):
        if engine is None:
            cache = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "bgeserve"
            check_model_path(model_path)
            artifacts = resolve_reranker(model_path=Path(model_path) if model_path is not None
                                         else None,
                                         variant=variant, cache_dir=cache, offline=offline)
            engine = Engine(artifacts=artifacts, config=config, start=start)
        if not engine.artifacts.layout.reranker:
            raise ModelUnavailable(f"{engine.artifacts.source} is not a reranker's graph")
        self.engine = engine
        self.model_id = model_id
        held = engine.config.max_seq  # clamped to the positions by the engine
        pairs = pairs or PairConfig(max_length=held)
        self.pairs = pairs if pairs.max_length <= held else replace(pairs, max_length=held)
        self.tokenizer = untruncated(engine.artifacts.tokenizer_path,
                                     engine.config.max_text_chars,
                                     engine.config.names.max_text_chars)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Load the sessions and start the workers."""
        self.engine.start()

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued work and release the sessions."""
        self.engine.close(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- scoring ---------------------------------------------------------------------------
    def admit(self, plan: PairPlan) -> None:
        """Refuse (413) a request whose longest window cannot fit the memory budget."""
        cost, names = self.engine.cost_model, self.engine.config.names
        if cost is None or not plan.rows:
            return
        longest = max(len(r) for r in plan.rows)
        if not cost.fits(1, longest):
            raise TooLarge(
                f"one (query, document) window of {longest} tokens needs "
                f"~{cost.cost(1, longest) / 2**20:.0f} MiB of workspace; the reranker's budget "
                f"per worker is {cost.max_workspace_bytes / 2**20:.0f} MiB (longest that fits: "
                f"{cost.max_seq()} tokens). Lower {names.pair_length} (windows get "
                f"shorter), shorten the query, or {names.more_memory}", param="documents")

    def min_tokens(self, query: str, documents: Sequence[str], options: RerankOptions,
                   stop_above: int | None = None) -> int:
        """A lower bound on the tokens ``make_job``'s rows hold, far cheaper than tokenizing
        (admission refuses a request on it before tokenizing), counted until past
        ``stop_above``.

        With ``q`` query tokens kept (at most ``query_limit``) and ``d`` document tokens (at
        most ``max_tokens_per_doc``), a document's rows hold ``4 + q + d`` tokens or more when
        its windows cover it all (``max``, no window cap), else its first row
        ``min(max_length, 4 + q + d)``: increasing in both, so the tokenizer's lower bounds of
        each (``Tokenizer.min_tokens``, less the two specials it counts) bound it from below.
        """
        config, words = self.pairs, self.tokenizer.min_tokens
        # No word is walked past what can count (the query's limit, the cut, a row's length,
        # the total past ``stop_above``): a prefix's count is still a lower bound.
        q = min(words([query], stop_above=config.query_limit + 2) - 2, config.query_limit)
        covered = options.long_documents == "max" and config.max_windows is None
        caps = [c for c in (options.max_tokens_per_doc,
                            None if covered else config.max_length - SPECIALS - q) if c is not None]
        total = 0
        for doc in documents:
            limit = [*caps] if stop_above is None else \
                [*caps, max(0, stop_above - total - SPECIALS - q)]
            d = words([doc], stop_above=min(limit) + 2 if limit else None) - 2
            total += SPECIALS + q + (min(d, *caps) if caps else d)
            if stop_above is not None and total > stop_above:
                break
        return total

    def make_job(self, query: str, documents: list[str], options: RerankOptions,
                 request_id: str = "", arrived: float | None = None) -> tuple[PairPlan, Job]:
        """Tokenize, build the rows and admit them: a job ready to submit, and its plan. The
        deadline counts from ``arrived`` (monotonic; default now)."""
        start = time.monotonic() if arrived is None else arrived
        plan = plan_pairs(self.tokenizer, query, documents, self.pairs, options)
        self.admit(plan)
        timeout = self.engine.config.request_timeout_s
        job = Job(plan.rows, np.zeros(len(plan.rows), dtype=bool), EmbedOptions(dense=True),
                  start + timeout if timeout else None, request_id)
        job.reuse(None)  # a row repeated (the same document twice) runs once: equal scores
        return plan, job

    def finish(self, plan: PairPlan, embedded: Embeddings,
               options: RerankOptions) -> RerankResult:
        """The scores of a finished job (``embedded.dense`` holds one logit per row)."""
        logits = embedded.dense[:, 0] if embedded.dense is not None else np.zeros(0)
        return finish_pairs(plan, logits, options, self.model_id)

    def submit(self, job: Job) -> Future:
        """Queue a job's rows on the engine."""
        return self.engine.submit(job)

    def rerank(self, query: str, documents: list[str], *, normalize: bool = False,
               long_documents: str = "max", truncation_direction: str = "right",
               max_tokens_per_doc: int | None = None) -> RerankResult:
        """Score ``documents`` against ``query`` (blocking); see ``RerankResult``.

        ``normalize``: sigmoid scores in [0, 1] (FlagReranker's ``normalize=True``);
        ``long_documents``: ``max`` (windows, best kept) or ``truncate`` (FlagReranker's cut,
        flagged; ``truncation_direction`` ``left`` keeps the end instead).
        """
        options = RerankOptions(model=self.model_id, normalize=normalize,
                                long_documents=long_documents,
                                truncation_direction=truncation_direction,
                                max_tokens_per_doc=max_tokens_per_doc)
        plan, job = self.make_job(query, rerank_inputs(query, documents), options)
        future = self.submit(job)
        try:
            return self.finish(plan, future.result(), options)
        except BaseException:
            self.engine.cancel(job)
            raise

    async def arerank(self, query: str, documents: list[str], *, normalize: bool = False,
                      long_documents: str = "max", truncation_direction: str = "right",
                      max_tokens_per_doc: int | None = None,
                      request_id: str = "") -> RerankResult:
        """Async ``rerank``: tokenization off the event loop; cancellation drops queued rows."""
        options = RerankOptions(model=self.model_id, normalize=normalize,
                                long_documents=long_documents,
                                truncation_direction=truncation_direction,
                                max_tokens_per_doc=max_tokens_per_doc)
        plan, job = await asyncio.to_thread(self.make_job, query,
                                            rerank_inputs(query, documents), options,
                                            request_id)
        return self.finish(plan, await self.engine.await_job(job), options)
