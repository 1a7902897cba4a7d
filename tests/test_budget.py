"""Tests for bgeserve.tuning.budget: per-worker workspace and two models sharing one process."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bgeserve.tuning.budget import budget, split_available

GiB = 1 << 30


def test_two_models_split_what_they_leave_free() -> None:
    """Each model keeps its own weights; the free rest goes ``share`` to the second."""
    assert split_available(10 * GiB, (2 * GiB, 2 * GiB), 0.25) == (13 * GiB // 2, 7 * GiB // 2)
    # Nothing free: each sees only its own weights (its budget is then 0: the floor refuses).
    assert split_available(3 * GiB, (2 * GiB, 2 * GiB), 0.5) == (2 * GiB, 2 * GiB)
    with pytest.raises(ValueError, match="BGE_M3_RERANK_MEMORY_SHARE"):
        split_available(GiB, (0, 0), 1.0)


@given(available=st.integers(0, 64 * GiB), a=st.integers(0, 8 * GiB), b=st.integers(0, 8 * GiB),
       share=st.floats(0.05, 0.95), workers=st.integers(1, 4))
def test_the_two_budgets_fit_the_machine_together(available, a, b, share, workers) -> None:
    """Both models' weights plus both budgets' workspace never exceed the memory available."""
    first, second = split_available(available, (workers * a, workers * b), share)
    total = (workers * (budget(first, workers, a) + budget(second, workers, b))
             + workers * (a + b))
    assert total <= max(available, workers * (a + b))
