"""The export's int8 recipe (SmoothQuant + dynamic per-channel) and its export-time validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bgeserve.export import smoothquant, validate
from bgeserve.export.smoothquant import scale_weight, smoothing_scales, weight_max
from tests.oracle import FP16, INT8


# ---------------------------------------------------------------------------- pure maths
def test_smoothing_scales_follow_the_formula_and_are_clipped():
    rng = np.random.default_rng(0)
    xmax = rng.uniform(0.1, 50, 16)
    wmax = rng.uniform(0.01, 2, 16)
    for alpha in (0.5, 0.8):
        np.testing.assert_allclose(smoothing_scales(xmax, wmax, alpha),
                                   xmax ** alpha / wmax ** (1 - alpha), rtol=1e-6)
    # A channel never active (or a zero weight row) keeps s = 1; extremes are clipped.
    s = smoothing_scales(np.array([0.0, 3.0, 1e30, 1e-30]), np.array([1.0, 0.0, 1e-30, 1e30]))
    lo, hi = smoothquant.SCALE_CLIP
    assert s.dtype == np.float32
    assert s.tolist() == [1.0, 1.0, pytest.approx(hi), pytest.approx(lo)]


def test_smoothing_moves_the_scale_into_the_weights_without_changing_the_product():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 8)).astype(np.float32)
    x[:, 3] *= 40  # an outlier channel, as after bge-m3's LayerNorms
    ws = [rng.normal(size=(8, 6)).astype(np.float32) for _ in range(3)]  # a Q/K/V-like group
    wmax = weight_max(ws)
    np.testing.assert_allclose(wmax, np.max([np.abs(w).max(axis=1) for w in ws], axis=0))
    s = smoothing_scales(np.abs(x).max(axis=0), wmax, 0.5)
    for w in ws:
        sw = scale_weight(w, s)
        # s multiplies the weight's input channels (rows of an ONNX MatMul's [in, out] weight)
        np.testing.assert_allclose(sw, w * s[:, None], rtol=1e-6)
        np.testing.assert_allclose((x / s) @ sw, x @ w, rtol=1e-4, atol=1e-4)
    # the outlier channel is divided down: the activations' range shrinks
    assert np.abs(x / s).max() < np.abs(x).max()


# ---------------------------------------------------------------------------- the graphs
slow = pytest.mark.slow


def _dense(path: Path, rows: list[np.ndarray]) -> np.ndarray:
    from bgeserve.runtime import SessionConfig
    from bgeserve.runtime.onnx import OnnxSession

    session = OnnxSession(path, SessionConfig(threads=1))
    try:
        return np.stack([session.run(ids[None, :], np.ones((1, len(ids)), np.int64),
                                     outputs=["dense"])["dense"][0] for ids in rows])
    finally:
        session.close()


def _rows(export: Path, n: int = 4) -> list[np.ndarray]:
    from bgeserve.export import corpus

    return corpus.token_rows(export / "tokenizer.json", 1234, n, max_tokens=300)


@slow
def test_manifest_records_agreement_with_fp32(tiny_export: Path):
    """fp16 and int8 carry their agreement with fp32, measured at export time; fp32 does not.
    int8 records its weight encoding: this CPU's 8-bit one, as `prepare` makes it."""
    from bgeserve.model.prepared import int8_weights

    variants = json.loads((tiny_export / "manifest.json").read_text())["variants"]
    assert variants["int8"]["quantization"] == {"weights": int8_weights()}
    assert "agreement" not in variants["fp32"]
    for variant, tol in (("fp16", FP16), ("int8", INT8)):
        agreement = variants[variant]["agreement"]
        assert set(agreement) == {"dense_cos_min", "dense_cos_mean", "sparse_max_abs", "texts"}
        assert agreement["texts"] == 58 == (
            validate.VALIDATION_TEXTS + validate.SHORT_TEXTS + len(validate.EDGE_TEXTS))
        assert tol.dense_cos <= agreement["dense_cos_min"] <= agreement["dense_cos_mean"] <= 1.0
        assert 0.0 < agreement["sparse_max_abs"] < 0.1


@slow
def test_validation_batched_pass_drops_padding_and_keeps_order(tiny_export: Path):
    """The batched pass pads neighbours together; on fp32 it gives the lone-text results back
    (padding is masked), row for row in the caller's order."""
    from bgeserve.export import corpus

    rows = corpus.token_rows(tiny_export / "tokenizer.json", 99, 7, min_tokens=3, max_tokens=90)
    rows = rows[::-1]  # not in length order: results must come back in this order
    alone = validate._outputs(tiny_export, "fp32", rows)
    batched = validate._outputs(tiny_export, "fp32", rows, batch=validate.BATCH)
    np.testing.assert_allclose(batched[0], alone[0], atol=1e-5)
    for a, b, r in zip(alone[1], batched[1], rows, strict=True):
        assert len(a) == len(b) == len(r)
        np.testing.assert_allclose(b, a, atol=1e-5)
    assert validate.worse(validate.compare(alone, batched), validate.compare(alone, alone)) == \
        validate.compare(alone, batched)


@slow
def test_int8_graph_has_one_smoothing_mul_per_group(tiny_export: Path):
    """Q/K/V, O, FFN up and FFN down of every layer read their input through one Mul by 1/s
    (the FFN's inside its row-block Scan); the heads stay fp32 MatMuls."""
    import onnx
    from onnx import numpy_helper

    def nodes(graph):
        for node in graph.node:
            yield node
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from nodes(attr.g)

    layers = json.loads((tiny_export / "manifest.json").read_text())["model"]["layers"]
    model = onnx.load(str(tiny_export / "int8" / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    every = list(nodes(model.graph))
    muls = [n for n in every if n.op_type == "Mul" and n.name.startswith(smoothquant.PREFIX)]
    assert len(muls) == 4 * layers
    assert sorted(n.name.split("/")[-2] for n in muls) == sorted(["qkv", "o", "up", "down"]
                                                                  * layers)
    for mul in muls:
        inv_s = inits[mul.input[1]]
        assert inv_s.dtype == np.float32 and inv_s.ndim == 1 and np.all(inv_s > 0)
        readers = [n for n in every if mul.output[0] in n.input]
        assert readers and all(n.op_type != "MatMul" for n in readers)  # quantized, not fp32
    heads = [n for n in model.graph.node if n.name.startswith(("/sparse_linear/",
                                                                 "/colbert_linear/"))]
    assert {n.op_type for n in heads if "MatMul" in n.name} == {"MatMul"}


@slow
def test_smoothing_alone_keeps_the_fp32_outputs(tiny_export: Path, tiny_fp32_unblocked: Path,
                                                tmp_path: Path):
    """X/s · (s·W) = X·W: the smoothed fp32 graph (before quantization) computes the same."""
    import onnx

    fp32 = tiny_fp32_unblocked
    rows = _rows(tiny_export)
    model, summary = smoothquant.smooth(fp32, rows,
                                        head_prefixes=("/sparse_linear/", "/colbert_linear/"))
    layers = json.loads((tiny_export / "manifest.json").read_text())["model"]["layers"]
    assert summary["groups"] == 4 * layers and summary["calibration_texts"] == len(rows)
    onnx.save_model(model, str(tmp_path / "smoothed.onnx"))
    np.testing.assert_allclose(_dense(tmp_path / "smoothed.onnx", rows), _dense(fp32, rows),
                               atol=2e-5)


@slow
def test_int8_from_a_graph_with_external_data_equals_the_one_file_build(
        tiny_export: Path, tiny_fp32_unblocked: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch):
    """The full-size path: weights in an external file, read in place for calibration and
    written back external, then row-blocked in place; same int8 model as the export's."""
    import onnx

    from bgeserve.export import FFN_ROWS, steps

    fp32 = tmp_path / "fp32" / "model.onnx"
    fp32.parent.mkdir()
    onnx.save_model(onnx.load(str(tiny_fp32_unblocked)), str(fp32),
                    save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    monkeypatch.setattr(steps, "EXTERNAL_DATA_THRESHOLD", 0)  # tiny, but saved as if large
    out = tmp_path / "int8" / "model.onnx"
    weights = json.loads((tiny_export / "manifest.json").read_text())[
        "variants"]["int8"]["quantization"]["weights"]  # the export's encoding
    steps.export_int8(fp32, out, tiny_export / "tokenizer.json", weights=weights)
    steps.row_block([out], FFN_ROWS)
    assert (out.parent / "model.onnx.data").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    rows = _rows(tiny_export)
    np.testing.assert_allclose(_dense(out, rows), _dense(tiny_export / "int8" / "model.onnx",
                                                         rows), atol=1e-6)
