"""``Engine`` as a library: the memory budget a plain Engine applies on its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from bgeserve.costmodel import CostModel
from bgeserve.engine import Engine
from bgeserve.errors import TooLarge


def test_plain_engine_budgets_memory_by_itself(tiny_export: Path, tmp_path: Path) -> None:
    """Without a server, an Engine still packs and admits under a measured budget."""
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine:
        cost = engine.cost_model
        assert cost is not None and cost.max_workspace_bytes > 0
        assert cost.b == 0.0  # the export's blocked attention: no quadratic term
        assert engine.embed(["a short text"] * 3).dense.shape == (3, 32)


def test_explicit_cost_model_refuses_what_cannot_fit(tiny_export: Path, tmp_path: Path) -> None:
    """A text whose predicted workspace exceeds the budget is refused, naming the knob."""
    tight = CostModel(a=1_000_000.0, b=0.0, max_workspace_bytes=50_000_000)
    with Engine(tiny_export, "fp32", cache_dir=tmp_path, cost_model=tight) as engine:
        engine.embed("fits")  # a few tokens: ~5 MB predicted
        with pytest.raises(TooLarge, match="BGE_M3_MAX_SEQ_LENGTH") as info:
            engine.embed(["ok", "word " * 200])
        assert info.value.param == "input[1]"
