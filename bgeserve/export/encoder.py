"""The encoder inside a hub ONNX graph: its sizes and, per layer, where attention starts and ends.

``prepare`` rewrites graphs it did not write: BAAI/bge-m3's, Xenova's fp32, an ``optimum-cli
export onnx``, exported by different torch and transformers versions (eager or SDPA attention,
LayerNorm fused or spelled out at opsets below 17). Everything here is found by structure, not
by node names: per layer the six weight MatMuls (``smoothquant.classify``), the Q, K and V
projections told apart by where they flow (Q·Kᵀ, then softmax·V), and the attention core
between them and the output projection's input. A graph that does not fit raises ValueError
saying what was expected; ``prepare`` then serves the stock graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import numpy_helper

from bgeserve.export import onnxbuild
from bgeserve.export.smoothquant import classify
from bgeserve.model.dims import position_offset

# bge-m3's heads, where ``headgraph.add_heads`` has written them into the graph: not a layer.
HEAD_PREFIXES = ("/sparse_linear/", "/colbert_linear/")
# Nodes allowed between the attention scores and the softmax (scaling, the mask, casts).
_SCORE_PATH = {"Add", "Mul", "Div", "Sub", "Where", "Cast", "Softmax"}


@dataclass(frozen=True)
class AttentionSite:
    """One layer's attention: the Q, K, V projections [B, L, H] (biases added) it reads, and
    the output projection (a MatMul, by node name) that reads its context [B, L, H]."""

    q: str
    k: str
    v: str
    output_projection: str


def fuse_layernorms(model: onnx.ModelProto) -> int:
    """Fuse spelled-out LayerNorms (ReduceMean, Sub, Pow, …) into LayerNormalization nodes with
    ONNX Runtime's own fusion; returns how many were fused (0 when the graph has them already).

    The FFN row blocks (rowblock.py) find each layer by its LayerNorms. LayerNormalization is
    an ONNX op from opset 17: a graph exported at 13-16 is raised to 17 (the ops between are
    backward compatible).
    """
    if any(n.op_type == "LayerNormalization" for n in model.graph.node):
        return 0
    from onnxruntime.transformers.fusion_layernorm import FusionLayerNormalization
    from onnxruntime.transformers.onnx_model import OnnxModel

    wrapped = OnnxModel(model)
    FusionLayerNormalization(wrapped).apply()
    wrapped.topological_sort()
    fused = sum(n.op_type == "LayerNormalization" for n in model.graph.node)
    if fused:
        onnxbuild.set_opset(model, "", 17)
    return fused


def layers(model: onnx.ModelProto) -> list[dict[str, Any]]:
    """The weight MatMuls of each layer by role (q, k, v, o, up, down), in graph order."""
    return classify(model, head_prefixes=HEAD_PREFIXES)


def attention_sites(model: onnx.ModelProto) -> list[AttentionSite]:
    """Each layer's attention, its Q/K/V roles checked by where each projection flows."""
    graph = model.graph
    fixed = onnxbuild.initializer_names(graph)
    readers = onnxbuild.consumers(graph)
    writer = onnxbuild.producers(graph)
    sites = []
    for index, layer in enumerate(layers(model)):
        projections = [_biased(graph, layer[role], readers, fixed) for role in ("q", "k", "v")]
        inside = _between(graph, projections, layer["o"].input[0], readers, writer)
        q, k, v = _roles(graph, inside, projections, readers, fixed, index)
        sites.append(AttentionSite(q, k, v, layer["o"].name))
    return sites


def _biased(graph: onnx.GraphProto, matmul: onnx.NodeProto, readers: dict[str, list[int]],
            fixed: set[str]) -> str:
    """A projection's output: its MatMul's, or the Add of a constant bias right after it."""
    out = matmul.output[0]
    users = readers.get(out, [])
    if len(users) == 1:
        node = graph.node[users[0]]
        if node.op_type == "Add" and any(x in fixed for x in node.input if x != out):
            return node.output[0]
    return out


def _reach(origin: Iterable[str], step: Callable[[str], Iterable[str]]) -> set[str]:
    seen, todo = set(origin), list(origin)
    while todo:
        for nxt in step(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _between(graph: onnx.GraphProto, starts: list[str], end: str,
             readers: dict[str, list[int]], writer: dict[str, int]) -> set[int]:
    """Indices of the nodes on some path from one of ``starts`` to ``end``."""
    forward = _reach(starts, lambda t: [o for i in readers.get(t, [])
                                        for o in graph.node[i].output])
    backward = _reach([end], lambda t: [x for x in graph.node[writer[t]].input if x in writer]
                      if t in writer and t not in starts else [])
    nodes = {writer[t] for t in forward & backward if t in writer and t not in starts}
    if not nodes or end not in writer or writer[end] not in nodes:
        raise ValueError(f"no path from the Q/K/V projections to the attention output {end!r}")
    return nodes


def _roles(graph: onnx.GraphProto, inside: set[int], projections: list[str],
           readers: dict[str, list[int]], fixed: set[str], index: int) -> tuple[str, str, str]:
    """(q, k, v) among ``projections``: Q feeds the left of the score MatMul, K its right, V
    the right of the MatMul that applies the softmax."""
    softmaxes = [i for i in inside if graph.node[i].op_type == "Softmax"]
    if len(softmaxes) != 1:
        raise ValueError(f"layer {index}: expected one Softmax in the attention, found "
                         f"{len(softmaxes)}")
    softmax = graph.node[softmaxes[0]]
    writer = onnxbuild.producers(graph)

    def flows_from(name: str) -> set[str]:
        # Data flow only: SDPA exports scale Q and Kᵀ by a factor computed from Q's Shape.
        return _reach([name], lambda t: [o for i in readers.get(t, []) if i in inside
                                         and graph.node[i].op_type != "Shape"
                                         for o in graph.node[i].output])

    reach = {p: flows_from(p) for p in projections}
    scores = _score_matmul(graph, softmax, writer, fixed)
    probs = flows_from(softmax.output[0])
    apply = [graph.node[i] for i in inside if graph.node[i].op_type == "MatMul"
             and graph.node[i].input[0] in probs]
    if scores is None or len(apply) != 1:
        raise ValueError(f"layer {index}: no Q·Kᵀ → softmax → ·V pattern in the attention")

    def only(name: str, role: str) -> str:
        found = [p for p in projections if name in reach[p]]
        if len(found) != 1:
            raise ValueError(f"layer {index}: cannot tell which projection is {role}")
        return found[0]

    q, k, v = (only(scores.input[0], "Q"), only(scores.input[1], "K"),
               only(apply[0].input[1], "V"))
    if len({q, k, v}) != 3:
        raise ValueError(f"layer {index}: Q, K and V are not three distinct projections")
    return q, k, v


def _score_matmul(graph: onnx.GraphProto, softmax: onnx.NodeProto, writer: dict[str, int],
                  fixed: set[str]) -> onnx.NodeProto | None:
    """The MatMul of two computed values upstream of ``softmax`` through scaling/masking ops."""
    todo, seen = [softmax.input[0]], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in writer:
            continue
        seen.add(name)
        node = graph.node[writer[name]]
        if node.op_type == "MatMul" and not any(x in fixed for x in node.input):
            return node
        if node.op_type in _SCORE_PATH:
            todo.extend(x for x in node.input if x not in fixed)
    return None


def dims(model: onnx.ModelProto, config: dict[str, Any] | None = None) -> dict[str, int]:
    """Encoder sizes: hidden, heads, intermediate, layers, max_positions (from ``config``, a
    config.json, where it has them; else read from the graph's weights and shapes)."""
    graph = model.graph
    config = config or {}
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    found = layers(model)
    hidden, intermediate = shapes[found[0]["up"].input[1]]
    out = {"hidden": int(hidden), "intermediate": int(intermediate), "layers": len(found)}
    heads = config.get("num_attention_heads") or _heads_from_reshape(model, found[0], hidden)
    if not heads:
        raise ValueError("cannot tell the number of attention heads (no config.json beside the "
                         "graph, and no constant [heads, head_dim] reshape in it)")
    out["heads"] = int(heads)
    positions = config.get("max_position_embeddings")
    if positions is None:
        positions = _position_rows(graph, shapes)
    if positions:
        out["max_positions"] = int(positions) - position_offset(config)  # XLM-R: 2
    return out


def _constant_ints(graph: onnx.GraphProto, name: str) -> list[int] | None:
    for t in graph.initializer:
        if t.name == name:
            return [int(x) for x in numpy_helper.to_array(t).reshape(-1)]
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            return None if value is None else [int(x) for x in
                                               numpy_helper.to_array(value).reshape(-1)]
    return None


def _heads_from_reshape(model: onnx.ModelProto, layer: dict[str, Any], hidden: int) -> int:
    """Heads from the constant tail [heads, head_dim] of the shape Q is reshaped to."""
    graph = model.graph
    readers = onnxbuild.consumers(graph)
    writer = onnxbuild.producers(graph)
    q = _biased(graph, layer["q"], readers, onnxbuild.initializer_names(graph))
    for i in readers.get(q, []):
        node = graph.node[i]
        if node.op_type != "Reshape":
            continue
        values = _constant_ints(graph, node.input[1])
        if values is None and node.input[1] in writer:
            concat = graph.node[writer[node.input[1]]]
            if concat.op_type == "Concat":
                parts = [_constant_ints(graph, x) for x in concat.input[-2:]]
                values = [v for p in parts if p for v in p] if all(parts) else None
        if values and len(values) >= 2 and values[-2] * values[-1] == hidden and values[-2] > 0:
            return values[-2]
    return 0


def _position_rows(graph: onnx.GraphProto, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """Rows of the position-embedding table: the largest 2-D table gathered by anything but
    the input ids (those index the word embeddings; the token-type table has one row)."""
    rows = [shapes[n.input[0]][0] for n in graph.node if n.op_type == "Gather"
            and len(shapes.get(n.input[0], ())) == 2 and n.input[1] != "input_ids"]
    return max(rows) if rows else None
