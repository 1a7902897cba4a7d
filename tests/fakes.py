"""Test doubles shared by the HTTP tests: ``FakeService`` has exactly the ``Service`` surface.

Vectors are deterministic functions of the input (seeded by a hash of the text or token ids),
so a test can compute what the server must return with ``FakeService.expected_dense``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bgeserve.config import Settings
from bgeserve.errors import BgeServeError, InvalidInput, TooLarge
from bgeserve.results import Embeddings, EmbedOptions, ModelInfo, RerankOptions, RerankResult, Token

HIDDEN = 1024
VOCAB = 250_002


def _seed(item: str | list[int]) -> int:
    raw = item.encode("utf-8", "surrogatepass") if isinstance(item, str) else repr(item).encode()
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little")


def fake_tokens(item: str | list[int]) -> list[int]:
    """Token ids the fake "tokenizer" gives: one per whitespace word, special tokens excluded."""
    if isinstance(item, list):
        return list(item)
    return [5 + _seed(word) % (VOCAB - 5) for word in item.split()]


@dataclass
class Call:
    """One recorded ``embed`` call."""

    inputs: list[Any]
    options: EmbedOptions
    request_id: str


@dataclass
class FakeService:
    """Deterministic stand-in for ``bgeserve.service.Service``.

    Set ``fail_with`` to make ``embed`` raise; ``delay`` to make it slow; ``status`` to choose
    the health state. ``calls`` records every ``embed`` call.
    """

    settings: Settings = field(default_factory=Settings)
    model_name: str = "bge-m3"
    fail_with: BaseException | None = None
    delay: float = 0.0
    status: str = "ok"
    calls: list[Call] = field(default_factory=list)
    started: bool = False
    stopped: bool = False
    rerank_ids: tuple[str, ...] = ()  # a reranker's ids when one is "loaded"
    rerank_calls: list[tuple[str, list[str], RerankOptions]] = field(default_factory=list)

    async def start(self) -> None:
        """Mark started."""
        self.started = True

    async def stop(self) -> None:
        """Mark stopped."""
        self.stopped = True

    async def until_ready(self, seconds: float | None = None) -> None:
        """Ready from the start: nothing to wait for."""

    @staticmethod
    def expected_dense(item: str | list[int]) -> np.ndarray:
        """The unit float32 vector the fake returns for ``item``."""
        v = np.random.default_rng(_seed(item)).standard_normal(HIDDEN).astype(np.float32)
        return v / np.linalg.norm(v)

    @staticmethod
    def expected_sparse(item: str | list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Ascending unique ids and positive float32 weights (max per id)."""
        ids = fake_tokens(item)
        weights: dict[int, np.float32] = {}
        for pos, token in enumerate(ids):
            w = np.float32((_seed([token, pos]) % 1000 + 1) / 1000)
            weights[token] = max(weights.get(token, np.float32(0)), w)
        keys = sorted(weights)
        return np.array(keys, dtype=np.int64), np.array([weights[k] for k in keys], np.float32)

    @staticmethod
    def expected_colbert(item: str | list[int], n_tokens: int) -> np.ndarray:
        """(n_tokens - 1, 1024) unit rows."""
        rng = np.random.default_rng(_seed(item) ^ 0xC0DE)
        m = rng.standard_normal((n_tokens - 1, HIDDEN)).astype(np.float32)
        return m / np.linalg.norm(m, axis=1, keepdims=True)

    async def embed(
        self, inputs: list[str] | list[list[int]], options: EmbedOptions, *, request_id: str,
        left: bool = False,
    ) -> Embeddings:
        """Fake vectors; honours ``max_seq_length``, ``truncate`` and ``left`` like the real
        service."""
        if left:
            inputs = await self.truncate_left(inputs)  # type: ignore[arg-type]
        self.calls.append(Call(list(inputs), options, request_id))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_with is not None:
            raise self.fail_with
        max_seq = self.settings.max_seq_length
        n_tokens, truncated = [], []
        for i, item in enumerate(inputs):
            if isinstance(item, list) and any(t >= VOCAB for t in item):
                raise InvalidInput("token id out of range", param=f"input[{i}]")
            n = len(fake_tokens(item)) + (0 if isinstance(item, list) else 2)
            if n > max_seq and not options.truncate:
                raise TooLarge(f"input[{i}] has {n} tokens > {max_seq}", param=f"input[{i}]")
            truncated.append(n > max_seq)
            n_tokens.append(min(n, max_seq))
        return Embeddings(
            dense=np.stack([self.expected_dense(x) for x in inputs]) if options.dense else None,
            sparse=[self.expected_sparse(x) for x in inputs] if options.sparse else None,
            colbert=[self.expected_colbert(x, n) for x, n in zip(inputs, n_tokens)]
            if options.colbert
            else None,
            n_tokens=np.array(n_tokens, dtype=np.int64),
            truncated=np.array(truncated, dtype=bool),
        )

    async def rerank(self, query: str, documents: list[str], options: RerankOptions, *,
                     request_id: str) -> RerankResult:
        """Scores: the dot product of the fake dense vectors (the query's and each document's);
        a document with a word "long" counts as cut when ``long_documents`` is truncate, else
        as 3 windows. The model echoed is the reranker's when asked for or by default."""
        self.rerank_calls.append((query, list(documents), options))
        if self.fail_with is not None:
            raise self.fail_with
        q = self.expected_dense(query)
        scores = np.array([float(q @ self.expected_dense(d)) for d in documents])
        long = np.array(["long" in d.split() for d in documents], dtype=bool)
        cut = options.long_documents == "truncate"
        reranker = bool(self.rerank_ids) and options.model in (None, *self.rerank_ids)
        return RerankResult(scores, long & cut, np.where(long & ~cut, 3, 1),
                            sum(len(fake_tokens(d)) + 4 for d in documents),
                            self.rerank_ids[0] if reranker else "bge-m3")

    def rerank_model_ids(self) -> tuple[str, ...]:
        """The reranker's ids (none unless ``rerank_ids`` is set)."""
        return self.rerank_ids

    def dense_width(self) -> int:
        """bge-m3's width."""
        return HIDDEN

    def vocab_size(self) -> int:
        """bge-m3's vocabulary size."""
        return VOCAB

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """``"w<id mod 1000>"``: distinct ids can collide, as sub-word strings do."""
        return [f"w{int(i) % 1000}" for i in ids]

    async def tokenize(self, texts: Sequence[str],
                       add_special_tokens: bool = True) -> list[list[Token]]:
        """One token per whitespace word (``fake_tokens``' ids), UTF-8 byte offsets."""
        out = []
        for text in texts:
            tokens, pos = [], 0
            for word in text.split():
                at = text.index(word, pos)
                start = len(text[:at].encode())
                stop = start + len(word.encode())
                tokens.append(Token(fake_tokens(word)[0], word, False, start, stop))
                pos = at + len(word)
            if add_special_tokens:
                tokens = [Token(0, "<s>", True, None, None), *tokens,
                          Token(2, "</s>", True, None, None)]
            out.append(tokens)
        return out

    async def decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = True) -> list[str]:
        """``"w<id>"`` per id, joined by spaces; ids 0-3 dropped when skipping specials."""
        return [" ".join(f"w{t}" for t in seq if not (skip_special_tokens and t < 4))
                for seq in sequences]

    async def truncate_left(self, texts: Sequence[str]) -> list[list[int]]:
        """``<s>``, the last words' ids and ``</s>``, at most ``max_seq_length`` of them."""
        keep = self.settings.max_seq_length - 2
        return [[0, *fake_tokens(t)[-keep:], 2] if keep else [0, 2] for t in texts]

    def info(self) -> ModelInfo:
        """Fixed facts, the limits from the settings."""
        s = self.settings
        return ModelInfo(model_id="BAAI/bge-m3", model_sha=None, dtype="float32",
                         max_input_length=s.max_seq_length, max_batch_tokens=16384,
                         max_batch_requests=64, max_client_batch_size=s.max_batch,
                         max_concurrent_requests=500_000, auto_truncate=s.truncate,
                         tokenization_workers=2, version="0.1.0")

    def reranker_info(self) -> ModelInfo:
        """bge-m3's facts, the reranker's id and pair length when one is "loaded"."""
        info = self.info()
        if not self.rerank_ids:
            return info
        return replace(info, model_id="BAAI/bge-reranker-v2-m3",
                       max_input_length=512)

    def health(self) -> dict[str, Any]:
        """A health report in the real shape, with the configured ``status``."""
        return {
            "status": self.status,
            "workers": {"live": 1, "loaded": 1, "total": 1},
            "max_seq_length": self.settings.max_seq_length,
            "model": {"name": self.model_name, "variant": "fake"},
            "tuning": {"probe_status": "disabled"},
        }

    def refuse_now(self) -> None:
        """Never full."""
        return

    async def deep_health(self, deadline_s: float | None = None) -> tuple[int, dict[str, Any]]:
        """The deep check in the real shape: 200 ok, or 503 unless ``status`` is healthy."""
        if self.status in ("ok", "warn", "idle"):
            return 200, {"status": "ok", "ms": 0.5, "compared": "bitwise",
                         "deadline_ms": round(1000 * (deadline_s or 5))}
        return 503, {"status": "fail", "reason": f"the service is {self.status}"}

    def metrics(self) -> tuple[bytes, str]:
        """A minimal Prometheus exposition."""
        return (
            b"# TYPE bgeserve_fake_calls counter\nbgeserve_fake_calls_total "
            + str(len(self.calls)).encode()
            + b"\n",
            "text/plain; version=0.0.4; charset=utf-8",
        )


def failing(error: BgeServeError | BaseException, settings: Settings | None = None) -> FakeService:
    """A FakeService whose ``embed`` raises ``error``."""
    return FakeService(settings=settings or Settings(), fail_with=error)


class FitsCost:
    """A cost model stand-in for the scheduler: ``fits(batch, seq)`` as the given function."""

    def __init__(self, fits: Callable[[int, int], bool]):
        self.fits = fits
