"""What an embedding call asks for and what it returns (plain data, shared by every layer)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EmbedOptions:
    """Which outputs to compute, and what to do with texts longer than ``max_seq``."""

    dense: bool = True
    sparse: bool = False
    colbert: bool = False
    truncate: bool = True

    def __post_init__(self) -> None:
        if not (self.dense or self.sparse or self.colbert):
            raise ValueError("ask for at least one of dense, sparse, colbert")


@dataclass
class Embeddings:
    """Results for ``n`` inputs, in input order.

    ``dense``: float32 (n, hidden), L2-normalised CLS vectors.
    ``sparse``: per input, ``(indices, values)``: int64 token ids ascending and unique, float32
    weights > 0 (FlagEmbedding's lexical weights: special tokens dropped, max per id).
    ``colbert``: per input, float32 (n_tokens - 1, hidden), each row L2-normalised.
    ``n_tokens``: tokens per input after truncation, special tokens included.
    ``truncated``: whether the input was cut to ``max_seq`` tokens.
    """

    dense: np.ndarray | None
    sparse: list[tuple[np.ndarray, np.ndarray]] | None
    colbert: list[np.ndarray] | None
    n_tokens: np.ndarray
    truncated: np.ndarray

    def __len__(self) -> int:
        return len(self.n_tokens)

    @property
    def prompt_tokens(self) -> int:
        """Real tokens processed (what ``usage`` reports)."""
        return int(self.n_tokens.sum())
