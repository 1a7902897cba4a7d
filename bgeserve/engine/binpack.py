"""Length-aware bin-packing of texts into ``session.run`` chunks. Pure; no model needed.

Texts are sorted by token length and packed greedily so each chunk is padded only to its own
longest text, holds at most ``max_chunk`` texts and ``max_tokens`` padded tokens, stays at least
``min_fill`` real tokens (padding is pure waste on a CPU, and quadratic in attention), and fits
the memory budget: ``fits(count, longest)`` is the cost model's check. A text that cannot fit even
alone is the caller's to refuse (admission happens before packing); ``plan`` puts such a text
in a chunk of its own rather than dropping it.

With ``pad_multiple`` > 1 each chunk's length is rounded up to a multiple of it (never past
``pad_cap``, and only where the rounded chunk still fits the budget): fewer distinct shapes, for
runtimes that pay for every shape they have not seen (a GPU's first run of a shape). The
rounding is wanted padding, so ``min_fill`` still judges a chunk by its texts' own longest.

With a ``RunCost`` (what a run of a shape takes, measured where it runs) a text joins a chunk
only where padding the chunk to it costs less than the run it saves: a runtime whose fixed cost
per run is small against a token's (OpenVINO's int8 on a CPU) then pads little, one whose runs
cost more to start batches more, each up to ``min_fill``. A run whose token count the session
has not run yet also pays the new shape (``known``; OpenVINO prepares its kernels per count),
so a session that has met few shapes batches more than one that has met its texts' counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bgeserve.tuning.runcost import RunCost

Fits = Callable[[int, int], bool]


@dataclass(frozen=True)
class Chunk:
    """Indices (into the caller's list) of the texts run together, and the padded length."""

    indices: tuple[int, ...]
    pad_to: int

    @property
    def padded_tokens(self) -> int:
        return len(self.indices) * self.pad_to


def rounded_length(longest: int, multiple: int = 1, cap: int | None = None) -> int:
    """``longest`` rounded up to a multiple of ``multiple``, but not past ``cap`` (a length
    already past ``cap`` stays as it is)."""
    if multiple <= 1:
        return longest
    up = -(-longest // multiple) * multiple
    return up if cap is None else max(longest, min(up, cap))


def chunk_length(count: int, longest: int, *, fits: Fits, multiple: int = 1,
                 cap: int | None = None) -> int:
    """What a chunk of ``count`` texts is padded to: ``longest`` rounded up, where the rounded
    chunk fits the budget; else ``longest`` (rounding never makes a chunk refusable)."""
    up = rounded_length(longest, multiple, cap)
    return up if up == longest or fits(count, up) else longest


def chunk_fits(count: int, longest: int, real_tokens: int, *, fits: Fits, max_chunk: int,
               max_tokens: int | None, min_fill: float, pad_multiple: int = 1,
               pad_cap: int | None = None) -> bool:
    """Whether ``count`` texts (``real_tokens`` in all, the longest ``longest``) may form a
    chunk, once padded (see ``chunk_length``)."""
    if count > max_chunk:
        return False
    # Padding never shortens: a chunk over max_tokens unpadded is refused before the padding
    # (and its budget checks) is worked out, the common refusal where long texts run alone.
    if count > 1 and max_tokens is not None and count * longest > max_tokens:
        return False
    padded = chunk_length(count, longest, fits=fits, multiple=pad_multiple, cap=pad_cap)
    if count > 1:
        if max_tokens is not None and count * padded > max_tokens:
            return False
        if real_tokens < min_fill * count * longest:
            return False
    return fits(count, padded)


def plan(lengths: Sequence[int], *, fits: Fits, max_chunk: int,
         max_tokens: int | None = None, min_fill: float = 0.0, pad_multiple: int = 1,
         pad_cap: int | None = None, run_cost: RunCost | None = None,
         known: Callable[[int], bool] | None = None,
         until: int | None = None) -> list[Chunk]:
    """Pack texts of the given token lengths; every index appears in exactly one chunk.
    ``known``: the token counts the session that runs them has run (``RunCost.joining_pays``
    prices a run of a new count with its ``new_shape``). ``until``: only the chunk holding
    that index, as the whole plan packs it (the queue takes one chunk of a window of up to a
    thousand texts: the chunks before it are only walked, the ones after it not at all).

    Chunks come out shortest first. Ties keep input order, so equal texts stay in order.
    """
    if max_chunk < 1:
        raise ValueError("max_chunk must be at least 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks: list[Chunk] = []
    current: list[int] = []
    real = 0
    top = 0  # the chunk's longest text so far (``order`` is sorted by length: its last)

    def padded(count: int, longest: int) -> int:
        return chunk_length(count, longest, fits=fits, multiple=pad_multiple, cap=pad_cap)

    def close() -> None:
        chunks.append(Chunk(tuple(current), padded(len(current), top)))

    def joins(count: int, before: int, longest: int, real_tokens: int) -> bool:
        """Whether the text of ``longest`` tokens joins the ``count`` texts packed so far,
        whose longest has ``before`` tokens; every length as the chunk would be padded."""
        if not chunk_fits(count + 1, longest, real_tokens, fits=fits, max_chunk=max_chunk,
                          max_tokens=max_tokens, min_fill=min_fill, pad_multiple=pad_multiple,
                          pad_cap=pad_cap):
            return False
        return run_cost is None or run_cost.joining_pays(
            count, padded(count, before), padded(count + 1, longest), padded(1, longest),
            known)

    for i in order:
        longest = max(int(lengths[i]), 1)
        if current and not joins(len(current), top, longest, real + longest):
            if until is None or until in current:
                close()
                if until is not None:
                    return chunks
            current, real = [], 0
        current.append(i)
        real += longest
        top = longest
    if current:
        close()
    return chunks
