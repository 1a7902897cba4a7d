"""Tokenizer use-cases beside embedding: ``/tokenize``, ``/decode`` and left truncation.

Plain functions over a started ``Engine`` (the ``Service`` methods of the same names call
them). Tokenizing is CPU work, so each runs on a thread through ``run``: the ``Service`` passes
its admission's tokenizing slots, so these requests wait their turn with the embedding ones
instead of all running at once (12 concurrent /decode floods held 2.2 GiB and stalled /health
for seconds), and the event loop keeps serving.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from bgeserve.engine import Engine
from bgeserve.engine.tokenizer import Encoded
from bgeserve.results import TextTokens

# One /tokenize answer holds at most this many tokens (~6 MB as TextTokens and ~17 MB of
# JSON, streamed past render.STREAM_BYTES); a request past it is 413. TEI bounds the same
# answer by its client batch size (32) times max_input_length.
MAX_TOKENIZE_TOKENS = 1 << 18


Run = Callable[[Callable[[], Any]], Awaitable[Any]]


async def tokenize(engine: Engine, texts: Sequence[str], add_special_tokens: bool,
                   run: Run) -> list[TextTokens]:
    """Every token of each text with UTF-8 byte offsets, untruncated (TEI's ``/tokenize``)."""
    return await run(functools.partial(engine.tokenizer.tokens, list(texts),
                                       add_special_tokens, MAX_TOKENIZE_TOKENS))


async def decode(engine: Engine, sequences: Sequence[Sequence[int]],
                 skip_special_tokens: bool, run: Run) -> list[str]:
    """The text of each id sequence (TEI's ``/decode``)."""
    return await run(functools.partial(engine.tokenizer.decode, sequences,
                                       skip_special_tokens))


async def truncate_left(engine: Engine, texts: Sequence[str], run: Run) -> Encoded:
    """Token ids of each text, an over-long one cut from the left (and which were): embedding
    these ids is embedding the text with TEI's ``truncation_direction: left``."""
    return await run(functools.partial(engine.tokenizer.encode_left, list(texts)))
