"""Length-aware bin-packing of texts into ``session.run`` chunks. Pure; no model needed.

Texts are sorted by token length and packed greedily so each chunk is padded only to its own
longest text, holds at most ``max_chunk`` texts and ``max_tokens`` padded tokens, stays at least
``min_fill`` real tokens (padding is pure waste on a CPU, and quadratic in attention), and fits
the memory budget: ``fits(count, longest)`` is the cost model's check. A text that cannot fit even
alone is the caller's to refuse (admission happens before packing); ``plan`` puts such a text
in a chunk of its own rather than dropping it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Fits = Callable[[int, int], bool]


@dataclass(frozen=True)
class Chunk:
    """Indices (into the caller's list) of the texts run together, and the padded length."""

    indices: tuple[int, ...]
    pad_to: int

    @property
    def padded_tokens(self) -> int:
        return len(self.indices) * self.pad_to


def chunk_fits(count: int, longest: int, real_tokens: int, *, fits: Fits, max_chunk: int,
               max_tokens: int | None, min_fill: float) -> bool:
    """Whether ``count`` texts (``real_tokens`` in all) padded to ``longest`` may form a chunk."""
    if count > max_chunk:
        return False
    if count > 1:
        if max_tokens is not None and count * longest > max_tokens:
            return False
        if real_tokens < min_fill * count * longest:
            return False
    return fits(count, longest)


def plan(lengths: Sequence[int], *, fits: Fits, max_chunk: int,
         max_tokens: int | None = None, min_fill: float = 0.0) -> list[Chunk]:
    """Pack texts of the given token lengths; every index appears in exactly one chunk.

    Chunks come out shortest first. Ties keep input order, so equal texts stay in order.
    """
    if max_chunk < 1:
        raise ValueError("max_chunk must be at least 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks: list[Chunk] = []
    current: list[int] = []
    real = 0
    for i in order:
        longest = max(int(lengths[i]), 1)
        if current and not chunk_fits(len(current) + 1, longest, real + longest, fits=fits,
                                      max_chunk=max_chunk, max_tokens=max_tokens,
                                      min_fill=min_fill):
            chunks.append(Chunk(tuple(current), max(int(lengths[current[-1]]), 1)))
            current, real = [], 0
        current.append(i)
        real += longest
    if current:
        chunks.append(Chunk(tuple(current), max(int(lengths[current[-1]]), 1)))
    return chunks
