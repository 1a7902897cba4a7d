"""Where an OpenVINO IR spends its time, by node type, and two IRs side by side.

    python scripts/ov_nodes.py EXPORT/ov-int8/model.xml --shape 4x256
    python scripts/ov_nodes.py OLD/ov-int8/model.xml --against NEW/ov-int8/model.xml \
        --shape 1x512 --shape 4x256 --shape 16x64 --rounds 6

One IR: OpenVINO's own per-node counters (``PERF_COUNT``) after a few warm runs at the shape,
summed by node type and by (type, kernel), with the node's share of the run: what the GEMMs
take against attention, layout and element-wise work. Two IRs: tokens per second of each at
every shape, in interleaved rounds (A B, then B A, ...), the medians and B/A, and the least
dense cosine between their outputs. Compiled as ``runtime/openvino.py`` compiles a variant (the
bf16 inference precision of bf16 and ov-int8, one stream, ``--threads``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def parse_shape(text: str) -> tuple[int, int]:
    batch, _, seq = text.lower().partition("x")
    if not (batch.isdigit() and seq.isdigit()) or int(batch) < 1 or int(seq) < 2:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected BATCHxSEQ, as 4x256")
    return int(batch), int(seq)


def inputs(shape: tuple[int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids as a tokenizer gives them (<s> first, </s> last, no padding) and the mask."""
    ids = np.random.default_rng(seed).integers(5, 1000, size=shape).astype(np.int64)
    ids[:, 0], ids[:, -1] = 0, 2
    return ids, np.ones(shape, np.int64)


def by_type(counters: list[tuple[str, str, float]]) -> tuple[dict[str, float],
                                                             dict[tuple[str, str], float]]:
    """Seconds by node type and by (type, kernel), from (type, kernel, seconds) counters."""
    types: dict[str, float] = defaultdict(float)
    kernels: dict[tuple[str, str], float] = defaultdict(float)
    for node_type, kernel, seconds in counters:
        types[node_type] += seconds
        kernels[(node_type, kernel)] += seconds
    return dict(types), dict(kernels)


def shares(totals: dict, top: int = 15) -> list[tuple[object, float, float]]:
    """The ``top`` largest entries as (key, milliseconds, % of all), largest first."""
    whole = sum(totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [(key, 1000 * value, 100 * value / whole) for key, value in ranked]


class Compiled:
    def __init__(self, xml: Path, threads: int, profile: bool = False):
        import openvino as ov

        from bgeserve.runtime.openvino import native_bf16

        config: dict[str, object] = {
            "INFERENCE_PRECISION_HINT": "bf16" if native_bf16() else "f32",
            "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads}
        if profile:
            config["PERF_COUNT"] = True
        self.model = ov.Core().compile_model(str(xml), "CPU", config)
        self.request = self.model.create_infer_request()
        self.names = [i.get_any_name() for i in self.model.inputs]

    def run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        result = self.request.infer({self.names[0]: ids, self.names[1]: mask})
        return np.array(result[self.model.outputs[0]])

    def counters(self) -> list[tuple[str, str, float]]:
        return [(p.node_type, p.exec_type, p.real_time.total_seconds())
                for p in self.request.profiling_info]


def profile(xml: Path, shape: tuple[int, int], threads: int, runs: int) -> None:
    compiled = Compiled(xml, threads, profile=True)
    ids, mask = inputs(shape)
    for _ in range(3):
        compiled.run(ids, mask)
    started = time.perf_counter()
    for _ in range(runs):
        compiled.run(ids, mask)
    seconds = (time.perf_counter() - started) / runs
    print(f"{xml} at {shape[0]}x{shape[1]}: {1000 * seconds:.1f} ms per run, "
          f"{shape[0] * shape[1] / seconds:.0f} tokens/s (last run's counters below)")
    types, kernels = by_type(compiled.counters())
    print("\n| node type | ms | share |\n|---|---|---|")
    for key, ms, share in shares(types):
        print(f"| {key} | {ms:.2f} | {share:.1f} % |")
    print("\n| node type, kernel | ms | share |\n|---|---|---|")
    for (node_type, kernel), ms, share in shares(kernels):
        print(f"| {node_type}, {kernel} | {ms:.2f} | {share:.1f} % |")


def against(a: Path, b: Path, shapes: list[tuple[int, int]], threads: int, rounds: int,
            tokens_per_pass: int) -> None:
    compiled = {"A": Compiled(a, threads), "B": Compiled(b, threads)}
    rates: dict[tuple[str, tuple[int, int]], list[float]] = defaultdict(list)
    least: dict[tuple[int, int], float] = {}
    for r in range(rounds):
        for shape in shapes:
            ids, mask = inputs(shape, seed=r)
            dense = {}
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                model = compiled[name]
                model.run(ids, mask)
                n = max(2, tokens_per_pass // (shape[0] * shape[1]))
                started = time.perf_counter()
                for _ in range(n):
                    dense[name] = model.run(ids, mask)
                rates[(name, shape)].append(n * shape[0] * shape[1]
                                            / (time.perf_counter() - started))
            cos = float((dense["A"] * dense["B"]).sum(-1).min())
            least[shape] = min(least.get(shape, 1.0), cos)
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    print(f"A = {a}\nB = {b}\n\n| shape | A tokens/s per round | B tokens/s per round | "
          "median A | median B | B/A | least dense cos |\n|---|---|---|---|---|---|---|")
    for shape in shapes:
        ra, rb = rates[("A", shape)], rates[("B", shape)]
        ma, mb = statistics.median(ra), statistics.median(rb)
        print(f"| {shape[0]}x{shape[1]} | {', '.join(f'{x:.0f}' for x in ra)} | "
              f"{', '.join(f'{x:.0f}' for x in rb)} | {ma:.0f} | {mb:.0f} | {mb / ma:.3f} | "
              f"{least[shape]:.6f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("xml", type=Path, help="an IR (model.xml) of a bf16 or ov-int8 export")
    parser.add_argument("--against", type=Path, help="a second IR: compare their speed")
    parser.add_argument("--shape", type=parse_shape, action="append",
                        help="BATCHxSEQ, repeatable (default 4x256)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=6, help="timed runs of the profile")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of --against")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="tokens each model runs per shape and round (--against)")
    args = parser.parse_args(argv)
    shapes = args.shape or [(4, 256)]
    if args.against is None:
        for shape in shapes:
            profile(args.xml, shape, args.threads, args.runs)
    else:
        against(args.xml, args.against, shapes, args.threads, args.rounds, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
