"""bge-m3's three outputs, in numpy, exactly as FlagEmbedding computes them.

- dense: the CLS hidden state, L2-normalised;
- sparse: ``relu(h·w + b)`` per position; special tokens and weights ≤ 0 dropped; the maximum
  weight kept for a token id that repeats; ids ascending and unique (vector-DB ready);
- colbert: ``colbert_linear(h[:, 1:]) * mask[:, 1:]``, each row L2-normalised, the first
  ``n_tokens - 1`` rows kept (CLS excluded, ``</s>`` kept, padding dropped).

Graphs exported by bgeserve compute the per-position parts in the graph; the hub graphs give
only hidden states, so ``HiddenHeads`` computes them here from the ``.pt`` head weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bgeserve.vocab import SPECIAL_IDS

_EPS = 1e-12  # torch.nn.functional.normalize's default


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` scaled to unit length (a zero row stays zero), in float32."""
    x = np.asarray(x, dtype=np.float32)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norm, _EPS)


@dataclass
class ChunkOutputs:
    """Per-position outputs of one padded chunk (B texts padded to L tokens)."""

    dense: np.ndarray | None  # (B, H), normalised; a reranker: (B, 1), its logits
    sparse_weights: np.ndarray | None  # (B, L), relu already applied
    colbert: np.ndarray | None  # (B, L - 1, H), normalised, padding rows zero


@dataclass(frozen=True)
class HiddenHeads:
    """Sparse and ColBERT heads applied to hidden states in numpy (hub graph layouts)."""

    sparse_weight: np.ndarray  # (H,)
    sparse_bias: float
    colbert_weight: np.ndarray  # (H_out, H_in), as nn.Linear stores it
    colbert_bias: np.ndarray  # (H_out,)

    def sparse(self, hidden: np.ndarray) -> np.ndarray:
        """``relu(h·w + b)`` for every position: (B, L, H) → (B, L)."""
        return np.maximum(hidden @ self.sparse_weight + np.float32(self.sparse_bias), 0.0)

    def colbert(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """ColBERT vectors for positions 1..L-1: (B, L, H) → (B, L - 1, H), normalised."""
        vecs = hidden[:, 1:] @ self.colbert_weight.T + self.colbert_bias
        vecs *= mask[:, 1:, None].astype(np.float32)
        return l2_normalize(vecs)


def sparse_vector(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FlagEmbedding's lexical weights for one text as (unique ascending ids, max weights).

    ``ids`` and ``weights`` cover the text's real tokens (no padding).
    """
    keep = (weights > 0) & ~np.isin(ids, SPECIAL_IDS)
    kept_ids = ids[keep]
    kept_w = weights[keep].astype(np.float32)
    if kept_ids.size == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)
    order = np.argsort(kept_ids, kind="stable")
    kept_ids, kept_w = kept_ids[order], kept_w[order]
    uniq, starts = np.unique(kept_ids, return_index=True)
    return uniq.astype(np.int64), np.maximum.reduceat(kept_w, starts)


def colbert_rows(vectors: np.ndarray, n_tokens: int) -> np.ndarray:
    """The ``n_tokens - 1`` ColBERT rows of one text (drops the padding rows), a copy: a view
    kept the chunk's whole output alive (its padding, its other texts' rows) for as long as
    any one text's answer was, past what the ColBERT allowance counts."""
    return np.array(vectors[: max(n_tokens - 1, 0)], dtype=np.float32, order="C", copy=True)
