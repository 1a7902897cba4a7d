"""bge-m3's own relevance scores from its outputs, as ``BGEM3FlagModel.compute_score`` computes
them (FlagEmbedding 1.4.2, ``finetune/embedder/encoder_only/m3/modeling.py`` and
``inference/embedder/encoder_only/m3.py``), from one encoding of the query per request.

- ``dense``: the dot product of the two L2-normalised CLS vectors (a cosine).
- ``sparse``: the dot product of the lexical weights over the vocabulary:
  ``Σ_{id in both} w_q(id) · w_d(id)`` (each id's weight is already its maximum over the text).
- ``colbert``: for each query vector (CLS excluded, ``</s>`` kept) the best dot product with a
  document vector, averaged over the query's vectors.
- ``sparse+dense`` = ``(w_s·sparse + w_d·dense) / (w_s + w_d)``;
  ``colbert+sparse+dense`` (alias ``hybrid``) =
  ``(w_c·colbert + w_s·sparse + w_d·dense) / (w_d + w_s + w_c)``, weights ``[w_d, w_s, w_c]``.

One difference, on purpose: FlagEmbedding pads the documents of a batch to its longest and
takes the ColBERT maximum over the padding too, whose vectors are zeros; when every real
document token of some query token has a negative dot product, a padded document then scores 0
for it instead of that negative maximum, so its score depends on its batch-mates. Here the
maximum runs over the document's real tokens only: the score ``compute_score`` gives with
``batch_size=1`` (and ``encode`` + ``colbert_score`` gives), which the tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bgeserve.results import Embeddings

SINGLE_MODES = ("dense", "sparse", "colbert")
MODES = (*SINGLE_MODES, "sparse+dense", "colbert+sparse+dense")
ALIASES = {"hybrid": "colbert+sparse+dense"}
DEFAULT_MODE = "hybrid"
# The model card's example weights, [dense, sparse, colbert].
DEFAULT_WEIGHTS = (0.4, 0.2, 0.4)
# The outputs each mode reads, as (dense, sparse, colbert).
_NEEDS = {"dense": (True, False, False), "sparse": (False, True, False),
          "colbert": (False, False, True), "sparse+dense": (True, True, False),
          "colbert+sparse+dense": (True, True, True)}


def canonical_mode(mode: str) -> str:
    """``mode`` as one of ``MODES`` (``hybrid`` is ``colbert+sparse+dense``).

    Raises:
        ValueError: an unknown mode (the message lists the accepted ones).
    """
    mode = ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: expected one of "
                         f"{', '.join((*MODES, *ALIASES))}")
    return mode


def check_weights(weights: Sequence[float], mode: str) -> tuple[float, float, float]:
    """``[w_dense, w_sparse, w_colbert]`` as floats, checked for ``mode``.

    Raises:
        ValueError: not three finite numbers >= 0, or the weights ``mode`` divides by sum to 0 (the message names them).
    """
    values = tuple(float(w) for w in weights)
    if len(values) != 3 or not all(np.isfinite(values)) or min(values) < 0:
        raise ValueError("weights must be three numbers >= 0: [dense, sparse, colbert]")
    mode = canonical_mode(mode)
    used = {"sparse+dense": (values[0] + values[1], "dense and sparse weights"),
            "colbert+sparse+dense": (sum(values), "weights")}
    total, which = used.get(mode, (1.0, ""))
    if total <= 0:
        raise ValueError(f"mode {mode!r} divides by the sum of its {which}, which is 0")
    top = max(values)
    # Only their ratios count: scaled to a top of 1, huge weights cannot overflow the sum and
    # tiny ones cannot underflow the products (weights [5e-324, 0, 0] scored every document
    # 1.0). Weights in between are used as given, as FlagEmbedding uses them.
    if top > 1 or top < 1e-100:
        values = tuple(v / top for v in values)
    return values[0], values[1], values[2]


def needs(mode: str) -> tuple[bool, bool, bool]:
    """Which of (dense, sparse, colbert) ``mode`` needs computed."""
    return _NEEDS[canonical_mode(mode)]


def dense_scores(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """``q · d`` for each document row (float64)."""
    return np.asarray(documents, dtype=np.float64) @ np.asarray(query, dtype=np.float64)


def sparse_scores(query: tuple[np.ndarray, np.ndarray],
                  documents: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The lexical matching score of the query's (ids, weights) with each document's."""
    q_ids, q_weights = query
    out = np.zeros(len(documents))
    for i, (d_ids, d_weights) in enumerate(documents):
        _, qi, di = np.intersect1d(q_ids, d_ids, assume_unique=True, return_indices=True)
        out[i] = float(np.dot(np.asarray(q_weights, np.float64)[qi],
                              np.asarray(d_weights, np.float64)[di]))
    return out


def colbert_scores(query: np.ndarray, documents: Sequence[np.ndarray]) -> np.ndarray:
    """Mean over the query's vectors of the best dot product with each document's vectors."""
    q = np.asarray(query, dtype=np.float32)
    out = np.zeros(len(documents))
    if not len(q):
        return out
    for i, doc in enumerate(documents):
        d = np.asarray(doc, dtype=np.float32)
        if len(d):
            out[i] = float((q @ d.T).max(axis=1).astype(np.float64).mean())
    return out


@dataclass(frozen=True)
class M3Scores:
    """Per-document dense, sparse and ColBERT scores (float64; None where not computed)."""

    dense: np.ndarray | None
    sparse: np.ndarray | None
    colbert: np.ndarray | None

    def combined(self, mode: str = DEFAULT_MODE,
                 weights: Sequence[float] = DEFAULT_WEIGHTS) -> np.ndarray:
        """The scores of ``mode`` (weights ``[dense, sparse, colbert]``, as FlagEmbedding)."""
        mode = canonical_mode(mode)
        w_dense, w_sparse, w_colbert = check_weights(weights, mode)
        parts = {"dense": self.dense, "sparse": self.sparse, "colbert": self.colbert}
        zero = np.zeros(0)
        for name, want in zip(SINGLE_MODES, _NEEDS[mode], strict=True):
            if want and parts[name] is None:
                raise ValueError(f"mode {mode!r} needs the {name} scores, not computed")
        dense, sparse, colbert = (zero if x is None else x for x in parts.values())
        if mode in SINGLE_MODES:
            return {"dense": dense, "sparse": sparse, "colbert": colbert}[mode]
        if mode == "sparse+dense":
            return np.asarray((w_sparse * sparse + w_dense * dense) / (w_sparse + w_dense))
        return np.asarray((w_colbert * colbert + w_sparse * sparse + w_dense * dense)
                          / (w_dense + w_sparse + w_colbert))


def m3_scores(query: Embeddings, documents: Embeddings) -> M3Scores:
    """Score the one text of ``query`` against every text of ``documents``, with whichever of
    dense / sparse / ColBERT both were embedded with."""
    if len(query) != 1:
        raise ValueError(f"query must hold one text, got {len(query)}")
    dense = sparse = colbert = None
    if query.dense is not None and documents.dense is not None:
        dense = dense_scores(query.dense[0], documents.dense)
    if query.sparse is not None and documents.sparse is not None:
        sparse = sparse_scores(query.sparse[0], documents.sparse)
    if query.colbert is not None and documents.colbert is not None:
        colbert = colbert_scores(query.colbert[0], documents.colbert)
    return M3Scores(dense, sparse, colbert)
