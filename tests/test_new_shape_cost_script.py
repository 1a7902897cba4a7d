"""scripts/new_shape_cost.py's timing: a shape's first run less its best repeat."""

from __future__ import annotations

import sys

import pytest

from tests.scriptload import load_script


@pytest.fixture(scope="module")
def script():
    module = load_script("new_shape_cost")
    yield module
    sys.modules.pop("new_shape_cost_under_test", None)


def test_the_first_run_of_a_new_count_reads_as_its_extra_cost(script) -> None:
    """A runtime that takes 30 ms more the first time it meets a token count (a fake clock):
    every new shape reads 30 ms, a known count split otherwise nothing."""
    seen: set[int] = set()
    now = [0.0]

    def run(batch: int, seq: int) -> None:
        if batch * seq not in seen:
            seen.add(batch * seq)
            now[0] += 0.03
        now[0] += 0.001 * batch * seq

    got = script.costs(run, [(1, 40), (2, 20), (1, 41)], clock=lambda: now[0])
    assert [shape for shape, _, _ in got] == [(1, 40), (2, 20), (1, 41)]
    assert [x for _, x, _ in got] == pytest.approx([0.03, 0.0, 0.03], abs=1e-9)
    assert [t for _, _, t in got] == pytest.approx([0.04, 0.04, 0.041])
