"""Tests for bgeserve.export.headgraph: bge-m3's heads written into a hub graph."""

from __future__ import annotations

import numpy as np
import pytest

from bgeserve.engine.heads import HiddenHeads, l2_normalize
from bgeserve.export.headgraph import OUTPUTS, add_heads
from bgeserve.model.ptload import load_heads
from tests.graphs import BATCHES, load_stock, padded_batch, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def heads(tiny_model):
    return load_heads(tiny_model / "sparse_linear.pt", tiny_model / "colbert_linear.pt")


@pytest.mark.parametrize(("layout", "hidden"), [("baai", "token_embeddings"),
                                                ("optimum", "last_hidden_state")])
def test_in_graph_heads_equal_the_numpy_heads(layout: str, hidden: str, hub_snapshots,
                                              heads) -> None:
    """dense, sparse_weights and colbert from the graph equal what the engine computes from
    the hidden states with the .pt weights (HiddenHeads), padded batches included."""
    path = hub_snapshots[layout] / "onnx" / "model.onnx"
    model = load_stock(path)
    add_heads(model, hidden, heads)
    numpy_heads = HiddenHeads(heads.sparse_weight, heads.sparse_bias, heads.colbert_weight,
                              heads.colbert_bias)

    assert [o.name for o in model.graph.output] == list(OUTPUTS)
    for lengths in BATCHES:
        ids, mask = padded_batch(lengths)
        h = run(str(path), [hidden], ids, mask)[0]
        dense, sparse, colbert = run(model, OUTPUTS, ids, mask)
        np.testing.assert_allclose(dense, l2_normalize(h[:, 0]), atol=1e-6)
        np.testing.assert_allclose(sparse * mask, numpy_heads.sparse(h) * mask, atol=1e-5)
        np.testing.assert_allclose(colbert, numpy_heads.colbert(h, mask), atol=1e-6)


def test_head_matmuls_carry_the_prefixes_int8_keeps_in_fp32(hub_snapshots, heads) -> None:
    """The heads' MatMuls are named /sparse_linear/… and /colbert_linear/…, so the int8 step
    (steps.HEAD_NODE_PREFIXES) leaves them fp32 as it does an export's."""
    from bgeserve.export.steps import HEAD_NODE_PREFIXES

    model = load_stock(hub_snapshots["baai"] / "onnx" / "model.onnx")
    add_heads(model, "token_embeddings", heads)
    head_matmuls = [n.name for n in model.graph.node if n.op_type == "MatMul"
                    and n.name.startswith(HEAD_NODE_PREFIXES)]

    assert len(head_matmuls) == 2
    assert not [n for n in model.graph.node if "sentence_embedding" in n.output]  # pruned


def test_a_graph_without_the_hidden_output_is_refused(hub_snapshots, heads) -> None:
    """Naming an output the graph does not have is a ValueError."""
    model = load_stock(hub_snapshots["optimum"] / "onnx" / "model.onnx")
    with pytest.raises(ValueError, match="token_embeddings"):
        add_heads(model, "token_embeddings", heads)
