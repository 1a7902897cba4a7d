"""SmoothQuant for the int8 export: move activation outliers into the weights before quantizing.

Dynamic int8 quantization gives each activation row one scale, so a few input channels with
large magnitudes (bge-m3 has them after its LayerNorms and GELUs) squeeze every other channel
into a handful of levels. SmoothQuant (Xiao et al., 2023) divides input channel j by

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

and multiplies row j of the weight by s_j, so X·W = (X/s)·(s·W) exactly and the difficulty is
shared between activations and weights. Measured on the full-size random bge-m3 (alpha 0.5, then
the dynamic per-channel recipe): dense cosine vs fp32 0.9967 → 0.9994, at ~0.93× the speed
(scripts/int8_recipes.py, recipe i).

bge-m3 is post-LN: each LayerNorm output feeds both the next MatMuls and the residual add, so
1/s cannot be folded into the LayerNorm. An explicit ``Mul`` by 1/s is inserted instead, one per
group of MatMuls sharing an input: Q/K/V, the attention output (O), the FFN up and the FFN down
projection of every layer. The heads (``/sparse_linear/``, ``/colbert_linear/``) are left alone:
the export keeps them fp32.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ALPHA = 0.5
# s is clipped: a channel that is (almost) never active must not get a huge or tiny scale.
SCALE_CLIP = (1e-5, 1e5)
ROLES = ("q", "k", "v", "o", "up", "down")
# MatMuls that read the same tensor share one Mul (and one s): Q/K/V read the same LayerNorm.
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "up": ("up",), "down": ("down",)}
PREFIX = "/smoothquant/"  # names of the inserted Mul nodes and their 1/s initializers


# ---------------------------------------------------------------------------- the maths
def smoothing_scales(xmax: np.ndarray, wmax: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """Per input channel: s = xmax^alpha / wmax^(1-alpha), 1 where either is 0, clipped."""
    xmax = np.asarray(xmax, dtype=np.float64)
    wmax = np.asarray(wmax, dtype=np.float64)
    live = (xmax > 0) & (wmax > 0)
    s = np.ones_like(xmax)
    s[live] = xmax[live] ** alpha / wmax[live] ** (1.0 - alpha)
    return np.clip(s, *SCALE_CLIP).astype(np.float32)


def weight_max(weights: Iterable[np.ndarray]) -> np.ndarray:
    """max |W| per input channel over a group's weights (ONNX MatMul weights are [in, out])."""
    return np.max([np.abs(w).max(axis=1) for w in weights], axis=0)


def scale_weight(weight: np.ndarray, s: np.ndarray) -> np.ndarray:
    """diag(s)·W: input channel (row) j of the [in, out] weight multiplied by s_j."""
    return (weight * s[:, None]).astype(np.float32)


# ---------------------------------------------------------------------------- the graph
def classify(model: Any, head_prefixes: Sequence[str]) -> list[dict[str, Any]]:
    """The weight MatMuls of each encoder layer, by role (q, k, v, o, up, down).

    Found by structure, not by name (torch names them /query/MatMul, /dense_3/MatMul, …): the
    main graph's MatMuls with an initializer weight, heads aside, come in graph order in groups
    of six per layer with weights [h,h] ×4, [h,f], [f,h], Q/K/V reading one tensor. Anything
    else is an unexpected graph and raises rather than smoothing the wrong tensors.
    """
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    uses = _input_uses(model.graph)
    mms = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
           and not n.name.startswith(tuple(head_prefixes))]
    if not mms or len(mms) % len(ROLES):
        raise ValueError(f"{len(mms)} weight MatMuls outside the heads: expected 6 per layer")
    layers = []
    for i in range(0, len(mms), len(ROLES)):
        group = mms[i:i + len(ROLES)]
        shapes = [inits[n.input[1]] for n in group]
        h = shapes[0][0]
        if (shapes[:4] != [(h, h)] * 4 or len(shapes[4]) != 2 or shapes[4][0] != h
                or shapes[5] != shapes[4][::-1] or len({n.input[0] for n in group[:3]}) != 1):
            raise ValueError(f"layer {i // len(ROLES)}: unexpected MatMul pattern {shapes}")
        shared = [n.input[1] for n in group if uses[n.input[1]] != 1]
        if shared:  # scaling a weight that something else also reads would change that too
            raise ValueError(f"layer {i // len(ROLES)}: weights used more than once: {shared}")
        layers.append(dict(zip(ROLES, group)))
    return layers


def _input_uses(graph: Any) -> Counter[str]:
    """How many node inputs name each tensor, subgraphs (If/Loop bodies) included."""
    uses: Counter[str] = Counter()
    for node in graph.node:
        uses.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                uses.update(_input_uses(sub))
    return uses


def smoothing_groups(layers: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """(name, MatMul nodes) per group sharing an input, e.g. ('layer.0/qkv', [q, k, v])."""
    return [(f"layer.{i}/{group}", [layer[r] for r in roles])
            for i, layer in enumerate(layers) for group, roles in GROUPS.items()]


def activation_max(fp32: Path, model: Any, tensors: Sequence[str],
                   rows: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """max |x| per channel (last axis) of each of ``tensors`` over the calibration rows.

    The tensors are added as outputs to a copy of the graph proto (without its external data),
    which ONNX Runtime opens from memory, reading the weights from the fp32 graph's own data
    file: no copy of the weights on disk. Rows run one at a time (batch 1, no padding).
    """
    import onnx

    from bgeserve.runtime.onnx import OnnxSession, SessionConfig

    stub = onnx.ModelProto()
    stub.CopyFrom(model)
    present = {o.name for o in stub.graph.output}
    for name in tensors:
        if name not in present:
            stub.graph.output.append(
                onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = OnnxSession(fp32, SessionConfig(), graph=stub.SerializeToString())
    del stub
    amax: dict[str, np.ndarray] = {}
    try:
        for ids in rows:
            outs = session.run(ids[None, :], np.ones((1, len(ids)), np.int64), outputs=tensors)
            for name, x in outs.items():
                m = np.abs(x).reshape(-1, x.shape[-1]).max(axis=0)
                amax[name] = np.maximum(amax[name], m) if name in amax else m
    finally:
        session.close()
    return amax


def _insert_smoothing(model: Any, name: str, group: list[Any], inv_s: np.ndarray) -> Any:
    """A ``Mul`` by 1/s (new initializer) feeding every MatMul of ``group``; returns the node."""
    import onnx
    from onnx import numpy_helper

    x = group[0].input[0]
    scale, out = f"{PREFIX}{name}/inv_scale", f"{PREFIX}{name}/Mul_output_0"
    model.graph.initializer.append(numpy_helper.from_array(inv_s.astype(np.float32), scale))
    for node in group:
        node.input[0] = out
    return onnx.helper.make_node("Mul", [x, scale], [out], name=f"{PREFIX}{name}/Mul")


def insert_before(model: Any, inserts: dict[str, Any]) -> None:
    """Put each ``inserts[name]`` node just before the node called ``name``: the graph stays
    topologically ordered, since a group's input is produced before its first MatMul."""
    ordered = []
    for node in model.graph.node:
        if node.name in inserts:
            ordered.append(inserts[node.name])
        ordered.append(node)
    model.graph.ClearField("node")
    model.graph.node.extend(ordered)


def smooth(fp32: Path, rows: Sequence[np.ndarray], *, alpha: float = ALPHA,
           head_prefixes: Sequence[str] = ()) -> tuple[Any, dict[str, Any]]:
    """The fp32 graph at ``fp32``, smoothed (weights in memory), and a summary for the log.

    The graph is read once without its weights (classification, calibration), then its
    weights are loaded into the same proto and rewritten in place: at most one copy of the
    weights is held, plus one weight matrix at a time.
    """
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_model

    model = onnx.load(str(fp32), load_external_data=False)
    groups = smoothing_groups(classify(model, head_prefixes))
    inputs = [nodes[0].input[0] for _, nodes in groups]
    amax = activation_max(fp32, model, inputs, rows)

    load_external_data_for_model(model, str(fp32.parent))  # no-op for a one-file graph
    inits = {t.name: t for t in model.graph.initializer}
    before: dict[str, Any] = {}  # first MatMul of a group -> its Mul, inserted just before it
    outliers = []
    for (name, nodes), x in zip(groups, inputs):
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        s = smoothing_scales(amax[x], weight_max(weights), alpha)
        for node, w in zip(nodes, weights):
            inits[node.input[1]].CopyFrom(numpy_helper.from_array(scale_weight(w, s),
                                                                  node.input[1]))
        del weights
        before[nodes[0].name] = _insert_smoothing(model, name, nodes, 1.0 / s)
        outliers.append(float(amax[x].max() / max(float(np.median(amax[x])), 1e-12)))
    insert_before(model, before)
    summary = {"alpha": alpha, "groups": len(groups), "calibration_texts": len(rows),
               "calibration_tokens": int(sum(len(r) for r in rows)),
               "max_activation_over_median": round(max(outliers), 1)}
    return model, summary
