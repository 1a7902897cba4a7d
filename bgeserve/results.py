"""What an embedding call asks for and what it returns (plain data, shared by every layer)."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from bgeserve.errors import InvalidInput


@dataclass(frozen=True)
class EmbedOptions:
    """Which outputs to compute, and what to do with texts longer than ``max_seq``."""

    dense: bool = True
    sparse: bool = False
    colbert: bool = False
    truncate: bool = True

    def __post_init__(self) -> None:
        flags = {"dense": self.dense, "sparse": self.sparse, "colbert": self.colbert,
                 "truncate": self.truncate}
        for name, value in flags.items():
            # Booleans only (numpy's too): "yes" or 1 read as True would be a typo's silent default.
            if not isinstance(value, bool | np.bool_):
                raise InvalidInput(f"{name} must be True or False, not {value!r}", param=name)
        if not (self.dense or self.sparse or self.colbert):
            raise InvalidInput("ask for at least one of dense, sparse, colbert",
                               param="outputs")


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

    def __repr__(self) -> str:
        # The dataclass's repr printed every float: 4.9 MB for 2,000 texts with ColBERT, a
        # notebook flooded by one result (QA). Shapes and counts instead.
        parts = [f"{len(self)} texts", f"{self.prompt_tokens} tokens"]
        if self.dense is not None:
            parts.append(f"dense {self.dense.dtype}{list(self.dense.shape)}")
        if self.sparse is not None:
            parts.append(f"sparse {sum(len(ids) for ids, _ in self.sparse)} weights")
        if self.colbert is not None:
            parts.append(f"colbert {sum(len(rows) for rows in self.colbert)} vectors")
        if self.truncated.any():
            parts.append(f"{int(self.truncated.sum())} truncated")
        return f"Embeddings({', '.join(parts)})"

    @property
    def prompt_tokens(self) -> int:
        """Real tokens processed (what ``usage`` reports)."""
        return int(self.n_tokens.sum())


@dataclass(frozen=True, slots=True)
class Token:
    """One token of a tokenized text, as TEI's ``/tokenize`` gives it.

    ``start``/``stop`` are UTF-8 *byte* offsets into the text (TEI's convention), ``None`` for
    special tokens; ``text`` is the text's slice for a regular token, the token string for a
    special one.
    """

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class TextTokens(Sequence[Token]):
    """The ``Token``s of one text, held as arrays and made a slice at a time when read: a
    ``Token`` object per token took ~140 bytes (QA: 12 /tokenize answers of 262,144 tokens
    each, read slowly, OOM-killed a server under a 400 MiB cap); these take 21."""

    __slots__ = ("_bytes", "_chars", "_ids", "_special", "_strings", "_text")

    def __init__(self, text: str, ids: np.ndarray, special: np.ndarray, chars: np.ndarray,
                 byte_offsets: np.ndarray, strings: Mapping[int, str]):
        """``chars``/``byte_offsets``: (n, 2) character and UTF-8 byte offsets into ``text``;
        ``strings``: the string of each special token's id."""
        self._text, self._ids, self._special = text, ids, special
        self._chars, self._bytes, self._strings = chars, byte_offsets, strings

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> Token: ...

    @overload
    def __getitem__(self, index: slice) -> list[Token]: ...

    def __getitem__(self, index: int | slice) -> Token | list[Token]:
        if isinstance(index, slice):
            span = range(len(self))[index]
            if span.step == 1:
                return self._made(span.start, span.stop)
            return [self._made(i, i + 1)[0] for i in span]
        i = range(len(self))[index]  # IndexError past the end, negatives from it
        return self._made(i, i + 1)[0]

    def dicts(self, lo: int, hi: int) -> list[dict[str, object]]:
        """Tokens ``lo`` to ``hi`` as dicts of ``Token``'s fields in its order: what orjson
        writes for the Tokens, made ~3x faster (a frozen dataclass sets each field through
        ``object.__setattr__``)."""
        text, strings = self._text, self._strings
        return [{"id": t, "text": strings[t], "special": True, "start": None, "stop": None}
                if special else
                {"id": t, "text": text[c0:c1], "special": False, "start": b0, "stop": b1}
                for t, special, (c0, c1), (b0, b1) in zip(
                    self._ids[lo:hi].tolist(), self._special[lo:hi].tolist(),
                    self._chars[lo:hi].tolist(), self._bytes[lo:hi].tolist(), strict=True)]

    def _made(self, lo: int, hi: int) -> list[Token]:
        return [Token(**fields) for fields in self.dicts(lo, hi)]  # type: ignore[arg-type]


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the served model and its limits (what TEI's ``GET /info`` reports)."""

    model_id: str
    model_sha: str | None
    dtype: str  # float32 | float16 | int8 | bfloat16
    max_input_length: int  # tokens per text, special tokens included
    max_batch_tokens: int  # padded tokens per session.run (a longer text runs alone)
    max_batch_requests: int | None  # texts per session.run
    max_client_batch_size: int  # inputs per request
    max_concurrent_requests: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
# --------------------------------------------------------------------------------- rerank
LONG_DOCUMENTS = ("max", "truncate")
M3_SCORER = "bge-m3"


@dataclass(frozen=True)
class RerankOptions:
    """How a rerank request is scored.

    ``model``: the scorer's id (None: the reranker when one is loaded, else bge-m3). The
    cross-encoder reads ``normalize`` (sigmoid of the logit), ``long_documents`` (``max``:
    overlapping windows, best kept; ``truncate``: the first window only, or the last with
    ``truncation_direction`` ``left``) and ``max_tokens_per_doc`` (documents cut to that many
    tokens first); bge-m3 reads ``mode`` and ``weights`` (``[dense, sparse, colbert]``) and
    the same long-document policy over windows of its own length.
    """

    model: str | None = None
    normalize: bool = False
    long_documents: str = "max"
    truncation_direction: str = "right"
    max_tokens_per_doc: int | None = None
    mode: str = "hybrid"
    weights: tuple[float, float, float] = (0.4, 0.2, 0.4)
    # The fields a request set (not defaulted): a scorer refuses those it does not read.
    given: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # A bool only (numpy's too), as EmbedOptions' flags: "false" read as True scored
        # sigmoids where logits were asked for (QA).
        if not isinstance(self.normalize, bool | np.bool_):
            raise InvalidInput(f"normalize must be True or False, not {self.normalize!r}",
                               param="normalize")
        if self.long_documents not in LONG_DOCUMENTS:
            raise InvalidInput(f"long_documents must be one of {LONG_DOCUMENTS}",
                               param="long_documents")
        if self.truncation_direction not in ("left", "right"):
            raise InvalidInput("truncation_direction must be left or right",
                               param="truncation_direction")
        limit = self.max_tokens_per_doc
        # 0 or less cut every document to nothing (or a negative slice): every score the same.
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise InvalidInput(f"max_tokens_per_doc must be an integer >= 1 or None, not "
                               f"{limit!r}", param="max_tokens_per_doc")

    def leading_tokens(self, width: int) -> int | None:
        """How many leading content tokens of a document its rows read when that is not all of
        it: ``max_tokens_per_doc`` (the document is cut there first), and a window's
        ``width`` when only its first window is kept (``truncate`` from the right); None when
        rows may read its end (windows, or ``truncate`` from the left, with no
        ``max_tokens_per_doc``). A document read to its leading tokens only may be tokenized
        from its leading words."""
        first = (width if self.long_documents == "truncate"
                 and self.truncation_direction == "right" else None)
        needs = [n for n in (self.max_tokens_per_doc, first) if n is not None]
        return min(needs) if needs else None

    @property
    def reads_document_ends(self) -> bool:
        """Whether rows may read a document's last tokens (``leading_tokens`` is None, at any
        width), so it is tokenized whole."""
        return self.leading_tokens(1) is None


@dataclass
class RerankResult:
    """One query's scores against its documents, in input order.

    ``scores``: float64 per document (the cross-encoder's logit, or its sigmoid; bge-m3's
    score of the mode). ``truncated``: part of the document was not scored (cut, or past the
    windows' cap). ``windows``: model inputs scored per document. ``tokens``: tokens fed to
    the model(s) (``usage``). ``model``: the scorer's id.
    """

    scores: np.ndarray
    truncated: np.ndarray
    windows: np.ndarray
    tokens: int
    model: str
    query_truncated: bool = False

    def __len__(self) -> int:
        return len(self.scores)

    def ranking(self, top_n: int | None = None) -> list[int]:
        """Document indices by descending score (ties: lower index first), cut to ``top_n``
        (None or 0: every document, as rerank clients send it)."""
        if top_n is not None:
            try:  # any integer, numpy's too; not a bool, a float or a negative count
                if isinstance(top_n, bool) or operator.index(top_n) < 0:
                    raise TypeError
            except TypeError:
                raise ValueError(f"top_n must be an integer >= 0 or None, not {top_n!r}") \
                    from None
        order = sorted(range(len(self.scores)), key=lambda i: (-float(self.scores[i]), i))
        return order if not top_n else order[:top_n]
