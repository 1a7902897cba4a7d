"""Row-blocked feed-forward: each layer's FFN runs over blocks of token rows (an ONNX Scan).

The FFN is per token, so any split of the rows is exact (up to int8's per-tensor activation
scale, which becomes per block: finer, never coarser). Unblocked, one 8,192-token text needs
three [8192, 4096] fp32 buffers at the GELU (its output, its input, the erf temporary: 384 MiB),
and ONNX Runtime's allocation plan keeps two of them reserved for the next layer's FFN while
attention runs; blocked, those are [rows, 4096]. A chunk of at most ``rows`` tokens (every
short-text chunk) is one block with no padding.

The pass works on the finished graph (fp32 or quantized alike), so the quantizer never sees a
subgraph: a layer's FFN is the nodes between its attention LayerNorm's output and its output
LayerNorm's output, found by structure, not by name.
"""

from __future__ import annotations

from collections import defaultdict

import onnx
from onnx import TensorProto, helper

from bgeserve.export import FFN_ROWS


def ffn_regions(graph: onnx.GraphProto) -> list[tuple[str, str, list[int]]]:
    """(input, output, node indices) of every layer's FFN: the nodes on paths from the output
    of LayerNorm 2i+1 to the output of LayerNorm 2i+2 (LayerNorm 0 is the embeddings')."""
    norms = [n for n in graph.node if n.op_type == "LayerNormalization"]
    if len(norms) < 3 or len(norms) % 2 == 0:
        raise ValueError(f"expected 1 + 2 × layers LayerNormalization nodes, found {len(norms)}")
    consumers: dict[str, list[int]] = defaultdict(list)
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            consumers[name].append(i)
        for name in node.output:
            producer[name] = i
    regions = []
    for attn_norm, out_norm in zip(norms[1::2], norms[2::2]):
        start, end = attn_norm.output[0], out_norm.output[0]
        forward = _reach(start, lambda t: [o for i in consumers[t] for o in graph.node[i].output],
                         stop=end)
        backward = _reach(end, lambda t: [x for x in graph.node[producer[t]].input
                                          if x in producer], stop=start)
        nodes = sorted({producer[t] for t in forward & backward if t != start})
        regions.append((start, end, nodes))
    return regions


def _reach(origin: str, step, stop: str) -> set[str]:
    seen, todo = {origin}, [origin]
    while todo:
        name = todo.pop()
        if name == stop and name != origin:
            continue
        for nxt in step(name):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def row_block_ffn(model: onnx.ModelProto, rows: int = FFN_ROWS) -> int:
    """Rewrite ``model`` in place so each layer's FFN runs in blocks of at most ``rows``
    tokens; returns the number of layers rewritten. Raises if a region is not closed (a node
    inside reads a value computed outside other than the input and constants, or a value
    computed inside is read outside other than the output): the graph is then not bge-m3's."""
    graph = model.graph
    fold_initializer_identities(graph)
    regions = ffn_regions(graph)
    width, dtype = _hidden(graph)
    moved: set[int] = set()
    replacement: dict[int, list[onnx.NodeProto]] = {}
    for layer, (start, end, nodes) in enumerate(regions):
        _check_closed(graph, start, end, nodes)
        moved.update(nodes)
        replacement[nodes[-1]] = _blocked(graph, layer, start, end, nodes, rows, width, dtype)
    kept = []
    for i, node in enumerate(graph.node):
        if i in replacement:
            kept.extend(replacement[i])
        elif i not in moved:
            kept.append(node)
    # Shapes recorded for the moved values describe [B, L, H]; inside a block they are wrong.
    inner = {o for i in moved for o in graph.node[i].output}
    infos = [v for v in graph.value_info if v.name not in inner]
    del graph.node[:]
    graph.node.extend(kept)
    # Each layer's output is [B, L, H] again; said so, ONNX Runtime fuses the next layer's
    # attention output (its bias, this residual, the LayerNorm) into one SkipLayerNormalization,
    # which it skips for a residual of unknown shape (23 of bge-m3's 24 layers, unsaid).
    batch, seq = _token_dims(graph)
    known = {v.name for v in infos} | {o.name for o in graph.output}
    infos += [helper.make_tensor_value_info(end, dtype, [batch, seq, width])
              for _, end, _ in regions if end not in known]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    return len(regions)


def _token_dims(graph: onnx.GraphProto) -> tuple[str | int | None, str | int | None]:
    """The batch and sequence dims of the graph's token input (symbolic names or sizes;
    None where unknown)."""
    ids = next((i for i in graph.input if i.name == "input_ids"), graph.input[0])
    dims = [d.dim_param or d.dim_value or None for d in ids.type.tensor_type.shape.dim]
    return (dims + [None, None])[0], (dims + [None, None])[1]


def fold_initializer_identities(graph: onnx.GraphProto) -> int:
    """Make readers of ``Identity(initializer)`` read the initializer itself; returns how many
    Identity nodes went.

    torch.onnx.export stores equal initializers once and feeds every further use through an
    Identity: in a freshly initialised model (``XLMRobertaModel(config)``, every bias zero)
    each layer's FFN biases then come from nodes outside the FFN, and the region would not be
    closed. The values are unchanged.
    """
    initializers = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    alias = {n.output[0]: n.input[0] for n in graph.node
             if n.op_type == "Identity" and n.input[0] in initializers
             and n.output[0] not in outputs}
    if not alias:
        return 0
    _rename_inputs(graph, alias)
    kept = [n for n in graph.node if not (n.op_type == "Identity" and n.output[0] in alias)]
    del graph.node[:]
    graph.node.extend(kept)
    infos = [v for v in graph.value_info if v.name not in alias]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    return len(alias)


def _rename_inputs(graph: onnx.GraphProto, alias: dict[str, str]) -> None:
    """Rename node inputs in ``graph`` and in every subgraph (a Loop body may read the outer
    names)."""
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in alias:
                node.input[k] = alias[name]
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _rename_inputs(attr.g, alias)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _rename_inputs(sub, alias)


def _hidden(graph: onnx.GraphProto) -> tuple[int, int]:
    """The hidden size and activation type: those of the first LayerNormalization's scale."""
    norm = next(n for n in graph.node if n.op_type == "LayerNormalization")
    scale = next(t for t in graph.initializer if t.name == norm.input[1])
    return int(scale.dims[-1]), scale.data_type


def _check_closed(graph: onnx.GraphProto, start: str, end: str, nodes: list[int]) -> None:
    inside = {o for i in nodes for o in graph.node[i].output}
    outer = {init.name for init in graph.initializer}
    outer |= {n.output[0] for n in graph.node if n.op_type == "Constant"}
    for i in nodes:
        stray = [x for x in graph.node[i].input if x and x not in inside | outer | {start}]
        if stray:
            raise ValueError(f"FFN node {graph.node[i].name!r} reads {stray} from outside "
                             f"the block between {start!r} and {end!r}")
    chosen = set(nodes)
    for i, node in enumerate(graph.node):
        if i in chosen:
            continue
        leaked = [x for x in node.input if x in inside and x != end]
        if leaked:
            raise ValueError(f"{node.name!r} reads FFN-internal values {leaked}")
    hidden = [o.name for o in graph.output if o.name in inside and o.name != end]
    if hidden:
        raise ValueError(f"graph outputs {hidden} are FFN-internal values")


def _blocked(graph: onnx.GraphProto, layer: int, start: str, end: str, nodes: list[int],
             rows: int, width: int, dtype: int) -> list[onnx.NodeProto]:
    """Main-graph nodes: flatten [B, L, H] to T rows, split into n = ceil(T / rows) blocks of
    r = ceil(T / n) rows (at most n - 1 padding rows), Scan the FFN over them, drop the
    padding, restore [B, L, H]."""
    p = f"/rowblock/layer.{layer}/"
    out_nodes: list[onnx.NodeProto] = []

    def c(name: str, values: list[int]) -> str:
        value = helper.make_tensor(p + name, TensorProto.INT64, [len(values)], values)
        out_nodes.append(helper.make_node("Constant", [], [p + name], name=p + name, value=value))
        return p + name

    one, rows_c, minus_one = c("one", [1]), c("rows", [rows]), c("minus_one", [-1])

    def node(op: str, inputs: list[str], name: str, **attrs) -> str:
        out_nodes.append(helper.make_node(op, inputs, [p + name], name=p + name, **attrs))
        return p + name

    shape = node("Shape", [start], "shape")
    hidden = node("Shape", [start], "hidden", start=2)
    tokens = node("ReduceProd", [node("Shape", [start], "lead", end=2)], "tokens", keepdims=1)
    # ceil(T / rows) blocks, then ceil(T / n) rows each.
    blocks = node("Div", [node("Sub", [node("Add", [tokens, rows_c], "t_plus"), one], "t_up"),
                          rows_c], "blocks")
    per = node("Div", [node("Sub", [node("Add", [tokens, blocks], "t_plus_n"), one], "t_up_n"),
                       blocks], "per_block")
    pad = node("Sub", [node("Mul", [blocks, per], "padded"), tokens], "pad")
    flat = node("Reshape", [start, node("Concat", [minus_one, hidden], "flat_shape", axis=0)],
                "flat")
    # Pad's layout: [begin rows, begin hidden, end rows, end hidden].
    pads = node("Concat", [c("zero2", [0, 0]), pad, c("zero1", [0])], "pads", axis=0)
    padded = node("Pad", [flat, pads], "padded_rows")
    split = node("Concat", [blocks, one, per, hidden], "block_shape", axis=0)
    stacked = node("Reshape", [padded, split], "stacked")

    body_in, body_out = p + "block_in", p + "block_out"
    body_nodes = []
    for i in nodes:
        inner = onnx.NodeProto()
        inner.CopyFrom(graph.node[i])
        inner.input[:] = [body_in if x == start else x for x in inner.input]
        inner.output[:] = [body_out if x == end else x for x in inner.output]
        body_nodes.append(inner)
    # A typed, shaped block lets ONNX Runtime's fusions (bias + GELU, skip + LayerNorm) match
    # inside the body as they do in the main graph.
    block: list[str | int | None] = [1, "block_rows", width]
    body = helper.make_graph(
        body_nodes, f"ffn_layer_{layer}",
        [helper.make_tensor_value_info(body_in, dtype, block)],
        [helper.make_tensor_value_info(body_out, dtype, block)])
    scanned = node("Scan", [stacked], "scan", body=body, num_scan_inputs=1)
    rows_out = node("Reshape", [scanned, node("Concat", [minus_one, hidden], "out_shape", axis=0)],
                    "rows_out")
    kept = node("Slice", [rows_out, c("first", [0]), tokens, c("axis0", [0])], "unpadded")
    out_nodes.append(helper.make_node("Reshape", [kept, shape], [end], name=p + "restore"))
    return out_nodes
