"""Reranking with bge-m3 itself: the query embedded once, each document (or each window of a
long one) embedded once, then ``m3score`` — dense, sparse, ColBERT or their weighted mix.

``BGEM3FlagModel.compute_score`` re-encodes the query for every pair; here the query is one
text of the same embedding call as the documents (so it shares their chunks), whatever the
number of documents. A document longer than bge-m3's ``max_seq`` tokens is cut (``truncate``:
FlagEmbedding's own input, flagged) or split into overlapping windows whose best score is kept
(``max``, the default), as the cross-encoder does (``pairs.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bgeserve.engine.m3score import m3_scores, needs
from bgeserve.engine.pairs import CLS_ID, EOS_ID, content_ids, document_windows
from bgeserve.engine.tokenizer import Tokenizer
from bgeserve.results import M3_SCORER, Embeddings, RerankOptions, RerankResult


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
    encoded = tokenizer.encode([query, *documents]).ids
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


def finish_m3(plan: M3Plan, embedded: Embeddings, options: RerankOptions) -> RerankResult:
    """Scores of the mode per document: the best window's (``embedded`` is the plan's inputs,
    in order)."""
    query = _rows(embedded, slice(0, 1))
    docs = _rows(embedded, slice(1, len(plan.inputs)))
    per_window = m3_scores(query, docs).combined(options.mode, options.weights)
    scores = np.full(len(plan.windows), -np.inf)
    np.maximum.at(scores, plan.owner, per_window)
    return RerankResult(scores, plan.truncated, plan.windows, plan.tokens, M3_SCORER,
                        plan.query_truncated)


def _rows(e: Embeddings, rows: slice) -> Embeddings:
    return Embeddings(None if e.dense is None else e.dense[rows],
                      None if e.sparse is None else e.sparse[rows],
                      None if e.colbert is None else e.colbert[rows],
                      e.n_tokens[rows], e.truncated[rows])
