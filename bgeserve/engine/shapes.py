"""Which shapes a session has run, so a chunk may pad to one rather than pay for a new one.

OpenVINO's CPU plugin prepares its kernels for every token count a run holds (batch × padded
length) the first time it meets it: ~35-40 ms on full-size ov-int8 on a 2-core Zen 4, as much
as 40 tokens of work there (``tuning.runcost``, ``RunCost.new_shape``; ONNX Runtime ~0). A chunk
whose count is new may instead be padded to a longer length whose count the session has already
run, where those padding tokens cost less than the new shape.

Padding instead of paying is renting instead of buying: a count that keeps coming back would be
cheaper run once. So the padding spent to avoid each new count is summed, and once one more
padding would take that sum past what the new shape costs, the chunk runs at its own count,
which is then known (a rent-or-buy rule: never more than twice the best choice in hindsight).
One padding may cost at most ``RENT_SHARE`` of the new shape: a server that sees its texts again
(a second pass over a corpus) pays the rent again where buying paid once, so rent worth a whole
new shape per chunk would make the second pass pay what the first saved; at a quarter a count
must come back four times before renting it cost more than buying it (measured, ov-int8, 4
one-text clients: 4-5 % on the engine fresh and warm, 0-3 % through the server;
docs/benchmarks.md).
A count is known once a run of it succeeded (``ran``): a chunk that ran out of memory taught
nothing. Per session: a reopened session has met no shape. Pure; no model needed.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

from bgeserve.tuning.runcost import RunCost

Fits = Callable[[int, int], bool]

RENT_SHARE = 0.25  # of a new shape's cost, the most one padding may cost (see above)


class RunShapes:
    """The token counts one session has run, and the padding spent avoiding each new one."""

    def __init__(self) -> None:
        self._ran: list[int] = []  # sorted
        self._spent: dict[int, float] = {}
        # One worker thread uses it; the lock keeps the bookkeeping whole should that change.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ran)

    def length(self, count: int, pad_to: int, cost: RunCost | None, *, fits: Fits,
               cap: int | None, max_tokens: int | None) -> int:
        """The length ``count`` texts padded to ``pad_to`` run at: the shortest longer one, up
        to ``cap`` and the chunk budget ``max_tokens`` and fitting memory, whose token count
        this session has run, where the extra padding costs less than ``RENT_SHARE`` of
        ``cost.new_shape`` (and leaves the padding spent avoiding this count within the whole of
        it; that padding is booked); else ``pad_to``. Without a cap no longer length is taken
        (padding must stay within the model's positions). ``ran`` records the shape once it
        has run."""
        tokens = count * pad_to
        with self._lock:
            at, known = self._find(tokens)
            if known:
                return pad_to
            if cost is not None and cap is not None:
                # A chunk within the budget stays within it; one text past it (a long text
                # runs alone whatever the budget) is bounded by memory and the cap alone.
                within = max_tokens is not None and tokens <= max_tokens
                seq = self._known_longer(count, pad_to, at, cost, fits=fits, cap=cap,
                                         limit=max_tokens if within else None)
                if seq is not None:
                    return seq
            return pad_to

    def known(self, tokens: int) -> bool:
        """Whether this session has run a chunk of ``tokens`` tokens (batch × padded length)."""
        with self._lock:
            return self._find(tokens)[1]

    def ran(self, count: int, seq: int) -> None:
        """A run of ``count`` texts padded to ``seq`` succeeded: its token count is known."""
        tokens = count * seq
        with self._lock:
            at, known = self._find(tokens)
            if not known:
                self._ran.insert(at, tokens)
            self._spent.pop(tokens, None)

    def _find(self, tokens: int) -> tuple[int, bool]:
        """Where ``tokens`` stands in the sorted counts run, and whether it is one of them."""
        at = bisect.bisect_left(self._ran, tokens)
        return at, at < len(self._ran) and self._ran[at] == tokens

    def _known_longer(self, count: int, pad_to: int, at: int, cost: RunCost, *, fits: Fits,
                      cap: int, limit: int | None) -> int | None:
        """``length``'s longer length, its padding added to what avoiding this count has
        spent; None where none pays (called with the lock held)."""
        tokens = count * pad_to
        budget = min(cost.new_shape * RENT_SHARE, cost.new_shape - self._spent.get(tokens, 0.0))
        base = cost.seconds(count, pad_to)
        for known in self._ran[at:] if budget > 0 else ():
            seq, rest = divmod(known, count)
            if (limit is not None and known > limit) or seq > cap:
                break
            if rest:
                continue
            extra = cost.seconds(count, seq) - base
            if extra >= budget or not fits(count, seq):
                break  # longer ones pad more, and need more memory
            self._spent[tokens] = self._spent.get(tokens, 0.0) + extra
            return seq
        return None
