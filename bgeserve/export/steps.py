"""The export steps, each meant to run in its own process (see ``main.py``).

One step of the full-size model peaks near 6 GiB, and torch and ONNX Runtime do not give all
memory back: running fp32, fp16 and int8 in one process peaked near 18 GiB. A process per step
keeps the peak at the largest single step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bgeserve.export import REFUSED, corpus
from bgeserve.model.kind import RERANKER, directory_kind

# ONNX protobufs cannot exceed 2 GiB; bigger graphs keep their weights in one external file.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
# Head nodes (bge-m3's two heads, a reranker's classifier): the int8 step keeps them fp32.
HEAD_NODE_PREFIXES = ("/sparse_linear/", "/colbert_linear/", "/classifier/")


def _log(msg: str, started: float) -> None:
    print(f"[export {time.monotonic() - started:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _save(model, out: Path) -> None:
    """Save an ONNX ModelProto, with one external data file when it is large."""
    import onnx

    out.parent.mkdir(parents=True, exist_ok=True)
    big = model.ByteSize() > EXTERNAL_DATA_THRESHOLD if _fits_protobuf(model) else True
    if big:
        data = out.name + ".data"
        (out.parent / data).unlink(missing_ok=True)
        onnx.save_model(model, str(out), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data, size_threshold=1024)
        # onnx writes the data file 0600; a model shared through a volume must be readable.
        os.chmod(out.parent / data, 0o644)
    else:
        onnx.save_model(model, str(out))


def _fits_protobuf(model) -> bool:
    try:
        return model.ByteSize() < 2**31 - 1
    except Exception:  # noqa: BLE001 - protobuf raises once the message passes 2 GiB
        return False


def export_fp32(model_dir: Path, out: Path, opset: int, layout: str = "bgeserve",
                attention_block: int | None = None) -> None:
    """PyTorch bge-m3 → ONNX fp32 with the heads in the graph (or a hub-like layout); a
    sequence-classification checkpoint (bge-reranker-v2-m3) → its ``score`` graph."""
    import onnx
    import torch

    from bgeserve.export import ATTENTION_BLOCK

    started = time.monotonic()
    _log(f"loading {model_dir}", started)
    block = ATTENTION_BLOCK if attention_block is None else attention_block
    if directory_kind(model_dir) == RERANKER:
        module, outputs, dynamic = _reranker_module(model_dir, layout, block)
    else:
        module, outputs, dynamic = _embedding_module(model_dir, layout, block)
    ids = torch.tensor([[0, 5, 6, 7, 2], [0, 8, 2, 1, 1]], dtype=torch.int64)
    mask = (ids != 1).to(torch.int64)
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        raw = Path(tmp) / "raw.onnx"
        _log(f"tracing and exporting (opset {opset})", started)
        with torch.no_grad():
            torch.onnx.export(module, (ids, mask), str(raw), input_names=["input_ids",
                              "attention_mask"], output_names=outputs, dynamic_axes=dynamic,
                              opset_version=opset, do_constant_folding=True, dynamo=False,
                              custom_opsets={"com.microsoft": 1})
        del module
        _log("consolidating weights", started)
        model = onnx.load(str(raw), load_external_data=True)
        _save(model, out)
    _log(f"wrote {out}", started)


_INPUT_AXES = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}


def _reranker_module(model_dir: Path, layout: str, block: int):
    """The reranker's module, output names and dynamic axes: ``score`` [B] (bgeserve), or
    ``logits`` [B, 1] with plain attention (``logits``: the layout of a stock hub ONNX)."""
    from bgeserve.export.rerank_graph import LogitsGraph, load_rerank_graph

    if layout not in ("bgeserve", "logits"):
        raise ValueError(f"a reranker exports as the bgeserve or logits layout, not {layout!r}")
    if layout == "logits":
        return (LogitsGraph(load_rerank_graph(model_dir, 0)), ["logits"],
                {**_INPUT_AXES, "logits": {0: "batch"}})
    return load_rerank_graph(model_dir, block), ["score"], {**_INPUT_AXES, "score": {0: "batch"}}


def _embedding_module(model_dir: Path, layout: str, block: int):
    """bge-m3's module, output names and dynamic axes for ``layout``."""
    import torch

    from bgeserve.export.graph import OUTPUTS, HiddenGraph, load_graph

    # The hub layouts reproduce the reference graphs: plain attention.
    graph = load_graph(model_dir, block if layout == "bgeserve" else 0)
    module: torch.nn.Module = graph
    outputs = list(OUTPUTS)
    dynamic = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
               "dense": {0: "batch"}, "sparse_weights": {0: "batch", 1: "seq"},
               "colbert": {0: "batch", 1: "seq_minus_1"}}
    if layout != "bgeserve":
        module = HiddenGraph(graph, layout)
        outputs = (["sentence_embedding", "token_embeddings"] if layout == "baai"
                   else ["last_hidden_state"])
        dynamic = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                   "sentence_embedding": {0: "batch"},
                   "token_embeddings": {0: "batch", 1: "seq"},
                   "last_hidden_state": {0: "batch", 1: "seq"}}
        dynamic = {k: v for k, v in dynamic.items() if k in outputs or k.startswith(("input",
                                                                                      "attention"))}
    return module, outputs, dynamic


def export_fp16(fp32: Path, out: Path, heads: int = 0, hidden: int = 0) -> None:
    """fp16 weights and compute, float32 inputs/outputs, via ONNX Runtime's float16 converter.

    The converter is applied to the graph as exported (no fusion pass first): the optimizer's
    topological sort breaks the attention Loop's references to outer-scope constants.
    """
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    started = time.monotonic()
    _log(f"converting {fp32} to fp16", started)
    model = onnx.load(str(fp32), load_external_data=True)
    big = not _fits_protobuf(model) or model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    model = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=big)
    _save(model, out)
    _log(f"wrote {out}", started)


INT8_RECIPES = ("smoothquant", "dynamic")
CALIBRATION_TEXTS = 16
INT8_WEIGHTS = ("s7", "s8", "u8")  # export_int8's weight encodings


def export_int8(fp32: Path, out: Path, tokenizer: Path | None = None,
                recipe: str = "smoothquant", max_tokens: int | None = None,
                weights: str = "s7", pairs: bool = False) -> None:
    """int8 MatMul weights (dynamic quantization, per channel); heads stay fp32.

    ``smoothquant`` (the export's recipe) first smooths the fp32 graph with activation maxima
    from CALIBRATION_TEXTS texts made with ``tokenizer`` (see smoothquant.py); ``dynamic``
    quantizes the graph as it is (the recipe before SmoothQuant; the tests' stand-in for
    Xenova's hub graph uses it). ``pairs``: calibrate on (query, document) pairs, as a
    reranker's graph sees them.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if recipe not in INT8_RECIPES:
        raise ValueError(f"int8 recipe {recipe!r}: expected one of {INT8_RECIPES}")
    if recipe == "smoothquant" and tokenizer is None:
        raise ValueError("the smoothquant int8 recipe needs a tokenizer for its calibration")
    started = time.monotonic()
    model = onnx.load(str(fp32), load_external_data=False)
    exclude = [n.name for n in model.graph.node if n.name.startswith(HEAD_NODE_PREFIXES)]
    big = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    del model
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = fp32
        if recipe == "smoothquant":
            from bgeserve.export import smoothquant

            assert tokenizer is not None  # checked above
            make = corpus.pair_rows if pairs else corpus.token_rows
            rows = make(tokenizer, corpus.CALIBRATION_SEED, CALIBRATION_TEXTS,
                        max_tokens=corpus.capped(max_tokens))
            _log(f"smoothing {fp32} (SmoothQuant, {len(rows)} calibration texts)", started)
            model, summary = smoothquant.smooth(fp32, rows, head_prefixes=HEAD_NODE_PREFIXES)
            # quantize_dynamic reads a path (given a proto, it would copy it twice more).
            src = Path(tmp) / "smoothed" / "model.onnx"
            _save(model, src)
            del model
            _log(f"smoothed: {summary}", started)
        _log(f"quantizing {src} (int8, per channel; {len(exclude)} head nodes kept fp32)",
             started)
        raw = Path(tmp) / "model.onnx"
        # weights: s7 = signed 7-bit (reduce_range), what a portable export writes: without
        # VNNI (AVX2-only CPUs), MLAS's u8 x s8 kernel sums pairs of products into int16
        # (vpmaddubsw), which saturates for 8-bit weights (on a Zen 3 the tiny model's int8
        # dense cosine fell to 0.971), and an export may be served on any CPU. `prepare` makes
        # its graph on the machine that serves it (prepared.int8_weights): s8 (signed 8-bit)
        # where VNNI/AMX sum into int32, u8 (unsigned 8-bit: MLAS's u8 x u8 kernels widen to
        # 16 bits first and cannot saturate) elsewhere; 8 bits agree better (0.99942 vs
        # 0.99879 dense cosine min on the full-size random model, docs/benchmarks.md).
        if weights not in INT8_WEIGHTS:
            raise ValueError(f"int8 weights {weights!r}: expected one of {INT8_WEIGHTS}")
        quantize_dynamic(str(src), str(raw),
                         weight_type=QuantType.QUInt8 if weights == "u8" else QuantType.QInt8,
                         per_channel=True, reduce_range=weights == "s7",
                         op_types_to_quantize=["MatMul", "Gemm"], nodes_to_exclude=exclude,
                         use_external_data_format=big,
                         # Shape inference cannot see through the com.microsoft attention op;
                         # every tensor it would quantize is float.
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        if big:
            _save(onnx.load(str(raw), load_external_data=True), out)
        else:
            shutil.move(str(raw), out)
    _log(f"wrote {out}", started)


def row_block(graphs: list[Path], rows: int) -> None:
    """Rewrite each graph so every layer's FFN runs in blocks of ``rows`` tokens (rowblock.py).

    Run after the int8 step, which smooths and quantizes the main graph's MatMuls and would not
    find the FFN's inside a Scan. Only the graph proto is rewritten: external weights stay as
    they are on disk (their references are kept), inline ones stay inline.
    """
    import onnx

    from bgeserve.export.rowblock import row_block_ffn

    started = time.monotonic()
    for path in graphs:
        model = onnx.load(str(path), load_external_data=False)
        layers = row_block_ffn(model, rows)
        onnx.save_model(model, str(path))
        del model
        _log(f"{path}: FFN of {layers} layers in blocks of {rows} tokens", started)


def validate(export_dir: Path, variants: list[str], tokenizer: Path, result: Path,
             max_tokens: int | None = None, kind: str = "embedding") -> None:
    """Agreement of ``variants`` with the export's fp32 graph, as JSON in ``result``
    (embeddings: vectors; a reranker: scores and rankings)."""
    import json

    from bgeserve.export import rerank_validate
    from bgeserve.export import validate as embedding_validate

    agreement = rerank_validate.agreement if kind == RERANKER else embedding_validate.agreement

    started = time.monotonic()
    _log(f"validating {', '.join(variants)} against fp32", started)
    found = agreement(export_dir, variants, tokenizer, max_tokens=corpus.capped(max_tokens))
    for variant, figures in found.items():
        _log(f"{variant}: {figures}", started)
    result.write_text(json.dumps(found, indent=1))


def export_openvino(plain_fp32: Path, out: Path) -> None:
    """The bf16 variant: an OpenVINO IR of the plain-attention fp32 graph, weights stored fp16.

    OpenVINO computes it in bf16 where the CPU has it (runtime/openvino.py); it fuses the
    plain attention into its own bounded-memory kernel, and crashes on the ONNX Loop of the
    blocked attention, hence a plain graph for this variant only.
    """
    from bgeserve.runtime.openvino import save_ir

    started = time.monotonic()
    _log(f"converting {plain_fp32} to an OpenVINO IR (fp16 weights)", started)
    save_ir(plain_fp32, out)
    _log(f"wrote {out}", started)


def export_ov_int8(plain_fp32: Path, out: Path, tokenizer: Path, report: Path,
                   max_tokens: int | None = None) -> None:
    """The ov-int8 variant: NNCF int8 quantization of the plain-attention graph (ovint8.py),
    its weights 8-bit where this CPU sums int8 products in int32 (VNNI, AMX-INT8), else 7-bit.

    An 8-bit graph would saturate on a CPU without that, so its manifest entry says
    ``"weights": "8-bit"`` and the measured default never picks it on such a CPU
    (``runtime.select.cpu_candidates``); there OpenVINO's int8 is slower than ONNX Runtime's
    anyway (docs/benchmarks.md). Its agreement is measured here, as it computes here.
    """
    import json

    from bgeserve.export import ovint8

    started = time.monotonic()
    weights = ovint8.weights_here()
    _log(f"quantizing {plain_fp32} for OpenVINO (NNCF int8, {weights} weights)", started)
    done = ovint8.quantize_to_bar(plain_fp32, out, tokenizer, max_tokens=max_tokens,
                                  weights=weights)
    report.write_text(json.dumps(done))
    _log(f"wrote {out}: {done}", started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bgeserve.export.steps")
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("fp32")
    p.add_argument("model_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--opset", type=int, default=18)
    p.add_argument("--layout", choices=["bgeserve", "baai", "xenova", "logits"],
                   default="bgeserve")
    p.add_argument("--attention-block", type=int, default=None)
    p = sub.add_parser("fp16")
    p.add_argument("fp32", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p = sub.add_parser("int8")
    p.add_argument("fp32", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--recipe", choices=INT8_RECIPES, default="smoothquant")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json for the calibration texts (smoothquant)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="longest calibration text (the model's positions)")
    p.add_argument("--weights", choices=INT8_WEIGHTS, default="s7",
                   help="s7 (signed 7-bit: safe on every CPU), s8 (signed 8-bit: CPUs with "
                        "VNNI/AMX) or u8 (unsigned 8-bit: any CPU, for the one it is made on)")
    p.add_argument("--pairs", action="store_true",
                   help="calibrate on (query, document) pairs (a reranker)")
    p = sub.add_parser("rowblock")
    p.add_argument("graphs", type=Path, nargs="+")
    p.add_argument("--rows", type=int, required=True)
    p = sub.add_parser("validate")
    p.add_argument("export_dir", type=Path)
    p.add_argument("result", type=Path, help="JSON file written with the figures")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--variant", action="append", required=True)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="longest validation text (the model's positions)")
    p.add_argument("--kind", choices=["embedding", RERANKER], default="embedding")
    p = sub.add_parser("openvino")
    p.add_argument("fp32", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("ov-int8")
    p.add_argument("fp32", type=Path, help="a plain-attention fp32 graph")
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--report", type=Path, required=True,
                   help="JSON file written with what was quantized (for the manifest)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="longest calibration text (the model's positions)")
    args = parser.parse_args(argv)
    if args.step == "fp32":
        from bgeserve.export.graph import CheckpointRefused  # torch: the step needs it anyway

        try:
            export_fp32(args.model_dir, args.out, args.opset, args.layout, args.attention_block)
        except CheckpointRefused as exc:  # the checkpoint's fault (graph.py)
            print(f"bgeserve export: {exc}", file=sys.stderr)
            return REFUSED
    elif args.step == "fp16":
        export_fp16(args.fp32, args.out, args.heads, args.hidden)
    elif args.step == "openvino":
        export_openvino(args.fp32, args.out)
    elif args.step == "ov-int8":
        export_ov_int8(args.fp32, args.out, args.tokenizer, args.report, args.max_tokens)
    elif args.step == "rowblock":
        row_block(args.graphs, args.rows)
    elif args.step == "validate":
        validate(args.export_dir, args.variant, args.tokenizer, args.result, args.max_tokens,
                 args.kind)
    else:
        export_int8(args.fp32, args.out, args.tokenizer, args.recipe, args.max_tokens,
                    args.weights, args.pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
