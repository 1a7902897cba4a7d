"""Reranking with a cross-encoder (bge-reranker-v2-m3): texts → pair rows → logits → scores.

``plan_pairs`` tokenizes the query and the documents once and builds FlagReranker's pair rows
(``pairs.py``: its query cap and cut, or windows over long documents); the rows are then scored
like any texts (each one is one text to the packer); ``finish_pairs`` keeps each document's
best window and applies the sigmoid when asked (FlagReranker's ``normalize``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bgeserve.engine.pairs import (
    SPECIALS,
    PairConfig,
    PairPlan,
    build_pairs,
    content_ids,
)
from bgeserve.engine.tokenizer import Tokenizer
from bgeserve.results import RerankOptions, RerankResult


def plan_pairs(tokenizer: Tokenizer, query: str, documents: Sequence[str],
               config: PairConfig, options: RerankOptions) -> PairPlan:
    """The pair rows for ``query`` against ``documents`` (``tokenizer`` must not truncate)."""
    limit = config.query_limit

    def document_keep(query_ids: np.ndarray) -> int | None:
        # The document tokens a row holds beside the query as build_pairs keeps it.
        width = config.max_length - min(len(content_ids(query_ids)), limit) - SPECIALS
        need = options.leading_tokens(width)
        return None if need is None else need + 2  # <s> and </s> counted

    encoded = tokenizer.encode_rerank(query, documents, limit + 2, document_keep)
    docs = [content_ids(ids) for ids in encoded[1:]]
    cut = np.zeros(len(docs), dtype=bool)
    if options.max_tokens_per_doc is not None:
        for i, d in enumerate(docs):
            if len(d) > options.max_tokens_per_doc:
                docs[i], cut[i] = d[:options.max_tokens_per_doc], True
    plan = build_pairs(content_ids(encoded[0]), docs, config, options.long_documents,
                       options.truncation_direction)
    plan.truncated |= cut
    return plan


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` in float64 (FlagReranker's ``normalize``), written with tanh so
    no logit overflows ``exp``."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def finish_pairs(plan: PairPlan, row_scores: np.ndarray, options: RerankOptions,
                 model: str) -> RerankResult:
    """Each document's best window's logit (its sigmoid with ``normalize``)."""
    scores = plan.reduce(row_scores)
    if options.normalize:
        scores = sigmoid(scores)
    return RerankResult(scores, plan.truncated, plan.windows, plan.tokens, model,
                        plan.query_truncated)
