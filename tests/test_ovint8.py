"""The ov-int8 variant (export/ovint8.py): NNCF's int8 IR, what it leaves in float, its manifest
entry, and serving it. Parity with FlagEmbedding is in test_parity.py (case export-ov-int8).
Everything skips without openvino and nncf (bgeserve installs both on x86-64)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bgeserve.engine import Engine
from bgeserve.export import validate
from tests.oracle import INT8, _cos
from tests.test_service import TEXTS

pytestmark = pytest.mark.slow


def test_manifest_records_the_runtime_the_quantization_and_the_agreement(
        tiny_export_ov_int8: Path) -> None:
    """The entry names OpenVINO, what NNCF did (48 calibration texts; 8-bit weights on a CPU
    that sums int8 products in int32, else 7-bit; SmoothQuant's alpha), and the agreement with
    fp32 measured at export, alone and in padded batches."""
    from bgeserve.model.prepared import sums_int8_in_int32

    entry = json.loads((tiny_export_ov_int8 / "manifest.json").read_text())["variants"]["ov-int8"]
    assert entry["path"] == "ov-int8/model.xml" and entry["runtime"] == "openvino"
    quantization = entry["quantization"]
    assert quantization["calibration_texts"] == 48 and quantization["tool"].startswith("nncf ")
    assert quantization["weights"] == ("8-bit" if sums_int8_in_int32() else "7-bit")
    # The preset's alpha, measured first; 0.75 is tried only where the preset misses the bar
    # and kept only where it clears it (test_a_second_alpha_is_tried_...): on the tiny model it
    # does not (ovint8's note).
    assert quantization["smooth_quant_alpha"] == 0.95
    assert quantization["smooth_quant_tried"][0]["alpha"] == 0.95
    assert entry["agreement"]["texts"] == 58 == (
        validate.VALIDATION_TEXTS + validate.SHORT_TEXTS + len(validate.EDGE_TEXTS))
    assert entry["agreement"]["dense_cos_min"] >= INT8.dense_cos
    # The plain-attention graph it was made from is temporary; no report is left behind.
    assert sorted(p.name for p in (tiny_export_ov_int8 / "ov-int8").iterdir()) == [
        "model.bin", "model.xml"]
    assert not (tiny_export_ov_int8 / "openvino-plain-attention").exists()


def test_linear_layers_are_int8_and_attention_and_heads_stay_float(
        tiny_export_ov_int8: Path) -> None:
    """Every encoder linear layer takes a quantized input; the attention MatMuls (which
    OpenVINO fuses into its bounded-memory kernel only unquantized) and the two heads do not."""
    from bgeserve.runtime import openvino

    model = openvino._ov().Core().read_model(str(tiny_export_ov_int8 / "ov-int8" / "model.xml"))
    quantized = openvino.quantized_inputs(model)
    attention = set(openvino.attention_matmuls(model))
    heads = {n for n in quantized if "sparse_linear" in n or "colbert_linear" in n}
    assert len(attention) == 4 and len(heads) == 2  # 2 layers x (q.k, scores.v); 2 heads
    assert all(quantized[n] == 0 for n in attention | heads)
    linear = set(quantized) - attention - heads
    assert len(linear) == 12 and all(quantized[n] >= 1 for n in linear)  # 2 layers x 6
    from tests.test_openvino import _key_transposes

    assert _key_transposes(tiny_export_ov_int8 / "ov-int8" / "model.xml") == (0, 2)


def test_served_ov_int8_agrees_with_fp32_and_keeps_fused_attention(
        tiny_export_ov_int8: Path, tmp_path: Path) -> None:
    """The engine opens ov-int8 on OpenVINO; dense and sparse stay within the int8 tolerance of
    fp32, and the compiled model has no separate Softmax (its attention is fused)."""
    with Engine(tiny_export_ov_int8, "fp32", cache_dir=tmp_path) as engine:
        want = engine.embed(TEXTS, dense=True, sparse=True)
    with Engine(tiny_export_ov_int8, "ov-int8", cache_dir=tmp_path) as engine:
        got = engine.embed(TEXTS, dense=True, sparse=True)
    from bgeserve.runtime.openvino import SharedModel

    # What the registry compiles for the variant: its precision, and the compiled graph.
    owner = SharedModel(tiny_export_ov_int8 / "ov-int8" / "model.xml", precision="ov-int8",
                        threads=1, streams=1)
    compiled = owner._shared.acquire()
    try:
        layers = {op.get_rt_info()["layerType"].astype(str)
                  for op in compiled.get_runtime_model().get_ops()}
    finally:
        owner._shared.release()
    assert owner.precision == "bf16"  # the rest of the graph: bf16 where native, else fp32
    assert "Softmax" not in layers and "FullyConnected" in layers
    assert _cos(got.dense, want.dense).min() >= INT8.dense_cos
    for (gi, gv), (wi, wv) in zip(got.sparse, want.sparse):
        g, w = dict(zip(gi.tolist(), gv.tolist())), dict(zip(wi.tolist(), wv.tolist()))
        assert max(abs(g.get(k, 0.0) - w.get(k, 0.0)) for k in set(g) | set(w)) <= INT8.sparse_abs


@pytest.mark.parametrize(("int8_dot", "weights"), [(False, "7-bit"), (True, "8-bit")])
def test_the_export_step_takes_8_bit_weights_only_where_int8_sums_in_int32(
        int8_dot: bool, weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step asks NNCF for 8-bit weights on VNNI / AMX-INT8 CPUs (no saturation there),
    7-bit elsewhere, and reports what it used for the manifest."""
    from bgeserve.export import ovint8, steps
    from bgeserve.model import prepared

    asked: dict[str, object] = {}

    def quantize(plain, out, tokenizer, *, max_tokens=None, weights="7-bit"):
        asked["weights"] = weights
        return {"weights": weights}

    monkeypatch.setattr(prepared, "sums_int8_in_int32", lambda: int8_dot)
    monkeypatch.setattr(ovint8, "quantize_to_bar", quantize)
    report = tmp_path / "report.json"
    steps.export_ov_int8(tmp_path / "plain.onnx", tmp_path / "out.xml", tmp_path / "tok.json",
                         report)
    assert asked == {"weights": weights}
    assert json.loads(report.read_text()) == {"weights": weights}


@pytest.mark.parametrize(("preset", "fallback", "kept"), [
    (0.9991, None, 0.95),      # the preset keeps the bar: no second quantization
    (0.9989, 0.9992, 0.75),    # it misses, alpha 0.75 clears it: that graph replaces it
    (0.9980, 0.9985, 0.95),    # both miss (the tiny model): the preset's graph stays
])
def test_a_second_alpha_is_tried_and_kept_only_where_it_clears_the_bar(
        preset: float, fallback: float | None, kept: float, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """quantize_to_bar: alpha 0.75 only where the preset's graph misses MIN_DENSE_COS on the
    validation texts, and its graph kept only if it clears the bar; the report says which
    alpha was kept and what each measured; nothing is left beside the IR."""
    from bgeserve.export import ovint8

    figures = {0.95: preset, 0.75: fallback}
    made: list[float] = []

    def quantize(plain, out, tokenizer, *, max_tokens=None, weights="7-bit",
                 smooth_quant_alpha=ovint8.SMOOTH_QUANT_ALPHA):
        made.append(smooth_quant_alpha)
        out.write_text(str(smooth_quant_alpha))
        out.with_suffix(".bin").write_text(str(smooth_quant_alpha))
        return {"weights": weights, "smooth_quant_alpha": smooth_quant_alpha}

    monkeypatch.setattr(ovint8, "quantize", quantize)
    monkeypatch.setattr(validate, "texts", lambda tokenizer, max_tokens: ["rows"])
    monkeypatch.setattr(validate, "outputs_of", lambda path, runtime, rows: "ref")
    monkeypatch.setattr(validate, "against", lambda ref, path, runtime, rows: {
        "dense_cos_min": figures[float(path.read_text())]})
    out = tmp_path / "ov-int8" / "model.xml"
    out.parent.mkdir()
    done = ovint8.quantize_to_bar(tmp_path / "plain.onnx", out, tmp_path / "tok.json",
                                  weights="8-bit")
    assert made == ([0.95] if fallback is None else [0.95, 0.75])
    assert done["smooth_quant_alpha"] == kept and done["weights"] == "8-bit"
    assert done["smooth_quant_tried"] == [{"alpha": a, "dense_cos_min": figures[a]}
                                          for a in made]
    assert out.read_text() == out.with_suffix(".bin").read_text() == str(kept)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["model.bin", "model.xml", "ov-int8"]


def test_ov_int8_refuses_an_unknown_weight_encoding(tmp_path: Path) -> None:
    from bgeserve.export import ovint8

    with pytest.raises(ValueError, match="expected one of"):
        ovint8.quantize(tmp_path / "plain.onnx", tmp_path / "out.xml", tmp_path / "tok.json",
                        weights="6-bit")


def test_the_emulation_computes_what_an_int32_accumulating_kernel_does(
        tiny_export_ov_int8: Path) -> None:
    """scripts/int8_emulated.py rebuilds every FakeQuantize in float ops. Where this CPU's int8
    kernels are exact (7-bit weights without VNNI, the weights the export chose there), the
    rebuilt graph gives the served results back; and it still quantizes (it is
    not the fp32 graph)."""
    import importlib.util

    from bgeserve.model.prepared import sums_int8_in_int32

    if sums_int8_in_int32():
        # Measured on the first VNNI CPU this ran on (2-core AMD Zen 4, 2026-12-04): the
        # served 8-bit graph and its emulation differ by up to 8e-3 in the tiny model's dense
        # vector, so there the emulation is an approximation (at full size it read 0.99915
        # where the served graph reads 0.99918), not the kernel's exact result.
        pytest.skip("the emulation is exact only for 7-bit weights on a CPU without VNNI")

    import numpy as np
    import openvino as ov

    from bgeserve.export import corpus

    script = Path(__file__).resolve().parent.parent / "scripts" / "int8_emulated.py"
    spec = importlib.util.spec_from_file_location("int8_emulated_under_test", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    core = ov.Core()
    xml = str(tiny_export_ov_int8 / "ov-int8" / "model.xml")
    served, emulated = core.read_model(xml), core.read_model(xml)
    fake = sum(op.get_type_name() == "FakeQuantize" for op in emulated.get_ops())
    assert fake > 0 and module.emulate(emulated) == fake
    assert not any(op.get_type_name() == "FakeQuantize" for op in emulated.get_ops())
    rows = corpus.token_rows(tiny_export_ov_int8 / "tokenizer.json", 4321, 4, max_tokens=200)
    config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1}

    def dense(model) -> np.ndarray:
        compiled = core.compile_model(model, "CPU", config)
        request = compiled.create_infer_request()
        return np.stack([request.infer({"input_ids": r[None],
                                        "attention_mask": np.ones((1, len(r)), np.int64)})[
            compiled.output("dense")][0] for r in rows])

    got, want = dense(emulated), dense(served)
    np.testing.assert_allclose(got, want, atol=2e-4)
    fp32, _ = validate.outputs_of(tiny_export_ov_int8 / "fp32" / "model.onnx", "onnxruntime",
                                  rows)
    assert np.abs(fp32 - got).max() > 1e-3  # the quantization is still there


def test_each_calibration_pass_reports_its_progress(capsys) -> None:
    """NNCF's passes over the calibration texts are reported a quarter at a time on stderr
    (what `prepare` relays during its longest step); NNCF's peek at one sample is no pass, and
    a pass that stops at the last text without asking for more still reports it."""
    import itertools

    from bgeserve.export.ovint8 import _Progress

    samples = [{"input_ids": np.full((1, 3), k)} for k in range(8)]
    progress = _Progress(samples)
    next(iter(progress))
    assert list(progress) == samples and list(itertools.islice(progress, 8)) == samples
    assert len(progress) == 8
    assert capsys.readouterr().err.splitlines() == [
        f"[ov-int8] statistics pass {p}: text {i}/8" for p in (1, 2) for i in (2, 4, 6, 8)]
