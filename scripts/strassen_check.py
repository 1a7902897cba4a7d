#!/usr/bin/env python3
"""Would one level of Strassen's algorithm make exact fp32 faster? (issue 17, item 3)

    python scripts/strassen_check.py [--threads 2] [--rounds 7]

For each of bge-m3's GEMM shapes (K×N: QKV 1024×3072, output 1024×1024, FFN 1024×4096 and
4096×1024) at 256 and 512 token rows, times ONNX Runtime's MatMul against one Strassen level
written as an ONNX graph (seven half-size MatMuls; the weight-side sums precomputed, as an
export would store them: 1.75× the weights), interleaved, medians. Prints each shape's
GFLOP/s, the ratio and both max |error| against float64. numpy's BLAS is timed beside ORT on
the FFN shape, as a second opinion on the fp32 ceiling.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import ModelProto
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

SHAPES = [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]
ROWS = (256, 512)


def _model(nodes, inits, k: int, n: int, opset: int) -> ModelProto:
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("A", T.FLOAT, ["M", k])],
                         [h.make_tensor_value_info("C", T.FLOAT, ["M", n])], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def plain(w: np.ndarray) -> ModelProto:
    return _model([h.make_node("MatMul", ["A", "W"], ["C"])], [nh.from_array(w, "W")],
                  *w.shape, 17)


def strassen(w: np.ndarray) -> ModelProto:
    """C = A·W by one Strassen level (A's rows even)."""
    k, n = w.shape[0] // 2, w.shape[1] // 2
    b11, b12, b21, b22 = w[:k, :n], w[:k, n:], w[k:, :n], w[k:, n:]
    weights = {"T1": b11 + b22, "T2": b11, "T3": b12 - b22, "T4": b21 - b11, "T5": b22,
               "T6": b11 + b12, "T7": b21 + b22}
    nodes = [h.make_node("Split", ["A"], ["R0", "R1"], axis=0, num_outputs=2),
             h.make_node("Split", ["R0"], ["A11", "A12"], axis=1, num_outputs=2),
             h.make_node("Split", ["R1"], ["A21", "A22"], axis=1, num_outputs=2)]

    def op(kind: str, a: str, b: str, out: str) -> None:
        nodes.append(h.make_node(kind, [a, b], [out]))

    op("Add", "A11", "A22", "S1"), op("Add", "A21", "A22", "S2"), op("Sub", "A21", "A11", "S3")
    op("Add", "A11", "A12", "S4"), op("Sub", "A12", "A22", "S5")
    for i, a in enumerate(["S1", "S2", "A11", "A22", "S4", "S3", "S5"], start=1):
        op("MatMul", a, f"T{i}", f"M{i}")
    op("Add", "M1", "M4", "c1"), op("Sub", "c1", "M5", "c2"), op("Add", "c2", "M7", "C11")
    op("Add", "M3", "M5", "C12"), op("Add", "M2", "M4", "C21")
    op("Sub", "M1", "M2", "d1"), op("Add", "d1", "M3", "d2"), op("Add", "d2", "M6", "C22")
    nodes += [h.make_node("Concat", ["C11", "C12"], ["Q0"], axis=1),
              h.make_node("Concat", ["C21", "C22"], ["Q1"], axis=1),
              h.make_node("Concat", ["Q0", "Q1"], ["C"], axis=0)]
    return _model(nodes, [nh.from_array(v, name) for name, v in weights.items()], *w.shape, 18)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--runs", type=int, default=5, help="runs per timing")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads

    def timed(fn) -> float:
        started = time.perf_counter()
        for _ in range(args.runs):
            fn()
        return (time.perf_counter() - started) / args.runs

    for k, n in SHAPES:
        w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        sessions = [ort.InferenceSession(m(w).SerializeToString(), options)
                    for m in (plain, strassen)]
        for m in ROWS:
            a = rng.standard_normal((m, k)).astype(np.float32)
            exact = a.astype(np.float64) @ w.astype(np.float64)
            errors = [float(np.abs(s.run(None, {"A": a})[0] - exact).max()) for s in sessions]
            times: list[list[float]] = [[], [], []]
            for _ in range(args.rounds):
                for i, s in enumerate(sessions):
                    times[i].append(timed(lambda s=s, a=a: s.run(None, {"A": a})))
                if (k, n) == (1024, 4096):
                    times[2].append(timed(lambda a=a, w=w: a @ w))
            ort_s, strassen_s = np.median(times[0]), np.median(times[1])
            flop = 2 * m * k * n / 1e9
            blas = f", numpy {flop / np.median(times[2]):.0f} GFLOP/s" if times[2] else ""
            print(f"{m}x{k}x{n}: MatMul {ort_s * 1e3:.2f} ms ({flop / ort_s:.0f} GFLOP/s{blas}), "
                  f"Strassen {strassen_s * 1e3:.2f} ms: {ort_s / strassen_s:.3f}x; "
                  f"max |error| {errors[0]:.1e} / {errors[1]:.1e}", flush=True)


if __name__ == "__main__":
    main()
