"""Reranking with bge-m3 itself: the query embedded once, each document (or each window of a
long one) embedded once, then ``m3score`` — dense, sparse, ColBERT or their weighted mix.

``BGEM3FlagModel.compute_score`` re-encodes the query for every pair; here the query is one
text of the same embedding call as the documents (so it shares their chunks), whatever the
number of documents. A document longer than bge-m3's ``max_seq`` tokens is cut (``truncate``:
FlagEmbedding's own input, flagged) or split into overlapping windows whose best score is kept
(``max``, the default), as the cross-encoder does (``pairs.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from bgeserve.engine.jobs import Job
from bgeserve.engine.m3score import canonical_mode, check_weights, m3_scores, needs
from bgeserve.engine.pairs import CLS_ID, EOS_ID, content_ids, document_windows
from bgeserve.engine.tokenizer import Tokenizer, untruncated
from bgeserve.errors import InvalidInput, TooLarge
from bgeserve.results import M3_SCORER, Embeddings, EmbedOptions, RerankOptions, RerankResult

if TYPE_CHECKING:
    from bgeserve.engine import Engine


@dataclass
class M3Plan:
    """The texts one M3 rerank embeds: the query, then every document window (token ids with
    ``<s>``/``</s>``), and how the windows map back to documents."""

    inputs: list[np.ndarray]  # [query, window, window, ...]
    owner: np.ndarray  # document of each window
    windows: np.ndarray
    truncated: np.ndarray
    query_truncated: bool
    outputs: tuple[bool, bool, bool]  # (dense, sparse, colbert) the mode needs

    @property
    def tokens(self) -> int:
        return int(sum(len(x) for x in self.inputs))


def plan_m3(tokenizer: Tokenizer, query: str, documents: Sequence[str], max_seq: int,
            options: RerankOptions, max_windows: int | None = None) -> M3Plan:
    """Tokenize once (``tokenizer`` must not truncate: its ``max_seq`` above any document) and
    cut each document into windows of ``max_seq - 2`` content tokens."""
    width = max_seq - 2
    need = options.leading_tokens(width)
    encoded = tokenizer.encode_rerank(query, documents, max_seq,
                                      lambda _: None if need is None else need + 2)
    q = content_ids(encoded[0])
    inputs = [np.concatenate(([CLS_ID], q[:width], [EOS_ID])).astype(np.int64)]
    owner: list[int] = []
    windows = np.zeros(len(documents), dtype=np.int64)
    truncated = np.zeros(len(documents), dtype=bool)
    for i, ids in enumerate(encoded[1:]):
        d = content_ids(ids)
        if options.max_tokens_per_doc is not None and len(d) > options.max_tokens_per_doc:
            d, truncated[i] = d[:options.max_tokens_per_doc], True
        starts, cut = document_windows(len(d), width, width // 4, options.long_documents,
                                       options.truncation_direction, max_windows)
        truncated[i] |= cut
        windows[i] = len(starts)
        for start in starts:
            inputs.append(np.concatenate(([CLS_ID], d[start:start + width], [EOS_ID])
                                         ).astype(np.int64))
            owner.append(i)
    return M3Plan(inputs, np.asarray(owner, dtype=np.int64), windows, truncated,
                  len(q) > width, needs(options.mode))


def groups(plan: M3Plan, width: int, colbert_bytes: int | None) -> list[list[int]]:
    """The plan's inputs in consecutive groups, each one job: with ColBERT, each group's
    vectors (``tokens - 1`` rows of ``width`` floats per input) stay under ``colbert_bytes``,
    so a request of many long documents never holds all of them at once. Group 0 starts with
    the query."""
    if not plan.outputs[2] or colbert_bytes is None:
        return [list(range(len(plan.inputs)))]
    out: list[list[int]] = [[]]
    size = 0
    for i, ids in enumerate(plan.inputs):
        rows = (len(ids) - 1) * width * 4
        if out[-1] and size + rows > colbert_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += rows
    return out


def finish_m3(plan: M3Plan, query: Embeddings, windows: Embeddings,
              options: RerankOptions) -> RerankResult:
    """Scores of the mode per document: its best window's (``windows`` holds the plan's
    inputs after the query, in order)."""
    scoring = Scoring(plan, options)
    scoring.query = query
    scoring.add(windows)
    return scoring.result()


class Scoring:
    """A plan's scores, one group's embeddings at a time: each group's windows are scored
    against the query as they arrive and their vectors dropped, so a request of many
    documents holds one group's ColBERT vectors, not all of them (every group was kept until
    the last one ran: ~4 KiB per token of every window, unbounded by the documents' count)."""

    def __init__(self, plan: M3Plan, options: RerankOptions) -> None:
        self.plan, self.options = plan, options
        self.query: Embeddings | None = None
        self._scores: list[np.ndarray] = []

    def add(self, part: Embeddings) -> None:
        """Score the next group (the first one starts with the query); ``drop`` it then."""
        windows = part
        if self.query is None:
            self.query, windows = rows(part, slice(0, 1)), rows(part, slice(1, None))
        if len(windows):
            self._scores.append(m3_scores(self.query, windows).combined(self.options.mode,
                                                                        self.options.weights))

    def result(self) -> RerankResult:
        plan = self.plan
        per_window = np.concatenate(self._scores) if self._scores else np.zeros(0)
        scores = np.full(len(plan.windows), -np.inf)
        np.maximum.at(scores, plan.owner, per_window)
        return RerankResult(scores, plan.truncated, plan.windows, plan.tokens, M3_SCORER,
                            plan.query_truncated)


def drop(job: Job, part: Embeddings) -> None:
    """Let a scored group's vectors go: the caller keeps each group's job (and its future's
    result, ``part``) to the last group. ColBERT's matrices, and since the memory QA the sparse
    rows and the dense ones too: kept, 2,048 documents of 15,000 characters in 128-token
    windows took the server from ~250 MiB to its 700 MiB cap (OOM-killed); in process, 768 of
    them grew RSS by ~550 MiB a group of 16,513 windows (small arrays kept among the freed
    chunks' buffers), flat once they were let go."""
    for listed in (part.sparse, part.colbert):  # shared with the job's own lists
        if listed is not None:
            listed.clear()
    part.dense = job.dense = None


def rows(e: Embeddings, index: slice | list[int]) -> Embeddings:
    """The embeddings of some of ``e``'s texts."""
    idx = np.arange(len(e))[index]
    return Embeddings(None if e.dense is None else e.dense[idx],
                      None if e.sparse is None else [e.sparse[i] for i in idx],
                      None if e.colbert is None else [e.colbert[i] for i in idx],
                      e.n_tokens[idx], e.truncated[idx])


# -- on an engine ------------------------------------------------------------------------------
def admit(engine: Engine, plan: M3Plan) -> None:
    """Refuse (413) a request whose longest text cannot fit bge-m3's memory budget."""
    cost, names = engine.cost_model, engine.config.names
    longest = max(len(x) for x in plan.inputs)
    if cost is not None and not cost.fits(1, longest):
        raise TooLarge(
            f"a text of {longest} tokens (the query or a document window) needs "
            f"~{cost.cost(1, longest) / 2**20:.0f} MiB of workspace; bge-m3's budget per "
            f"worker is {cost.max_workspace_bytes / 2**20:.0f} MiB (longest that fits: "
            f"{cost.max_seq()} tokens). Lower {names.max_seq} (windows get shorter), or "
            f"{names.more_memory}", param="documents")


def min_tokens(tokenizer: Tokenizer, query: str, documents: Sequence[str], max_seq: int,
               options: RerankOptions, stop_above: int | None = None) -> int:
    """A lower bound on the tokens ``make_jobs``' texts hold, far cheaper than tokenizing
    (admission refuses a request on it before tokenizing), counted until past ``stop_above``:
    the query and each document's first window (each at most a window's width; a document at
    most ``max_tokens_per_doc``), with ``<s>`` and ``</s>``, from the tokenizer's lower bound of
    their tokens (``Tokenizer.min_tokens``). No word is walked past what can count."""
    width = max_seq - 2
    words = tokenizer.min_tokens
    total = 2 + min(words([query], stop_above=width + 2) - 2, width)
    cap = width if options.max_tokens_per_doc is None else min(width, options.max_tokens_per_doc)
    for doc in documents:
        if stop_above is not None and total > stop_above:
            break
        limit = cap if stop_above is None else min(cap, max(0, stop_above - total - 2))
        total += 2 + min(words([doc], stop_above=limit + 2) - 2, cap)
    return total


def check_options(options: RerankOptions) -> None:
    """Refuse an unknown mode or weights the mode cannot combine before any text is embedded
    (``M3Scores.combined`` would find them only after)."""
    try:
        canonical_mode(options.mode)
    except ValueError as exc:
        raise InvalidInput(str(exc), param="mode") from exc
    try:
        check_weights(options.weights, options.mode)
    except ValueError as exc:
        raise InvalidInput(str(exc), param="weights") from exc


def make_jobs(engine: Engine, query: str, documents: Sequence[str], options: RerankOptions,
              request_id: str = "", arrived: float | None = None) -> tuple[M3Plan, list[Job]]:
    """Tokenize, window and admit: the jobs to run one after the other (see ``groups``)."""
    start = time.monotonic() if arrived is None else arrived
    check_options(options)
    plan = plan_m3(untruncated(engine.artifacts.tokenizer_path, engine.config.max_text_chars,
                               engine.config.names.max_text_chars),
                   query, documents, engine.config.max_seq, options)
    admit(engine, plan)
    timeout = engine.config.request_timeout_s
    deadline = start + timeout if timeout else None
    dense, sparse, colbert = plan.outputs
    limit = engine.config.max_colbert_bytes
    jobs = [Job([plan.inputs[i] for i in group], np.zeros(len(group), dtype=bool),
                EmbedOptions(dense, sparse, colbert), deadline, request_id)
            for group in groups(plan, engine.width, None if limit is None else limit // 2)]
    return plan, jobs


def rerank_m3(engine: Engine, query: str, documents: Sequence[str],
              options: RerankOptions) -> RerankResult:
    """bge-m3's scores of ``documents`` against ``query`` (blocking)."""
    plan, jobs = make_jobs(engine, query, documents, options)
    scoring = Scoring(plan, options)
    for job in jobs:
        future = engine.submit(job)
        try:
            part = future.result()
            scoring.add(part)
            drop(job, part)
        except BaseException:
            engine.cancel(job)
            raise
    return scoring.result()


async def arerank_m3(engine: Engine, query: str, documents: Sequence[str],
                     options: RerankOptions, request_id: str = "") -> RerankResult:
    """Async ``rerank_m3``: tokenization off the event loop, the groups one after another."""
    plan, jobs = await asyncio.to_thread(make_jobs, engine, query, documents, options,
                                         request_id)
    return await arun_jobs(engine, plan, jobs, options)


async def arun_jobs(engine: Engine, plan: M3Plan, jobs: Sequence[Job], options: RerankOptions,
                    first: Future | None = None,
                    submit: Callable[[Job], Future] | None = None,
                    before: Callable[[Job], Awaitable[None]] | None = None) -> RerankResult:
    """Run ``make_jobs``' jobs one after the other, each group scored before the next is
    queued (``first``: the first one's future, when the caller queued it already; ``submit``
    queues the later ones, ``engine.submit`` unless given; ``before(job)`` is awaited before
    each later one is queued: the service takes room for its ColBERT vectors there). Each group
    is scored on a thread: ColBERT's query-by-window products of a few long documents held the
    event loop, /health included, for 11-25 s on the tiny model (fuzz QA)."""
    scoring = Scoring(plan, options)
    for i, job in enumerate(jobs):
        future = first
        if i > 0:
            if before is not None:
                await before(job)
            future = submit(job) if submit is not None else None
        part = await engine.await_job(job, future)
        await asyncio.to_thread(scoring.add, part)
        drop(job, part)
    return await asyncio.to_thread(scoring.result)
