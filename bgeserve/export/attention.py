"""Bounded-memory attention for a hub graph: each layer's attention becomes If(unpadded, MHA,
blocked), as ``bgeserve export`` writes it (docs/startup-probe.md §8).

- A chunk without padding (every text run alone, so every long text) takes ONNX Runtime's
  com.microsoft ``MultiHeadAttention`` without a mask: on the CPU that runs MLAS flash attention,
  which never materialises the score matrix (ORT's CPU kernel takes the flash path only when it
  has no key padding mask and no attention bias; with either it computes all B·N·S² scores).
- A padded chunk takes masked attention over blocks of query rows: an ONNX ``Scan`` over
  ⌈S/block⌉ blocks of ⌈S/n⌉ rows (at most n − 1 padding rows, dropped after), so a block's scores
  are heads × rows × S, never heads × S². Softmax is per query row: blocking is exact.

The new nodes read the Q, K and V projections (``encoder.attention_sites``) and feed the output
projection; the stock attention nodes, left without readers, are pruned.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper

from bgeserve.export import ATTENTION_BLOCK, encoder, onnxbuild

PREFIX = "/bgeserve_attention/"
MASK_MIN = float(np.finfo(np.float32).min)  # transformers' eager mask value


def bound_attention(model: onnx.ModelProto, heads: int, hidden: int,
                    block: int = ATTENTION_BLOCK) -> int:
    """Rewrite every layer's attention in place; returns the number of layers rewritten.

    Raises ValueError when the graph's opset is older than 13, its layers cannot be found, or
    plain attention is still needed afterwards (some other node reads its values).
    """
    opset = onnxbuild.default_opset(model)
    if opset < onnxbuild.MIN_OPSET:
        raise ValueError(f"the graph is at opset {opset}; rewriting needs {onnxbuild.MIN_OPSET}+")
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads")
    graph = model.graph
    onnxbuild.name_nodes(graph)
    sites = encoder.attention_sites(model)
    shared = onnxbuild.Nodes(PREFIX + "mask/", opset)
    mask = shared.op("Cast", ["attention_mask"], to=TensorProto.INT64)
    lowest = shared.reduce("ReduceMin", mask, [0, 1], keepdims=0)
    unpadded = shared.op("Equal", [lowest, shared.const([1], scalar=True)])
    keep = shared.op("Cast", [mask], to=TensorProto.FLOAT)
    dropped = shared.op("Sub", [shared.const([1.0], dtype=TensorProto.FLOAT, scalar=True), keep])
    bias = shared.unsqueeze(shared.op("Mul", [dropped, shared.const(
        [MASK_MIN], dtype=TensorProto.FLOAT, scalar=True)]), [1, 2])  # [B, 1, 1, S]

    branches = {}
    for layer, site in enumerate(sites):
        p = f"{PREFIX}layer.{layer}/"
        context = p + "context"
        branches[site.output_projection] = helper.make_node(
            "If", [unpadded], [context], name=p + "If",
            then_branch=_fused(site, heads, hidden, p + "mha/"),
            else_branch=_blocked(site, heads, hidden, block, bias, p + "blocked/", opset))
    nodes = list(shared.nodes)
    for node in graph.node:
        if node.name in branches:
            node.input[0] = branches[node.name].output[0]
            nodes.append(branches[node.name])
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnxbuild.set_opset(model, "com.microsoft", 1)
    onnxbuild.prune(graph)
    left = [n.name for n in graph.node if n.op_type == "Softmax"]
    if left:
        raise ValueError(f"plain attention is still read after the rewrite ({left[:3]})")
    return len(sites)


def _output(name: str, hidden: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [None, None, hidden])


def _fused(site: encoder.AttentionSite, heads: int, hidden: int,
           prefix: str) -> onnx.GraphProto:
    """The unpadded branch: one MultiHeadAttention over the [B, S, H] projections, no mask."""
    out = prefix + "out"
    node = helper.make_node("MultiHeadAttention", [site.q, site.k, site.v], [out],
                            name=prefix + "MultiHeadAttention", domain="com.microsoft",
                            num_heads=heads)
    return helper.make_graph([node], prefix.strip("/").replace("/", "_"), [],
                             [_output(out, hidden)])


def _blocked(site: encoder.AttentionSite, heads: int, hidden: int, block: int, bias: str,
             prefix: str, opset: int) -> onnx.GraphProto:
    """The padded branch: masked attention, ``Scan`` over blocks of query rows."""
    b = onnxbuild.Nodes(prefix, opset)
    head_dim = hidden // heads
    split = b.const([0, 0, heads, head_dim])

    def per_head(x: str, perm: list[int]) -> str:
        return b.op("Transpose", [b.op("Reshape", [x, split])], perm=perm)

    scale = b.const([1.0 / math.sqrt(head_dim)], dtype=TensorProto.FLOAT, scalar=True)
    q = b.op("Mul", [per_head(site.q, [0, 2, 1, 3]), scale])  # [B, N, S, d]
    kt = per_head(site.k, [0, 2, 3, 1])  # [B, N, d, S]
    v = per_head(site.v, [0, 2, 1, 3])  # [B, N, S, d]
    seq = b.op("Slice", [b.op("Shape", [site.q]), b.const([1]), b.const([2])])
    one, rows = b.const([1]), b.const([block])
    # n = ceil(S / block) blocks of r = ceil(S / n) rows: at most n - 1 padding rows.
    n = b.op("Div", [b.op("Sub", [b.op("Add", [seq, rows]), one]), rows])
    r = b.op("Div", [b.op("Sub", [b.op("Add", [seq, n]), one]), n])
    pad = b.op("Sub", [b.op("Mul", [n, r]), seq])
    pads = b.op("Concat", [b.const([0] * 6), pad, b.const([0])], axis=0)
    shape = b.op("Concat", [b.const([0, 0]), n, r, b.const([head_dim])], axis=0)
    stacked = b.op("Transpose", [b.op("Reshape", [b.op("Pad", [q, pads]), shape])],
                   perm=[2, 0, 1, 3, 4])  # [n, B, N, r, d]

    body = onnxbuild.Nodes(prefix + "body/", opset)
    rows_in, rows_out = prefix + "block_q", prefix + "block_out"
    scores = body.op("Add", [body.op("MatMul", [rows_in, kt]), bias])
    body.op("MatMul", [body.op("Softmax", [scores], axis=-1), v], output=rows_out)
    scan_body = helper.make_graph(
        body.nodes, prefix.strip("/").replace("/", "_") + "_body",
        [helper.make_tensor_value_info(rows_in, TensorProto.FLOAT, [None] * 4)],
        [helper.make_tensor_value_info(rows_out, TensorProto.FLOAT, [None] * 4)])
    scanned = b.op("Scan", [stacked], body=scan_body, num_scan_inputs=1)
    merged = b.op("Reshape", [b.op("Transpose", [scanned], perm=[1, 0, 3, 2, 4]),
                              b.const([0, -1, hidden])])  # [B, n·r, H]
    out = prefix + "out"
    b.op("Slice", [merged, b.const([0]), seq, b.const([1])], output=out)
    return helper.make_graph(b.nodes, prefix.strip("/").replace("/", "_"), [],
                             [_output(out, hidden)])
