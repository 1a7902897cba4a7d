"""Tests for bgeserve.export.attention: a hub graph's attention rewritten as If(unpadded, MHA,
blocked), exactly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from bgeserve.export import attention, encoder, onnxbuild
from tests.graphs import BATCHES, load_stock, padded_batch, run

pytestmark = pytest.mark.slow

STYLES = {"graphpy": "token_embeddings", "baai": "token_embeddings",
          "optimum": "last_hidden_state"}


@pytest.fixture(scope="module")
def stock(hub_layouts, hub_snapshots):
    """The three hub styles of test_encoder: bgeserve's stand-in, transformers at opset 17
    and at opset 14."""
    return {"graphpy": hub_layouts["baai"] / "onnx" / "model.onnx",
            "baai": hub_snapshots["baai"] / "onnx" / "model.onnx",
            "optimum": hub_snapshots["optimum"] / "onnx" / "model.onnx"}


def _rewritten(path, block: int = 4) -> onnx.ModelProto:
    model = load_stock(path)
    encoder.fuse_layernorms(model)
    assert attention.bound_attention(model, heads=4, hidden=32, block=block) == 2
    return model


@pytest.mark.parametrize("style", STYLES)
def test_the_rewrite_computes_what_the_stock_graph_computes(style: str, stock) -> None:
    """Unpadded batches (the fused MultiHeadAttention) and padded ones (masked attention in
    blocks of 4 query rows, so several blocks and a ragged last one) give the stock graph's
    hidden states to float noise."""
    output = STYLES[style]
    model = _rewritten(stock[style])
    for lengths in BATCHES:
        ids, mask = padded_batch(lengths)
        want = run(str(stock[style]), [output], ids, mask)[0]
        got = run(model, [output], ids, mask)[0]
        real = mask.astype(bool)  # padding positions are not outputs anyone reads
        np.testing.assert_allclose(got[real], want[real], atol=2e-5, err_msg=str(lengths))


def test_each_layer_branches_on_padding_and_no_plain_attention_is_left(stock) -> None:
    """One If per layer: MultiHeadAttention without a mask input when unpadded, a Scan over
    query blocks otherwise; the stock graph's softmax attention is pruned away."""
    model = _rewritten(stock["baai"], block=256)
    ifs = [n for n in model.graph.node if n.op_type == "If"]

    assert len(ifs) == 2
    assert not [n for n in model.graph.node if n.op_type == "Softmax"]
    for node in ifs:
        branches = {a.name: a.g for a in node.attribute}
        fused = branches["then_branch"].node
        assert [(n.op_type, n.domain, len(n.input)) for n in fused] == [
            ("MultiHeadAttention", "com.microsoft", 3)]
        assert "Scan" in {n.op_type for n in branches["else_branch"].node}
    assert {"": 17, "com.microsoft": 1}.items() <= {
        o.domain: o.version for o in model.opset_import}.items()


def test_graphs_older_than_opset_13_are_refused(stock) -> None:
    """Squeeze/Unsqueeze changed at opset 13: an older graph is refused, not half-rewritten."""
    model = load_stock(stock["graphpy"])
    for entry in model.opset_import:
        if entry.domain == "":
            entry.version = 12
    with pytest.raises(ValueError, match="opset 12"):
        attention.bound_attention(model, heads=4, hidden=32)
    assert onnxbuild.default_opset(model) == 12
