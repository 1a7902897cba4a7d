"""What a chunk may hold, now: the packing caps and the cost model, in one object.

The scheduler packs every chunk through its ``Packer``; the tuner changes what the packer holds
(a fitted cost model, a timed chunk budget, the measured cost of a run) through the engine, and
the next chunk sees it. Each value lives here alone: nothing else keeps a copy to re-sync.
Reads and swaps are single attribute assignments of frozen values, so a chunk being packed sees
either the old or the new rules, never a mix; the setters' read-modify-write is safe because
one thread (the tuner's) calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from bgeserve.engine.binpack import Chunk, chunk_length, plan
from bgeserve.engine.shapes import RunShapes
from bgeserve.tuning.runcost import RunCost


class Cost(Protocol):
    """A memory cost model: whether ``batch`` texts padded to ``seq`` tokens fit the budget."""

    def fits(self, batch: int, seq: int) -> bool: ...


@dataclass(frozen=True)
class Rules:
    """The caps a chunk obeys besides memory (``binpack.plan``'s arguments)."""

    max_chunk: int = 64
    max_tokens: int | None = 1024
    min_fill: float = 0.75
    pad_multiple: int = 1
    pad_cap: int | None = None
    run_cost: RunCost | None = None  # measured: pad only where it costs less than a run


class Packer:
    """Packs pending texts into chunks under the current rules and cost model."""

    def __init__(self, rules: Rules, cost: Cost | None = None):
        self.rules = rules
        self.cost = cost  # None: no memory limit (tests, or a caller that budgets elsewhere)

    def set_cost(self, cost: Cost | None) -> None:
        """Pack under ``cost`` from the next chunk on."""
        self.cost = cost

    def set_chunk_tokens(self, tokens: int | None) -> None:
        """Padded tokens per run from the next chunk on (chunks already taken keep theirs)."""
        self.rules = replace(self.rules, max_tokens=tokens)

    def set_run_cost(self, cost: RunCost | None) -> None:
        """Pad by what a run costs from the next chunk on (None: by ``min_fill`` alone)."""
        self.rules = replace(self.rules, run_cost=cost)

    def fits(self, batch: int, seq: int) -> bool:
        cost = self.cost
        return True if cost is None else cost.fits(batch, seq)

    def plan(self, lengths: Sequence[int], known: Callable[[int], bool] | None = None,
             until: int | None = None) -> list[Chunk]:
        """Chunks of the texts of these lengths, each with the length it is padded to;
        ``known``: the token counts the session that runs them has run (``RunShapes.known``);
        ``until``: up to the chunk holding that index (``binpack.plan``)."""
        r = self.rules
        return plan(lengths, fits=self.fits, max_chunk=r.max_chunk, max_tokens=r.max_tokens,
                    min_fill=r.min_fill, pad_multiple=r.pad_multiple, pad_cap=r.pad_cap,
                    run_cost=r.run_cost, known=known, until=until)

    def pad_length(self, count: int, longest: int) -> int:
        """What ``count`` texts whose longest has ``longest`` tokens are padded to (the halves
        of a chunk split after running out of memory are padded afresh)."""
        r = self.rules
        return chunk_length(count, longest, fits=self.fits, multiple=r.pad_multiple,
                            cap=r.pad_cap)

    def run_length(self, shapes: RunShapes, count: int, pad_to: int, *,
                   lengthen: bool = True) -> int:
        """The length a chunk of ``count`` texts padded to ``pad_to`` runs at in a session that
        has run ``shapes``: longer where that session has run the longer shape's token count
        and padding costs less than a new shape (``RunShapes.length``); ``pad_to`` where not
        ``lengthen``."""
        r = self.rules
        # A server that runs every text alone promises unpadded runs: the embedding cache keeps
        # a variant whose results depend on padding only then (engine/cache.applies).
        cost = r.run_cost if lengthen and r.max_chunk > 1 else None
        return shapes.length(count, pad_to, cost, fits=self.fits, cap=r.pad_cap,
                             max_tokens=r.max_tokens)
