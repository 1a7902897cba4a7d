"""This CPU's GEMM ceilings, per precision, as the runtimes bgeserve serves with see them.

One MatMul of bge-m3's FFN shape (``--rows`` tokens × 1024 → 4096), timed in each precision a
variant computes in:

- ``fp32``: ONNX Runtime (MLAS), the fp32 variant;
- ``int8-ort``: ONNX Runtime's dynamic int8 MatMul (per-channel weights in the 8-bit encoding
  this CPU's int8 variant gets, ``prepared.int8_weights``; activations quantized per run), the
  int8 variant;
- ``bf16-openvino``: OpenVINO with ``INFERENCE_PRECISION_HINT=bf16`` (AMX / AVX512_BF16; a CPU
  without native bf16 runs it in fp32, and the line says so), the bf16 variant;
- ``int8-openvino``: the same MatMul quantized by NNCF as the ov-int8 variant is (8-bit weights
  where the CPU sums int8 products in int32, else 7-bit), compiled with the bf16 hint.

bge-m3 costs ~0.63 GFLOP per token (24 layers × (8·1024² + 4·1024·4096) FLOPs, plus attention:
``scripts/benchkit/roofline.py``), so ``GFLOP/s / 0.63`` is the tokens/s no forward pass in that
precision can beat here; ``scripts/bench.py`` divides each path's figure by its precision's
ceiling. A runtime that is not installed is skipped.

    .venv/bin/python scripts/gemm_ceiling.py [--rows 512] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from bgeserve.model import prepared

HIDDEN, INTERMEDIATE = 1024, 4096
GFLOP_PER_TOKEN = 0.63
PRECISIONS = ("fp32", "int8-ort", "bf16-openvino", "int8-openvino")


def _time(run: Callable[[], object], seconds: float) -> float:
    """Seconds of the fastest call: 3 warm-up calls, then calls until ``seconds`` have passed
    (≥ 5). A ceiling is what the machine can do: the fastest call is the one the least
    disturbed by whatever else runs (on a shared machine the mean of a loaded second was a
    fifth of the quiet figure, and corpus rows then read > 100 % of their roofline)."""
    for _ in range(3):
        run()
    best, calls, started = float("inf"), 0, time.perf_counter()
    while calls < 5 or time.perf_counter() - started < seconds:
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
        calls += 1
    return best


def _onnx_matmul(weight: np.ndarray) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "ffn_up",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, INTERMEDIATE])],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model.SerializeToString()


def _ort(model: bytes | str, threads: int) -> Callable[[np.ndarray], object]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x})


def ort_fp32(weight: np.ndarray, threads: int) -> Callable[[np.ndarray], object]:
    return _ort(_onnx_matmul(weight), threads)


def ort_int8(weight: np.ndarray, threads: int) -> Callable[[np.ndarray], object]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        src.write_bytes(_onnx_matmul(weight))
        unsigned = prepared.int8_weights() == "u8"  # the int8 variant's encoding here
        quantize_dynamic(str(src), str(dst), per_channel=True,
                         weight_type=QuantType.QUInt8 if unsigned else QuantType.QInt8)
        return _ort(dst.read_bytes(), threads)


def _ov_model(weight: np.ndarray):
    import openvino as ov
    from openvino import opset13 as ops

    x = ops.parameter([-1, HIDDEN], np.float32, name="x")
    return ov.Model([ops.matmul(x, ops.constant(weight), False, False)], [x], "ffn_up")


def _ov_compile(model, threads: int) -> Callable[[np.ndarray], object]:
    import openvino as ov

    compiled = ov.Core().compile_model(model, "CPU", {
        "INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": threads,
        "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    return lambda x: request.infer({0: x})


def ov_bf16(weight: np.ndarray, threads: int) -> Callable[[np.ndarray], object]:
    return _ov_compile(_ov_model(weight), threads)


def ov_int8(weight: np.ndarray, threads: int) -> Callable[[np.ndarray], object]:
    from bgeserve.export import ovint8

    nncf = ovint8.import_nncf()  # with its telemetry off, as the export's step imports it
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters

    rng = np.random.default_rng(1)
    data = [rng.standard_normal((64, HIDDEN)).astype(np.float32) for _ in range(4)]
    model = nncf.quantize(_ov_model(weight), nncf.Dataset(data), subset_size=len(data),
                          fast_bias_correction=False, advanced_parameters=(
                              AdvancedQuantizationParameters(
                                  overflow_fix=ovint8.overflow_fix(ovint8.weights_here()))))
    return _ov_compile(model, threads)


def native_bf16() -> bool | None:
    """Whether OpenVINO runs bf16 natively here (None: openvino missing)."""
    try:
        import openvino as ov
    except ImportError:
        return None
    return "BF16" in [str(c).upper() for c in
                      ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]


OPENERS = {"fp32": ort_fp32, "int8-ort": ort_int8, "bf16-openvino": ov_bf16,
           "int8-openvino": ov_int8}


def measure(rows: int, threads: int, seconds: float = 1.0) -> dict[str, object]:
    """{precision: GFLOP/s or None when its runtime is missing}, plus ``bf16_native``."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((HIDDEN, INTERMEDIATE)).astype(np.float32) * 0.03
    x = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
    out: dict[str, object] = {"rows": rows, "threads": threads, "bf16_native": native_bf16()}
    for name in PRECISIONS:
        try:
            run = OPENERS[name](weight, threads)
        except ImportError as exc:
            print(f"{name}: skipped ({exc})", file=sys.stderr)
            out[name] = None
            continue
        out[name] = 2 * rows * HIDDEN * INTERMEDIATE / _time(partial(run, x), seconds) / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512, help="tokens per MatMul")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=1.0, help="timing per precision")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    found = measure(args.rows, args.threads, args.seconds)
    if args.json:
        print(json.dumps(found))
        return 0
    for name in PRECISIONS:
        value = found[name]
        if value is None:
            continue
        note = " (no native bf16 here: runs in fp32)" if (
            name != "fp32" and "openvino" in name and found["bf16_native"] is False
            and name.startswith("bf16")) else ""
        print(f"{name}: {value:.1f} GFLOP/s with {args.threads} thread(s) -> at most "
              f"{value / GFLOP_PER_TOKEN:.0f} bge-m3 tokens/s{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
