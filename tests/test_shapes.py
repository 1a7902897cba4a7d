"""Which shapes a session has run (``engine.shapes``): a chunk pads to one where padding costs
less than a new shape, and stops renting once that padding would have bought the shape."""

from __future__ import annotations

import pytest

from bgeserve.engine.packing import Packer, Rules
from bgeserve.engine.shapes import RENT_SHARE, RunShapes
from bgeserve.tuning.runcost import RunCost

# ov-int8 on a 2-core Zen 4 as the probe measured it: a new shape costs ~44 tokens of work, so
# one padding may take up to ~10 tokens (RENT_SHARE).
COST = RunCost(fixed=0.012, per_token=0.00085, per_pair=0.0, new_shape=0.037)
TOKEN = COST.per_token


def always(batch: int, seq: int) -> bool:
    return True


def length(shapes: RunShapes, count: int, pad_to: int, cost: RunCost | None = COST, *,
           fits=always, cap: int | None = 8192, max_tokens: int | None = 1024) -> int:
    """The length the chunk runs at, then its run recorded as succeeded (as the scheduler)."""
    seq = shapes.length(count, pad_to, cost, fits=fits, cap=cap, max_tokens=max_tokens)
    shapes.ran(count, seq)
    return seq


def test_a_chunk_pads_to_a_count_run_before_where_that_is_cheaper_than_a_new_shape():
    shapes = RunShapes()
    assert length(shapes, 1, 100) == 100  # nothing run yet: runs as it is, and is known
    assert length(shapes, 1, 90) == 100  # 10 tokens (8.5 ms) < a quarter of 37 ms
    assert length(shapes, 1, 50) == 50  # 50 tokens (42.5 ms): a new shape
    assert length(shapes, 1, 49) == 50
    assert len(shapes) == 2


def test_the_shortest_known_longer_length_is_taken():
    shapes = RunShapes()
    for n in (95, 100, 120):  # none has a longer one known when it runs
        assert length(shapes, 1, n) == n
    assert length(shapes, 1, 93) == 95
    assert length(shapes, 1, 96) == 100


def test_a_batch_pads_each_text_to_the_count_it_can_reach():
    """Two texts of 45 tokens make 90: a known 100 is 2 × 50; a known 101 is no length for
    two texts, and 2 × 70 = 140 costs 50 tokens, more than a new shape."""
    shapes = RunShapes()
    length(shapes, 1, 101)
    length(shapes, 1, 140)
    assert length(shapes, 2, 45) == 45
    shapes = RunShapes()
    length(shapes, 4, 25)  # 100 tokens, as 4 × 25
    assert length(shapes, 2, 45) == 50
    assert length(shapes, 1, 97) == 100  # any split of a known count will do
    shapes = RunShapes()
    length(shapes, 1, 91)
    length(shapes, 1, 92)
    assert length(shapes, 2, 45) == 46  # 91 is passed over, 92 = 2 × 46


def test_a_count_is_known_only_once_a_run_of_it_succeeded():
    """A chunk that ran out of memory taught nothing: its count stays new."""
    shapes = RunShapes()
    assert shapes.length(1, 100, COST, fits=always, cap=8192, max_tokens=1024) == 100
    assert len(shapes) == 0
    assert shapes.length(1, 90, COST, fits=always, cap=8192, max_tokens=1024) == 90
    assert not shapes.known(100)
    shapes.ran(1, 100)
    shapes.ran(1, 100)
    assert len(shapes) == 1
    assert shapes.known(100) and not shapes.known(90)
    assert shapes.length(1, 90, COST, fits=always, cap=8192, max_tokens=1024) == 100


def test_one_padding_may_cost_up_to_a_quarter_of_a_new_shape():
    """At the boundary (10 tokens of 1/1024 s against a quarter of a new shape of 40/1024 s,
    exact in binary) the chunk runs as it is; one token less pads. With ov-int8's figures a
    padding of 15 tokens (12.75 ms, a third of its 37 ms) is not taken: a second pass over the
    same texts would pay it again."""
    shapes = RunShapes()
    length(shapes, 1, 100)
    assert length(shapes, 1, 85) == 85
    assert RENT_SHARE == 0.25
    cost = RunCost(fixed=0.0, per_token=2.0 ** -10, per_pair=0.0, new_shape=40 * 2.0 ** -10)
    shapes = RunShapes()
    length(shapes, 1, 110, cost)
    assert length(shapes, 1, 100, cost) == 100
    shapes = RunShapes()
    length(shapes, 1, 110, cost)
    assert length(shapes, 1, 101, cost) == 110


@pytest.mark.parametrize("limits", [
    {"cap": 95},  # past the model's positions (pad_cap)
    {"cap": None},  # no cap known: no longer length at all
    {"max_tokens": 99},  # past the chunk budget
    {"fits": lambda b, s: s < 100},  # does not fit the memory budget
])
def test_no_padding_past_a_limit(limits):
    shapes = RunShapes()
    length(shapes, 1, 100)
    assert length(shapes, 1, 90, **limits) == 90


def test_a_single_text_past_the_chunk_budget_may_still_pad_within_memory():
    shapes = RunShapes()
    length(shapes, 1, 2010, max_tokens=1024)
    assert length(shapes, 1, 2000, max_tokens=1024) == 2010


@pytest.mark.parametrize("cost", [None, RunCost(0.012, 0.00085, 0.0, new_shape=0.0)])
def test_without_a_new_shape_cost_nothing_pads(cost):
    """No run cost (the probe off, a GPU) or a runtime that takes any shape (ONNX Runtime's
    CPU kernels, measured ~0): every chunk runs as it is."""
    shapes = RunShapes()
    length(shapes, 1, 100, cost)
    assert length(shapes, 1, 99, cost) == 99


def test_padding_stops_once_it_would_have_paid_for_the_new_shape():
    """Rent or buy: 10 tokens (8.5 ms) four times is 34 ms; a fifth would pass the 37 ms the
    shape costs once, so that chunk runs as it is, and later ones find it known."""
    shapes = RunShapes()
    length(shapes, 1, 100)
    assert [length(shapes, 1, 90) for _ in range(6)] == [100, 100, 100, 100, 90, 90]


def test_the_cost_counts_attention_too():
    """Padding lengthens every position's attention: 1,000 → 1,010 tokens is 8.5 ms of tokens
    (under a quarter of 37 ms) but 20 ms more of attention at 1 µs per token per position: a
    new shape; 1,008 → 1,010 costs 1.7 + 4 ms and pads."""
    cost = RunCost(fixed=0.012, per_token=TOKEN, per_pair=1e-6, new_shape=0.037)
    shapes = RunShapes()
    length(shapes, 1, 1010, cost, max_tokens=None)
    assert length(shapes, 1, 1000, cost, max_tokens=None) == 1000
    assert length(shapes, 1, 1008, cost, max_tokens=None) == 1010


def test_the_packer_runs_every_text_alone_unpadded_when_chunks_hold_one():
    """BGE_M3_MAX_CHUNK=1 promises unpadded runs (the embedding cache keeps variants whose
    results depend on padding only then), and a chunk the scheduler will not lengthen (a solo
    job's: the canary is checked bit for bit) runs as packed: no known shape is padded to."""
    for max_chunk, lengthen, expect in ((1, True, 90), (64, False, 90), (64, True, 100)):
        packer = Packer(Rules(max_chunk=max_chunk, max_tokens=1024, pad_cap=8192,
                              run_cost=COST))
        shapes = RunShapes()
        assert packer.run_length(shapes, 1, 100) == 100
        shapes.ran(1, 100)
        assert packer.run_length(shapes, 1, 90, lengthen=lengthen) == expect
