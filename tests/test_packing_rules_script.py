"""scripts/packing_rules.py's pure part: packing a corpus a window of texts at a time."""

from __future__ import annotations

import sys

import pytest

from tests.scriptload import load_script


@pytest.fixture(scope="module")
def rules():
    module = load_script("packing_rules")
    yield module
    sys.modules.pop("packing_rules_under_test", None)


def test_a_rule_may_name_a_window_and_a_run_cost(rules) -> None:
    assert rules._rule("all=64,1024,0.75") == ("all", (64, 1024, 0.75, 0, ""))
    assert rules._rule("four=64,1024,0.75,4") == ("four", (64, 1024, 0.75, 4, ""))
    assert rules._rule("c=64,1024,0.75,0,measure") == ("c", (64, 1024, 0.75, 0, "measure"))
    cost = rules._run_cost("11/0.75/0.0003", measured=None)
    assert (cost.fixed, cost.per_token, cost.per_pair) == pytest.approx((0.011, 0.00075, 3e-7))
    assert rules._run_cost("", measured=None) is None
    assert rules._run_cost("measure", measured=lambda: "timed") == "timed"


def test_each_window_is_packed_alone_with_indices_into_the_corpus(rules) -> None:
    """Texts of equal length in different windows never share a chunk; every text runs once."""
    lengths = [100, 20, 100, 20, 100, 20]
    kw = {"max_chunk": 64, "max_tokens": 1024, "min_fill": 0.75}
    whole = rules.windowed(lengths, 0, **kw)
    assert sorted(c.indices for c in whole) == [(0, 2, 4), (1, 3, 5)]
    pairs = rules.windowed(lengths, 2, **kw)
    assert sorted(i for c in pairs for i in c.indices) == list(range(6))
    assert all(max(c.indices) - min(c.indices) <= 1 for c in pairs)
    assert [c.pad_to for c in sorted(pairs, key=lambda c: c.indices)] == [100, 20] * 3
