#!/usr/bin/env python3
"""int8 recipes for bgeserve's ONNX export: accuracy vs fp32 and speed, side by side (issue 7).

Given the fp32 graph of a ``bgeserve export`` (``EXPORT/fp32/model.onnx``), this builds candidate
int8 graphs into ``--out`` (default ``/tmp/int8rec``, never inside the repository) and measures,
in one invocation so that the ratios between them hold on a noisy machine:

- dense cosine vs fp32 (min / mean over the corpus) and the largest ``sparse_weights`` |Δ|;
- tokens/s at batch 1 over a fixed corpus (``--texts`` random-id texts whose lengths are spread
  evenly over 16–512 tokens, shuffled, seed fixed; id 0 first, id 2 last, the others uniform in
  [5, 250000) — or below the vocabulary size of a smaller model), the fastest of ``--passes``
  passes in one process and of ``--rounds`` interleaved rounds (a fresh child per model and round:
  other load on a shared machine comes in bursts, so spreading the rounds over time helps);
- RSS after the session is created and after a warm-up of three texts (external data is mapped,
  so a graph stored that way shows its weights in RSS only once it has run), peak RSS, and the
  model's size on disk.

Every build and every measurement runs in its own child process, one at a time (a build of the
full-size model peaks at 5–9 GiB): the measuring children run after all builds, with nothing else
of ours running. fp32 and the current recipe are measured first and both once more at the end,
so drift from other load on the machine shows. The recipes (``--list`` prints them):

    a        the current export recipe: quantize_dynamic, QInt8 weights, per channel, MatMul/Gemm,
             heads (/sparse_linear/, /colbert_linear/) kept fp32
    b        a + the FFN down-projections (the MatMul after the GELU) kept fp32
    c        a + FFN up and down kept fp32 (int8 only in attention's Q/K/V/O projections)
    d        a + every MatMul of the first and last ``--edge-layers`` layers kept fp32
    e        static QDQ (quantize_static, MinMax calibration on ``--calib-texts`` random-id texts),
             per channel, MatMul only, no Q/DQ on the MatMul outputs (ORT fuses to
             MatMulIntegerToFloat)
    f1       a with per-tensor weight scales (per_channel=False)
    f2       a with reduce_range=True (7-bit weights)
    f3       a + the word-embedding Gather quantized too (uint8, per tensor): smaller, less RSS
    g        weight-only blockwise 8-bit MatMulNBits (block 128, symmetric, accuracy_level 4 =
             int8 compute with per-block activation scales) for every MatMul but the heads
    h        a, but the FFN down-projections as MatMulNBits 8-bit (as in g) instead of MatMulInteger
    i        SmoothQuant (alpha ``--sq-alpha``, per-channel activation max from the calibration
             texts; an explicit Mul by 1/s before each quantized MatMul group, s folded into the
             weights) followed by recipe a
    b3, c3, i3  b, c and i with f3's Gather quantization (RSS)

Attention's QK^T and PV MatMuls live in the If/Loop subgraphs of the blocked attention and have
no constant weight: quantize_dynamic (EnableSubgraph off, MatMulConstBOnly) leaves them fp32 in
every recipe, and so do the static and MatMulNBits quantizers.

The fp32 graph must come from an export made with ``--ffn-rows 0`` (the default export runs each FFN
in row blocks inside a Scan, where the quantizers do not look); the script says so otherwise.

Usage (from the repository root). For the full-size model on 2 cores the builds take ~12 minutes
(about a minute each, SmoothQuant and static ~2) and one measuring round ~9 minutes, so the first
command below runs ~30 minutes, ~18 once the models are built:

    .venv/bin/python scripts/int8_recipes.py --fp32 /tmp/bge-full-onnx/fp32/model.onnx \
        --rounds 2 --no-repeat-baselines
    .venv/bin/python scripts/int8_recipes.py --fp32 X/fp32/model.onnx --recipes a,i --rounds 3
    .venv/bin/python scripts/int8_recipes.py --list

The builds read a copy of the fp32 graph in ``OUT/fp32-src`` (onnxruntime's quantizers write and
remove a ``-inferred`` file next to their input; the export directory is left alone). Built
models are reused when their recipe is unchanged (``--rebuild`` forces). Results:
``OUT/results.json`` and ``OUT/results.md`` (the markdown table is also printed on stdout).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# The export's attention op (com.microsoft MultiHeadAttention) hides tensor types from the
# quantizers' shape inference; every tensor they would quantize is float (as export/steps.py).
FLOAT_DEFAULT = {"DefaultTensorType": 1}  # onnx.TensorProto.FLOAT
HEAD_PREFIXES = ("/sparse_linear/", "/colbert_linear/")  # as bgeserve.export.steps
EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # as bgeserve.export.steps
LENGTHS = (16, 512)
CORPUS_SEED = 7007
CALIB_SEED = 7008
ID_RANGE = (5, 250_000)
ROLES = ("q", "k", "v", "o", "up", "down")
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Recipe:
    key: str
    label: str
    method: str = "dynamic"          # dynamic | static | nbits
    per_channel: bool = True
    reduce_range: bool = False
    fp32_roles: tuple[str, ...] = ()  # besides the heads
    edge_layers: bool = False         # keep the first/last --edge-layers layers fp32
    gather: bool = False              # quantize the word-embedding Gather
    nbits_roles: tuple[str, ...] = ()  # roles quantized as MatMulNBits 8-bit before the rest
    smooth: bool = False              # SmoothQuant before quantize_dynamic


RECIPES = {r.key: r for r in (
    Recipe("a", "a: current (dynamic, per-channel, heads fp32)"),
    Recipe("b", "b: a + FFN down fp32", fp32_roles=("down",)),
    Recipe("c", "c: a + FFN up+down fp32 (attention-only int8)", fp32_roles=("up", "down")),
    Recipe("d", "d: a + first/last N layers fp32", edge_layers=True),
    Recipe("e", "e: static QDQ, MinMax calibration", method="static"),
    Recipe("f1", "f1: a, per-tensor weights", per_channel=False),
    Recipe("f2", "f2: a, reduce_range", reduce_range=True),
    Recipe("f3", "f3: a + word-embedding Gather uint8", gather=True),
    Recipe("g", "g: MatMulNBits 8-bit blk128 acc4 (all)", method="nbits"),
    Recipe("h", "h: a, FFN down as MatMulNBits 8-bit", nbits_roles=("down",)),
    Recipe("i", "i: SmoothQuant + a", smooth=True),
    Recipe("b3", "b3: b + word-embedding Gather uint8", fp32_roles=("down",), gather=True),
    Recipe("c3", "c3: c + word-embedding Gather uint8", fp32_roles=("up", "down"), gather=True),
    Recipe("i3", "i3: SmoothQuant + a + word-embedding Gather uint8", smooth=True, gather=True),
)}
DEFAULT_RECIPES = "a,b,c,d,e,f1,f2,f3,g,h,i,i3"


# ============================================================================ small helpers
def log(msg: str) -> None:
    print(f"[int8rec {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def proc_mem() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def model_files(path: Path) -> list[Path]:
    data = path.with_name(path.name + ".data")
    return [path, data] if data.exists() else [path]


def model_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in model_files(path))


def save_model(model: Any, out: Path) -> None:
    """One file when it fits (as bgeserve's export does), else one external data file."""
    import onnx

    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        big = model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    except Exception:  # noqa: BLE001 - protobuf raises past 2 GiB
        big = True
    if big:
        data = out.name + ".data"
        (out.parent / data).unlink(missing_ok=True)
        onnx.save_model(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data, size_threshold=1024)
        os.chmod(out.parent / data, 0o644)
    else:
        onnx.save_model(model, str(out))


def texts(seed: int, n: int, vocab: int) -> list[np.ndarray]:
    """``n`` id rows with lengths spread evenly over LENGTHS, shuffled: [0, random…, 2]."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(LENGTHS[0], LENGTHS[1], n).round().astype(int)
    rng.shuffle(lengths)
    high = min(ID_RANGE[1], vocab - 2)
    return [np.concatenate([[0], rng.integers(ID_RANGE[0], high, int(L) - 2), [2]]).astype(np.int64)
            for L in lengths]


def vocab_size(fp32: Path) -> int:
    import onnx

    model = onnx.load(str(fp32), load_external_data=False)
    for init in model.graph.initializer:
        if init.name.endswith("word_embeddings.weight"):
            return int(init.dims[0])
    raise SystemExit(f"{fp32}: no word_embeddings initializer")


def session(path: Path, threads: int) -> Any:
    """An ORT CPU session configured as bgeserve's (sequential, no arena, ORT_ENABLE_ALL)."""
    import onnxruntime as ort

    from bgeserve.runtime import SessionConfig
    from bgeserve.runtime.onnx import session_options

    return ort.InferenceSession(str(path), session_options(SessionConfig(threads=threads)),
                                providers=["CPUExecutionProvider"])


def feed(ids: np.ndarray) -> dict[str, np.ndarray]:
    return {"input_ids": ids[None, :], "attention_mask": np.ones((1, len(ids)), np.int64)}


# ============================================================================ the graph
def classify(model: Any) -> dict[str, Any]:
    """The weight MatMuls of the main graph: per layer q, k, v, o, up, down; and the heads.

    Found by structure, not by name: the main graph's MatMuls with an initializer weight, in graph
    order, come in groups of six per layer ([h,h] ×4, [h,4h], [4h,h]); the heads are named
    /sparse_linear/ and /colbert_linear/ by the exporter.
    """
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    layers: list[dict[str, str]] = []
    heads: list[str] = []
    weight_mm = []
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        if node.name.startswith(HEAD_PREFIXES):
            heads.append(node.name)
        else:
            weight_mm.append(node)
    if len(weight_mm) % 6:
        raise SystemExit(f"{len(weight_mm)} weight MatMuls: expected 6 per layer")
    for i in range(0, len(weight_mm), 6):
        group = weight_mm[i:i + 6]
        shapes = [inits[n.input[1]] for n in group]
        h = shapes[0][0]
        if shapes[:4] != [(h, h)] * 4 or shapes[4][0] != h or shapes[5] != shapes[4][::-1] or \
                len({n.input[0] for n in group[:3]}) != 1:
            raise SystemExit(f"layer {i // 6}: unexpected MatMul pattern {shapes}")
        layers.append({role: n.name for role, n in zip(ROLES, group)})
    gathers = [n.name for n in model.graph.node if n.op_type == "Gather"]
    word = [n.name for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits
            and n.input[0].endswith("word_embeddings.weight")]
    return {"layers": layers, "heads": heads, "gathers": gathers, "word_gather": word}


def excluded(recipe: Recipe, graph: dict[str, Any], edge: int) -> list[str]:
    """nodes_to_exclude for ``recipe``: heads, its fp32 roles and edge layers, other Gathers."""
    names = list(graph["heads"])
    n = len(graph["layers"])
    for i, layer in enumerate(graph["layers"]):
        edge_layer = recipe.edge_layers and (i < edge or i >= n - edge)
        names += [layer[r] for r in ROLES if edge_layer or r in recipe.fp32_roles]
    if recipe.gather:
        names += [g for g in graph["gathers"] if g not in graph["word_gather"]]
    return names


# ============================================================================ builds (child)
class Reader:
    """Calibration texts for quantize_static (onnxruntime.quantization.CalibrationDataReader)."""

    def __init__(self, rows: list[np.ndarray]):
        self.rows = iter(rows)

    def get_next(self) -> dict[str, np.ndarray] | None:
        row = next(self.rows, None)
        return None if row is None else feed(row)


def stub_with_outputs(fp32: Path, names: list[str]) -> Path:
    """The fp32 graph with ``names`` as extra outputs, saved next to ``fp32`` (our private copy:
    ONNX Runtime refuses external data that resolves outside the model's directory)."""
    import onnx

    model = onnx.load(str(fp32), load_external_data=False)
    present = {o.name for o in model.graph.output}
    for name in names:
        if name not in present:
            model.graph.output.append(onnx.helper.make_tensor_value_info(name,
                                                                         onnx.TensorProto.FLOAT,
                                                                         None))
    out = fp32.with_name(f"stub-{os.getpid()}.onnx")
    onnx.save_model(model, str(out))
    return out


def smooth(fp32: Path, work: Path, graph: dict[str, Any], exclude: set[str], alpha: float,
           calib: list[np.ndarray], threads: int) -> tuple[Path, dict[str, Any]]:
    """SmoothQuant: per input channel j, s_j = max|X_j|^a / max|W_j|^(1-a); X/s, diag(s)·W.

    One Mul by 1/s is inserted before each group of quantized MatMuls sharing an input (Q/K/V,
    O, FFN up, FFN down of each layer): the post-LN residual also reads the LayerNorm outputs,
    so 1/s cannot be folded into the LayerNorm. Returns the smoothed fp32 path and a check.
    """
    import onnx
    from onnx import numpy_helper

    from bgeserve.export.smoothquant import (
        insert_before,
        scale_weight,
        smoothing_scales,
        weight_max,
    )

    groups = []
    for layer in graph["layers"]:
        for roles in (("q", "k", "v"), ("o",), ("up",), ("down",)):
            mm = [layer[r] for r in roles if layer[r] not in exclude]
            if mm:
                groups.append(mm)
    base = onnx.load(str(fp32), load_external_data=False)
    by_name = {n.name: n for n in base.graph.node}
    inputs = [by_name[g[0]].input[0] for g in groups]
    stub = stub_with_outputs(fp32, inputs)
    try:
        sess = session(stub, threads)
    finally:
        stub.unlink()
    amax = {name: None for name in inputs}
    for row in calib:
        outs = sess.run(inputs, feed(row))
        for name, x in zip(inputs, outs):
            m = np.abs(x).reshape(-1, x.shape[-1]).max(axis=0)
            amax[name] = m if amax[name] is None else np.maximum(amax[name], m)
    check_rows = [calib[0][:64], calib[1][:200]]
    ref = [sess.run(["dense"], feed(r))[0][0] for r in check_rows]
    del sess

    model = onnx.load(str(fp32), load_external_data=True)
    inits = {t.name: t for t in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    inserts: dict[str, Any] = {}  # first MatMul of a group -> Mul node
    ratios = []
    for group, x in zip(groups, inputs):
        weights = [numpy_helper.to_array(inits[nodes[n].input[1]]) for n in group]
        xmax = amax[x]
        s = smoothing_scales(xmax, weight_max(weights), alpha)  # the export's own maths
        ratios.append(float(xmax.max() / max(np.median(xmax), 1e-12)))
        for name, w in zip(group, weights):
            init = inits[nodes[name].input[1]]
            init.CopyFrom(numpy_helper.from_array(scale_weight(w, s), init.name))
        inv = f"{group[0]}_smooth_inv_s"
        model.graph.initializer.append(numpy_helper.from_array(1.0 / s, inv))
        out = f"{x}_smoothed_{group[0]}"
        inserts[group[0]] = onnx.helper.make_node("Mul", [x, inv], [out],
                                                  name=f"{group[0]}_smooth")
        for name in group:
            nodes[name].input[0] = out
    insert_before(model, inserts)
    smoothed = work / "smoothed" / "model.onnx"
    save_model(model, smoothed)
    del model
    sess = session(smoothed, threads)
    got = [sess.run(["dense"], feed(r))[0][0] for r in check_rows]
    del sess
    cos = [float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(ref, got)]
    return smoothed, {"smoothed_fp32_cos": cos, "groups": len(groups),
                      "act_max_over_median_max": max(ratios), "alpha": alpha}


def nbits(src: Path, out: Path, include: list[str]) -> None:
    """MatMulNBits 8-bit (block 128, symmetric, accuracy_level 4) for exactly ``include``."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src), load_external_data=True)
    keep = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in include]
    quant = MatMulNBitsQuantizer(model, bits=8, block_size=128, is_symmetric=True,
                                 accuracy_level=4, nodes_to_exclude=keep)
    quant.process()
    save_model(quant.model.model, out)  # not save_model_to_file: no topological re-sort


def build(spec: dict[str, Any]) -> dict[str, Any]:
    """Build one recipe into spec['out'] (runs in a child process)."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    recipe = Recipe(**{k: tuple(v) if isinstance(v, list) else v
                       for k, v in spec["recipe"].items()})
    fp32, out = Path(spec["fp32"]), Path(spec["out"])
    started = time.monotonic()
    base = onnx.load(str(fp32), load_external_data=False)
    graph = classify(base)
    del base
    exclude = excluded(recipe, graph, spec["edge_layers"])
    info: dict[str, Any] = {"nodes_to_exclude": exclude}
    calib = texts(CALIB_SEED, spec["calib_texts"], spec["vocab"])
    work = Path(tempfile.mkdtemp(prefix="build-", dir=out.parent.parent))
    try:
        raw = work / "quant" / "model.onnx"
        raw.parent.mkdir()
        src = fp32
        if recipe.method == "nbits":
            names = [layer[r] for layer in graph["layers"] for r in ROLES
                     if layer[r] not in exclude]
            nbits(fp32, out, names)
            info["nbits_nodes"] = len(names)
        elif recipe.method == "static":
            quantize_static(str(fp32), str(raw), Reader(calib), quant_format=QuantFormat.QDQ,
                            per_channel=recipe.per_channel, reduce_range=recipe.reduce_range,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            op_types_to_quantize=["MatMul"], nodes_to_exclude=exclude,
                            calibrate_method=CalibrationMethod.MinMax,
                            use_external_data_format=True,
                            extra_options={"OpTypesToExcludeOutputQuantization": ["MatMul"],
                                           "MatMulConstBOnly": True, **FLOAT_DEFAULT})
            save_model(onnx.load(str(raw), load_external_data=True), out)
        else:
            if recipe.smooth:
                src, info["smoothquant"] = smooth(fp32, work, graph, set(exclude),
                                                  spec["sq_alpha"], calib, spec["threads"])
            if recipe.nbits_roles:
                names = [layer[r] for layer in graph["layers"] for r in recipe.nbits_roles
                         if layer[r] not in exclude]
                nb = work / "nbits" / "model.onnx"
                nbits(src, nb, names)
                src = nb
                info["nbits_nodes"] = len(names)
            ops = ["MatMul", "Gemm"] + (["Gather"] if recipe.gather else [])
            quantize_dynamic(str(src), str(raw), weight_type=QuantType.QInt8,
                             per_channel=recipe.per_channel, reduce_range=recipe.reduce_range,
                             op_types_to_quantize=ops, nodes_to_exclude=exclude,
                             use_external_data_format=True, extra_options=FLOAT_DEFAULT)
            save_model(onnx.load(str(raw), load_external_data=True), out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info.update(build_s=round(time.monotonic() - started, 1),
                build_peak_rss=proc_mem().get("VmHWM", 0))
    return info


# ============================================================================ measure (child)
def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Load one model, then run the corpus at batch 1 ``passes`` times (runs in a child)."""
    with np.load(spec["corpus"]) as z:
        rows = [z[f"t{i}"] for i in range(int(z["n"]))]
    before = proc_mem()["VmRSS"]
    t0 = time.perf_counter()
    sess = session(Path(spec["model"]), spec["threads"])
    load_s = time.perf_counter() - t0
    rss_load = proc_mem()["VmRSS"]
    names = [o.name for o in sess.get_outputs()]
    for row in sorted(rows, key=len)[::max(1, len(rows) // 3)]:  # warm-up: short … long
        sess.run(names, feed(row))
    rss_warm = proc_mem()["VmRSS"]
    passes, dense, sparse = [], [], []
    for p in range(spec["passes"]):
        t0 = time.perf_counter()
        outs = [sess.run(names, feed(row)) for row in rows]
        passes.append(time.perf_counter() - t0)
        if p == 0:
            by = [dict(zip(names, o)) for o in outs]
            dense = np.stack([o["dense"][0] for o in by])
            sparse = [o["sparse_weights"][0].reshape(-1) for o in by]
            colbert = [o["colbert"][0] for o in by]
        del outs
    tokens = int(sum(len(r) for r in rows))
    np.savez(spec["vectors"], dense=dense, sparse=np.concatenate(sparse),
             colbert=np.concatenate(colbert))
    return {"load_s": round(load_s, 2), "rss_before": before, "rss_after_load": rss_load,
            "rss_after_warmup": rss_warm,
            "peak_rss": proc_mem()["VmHWM"], "passes_s": [round(p, 3) for p in passes],
            "tokens": tokens, "tok_s": tokens / min(passes)}


# ============================================================================ parent
def child(kind: str, spec: dict[str, Any], spec_path: Path, timeout: float) -> dict[str, Any]:
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path = spec_path.with_suffix(".result.json")
    result_path.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), f"_{kind}",
                           str(spec_path)], timeout=timeout, check=False)
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"{kind} child failed (exit {proc.returncode}), spec {spec_path}")
    return json.loads(result_path.read_text())


def copy_source(fp32: Path, dest: Path) -> Path:
    """``fp32`` and its external data copied into ``dest`` (kept while sizes and times match)."""
    import onnx

    model = onnx.load(str(fp32), load_external_data=False)
    names = {fp32.name} | {e.value for t in model.graph.initializer for e in t.external_data
                           if e.key == "location"}
    del model
    dest.mkdir(parents=True, exist_ok=True)
    for name in sorted(names):
        src, dst = fp32.parent / name, dest / name
        st = src.stat()
        if dst.exists() and dst.stat().st_size == st.st_size and dst.stat().st_mtime == st.st_mtime:
            continue
        log(f"copying {src} to {dest}")
        shutil.copy2(src, dst)
    return dest / fp32.name


def cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def fmt_mib(n: int) -> str:
    return f"{n / MiB:,.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    fp32 = next(r for r in rows if r["key"] == "fp32")
    cur = next((r for r in rows if r["key"] == "a"), None)
    lines = [("| recipe | dense cos min / mean | sparse max Δ | tok/s | × fp32 | × current int8 "
              "| RSS load / warm MiB | peak RSS MiB | size MiB |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "**" if r["cos_min"] >= 0.999 and not r["key"].startswith("fp32") else ""
        cur_ratio = f"{r['tok_s'] / cur['tok_s']:.2f}" if cur else "–"
        lines.append(
            f"| {r['label']} | {ok}{r['cos_min']:.4f}{ok} / {r['cos_mean']:.4f} "
            f"| {r['sparse_max_diff']:.4f} | {r['tok_s']:.0f} | {r['tok_s'] / fp32['tok_s']:.2f} "
            f"| {cur_ratio} | {fmt_mib(r['rss_after_load'])} / {fmt_mib(r['rss_after_warmup'])} "
            f"| {fmt_mib(r['peak_rss'])} "
            f"| {fmt_mib(r['bytes'])} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    fp32 = args.fp32.resolve()
    out = args.out.resolve()
    if out == REPO or REPO in out.parents:
        raise SystemExit(f"--out {out} is inside the repository; use a directory outside it")
    if not fp32.is_file():
        raise SystemExit(f"--fp32 {fp32}: not a file")
    keys = [k.strip() for k in args.recipes.split(",") if k.strip()]
    unknown = [k for k in keys if k not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}; --list shows them")
    out.mkdir(parents=True, exist_ok=True)
    (out / "specs").mkdir(exist_ok=True)
    vocab = vocab_size(fp32)
    corpus = texts(CORPUS_SEED, args.texts, vocab)
    np.savez(out / "corpus.npz", n=len(corpus), **{f"t{i}": r for i, r in enumerate(corpus)})
    started = time.monotonic()
    log(f"{len(keys)} recipes, corpus {len(corpus)} texts / {sum(map(len, corpus))} tokens, "
        f"out {out}")

    # 1. builds, one child at a time, from a copy of the fp32 graph: onnxruntime's quantizers
    # write (and remove) a "-inferred" file next to their input, so they get a private copy
    builds: dict[str, dict[str, Any]] = {}
    source = copy_source(fp32, out / "fp32-src")
    for key in keys:
        recipe = RECIPES[key]
        model = out / key / "model.onnx"
        spec = json.loads(json.dumps({  # as it reads back from build.json (lists, not tuples)
            "recipe": dataclasses.asdict(recipe), "fp32": str(source), "out": str(model),
            "edge_layers": args.edge_layers, "calib_texts": args.calib_texts,
            "sq_alpha": args.sq_alpha, "vocab": vocab, "threads": args.threads}))
        stamp = out / key / "build.json"
        if not args.rebuild and model.exists() and stamp.exists():
            old = json.loads(stamp.read_text())
            if old.get("spec") == spec:
                log(f"build {key}: reusing {model}")
                builds[key] = old["info"]
                continue
        for p in model_files(model):
            p.unlink(missing_ok=True)
        log(f"build {key}: {recipe.label}")
        info = child("build", spec, out / "specs" / f"build-{key}.json", args.build_timeout)
        stamp.write_text(json.dumps({"spec": spec, "info": info}, indent=1))
        builds[key] = info
        log(f"build {key}: {info['build_s']}s, peak {fmt_mib(info['build_peak_rss'])} MiB, "
            f"{fmt_mib(model_bytes(model))} MiB on disk")

    # 2. measurements, one child at a time: fp32, current, the rest, then both again (drift)
    order = [("fp32", fp32)] + [(k, out / k / "model.onnx") for k in keys]
    if args.repeat_baselines:
        order += [("fp32 (again)", fp32)]
        if "a" in keys:
            order.append(("a (again)", out / "a" / "model.onnx"))
    rows: dict[str, dict[str, Any]] = {}
    ref = None
    for rnd in range(args.rounds):
        for name, model in order:
            key = name.split()[0]
            tag = name.replace(" ", "_").replace("(", "").replace(")", "")
            spec = {"model": str(model), "corpus": str(out / "corpus.npz"),
                    "threads": args.threads, "passes": args.passes,
                    "vectors": str(out / "specs" / f"vectors-{tag}.npz")}
            load = os.getloadavg()[0]
            log(f"measure {name} (round {rnd + 1}/{args.rounds}): load avg {load:.2f}")
            res = child("measure", spec, out / "specs" / f"measure-{tag}.json",
                        args.measure_timeout)
            if name in rows:  # a later round: timing only, the fastest round counts
                row = rows[name]
                row["rounds"].append({"tok_s": res["tok_s"], "passes_s": res["passes_s"],
                                      "load_avg": load})
                row["tok_s"] = max(r["tok_s"] for r in row["rounds"])
                log(f"measure {name}: {res['tok_s']:.0f} tok/s (passes {res['passes_s']})")
                continue
            with np.load(spec["vectors"]) as z:
                vec = {k: z[k] for k in z.files}
            if ref is None:
                ref = vec
            cos = cos_rows(vec["dense"], ref["dense"])
            colbert = cos_rows(vec["colbert"], ref["colbert"])
            label = "fp32 (reference)" if key == "fp32" else RECIPES[key].label
            if key == "d":
                label = label.replace("N layers", f"{args.edge_layers} layers")
            if name != key:
                label = ("fp32" if key == "fp32" else label) + " (again, last)"
            row = {"key": name, "label": label, "model": str(model),
                   "bytes": model_bytes(model), "cos_min": float(cos.min()),
                   "cos_mean": float(cos.mean()),
                   "cos_min_text_len": len(corpus[int(cos.argmin())]),
                   "sparse_max_diff": float(np.abs(vec["sparse"] - ref["sparse"]).max()),
                   "sparse_ref_max": float(ref["sparse"].max()),
                   "colbert_token_cos_min": float(colbert.min()),
                   "colbert_token_cos_mean": float(colbert.mean()),
                   **res, "rounds": [{"tok_s": res["tok_s"], "passes_s": res["passes_s"],
                                      "load_avg": load}],
                   "build": builds.get(key)}
            rows[name] = row
            log(f"measure {name}: cos min {row['cos_min']:.4f} mean {row['cos_mean']:.4f}, "
                f"{row['tok_s']:.0f} tok/s (passes {res['passes_s']}), "
                f"RSS {fmt_mib(res['rss_after_load'])} MiB")
    results = list(rows.values())

    md = table(results)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(),
            "onnxruntime": __import__("onnxruntime").__version__, "cpus": os.cpu_count(),
            "fp32": str(fp32), "texts": len(corpus), "tokens": int(sum(map(len, corpus))),
            "passes": args.passes, "rounds": args.rounds, "threads": args.threads,
            "edge_layers": args.edge_layers, "calib_texts": args.calib_texts,
            "sq_alpha": args.sq_alpha,
            "wall_s": round(time.monotonic() - started, 1), "argv": sys.argv[1:]}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "results.md").write_text(md + "\n")
    print(md)
    log(f"done in {meta['wall_s']:.0f}s: {out / 'results.json'}, {out / 'results.md'}")
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except for on/off flags."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.nargs == 0:
            return action.help or ""
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_build", "_measure"):
        spec_path = Path(argv[1])
        spec = json.loads(spec_path.read_text())
        result = build(spec) if argv[0] == "_build" else measure(spec)
        spec_path.with_suffix(".result.json").write_text(json.dumps(result, indent=1))
        return 0
    parser = argparse.ArgumentParser(
        prog="scripts/int8_recipes.py",
        description="Build candidate int8 graphs from bgeserve's fp32 export and measure dense "
                    "cosine, sparse Δ, tokens/s at batch 1, RSS and size, side by side.",
        formatter_class=_Help)
    parser.add_argument("--fp32", type=Path, default=Path("/tmp/bge-full-onnx/fp32/model.onnx"),
                        help="the fp32 graph of a bgeserve export")
    parser.add_argument("--out", type=Path, default=Path("/tmp/int8rec"),
                        help="work directory for models and results (outside the repository)")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES,
                        help=f"comma-separated recipe keys, from {','.join(RECIPES)}")
    parser.add_argument("--texts", type=int, default=64, help="texts in the timed corpus")
    parser.add_argument("--calib-texts", type=int, default=16,
                        help="calibration texts (static QDQ, SmoothQuant), another seed")
    parser.add_argument("--edge-layers", type=int, default=2,
                        help="recipe d: first and last N layers kept fp32")
    parser.add_argument("--sq-alpha", type=float, default=0.5, help="recipe i: SmoothQuant alpha")
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    parser.add_argument("--passes", type=int, default=1,
                        help="timed passes over the corpus per model (the fastest counts)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every model this many times, interleaved (a fresh child "
                             "each time); the fastest round counts, accuracy is from the first")
    parser.add_argument("--no-repeat-baselines", dest="repeat_baselines", action="store_false",
                        help="do not measure fp32 and recipe a again at the end (drift check)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild models that exist")
    parser.add_argument("--build-timeout", type=float, default=1800,
                        help="seconds one build child may take")
    parser.add_argument("--measure-timeout", type=float, default=1200,
                        help="seconds one measuring child may take")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    args = parser.parse_args(argv)
    if args.list:
        for r in RECIPES.values():
            print(f"{r.key:3s} {r.label}")
        return 0
    _require_unblocked(args.fp32)
    return run(args)


def _require_unblocked(fp32: Path) -> None:
    """The quantizers and SmoothQuant work on the main graph's MatMuls; an export's FFN row
    blocks (Scan) hide half of them."""
    import onnx

    graph = onnx.load(str(fp32), load_external_data=False).graph
    if any(n.op_type == "Scan" for n in graph.node):
        raise SystemExit(f"{fp32}: its FFN runs in row blocks (Scan); export the source with "
                         "`bgeserve export --variant fp32 --ffn-rows 0`")


if __name__ == "__main__":
    sys.exit(main())
