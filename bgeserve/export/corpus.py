"""Deterministic texts, as token ids, for the export's int8 calibration and its validation
(single texts for bge-m3, (query, document) pairs for a reranker).

They are made with the export's own tokenizer from ``bgeserve.export.texts.random_texts``
(multilingual-looking words in five scripts, numbers, emoji, punctuation): for a real model this
exercises the activations much as real text does, where uniformly random ids would not. The
lengths are spread evenly from ``MIN_TOKENS`` to ``MAX_TOKENS`` so that position-dependent
activations are covered too. The same seed gives the same rows on every machine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CALIBRATION_SEED = 5150
VALIDATION_SEED = 7151  # a different seed: validation never sees the calibration texts
MIN_TOKENS = 16
MAX_TOKENS = 512
_SENTENCES = 48  # sentences generated per round for one row (~1,000 words: past 512 tokens)


def capped(limit: int | None) -> int:
    """``MAX_TOKENS``, or less for a model with fewer positions (``limit``: tokens it holds)."""
    return MAX_TOKENS if limit is None else max(MIN_TOKENS, min(MAX_TOKENS, limit))


def text_rows(tokenizer: Path, texts: tuple[str, ...], max_tokens: int) -> list[np.ndarray]:
    """Id rows (``<s>`` … ``</s>``, int64) of ``texts``, each cut to ``max_tokens`` as the
    server cuts it."""
    from bgeserve.engine.tokenizer import Tokenizer

    tk = Tokenizer.load(tokenizer, max_seq=max_tokens)
    return [np.asarray(ids, dtype=np.int64) for ids in tk.encode(list(texts)).ids]


def token_rows(tokenizer: Path, seed: int, n: int, *, min_tokens: int = MIN_TOKENS,
               max_tokens: int = MAX_TOKENS) -> list[np.ndarray]:
    """``n`` id rows (``<s>`` … ``</s>``, int64) of lengths spread over [min_tokens, max_tokens].

    Row ``i`` joins sentences from ``random_texts`` under its own seed until it has enough
    tokens, then keeps ``<s>``, the first content tokens and ``</s>`` (as the server truncates).
    """
    from bgeserve.engine.tokenizer import Tokenizer
    from bgeserve.export.texts import random_texts

    tk = Tokenizer.load(tokenizer, max_seq=1 << 30)  # no truncation here: done per row below
    targets = np.linspace(min_tokens, max_tokens, n).round().astype(int) if n > 1 \
        else np.array([max_tokens])
    rows = []
    for i, target in enumerate(targets):
        sentences: list[str] = []
        ids = np.zeros(0, dtype=np.int64)
        for round_ in range(8):  # at most 8 rounds: a degenerate tokenizer cannot loop forever
            sentences += random_texts(seed * 1000 + i * 8 + round_, _SENTENCES, 8, 40)
            ids = tk.encode([" ".join(sentences)]).ids[0]
            if len(ids) >= target:
                break
        rows.append(np.concatenate((ids[:target - 1], ids[-1:])).astype(np.int64)
                    if len(ids) > target else ids)
    return rows


def pair_row(query: np.ndarray, document: np.ndarray, max_tokens: int) -> np.ndarray:
    """``<s> q </s></s> d </s>`` from two rows (``<s>`` … ``</s>`` each), as a cross-encoder
    sees a (query, document) pair; the document is cut so the pair has at most ``max_tokens``."""
    q, d = query[1:-1], document[1:-1]
    room = max(0, max_tokens - len(q) - 4)
    return np.concatenate(([0], q, [2, 2], d[:room], [2])).astype(np.int64)


def pair_rows(tokenizer: Path, seed: int, n: int, *, max_tokens: int = MAX_TOKENS
              ) -> list[np.ndarray]:
    """``n`` (query, document) pair rows for a reranker's int8 calibration: queries of 3–24
    content tokens, pairs of lengths spread over [MIN_TOKENS, max_tokens]."""
    queries = token_rows(tokenizer, seed, n, min_tokens=5, max_tokens=26)
    documents = token_rows(tokenizer, seed + 1, n, max_tokens=max_tokens)
    return [pair_row(q, d, max_tokens) for q, d in zip(queries, documents, strict=True)]
