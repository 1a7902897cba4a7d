"""Tests for bgeserve.export.encoder: the layers of a hub graph, found by structure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from bgeserve.export import encoder, onnxbuild
from tests.graphs import BAAI_OUTPUTS, graph_bytes, load_stock, padded_batch, run

pytestmark = pytest.mark.slow

STYLES = ("graphpy", "baai", "optimum")


@pytest.fixture(scope="module")
def stock(hub_layouts, hub_snapshots):
    """Hub-style graph files of the tiny model: bgeserve's own hub stand-in (graph.py's plain
    attention, opset 18), transformers' SDPA encoder traced at opset 17 (BAAI's layout) and
    at opset 14 (optimum's: LayerNorm spelled out)."""
    return {"graphpy": hub_layouts["baai"] / "onnx" / "model.onnx",
            "baai": hub_snapshots["baai"] / "onnx" / "model.onnx",
            "optimum": hub_snapshots["optimum"] / "onnx" / "model.onnx"}


def _producer_name(model: onnx.ModelProto, value: str) -> str:
    return model.graph.node[onnxbuild.producers(model.graph)[value]].name


@pytest.mark.parametrize("style", STYLES)
def test_each_layers_query_key_and_value_are_told_apart(style: str, stock) -> None:
    """Every layer's Q, K and V projections are found, each the one its exporter named so."""
    model = load_stock(stock[style])
    sites = encoder.attention_sites(model)

    assert len(sites) == 2
    for site in sites:
        assert "query" in _producer_name(model, site.q)
        assert "key" in _producer_name(model, site.k)
        assert "value" in _producer_name(model, site.v)
        assert "dense" in site.output_projection  # attention.output.dense


def test_roles_come_from_the_data_flow_not_the_node_order(stock) -> None:
    """With the value projection moved before the query's (still a valid graph), V is still
    the projection that the softmax is applied to."""
    model = load_stock(stock["baai"])
    nodes = list(model.graph.node)
    first = next(i for i, n in enumerate(nodes) if "query/MatMul" in n.name)
    moved = [n for n in nodes if "layer.0/attention/self/value/" in n.name]
    rest = [n for n in nodes if n not in moved]
    reordered = rest[:first] + moved + rest[first:]
    del model.graph.node[:]
    model.graph.node.extend(reordered)

    assert "value" in encoder.layers(model)[0]["q"].name  # the order-based guess is wrong
    site = encoder.attention_sites(model)[0]
    assert "value" in _producer_name(model, site.v) and "query" in _producer_name(model, site.q)


@pytest.mark.parametrize("style", STYLES)
def test_sizes_are_read_from_the_graph_or_taken_from_a_config(style: str, stock) -> None:
    """hidden, FFN width, layers, heads (from Q's reshape) and positions (the position table)
    without config.json; a config's heads and positions win where given."""
    model = onnx.load(str(stock[style]), load_external_data=False)

    assert encoder.dims(model) == {"hidden": 32, "intermediate": 64, "layers": 2, "heads": 4,
                                   "max_positions": 8192}
    config = {"num_attention_heads": 4, "max_position_embeddings": 514}
    assert encoder.dims(model, config)["max_positions"] == 512


def test_spelled_out_layernorms_are_fused_at_opset_17_and_compute_the_same(stock) -> None:
    """The opset-14 graph's 5 LayerNorms (embeddings + 2 per layer) become LayerNormalization
    nodes, the opset is raised to 17, and the outputs do not move."""
    model = load_stock(stock["optimum"])
    ids, mask = padded_batch([3, 9, 12])
    before = run(model, ["last_hidden_state"], ids, mask)[0]

    assert encoder.fuse_layernorms(model) == 5
    assert onnxbuild.default_opset(model) == 17
    assert not [n for n in model.graph.node if n.op_type == "ReduceMean"]
    np.testing.assert_allclose(run(model, ["last_hidden_state"], ids, mask)[0], before,
                               atol=1e-5)
    assert encoder.fuse_layernorms(load_stock(stock["baai"])) == 0  # opset 17: fused already


def test_a_graph_without_encoder_layers_is_refused(tmp_path: Path) -> None:
    """A graph with the right names but no transformer layers is a ValueError."""
    path = tmp_path / "m.onnx"
    path.write_bytes(graph_bytes(BAAI_OUTPUTS))
    with pytest.raises(ValueError, match="weight MatMuls"):
        encoder.attention_sites(onnx.load(str(path)))


