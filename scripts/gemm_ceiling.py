"""The fp32 GEMM ceiling of this CPU as ONNX Runtime sees it: one MatMul of bge-m3's FFN shape.

bge-m3 costs ~0.63 GFLOP per token (24 layers × (4·1024² + 2·1024·4096) multiply-adds × 2,
plus attention), so ``GFLOP/s / 0.63`` is the tokens/s no fp32 forward pass can beat here.

    .venv/bin/python scripts/gemm_ceiling.py [--rows 512] [--runs 30]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

HIDDEN, INTERMEDIATE = 1024, 4096
GFLOP_PER_TOKEN = 0.63


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512, help="tokens per MatMul")
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(
        rng.standard_normal((HIDDEN, INTERMEDIATE)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "ffn_up",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, INTERMEDIATE])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    x = rng.standard_normal((args.rows, HIDDEN)).astype(np.float32)
    for threads in (1, 2):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        session = ort.InferenceSession(model.SerializeToString(), opts,
                                       providers=["CPUExecutionProvider"])
        for _ in range(3):
            session.run(None, {"x": x})
        started = time.perf_counter()
        for _ in range(args.runs):
            session.run(None, {"x": x})
        seconds = (time.perf_counter() - started) / args.runs
        gflops = 2 * args.rows * HIDDEN * INTERMEDIATE / seconds / 1e9
        print(f"{threads} thread(s): {gflops:.1f} GFLOP/s -> at most "
              f"{gflops / GFLOP_PER_TOKEN:.0f} bge-m3 fp32 tokens/s")


if __name__ == "__main__":
    main()
