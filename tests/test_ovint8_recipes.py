"""scripts/ovint8_recipes.py: which linear layers a recipe keeps in float, found by shape."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.scriptload import load_script


@pytest.fixture(scope="module")
def recipes() -> Iterator[ModuleType]:
    module = load_script("ovint8_recipes")
    yield module
    sys.modules.pop(module.__name__, None)


def _graph(tmp_path: Path, layers: int = 3, hidden: int = 4, inner: int = 8) -> Path:
    """A chain shaped like the encoder: per layer Q, K, V, the two attention MatMuls (no
    weight), the attention output, FFN up and down; then the two heads. Names as the
    exporter writes them (``/dense_N/MatMul``), which say nothing of the layer."""
    nodes, weights, x, n = [], [], "x", 0

    def linear(name: str, rows: int, cols: int) -> None:
        nonlocal x
        w = f"{name}.weight"
        weights.append(numpy_helper.from_array(np.zeros((rows, cols), np.float32), w))
        nodes.append(helper.make_node("MatMul", [x, w], [f"{name}.out"], name=f"/{name}/MatMul"))
        x = f"{name}.out"

    for layer in range(layers):
        suffix = f"_{layer}" if layer else ""
        for part in ("query", "key", "value"):
            linear(f"{part}{suffix}", hidden, hidden)
        nodes.append(helper.make_node("MatMul", [x, x], [f"s{layer}"], name=f"/MatMul_{layer}"))
        linear(f"dense{'_' + str(n) if n else ''}", hidden, hidden)
        linear(f"dense_{n + 1}", hidden, inner)
        linear(f"dense_{n + 2}", inner, hidden)
        n += 3
    linear("sparse_linear", hidden, 1)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                          [1, hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)],
                              initializer=weights)
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_the_ffn_down_projections_are_the_narrowing_matmuls(recipes, tmp_path: Path) -> None:
    assert recipes.float_layers(_graph(tmp_path), "ffn2") == [
        "/dense_2/MatMul", "/dense_5/MatMul", "/dense_8/MatMul"]


def test_the_edge_layers_are_the_first_and_last_six_linear_matmuls(recipes,
                                                                   tmp_path: Path) -> None:
    assert recipes.float_layers(_graph(tmp_path), "edge") == [
        "/query/MatMul", "/key/MatMul", "/value/MatMul", "/dense/MatMul", "/dense_1/MatMul",
        "/dense_2/MatMul", "/query_2/MatMul", "/key_2/MatMul", "/value_2/MatMul",
        "/dense_6/MatMul", "/dense_7/MatMul", "/dense_8/MatMul"]
    assert recipes.float_layers(_graph(tmp_path), "") == []  # the SmoothQuant recipes
