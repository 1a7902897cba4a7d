"""Cross-encoder inputs: (query, document) token ids as FlagReranker builds them, plus windows.

FlagReranker (FlagEmbedding 1.4.2, ``inference/reranker/encoder_only/base.py``) tokenizes the
query and the document separately without special tokens, cuts the query to
``max_length * 3 // 4`` tokens, cuts the document so the pair holds ``max_length`` tokens and
joins them as ``<s> q </s></s> d </s>`` (``[0] + q + [2, 2] + d + [2]``). A pair that fits is
built exactly so (bit-identical ids, so scores match FlagReranker's to float noise).

A longer document is either cut there (``truncate``: FlagReranker's own input, flagged) or
scored over overlapping windows of ``W = max_length - len(q) - 4`` document tokens and the best
window kept (``max``): window 0 is FlagReranker's input, the last ends at the document's end,
neighbours overlap by ``overlap`` tokens (default ``W // 4``) so a passage cut by one window's
edge lies whole in the next. Nothing is refused for length; ``max_windows`` bounds the cost
of one document (the text past its last window is then ignored, and flagged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CLS_ID, EOS_ID = 0, 2
SPECIALS = 4  # <s>, </s></s> between, </s> at the end
LONG_DOCUMENTS = ("max", "truncate")


@dataclass(frozen=True)
class PairConfig:
    """How pairs are built: the length FlagReranker is given and the window policy."""

    max_length: int = 8192  # tokens per pair, specials included (the model's positions)
    query_max: int | None = None  # query tokens kept (default max_length * 3 // 4)
    overlap: int | None = None  # tokens shared by neighbouring windows (default W // 4)
    max_windows: int | None = None  # windows per document at most (None: no cap)

    def __post_init__(self) -> None:
        if self.max_length < SPECIALS + 2:
            raise ValueError(f"max_length must be at least {SPECIALS + 2} tokens")
        if self.query_max is not None and self.query_max < 0:
            raise ValueError("query_max must be >= 0")
        if self.overlap is not None and self.overlap < 0:
            raise ValueError("overlap must be >= 0")
        if self.max_windows is not None and self.max_windows < 1:
            raise ValueError("max_windows must be >= 1")

    @property
    def query_limit(self) -> int:
        """Query tokens kept: FlagReranker's 3/4 of ``max_length``, always leaving a window of
        at least one document token."""
        cap = self.max_length * 3 // 4 if self.query_max is None else self.query_max
        return min(cap, self.max_length - SPECIALS - 1)


@dataclass
class PairPlan:
    """The model inputs of one query against its documents, and how they map back.

    ``rows``: one id row (int64) per window, document-major (document ``i``'s windows are
    consecutive); ``owner[r]``: the document of row ``r``; ``windows[i]``: rows of document
    ``i``; ``truncated[i]``: some of document ``i``'s tokens were not scored;
    ``query_truncated``: the query was cut to ``query_limit``.
    """

    rows: list[np.ndarray]
    owner: np.ndarray
    windows: np.ndarray
    truncated: np.ndarray
    query_tokens: int
    query_truncated: bool

    @property
    def tokens(self) -> int:
        """Tokens fed to the model (every window's, specials included): ``usage``."""
        return int(sum(len(r) for r in self.rows))

    def reduce(self, row_scores: np.ndarray) -> np.ndarray:
        """Each document's score: the maximum over its windows' scores (raw logits; a sigmoid
        after this is the sigmoid of the maximum, as it is monotone)."""
        row_scores = np.asarray(row_scores, dtype=np.float64).reshape(-1)
        if len(row_scores) != len(self.rows):
            raise ValueError(f"{len(row_scores)} scores for {len(self.rows)} rows")
        out = np.full(len(self.windows), -np.inf)
        np.maximum.at(out, self.owner, row_scores)
        return out


def window_starts(length: int, width: int, overlap: int) -> list[int]:
    """Start offsets of the windows of ``width`` tokens covering ``length`` tokens.

    One window (start 0) when the document fits; else starts ``0, S, 2S, …`` below
    ``length - width`` with ``S = width - overlap``, and a last one at ``length - width`` so the
    last window is full and ends at the document's end.
    """
    if width < 1:
        raise ValueError("a window must hold at least one token")
    if length <= width:
        return [0]
    stride = max(1, width - min(overlap, width - 1))
    return [*range(0, length - width, stride), length - width]


def pair_ids(query: np.ndarray, document: np.ndarray) -> np.ndarray:
    """``[0] + q + [2, 2] + d + [2]`` (int64): FlagReranker's ids for content-token rows."""
    return np.concatenate(([CLS_ID], query, [EOS_ID, EOS_ID], document, [EOS_ID])
                          ).astype(np.int64)


def document_windows(length: int, width: int, overlap: int, long_documents: str = "max",
                     direction: str = "right", max_windows: int | None = None
                     ) -> tuple[list[int], bool]:
    """Window starts for a document of ``length`` tokens, and whether tokens are left out.

    ``max``: ``window_starts`` (at most ``max_windows``); ``truncate``: one window, the
    document's first ``width`` tokens, or its last with ``direction`` ``left``.
    """
    if long_documents not in LONG_DOCUMENTS:
        raise ValueError(f"long_documents must be one of {LONG_DOCUMENTS}")
    if long_documents == "truncate":
        start = max(0, length - width) if direction == "left" else 0
        return [start], length > width
    starts = window_starts(length, width, overlap)
    if max_windows is not None and len(starts) > max_windows:
        starts = starts[:max_windows]
    return starts, starts[-1] + width < length


def build_pairs(query: np.ndarray, documents: Sequence[np.ndarray], config: PairConfig,
                long_documents: str = "max", direction: str = "right") -> PairPlan:
    """The rows scoring ``query`` against each of ``documents`` (content ids, no specials).

    ``long_documents``: ``max`` (windows, best kept) or ``truncate`` (one window: the start,
    or the end with ``direction`` ``left``).
    """
    limit = config.query_limit
    q = np.asarray(query, dtype=np.int64)[:limit]
    width = config.max_length - len(q) - SPECIALS
    overlap = width // 4 if config.overlap is None else config.overlap
    rows: list[np.ndarray] = []
    owner: list[int] = []
    windows = np.zeros(len(documents), dtype=np.int64)
    truncated = np.zeros(len(documents), dtype=bool)
    for i, doc in enumerate(documents):
        d = np.asarray(doc, dtype=np.int64)
        starts, truncated[i] = document_windows(len(d), width, overlap, long_documents,
                                                direction, config.max_windows)
        windows[i] = len(starts)
        for start in starts:
            rows.append(pair_ids(q, d[start:start + width]))
            owner.append(i)
    return PairPlan(rows, np.asarray(owner, dtype=np.int64), windows, truncated, len(q),
                    len(query) > limit)


def content_ids(ids: np.ndarray) -> np.ndarray:
    """A tokenized text's ids without its ``<s>`` and ``</s>`` (what ``add_special_tokens=
    False`` gives, for a tokenizer whose post-processor only adds those two)."""
    start = 1 if len(ids) and ids[0] == CLS_ID else 0
    end = len(ids) - 1 if len(ids) > start and ids[-1] == EOS_ID else len(ids)
    return np.asarray(ids[start:end], dtype=np.int64)
