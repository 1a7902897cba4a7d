"""Tests for bgeserve.binpack: the packing rules, as properties over random inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bgeserve.engine.binpack import Chunk, chunk_fits, chunk_length, plan, rounded_length
from bgeserve.tuning.runcost import RunCost

# Reproducible in CI, and no example database written into the working tree.
PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)


def cost_model(a: float, c: float, budget: float):
    """The fake memory check: workspace a·b·s + c·b·s² within ``budget``."""
    return lambda b, s: a * b * s + c * b * s * s <= budget


def always(b: int, s: int) -> bool:
    return True


@st.composite
def problems(draw):
    """A packing problem: lengths plus every knob ``plan`` takes."""
    lengths = draw(st.lists(st.integers(1, 600), max_size=60))
    a = draw(st.floats(0.0, 10.0))
    c = draw(st.floats(0.0, 0.1))
    budget = draw(st.floats(0.0, 50_000.0))
    max_chunk = draw(st.integers(1, 16))
    max_tokens = draw(st.none() | st.integers(1, 4000))
    min_fill = draw(st.sampled_from([0.0, 0.25, 0.5, 0.75, 0.9, 1.0]))
    return lengths, (a, c, budget), max_chunk, max_tokens, min_fill


def run_plan(problem):
    lengths, (a, c, budget), max_chunk, max_tokens, min_fill = problem
    fits = cost_model(a, c, budget)
    chunks = plan(lengths, fits=fits, max_chunk=max_chunk, max_tokens=max_tokens,
                  min_fill=min_fill)
    return lengths, fits, chunks


# ------------------------------------------------------------------------------ properties
@PROPERTY
@given(problems())
def test_every_index_appears_exactly_once(problem):
    """Each input index is in exactly one chunk; no chunk is empty."""
    lengths, _, chunks = run_plan(problem)
    flat = [i for c in chunks for i in c.indices]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(c.indices for c in chunks)


@PROPERTY
@given(problems())
def test_each_chunk_is_padded_to_its_own_longest_text(problem):
    """``pad_to`` is the longest text of that chunk, not of the whole request."""
    lengths, _, chunks = run_plan(problem)
    for c in chunks:
        assert c.pad_to == max(lengths[i] for i in c.indices)
        assert c.padded_tokens == len(c.indices) * c.pad_to


@PROPERTY
@given(problems())
def test_every_chunk_respects_the_caps(problem):
    """Every chunk holds at most max_chunk texts; a multi-text chunk also stays within
    max_tokens, at least min_fill real tokens, and inside the memory budget."""
    lengths, fits, chunks = run_plan(problem)
    _, _, max_chunk, max_tokens, min_fill = problem
    for c in chunks:
        count = len(c.indices)
        assert count <= max_chunk
        if count > 1:
            real = sum(lengths[i] for i in c.indices)
            if max_tokens is not None:
                assert c.padded_tokens <= max_tokens
            assert real >= min_fill * c.padded_tokens
            assert fits(count, c.pad_to)


@PROPERTY
@given(problems())
def test_chunks_ascend_by_length_and_ties_keep_input_order(problem):
    """Read chunk by chunk, the indices are a stable sort of the inputs by length."""
    lengths, _, chunks = run_plan(problem)
    flat = [i for c in chunks for i in c.indices]
    assert flat == sorted(range(len(lengths)), key=lambda i: lengths[i])
    pads = [c.pad_to for c in chunks]
    assert pads == sorted(pads)


@PROPERTY
@given(problems())
def test_a_text_that_cannot_fit_alone_gets_a_chunk_of_its_own(problem):
    """A text over the budget even alone is neither dropped nor packed with others."""
    lengths, fits, chunks = run_plan(problem)
    owner = {i: c for c in chunks for i in c.indices}
    for i, n in enumerate(lengths):
        if not fits(1, n):
            assert owner[i].indices == (i,)


@PROPERTY
@given(problems())
def test_packing_is_greedy(problem):
    """A chunk is closed only because its next text would break a rule (no needless splits)."""
    lengths, fits, chunks = run_plan(problem)
    _, _, max_chunk, max_tokens, min_fill = problem
    for this, following in itertools.pairwise(chunks):
        nxt = following.indices[0]
        real = sum(lengths[i] for i in this.indices) + lengths[nxt]
        assert not chunk_fits(len(this.indices) + 1, lengths[nxt], real, fits=fits,
                              max_chunk=max_chunk, max_tokens=max_tokens, min_fill=min_fill)


@PROPERTY
@given(problems(), st.integers(1, 64), st.none() | st.tuples(
    st.floats(0.0, 0.05), st.floats(1e-5, 1e-3), st.floats(0.0, 1e-6), st.floats(0.0, 0.05)))
def test_a_plan_until_an_index_is_the_whole_plans_chunk_holding_it(problem, multiple, cost):
    """``until`` (the queue takes one chunk of a window of up to a thousand texts) gives the
    chunk the whole plan holds that index in, under every rule: padding multiples, a run
    cost and the shapes a session knows."""
    lengths, (a, c, budget), max_chunk, max_tokens, min_fill = problem
    rules = {"fits": cost_model(a, c, budget), "max_chunk": max_chunk,
             "max_tokens": max_tokens, "min_fill": min_fill, "pad_multiple": multiple,
             "pad_cap": 512, "run_cost": None if cost is None else RunCost(*cost),
             "known": lambda count: count % 3 == 0}
    whole = plan(lengths, **rules)
    for i in range(len(lengths)):
        assert plan(lengths, until=i, **rules) == [c for c in whole if i in c.indices]


# ------------------------------------------------------------------------------- examples
def test_a_small_plan_by_hand():
    """Two texts per chunk: the two shortest first, each chunk padded to its own longest."""
    chunks = plan([5, 3, 8, 3], fits=always, max_chunk=2)
    assert chunks == [Chunk((1, 3), 3), Chunk((0, 2), 8)]


def test_equal_lengths_stay_in_input_order():
    """Ties are broken by input position, across chunk boundaries too."""
    chunks = plan([7, 7, 7, 7, 7], fits=always, max_chunk=2)
    assert [c.indices for c in chunks] == [(0, 1), (2, 3), (4,)]


def test_empty_input_gives_no_chunks():
    """Nothing to pack is no chunks, not an error."""
    assert plan([], fits=always, max_chunk=4) == []


@pytest.mark.parametrize("max_chunk", [0, -1])
def test_max_chunk_below_one_is_refused(max_chunk):
    """A chunk cap under one text cannot pack anything: ValueError."""
    with pytest.raises(ValueError, match="max_chunk"):
        plan([1, 2], fits=always, max_chunk=max_chunk)


def test_a_chunk_may_fill_max_tokens_and_max_chunk_exactly():
    """The bounds are inclusive in a plan too (it refuses the plain cases before working out
    any padding: a shortcut that must not move them)."""
    assert plan([2, 2, 2], fits=always, max_chunk=3, max_tokens=6) == [Chunk((0, 1, 2), 2)]
    assert plan([2, 2, 2], fits=always, max_chunk=2, max_tokens=6) == [
        Chunk((0, 1), 2), Chunk((2,), 2)]
    assert plan([2, 2, 3], fits=always, max_chunk=3, max_tokens=8) == [
        Chunk((0, 1), 2), Chunk((2,), 3)]


def test_max_tokens_does_not_split_a_single_text():
    """A text longer than max_tokens still gets a chunk (admission is the caller's job)."""
    assert plan([100, 3], fits=always, max_chunk=8, max_tokens=10) == [
        Chunk((1,), 3), Chunk((0,), 100)]


def test_min_fill_separates_short_texts_from_long_ones():
    """With min_fill, short texts are not padded up to a long neighbour."""
    chunks = plan([2, 2, 100], fits=always, max_chunk=8, min_fill=0.75)
    assert [c.indices for c in chunks] == [(0, 1), (2,)]
    assert plan([2, 2, 100], fits=always, max_chunk=8, min_fill=0.0) == [Chunk((0, 1, 2), 100)]


def test_the_budget_check_sees_the_count_and_padded_length():
    """``fits`` is asked about (texts in the chunk, longest text), never the token sum."""
    seen = []

    def fits(b, s):
        seen.append((b, s))
        return b * s <= 12

    chunks = plan([3, 4, 4, 5], fits=fits, max_chunk=8)
    assert [c.indices for c in chunks] == [(0, 1, 2), (3,)]
    assert seen == [(2, 4), (3, 4), (4, 5)]


def test_oversized_texts_each_get_their_own_chunk():
    """Texts over the budget alone are kept, one per chunk, after the ones that fit."""
    fits = cost_model(1.0, 0.0, 100.0)
    chunks = plan([10, 500, 20, 600, 30], fits=fits, max_chunk=8)
    assert [c.indices for c in chunks] == [(0, 2, 4), (1,), (3,)]


def test_zero_length_texts_are_padded_to_one():
    """An empty token list still occupies one position (a session cannot run 0 columns)."""
    assert plan([0, 0], fits=always, max_chunk=4) == [Chunk((0, 1), 1)]


def test_numpy_lengths_are_accepted():
    """Lengths may be a numpy array (what the tokenizer returns); pad_to is a plain int."""
    chunks = plan(np.array([4, 2], dtype=np.int64), fits=always, max_chunk=4)
    assert chunks == [Chunk((1, 0), 4)]
    assert type(chunks[0].pad_to) is int


# ---------------------------------------------------------------------------- chunk_fits
def test_chunk_fits_caps_the_count_even_for_one_text():
    """More texts than max_chunk never fit, whatever the budget."""
    assert not chunk_fits(2, 1, 2, fits=always, max_chunk=1, max_tokens=None, min_fill=0.0)
    assert chunk_fits(1, 1, 1, fits=always, max_chunk=1, max_tokens=None, min_fill=0.0)


def test_chunk_fits_exempts_a_single_text_from_max_tokens_and_min_fill():
    """One text alone is judged only by max_chunk and the memory budget."""
    assert chunk_fits(1, 1000, 1, fits=always, max_chunk=4, max_tokens=10, min_fill=1.0)
    assert not chunk_fits(1, 1000, 1000, fits=lambda b, s: False, max_chunk=4,
                          max_tokens=None, min_fill=0.0)


def test_chunk_fits_bounds_are_inclusive():
    """Exactly max_tokens padded tokens and exactly min_fill real tokens both fit."""
    assert chunk_fits(2, 5, 10, fits=always, max_chunk=4, max_tokens=10, min_fill=1.0)
    assert not chunk_fits(2, 5, 10, fits=always, max_chunk=4, max_tokens=9, min_fill=0.0)
    assert not chunk_fits(2, 5, 9, fits=always, max_chunk=4, max_tokens=None, min_fill=1.0)


def test_chunk_is_frozen():
    """A Chunk is an immutable value."""
    chunk = Chunk((0,), 3)
    with pytest.raises(AttributeError):
        chunk.pad_to = 4  # type: ignore[misc]


# ------------------------------------------------------------------------ rounded lengths
@pytest.mark.parametrize("longest, multiple, cap, want", [
    (17, 1, None, 17), (17, 32, None, 32), (32, 32, None, 32), (33, 32, None, 64),
    (1, 32, None, 32), (500, 32, 512, 512), (510, 32, 500, 510), (8190, 64, 8192, 8192),
])
def test_rounded_length(longest, multiple, cap, want):
    """Up to the next multiple, never past the cap, never below the length itself."""
    assert rounded_length(longest, multiple, cap) == want


def test_rounding_happens_only_where_the_rounded_chunk_fits():
    """A chunk the budget admits at its own length is never refused for the rounding."""
    tight = lambda count, seq: count * seq <= 100
    assert chunk_length(3, 30, fits=tight, multiple=32) == 32  # 3 x 32 = 96 fits
    assert chunk_length(3, 33, fits=tight, multiple=32) == 33  # 3 x 64 does not: unrounded
    assert chunk_fits(3, 33, 99, fits=tight, max_chunk=8, max_tokens=None, min_fill=0.0,
                      pad_multiple=32)


def test_plan_rounds_each_chunk_and_judges_fill_by_the_texts_own_longest():
    """Short texts padded to 32 still pack together: min_fill looks at their own longest (8),
    not the rounded 32; max_tokens counts the rounded length."""
    chunks = plan([8] * 10, fits=always, max_chunk=64, max_tokens=128, min_fill=0.75,
                  pad_multiple=32)
    assert [c.pad_to for c in chunks] == [32, 32, 32]
    assert [len(c.indices) for c in chunks] == [4, 4, 2]  # 4 x 32 = 128 padded tokens each
    unrounded = plan([8] * 10, fits=always, max_chunk=64, max_tokens=128, min_fill=0.75)
    assert [len(c.indices) for c in unrounded] == [10]


def test_plan_rounding_stops_at_the_cap():
    chunks = plan([500, 10], fits=always, max_chunk=1, pad_multiple=64, pad_cap=512)
    assert [(c.indices, c.pad_to) for c in chunks] == [((1,), 64), ((0,), 512)]
