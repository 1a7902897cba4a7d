"""Adapter over Hugging Face ``tokenizers``: the only module that imports it.

Texts are encoded once, without padding (each chunk pads to its own longest text later).
Truncation is done here, by hand, so every text carries an exact ``truncated`` flag: an
over-long text keeps ``<s>``, its first ``max_seq - 2`` content tokens and ``</s>``, which is
what FlagEmbedding's ``tokenizer(..., truncation=True, max_length=max_seq)`` produces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

from .errors import InvalidInput, ModelUnavailable

CLS_ID, PAD_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_IDS = (CLS_ID, PAD_ID, EOS_ID, UNK_ID)
_WORD_CHAR = re.compile(r"[^\W_]")  # a letter or digit: no normalizer maps it to nothing
_WORD_SPLITTERS = {"WhitespaceSplit", "Whitespace", "BertPreTokenizer"}


def _splits_on_spaces(pre_tokenizer: dict | None) -> bool:
    """Whether a pre-tokenizer (tokenizer.json's) cuts text at spaces, so no token spans two
    space-separated words (XLM-R's: Metaspace with split, or WhitespaceSplit)."""
    if not pre_tokenizer:
        return False
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return any(_splits_on_spaces(p) for p in pre_tokenizer.get("pretokenizers", []))
    return kind in _WORD_SPLITTERS or (kind == "Metaspace" and pre_tokenizer.get("split", True))


@dataclass
class Encoded:
    """Token ids per text (int64, special tokens included) and whether each was truncated."""

    ids: list[np.ndarray]
    truncated: np.ndarray
    full_lengths: np.ndarray  # tokens before truncation

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(x) for x in self.ids), dtype=np.int64, count=len(self.ids))


class Tokenizer:
    """bge-m3's XLM-R tokenizer with truncation at ``max_seq`` tokens."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, max_seq: int):
        if max_seq < 2:
            raise ValueError("max_seq must leave room for <s> and </s>")
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tk = tokenizer
        self.max_seq = max_seq
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        try:
            pre = json.loads(tokenizer.to_str()).get("pre_tokenizer")
        except (ValueError, AttributeError):
            pre = None
        self._word_bound = _splits_on_spaces(pre)

    @classmethod
    def load(cls, path: Path, max_seq: int) -> Tokenizer:
        """Read ``tokenizer.json``; a missing or invalid file is ``ModelUnavailable``."""
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)), max_seq)
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ModelUnavailable(f"cannot load tokenizer {path}: {exc}") from exc

    def encode(self, texts: Sequence[str]) -> Encoded:
        """Tokenize ``texts`` (in parallel, in Rust) and truncate each to ``max_seq``."""
        try:
            encodings = self._tk.encode_batch(list(texts), add_special_tokens=True)
        except Exception as exc:
            raise InvalidInput(f"cannot tokenize input: {exc}", param="input") from exc
        return self._truncate([np.asarray(e.ids, dtype=np.int64) for e in encodings])

    def min_tokens(self, texts: Sequence[str]) -> int:
        """A lower bound on the tokens ``encode(texts)`` gives, far cheaper than encoding (for
        refusing work before tokenizing it when the queue is full).

        Each text has ``<s>`` and ``</s>``; where the pre-tokenizer cuts at spaces, each
        space-separated word holding a letter or digit is at least one more token. Capped at
        ``max_seq`` per text, as truncation does.
        """
        if not self._word_bound:
            return 2 * len(texts)
        return sum(min(self.max_seq, 2 + sum(1 for w in t.split(" ") if _WORD_CHAR.search(w)))
                   for t in texts)

    def from_ids(self, sequences: Sequence[Sequence[int]]) -> Encoded:
        """Accept pre-tokenized input in bge-m3's vocabulary.

        ``<s>`` is added unless the sequence starts with it and ``</s>`` unless it ends with
        it, so the ids a client got from ``tokenizer(text)`` with or without special tokens
        embed exactly like ``text``.
        """
        out = []
        for i, seq in enumerate(sequences):
            try:  # not dtype=int64: that would silently turn 1.5 into 1 and True into 1
                ids = np.asarray(seq)
            except ValueError:  # ragged nesting
                ids = np.empty(0)
            if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
                raise InvalidInput(f"input[{i}] must be a non-empty list of integer token ids",
                                   param=f"input[{i}]")
            bad = (ids < 0) | (ids >= self.vocab_size)
            if bad.any():
                raise InvalidInput(
                    f"input[{i}] has token id {int(ids[bad][0])} outside the vocabulary "
                    f"[0, {self.vocab_size})", param=f"input[{i}]")
            ids = ids.astype(np.int64)
            head = [] if ids[0] == CLS_ID else [CLS_ID]
            tail = [] if ids.size >= 1 + (not head) and ids[-1] == EOS_ID else [EOS_ID]
            if head or tail:
                ids = np.concatenate((head, ids, tail)).astype(np.int64)
            out.append(ids)
        return self._truncate(out)

    def _truncate(self, ids: list[np.ndarray]) -> Encoded:
        truncated = np.zeros(len(ids), dtype=bool)
        full = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        limit = self.max_seq
        for i, x in enumerate(ids):
            if len(x) > limit:
                ids[i] = np.concatenate((x[: limit - 1], [x[-1]]))
                truncated[i] = True
        return Encoded(ids, truncated, full)

    def id_to_token(self, ids: Sequence[int]) -> list[str]:
        """Token strings for ids (``<unk>`` for an id the vocabulary lacks)."""
        return [self._tk.id_to_token(int(i)) or "<unk>" for i in ids]
