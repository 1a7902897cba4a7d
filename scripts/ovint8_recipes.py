#!/usr/bin/env python3
"""ov-int8 recipes: NNCF settings side by side, accuracy vs the fp32 graph and speed (issue 17).

    .venv/bin/python scripts/ovint8_recipes.py --plain PLAIN/fp32/model.onnx \\
        --tokenizer MODEL_DIR/tokenizer.json --out /tmp/ovrec [--recipes base,sq75,wc8] \\
        [--rounds 3]

``--plain`` is a plain-attention fp32 export (``bgeserve export --variant fp32
--attention-block 0``), the graph the ov-int8 variant is quantized from. Each recipe is built
by ``bgeserve.export.ovint8.quantize`` (this CPU's weight encoding) in a child of its own, one
at a time (a recipe with ``--out/NAME/agreement.json`` from an earlier invocation is neither
built nor measured again). Then, in one child each, its agreement with the fp32 graph (ONNX
Runtime) as the export's validation measures it (alone and in padded batches, the worse of the
two; the fp32 outputs computed once and kept in ``--out``) on two sets of texts: the validation texts (32 of 16-512
tokens + 4 short) and ``--holdout`` texts drawn with another seed, so that a recipe picked on
the first set is checked on texts nobody tuned on. Last, speed: ``--rounds`` interleaved
rounds, a fresh child per recipe and round, each timing OpenVINO (as served: the bf16 hint,
``--threads``) over a fixed list of chunk shapes; tokens/s per round and the median.

Recipes (``--list``):
    base   NNCF's transformer preset as it comes (SmoothQuant alpha 0.95, mixed preset): the
           export's recipe
    sq50 / sq75 / nosq   base with SmoothQuant alpha 0.5 / 0.75 / off
    ffn2   base + the FFN down-projections (the MatMul after the GELU) kept in float
    edge   base + every linear layer of the first and the last encoder layer kept in float
    wc8    weight-only int8 (NNCF compress_weights INT8_SYM, per channel); OpenVINO quantizes
           the activations at run time per token and 32 channels (its default group size)
    wc8-dq0 / wc8-dq1024   the same graph with that dynamic quantization off / per 1024
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# name: (SmoothQuant alpha for the MatMuls, which linear layers stay in float)
RECIPES: dict[str, tuple[float, str]] = {
    "base": (0.95, ""), "sq50": (0.5, ""), "sq75": (0.75, ""), "nosq": (-1.0, ""),
    "ffn2": (0.95, "ffn2"), "edge": (0.95, "edge"),
}
# Weight-only int8 (nncf.compress_weights, INT8_SYM per channel, heads in float): OpenVINO's
# CPU plugin quantizes the activations itself, per token and per DYNAMIC_QUANTIZATION_GROUP_SIZE
# input channels, at run time; name: that group size (None: the plugin's default, 32; 0: off,
# the weights are only decompressed).
WEIGHT_ONLY: dict[str, int | None] = {"wc8": None, "wc8-dq0": 0, "wc8-dq1024": 1024}
SHAPES = [(8, 128), (4, 256), (2, 512), (16, 64), (1, 384)]  # (rows, tokens) per chunk
HOLDOUT_SEED = 90_210
REAL_SHARED_MODEL = None  # set in main: runtime.openvino.SharedModel (compiled_as_recipe() patches it)
LINEAR_PER_LAYER = 6  # Q, K, V, attention output, FFN up, FFN down


def float_layers(plain: Path, which: str) -> list[str]:
    """Names of the encoder's linear MatMuls that ``which`` keeps in float, found by shape
    (the graph's node names are the exporter's): a MatMul by a 2-D weight, in graph order,
    six per layer; the FFN down-projection is the one whose weight narrows (4096 -> 1024)."""
    import onnx

    graph = onnx.load(str(plain), load_external_data=False).graph
    weights = {i.name: list(i.dims) for i in graph.initializer if len(i.dims) == 2}
    linear = [(n.name, weights[n.input[1]]) for n in graph.node
              if n.op_type == "MatMul" and n.input[1] in weights
              and not any(h in n.name for h in ("sparse_linear", "colbert_linear"))]
    layers = [linear[i:i + LINEAR_PER_LAYER] for i in range(0, len(linear), LINEAR_PER_LAYER)]
    if which == "ffn2":
        return [name for name, (rows, cols) in linear if rows > cols]
    if which == "edge":
        return [name for name, _ in layers[0] + layers[-1]]
    return []


def build(args: argparse.Namespace, name: str) -> dict[str, object]:
    from bgeserve.export import ovint8

    if name in WEIGHT_ONLY:
        return compress(args, name)
    alpha, which = RECIPES[name]
    keep = tuple(re.escape(n) for n in float_layers(args.plain, which))
    return ovint8.quantize(args.plain, args.out / name / "model.xml", args.tokenizer,
                           weights=ovint8.weights_here(), smooth_quant_alpha=alpha,
                           float_patterns=keep)


def compress(args: argparse.Namespace, name: str) -> dict[str, object]:
    from bgeserve.export import ovint8
    from bgeserve.runtime import openvino

    nncf = ovint8.import_nncf()
    started = time.monotonic()
    graph = args.out / "wc8" / "model.xml"
    if not graph.exists():  # the wc8 recipes differ only in how it is compiled
        model = openvino.read_model(args.plain)
        compressed = nncf.compress_weights(
            model, mode=nncf.CompressWeightsMode.INT8_SYM,
            ignored_scope=nncf.IgnoredScope(patterns=ovint8.HEAD_PATTERNS, validate=False))
        openvino.save_model(compressed, graph)
    (args.out / name).mkdir(parents=True, exist_ok=True)
    for suffix in (".xml", ".bin"):
        target = args.out / name / f"model{suffix}"
        if not target.exists():
            target.symlink_to(graph.with_suffix(suffix))
    return {"weight_only": "int8_sym", "dq_group": WEIGHT_ONLY[name],
            "seconds": round(time.monotonic() - started, 1)}


def open_model(args: argparse.Namespace, name: str, threads: int):  # a SharedModel
    """The recipe's graph as served (the bf16 hint), with a wc8 recipe's dynamic quantization
    group size."""
    from bgeserve.runtime import openvino
    from bgeserve.runtime.common import Shared

    model = REAL_SHARED_MODEL(args.out / name / "model.xml", precision="ov-int8",
                              threads=threads, streams=1)
    group = WEIGHT_ONLY.get(name)
    if group is not None:
        def compile_with_group():
            config = {"INFERENCE_PRECISION_HINT": "bf16", "NUM_STREAMS": 1,
                      "PERFORMANCE_HINT": "LATENCY", "DYNAMIC_QUANTIZATION_GROUP_SIZE": group}
            if threads:
                config["INFERENCE_NUM_THREADS"] = threads
            return openvino._ov().Core().compile_model(str(model.path), "CPU", config)

        model._shared = Shared(compile_with_group)
    return model


@contextlib.contextmanager
def compiled_as_recipe(args: argparse.Namespace, name: str):
    """``export.validate`` compiles the recipe's graph as ``open_model`` does, meanwhile."""
    from bgeserve.runtime import openvino

    openvino.SharedModel = lambda path, **kw: open_model(args, name, 0)  # type: ignore[misc]
    try:
        yield
    finally:
        openvino.SharedModel = REAL_SHARED_MODEL  # type: ignore[misc]


def agreement(args: argparse.Namespace, name: str) -> dict[str, object]:
    """As ``export.validate.agreement_with`` measures it, the fp32 outputs computed once (and
    kept in --out) for all recipes."""
    import pickle

    from bgeserve.export import corpus, validate

    sets = {"validation": validate.texts(args.tokenizer),
            "holdout": corpus.token_rows(args.tokenizer, HOLDOUT_SEED, args.holdout)}
    found: dict[str, object] = {}
    for label, rows in sets.items():
        cached = args.out / f"reference-{label}-{len(rows)}.pkl"
        if not cached.exists():
            cached.write_bytes(pickle.dumps(validate.outputs_of(args.plain, "onnxruntime", rows)))
        ref = pickle.loads(cached.read_bytes())
        with compiled_as_recipe(args, name):
            found[label] = validate.against(ref, args.out / name / "model.xml", "openvino", rows)
    return found


def speed(args: argparse.Namespace, name: str) -> dict[str, object]:
    import numpy as np

    session = open_model(args, name, args.threads).session()
    rng = np.random.default_rng(0)
    feeds = [(rng.integers(5, 1000, (b, s)), np.ones((b, s), np.int64)) for b, s in SHAPES]
    for ids, mask in feeds:  # compile each shape's kernels before the clock
        session.run(ids, mask, outputs=["dense"])
    started, tokens = time.perf_counter(), 0
    for _ in range(args.passes):
        for ids, mask in feeds:
            session.run(ids, mask, outputs=["dense", "sparse_weights"])
            tokens += ids.size
    seconds = time.perf_counter() - started
    session.close()
    return {"tokens_per_s": round(tokens / seconds, 1)}


def child(args: argparse.Namespace, what: str, name: str) -> dict[str, object]:
    argv = [sys.executable, __file__, "--plain", str(args.plain), "--tokenizer",
            str(args.tokenizer), "--out", str(args.out), "--threads", str(args.threads),
            "--passes", str(args.passes), "--holdout", str(args.holdout), "--child", what, name]
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit(f"{what} {name}: exit {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", type=Path)
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/ovrec"))
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--holdout", type=int, default=64)
    parser.add_argument("--skip-build", action="store_true", help="reuse --out's graphs")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("WHAT", "RECIPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list:
        print(__doc__.split("Recipes (``--list``):\n")[1])
        return 0
    if args.child:
        global REAL_SHARED_MODEL
        from bgeserve.runtime.openvino import SharedModel

        REAL_SHARED_MODEL = SharedModel
        what, name = args.child
        print(json.dumps({"build": build, "agreement": agreement, "speed": speed}[what](
            args, name)))
        return 0
    names = args.recipes.split(",")
    unknown = set(names) - set(RECIPES) - set(WEIGHT_ONLY)
    if unknown or not args.plain or not args.tokenizer:
        parser.error(f"--plain and --tokenizer are needed; unknown recipes: {sorted(unknown)}")
    report: dict[str, dict[str, object]] = {n: {} for n in names}
    for name in names:
        found = args.out / name / "agreement.json"  # a recipe measured before is reused
        if not found.exists():
            if not args.skip_build:
                report[name]["build"] = child(args, "build", name)
            report[name].update(child(args, "agreement", name))
            found.write_text(json.dumps(report[name]))
        report[name] = json.loads(found.read_text())
        print(json.dumps({name: report[name]}), flush=True)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            rate = child(args, "speed", name)["tokens_per_s"]
            rates[name].append(float(rate))  # type: ignore[arg-type]
    for name in names:
        report[name]["tokens_per_s"] = rates[name]
        report[name]["median"] = statistics.median(rates[name])
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
