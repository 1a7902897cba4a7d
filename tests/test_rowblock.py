"""Row-blocked FFN (export/rowblock.py): exact for any split of the rows, found by structure,
refused where the graph is not a chain of layers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bgeserve.export import FFN_ROWS
from bgeserve.export.rowblock import ffn_regions, row_block_ffn
from bgeserve.runtime import SessionConfig
from bgeserve.runtime.onnx import OnnxSession

H, F = 8, 24


def _layers_graph(layers: int = 2, leak: bool = False) -> onnx.ModelProto:
    """x [B, L, H] → LayerNorm → per layer: (a token-mixing stand-in for attention) + LayerNorm,
    then FFN (MatMul, bias, erf-GELU, MatMul, residual) + LayerNorm. ``leak`` also outputs the
    first FFN's GELU, which the pass must refuse to hide."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def init(name: str, value: np.ndarray, dtype: type = np.float32) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value).astype(dtype), name))
        return name

    def norm(x: str, out: str) -> None:
        nodes.append(helper.make_node("LayerNormalization", [x, init(out + ".w", rng.random(H) + 0.5),
                                                             init(out + ".b", rng.random(H))],
                                      [out], axis=-1))

    norm("x", "ln0")
    x = "ln0"
    for i in range(layers):
        # Mixing across tokens (a cumulative sum along L): a row split here would be wrong,
        # so it must stay outside the FFN region.
        nodes.append(helper.make_node("CumSum", [x, init(f"axis{i}", 1, np.int64)], [f"mix{i}"]))
        nodes.append(helper.make_node("Add", [f"mix{i}", x], [f"res{i}"]))
        norm(f"res{i}", f"ln{i}a")
        a = f"ln{i}a"
        nodes += [
            helper.make_node("MatMul", [a, init(f"w1_{i}", rng.standard_normal((H, F)))], [f"up{i}"]),
            helper.make_node("Add", [f"up{i}", init(f"b1_{i}", rng.standard_normal(F))], [f"ub{i}"]),
            helper.make_node("Div", [f"ub{i}", init(f"sqrt2_{i}", np.array(2 ** 0.5))], [f"d{i}"]),
            helper.make_node("Erf", [f"d{i}"], [f"e{i}"]),
            helper.make_node("Add", [f"e{i}", init(f"one{i}", np.array(1.0))], [f"e1{i}"]),
            helper.make_node("Mul", [f"ub{i}", f"e1{i}"], [f"g0{i}"]),
            helper.make_node("Mul", [f"g0{i}", init(f"half{i}", np.array(0.5))], [f"g{i}"]),
            helper.make_node("MatMul", [f"g{i}", init(f"w2_{i}", rng.standard_normal((F, H)))],
                             [f"down{i}"]),
            helper.make_node("Add", [f"down{i}", a], [f"r{i}"]),
        ]
        norm(f"r{i}", f"ln{i}b")
        x = f"ln{i}b"
    outputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["B", "L", H])]
    if leak:
        outputs.append(helper.make_tensor_value_info("g0", TensorProto.FLOAT, ["B", "L", F]))
    graph = helper.make_graph(nodes, "layers",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "L", H])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_regions_are_each_layers_ffn() -> None:
    model = _layers_graph(layers=3)
    regions = ffn_regions(model.graph)
    assert [(start, end) for start, end, _ in regions] == [(f"ln{i}a", f"ln{i}b") for i in range(3)]
    for i, (_, _, nodes) in enumerate(regions):
        ops = [model.graph.node[n].op_type for n in nodes]
        assert ops == ["MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul", "MatMul", "Add",
                       "LayerNormalization"], i


@pytest.mark.parametrize("rows", [1, 3, 7, 16, 1000])
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (1, 22), (3, 5)])
def test_any_split_of_the_rows_is_exact(rows: int, shape: tuple[int, int]) -> None:
    x = np.random.default_rng(1).standard_normal((*shape, H)).astype(np.float32)
    plain = _layers_graph()
    blocked = _layers_graph()
    assert row_block_ffn(blocked, rows) == 2
    onnx.checker.check_model(blocked)
    scans = [n for n in blocked.graph.node if n.op_type == "Scan"]
    assert len(scans) == 2
    assert not any(n.op_type == "Erf" for n in blocked.graph.node)  # moved into the blocks
    np.testing.assert_allclose(_run(blocked, x), _run(plain, x), rtol=1e-5, atol=1e-5)


def test_a_value_read_outside_the_ffn_is_refused() -> None:
    with pytest.raises(ValueError, match="FFN-internal|graph output"):
        row_block_ffn(_layers_graph(leak=True))


def test_a_graph_without_layers_is_refused() -> None:
    model = _layers_graph(layers=1)
    del model.graph.node[-1]  # the last LayerNorm: no longer 1 + 2 × layers
    model.graph.output[0].name = "r0"
    with pytest.raises(ValueError, match="LayerNormalization"):
        row_block_ffn(model)


def test_the_export_blocks_the_cpu_graphs(tiny_export: Path) -> None:
    manifest = json.loads((tiny_export / "manifest.json").read_text())
    assert manifest["model"]["ffn_rows"] == FFN_ROWS
    layers = manifest["model"]["layers"]
    for variant, expected in (("fp32", layers), ("int8", layers), ("fp16", 0)):
        graph = onnx.load(str(tiny_export / variant / "model.onnx"), load_external_data=False)
        assert sum(n.op_type == "Scan" for n in graph.graph.node) == expected, variant


def test_real_graph_blocks_agree_with_the_unblocked_graph(tiny_model: Path,
                                                          tiny_fp32_unblocked: Path,
                                                          tmp_path: Path) -> None:
    """bge-m3's own graph (tiny), unblocked as the fp32 step writes it and blocked at 5 rows so
    every chunk spans several blocks with padding: a padded batch and a lone text agree."""
    unblocked = tiny_fp32_unblocked
    model = onnx.load(str(unblocked))
    layers = row_block_ffn(model, 5)
    blocked = tmp_path / "blocked" / "model.onnx"
    blocked.parent.mkdir()
    onnx.save(model, str(blocked))
    assert layers == json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]

    rng = np.random.default_rng(3)
    ids = np.concatenate([[[0]] * 2, rng.integers(5, 2000, (2, 21)), [[2]] * 2], axis=1)
    mask = np.ones_like(ids)
    ids[1, 14:], mask[1, 14:] = 1, 0
    for feed in ((ids, mask), (ids[:1], mask[:1])):
        want = OnnxSession(unblocked, SessionConfig(threads=1)).run(*feed)
        got = OnnxSession(blocked, SessionConfig(threads=1)).run(*feed)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_onnx_runtime_fuses_every_layers_skip_layernorm_after_a_blocked_ffn(
        tiny_export: Path, tmp_path: Path) -> None:
    """Each blocked layer's output is typed [B, L, H], so ONNX Runtime fuses the next layer's
    attention output (bias + residual + LayerNorm) into one SkipLayerNormalization in every
    layer, not only the first: only the embeddings' LayerNorm stays on its own."""
    import onnxruntime as ort

    graph = tiny_export / "fp32" / "model.onnx"
    layers = json.loads((tiny_export / "manifest.json").read_text())["model"]["layers"]
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    opts.log_severity_level = 3
    ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node]
    assert ops.count("SkipLayerNormalization") == layers
    assert ops.count("LayerNormalization") == 1
