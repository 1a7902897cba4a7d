"""Small tools for rewriting ONNX graphs: a node builder that knows the opset, graph walks, pruning.

``prepare`` edits graphs it did not write (BAAI's, an optimum export), at whatever opset they
were exported with (13 and later): ops whose signature changed across opsets (``Unsqueeze``
and ``Squeeze`` take their axes as an input from opset 13, the ``Reduce*`` ops from 18) are
emitted in the form the graph's opset expects.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MIN_OPSET = 13  # the Squeeze/Unsqueeze/Split signatures used here


class Nodes:
    """Nodes named under ``prefix``, appended to ``self.nodes`` in the order they are made."""

    def __init__(self, prefix: str, opset: int):
        self.prefix = prefix
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def const(self, values: Sequence[float] | Sequence[int] | np.ndarray, *,
              dtype: int = TensorProto.INT64, scalar: bool = False, hint: str = "const") -> str:
        """A Constant node holding ``values`` (1-D, or a scalar); returns its output name."""
        array = np.asarray(values, dtype=helper.tensor_dtype_to_np_dtype(dtype))
        if scalar:
            array = array.reshape(())
        name = self._name(hint)
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(array, name)))
        return name

    def op(self, op_type: str, inputs: Sequence[str], *, hint: str | None = None,
           domain: str | None = None, output: str | None = None, **attrs: object) -> str:
        """One node of ``op_type``; returns its (single) output name (``output`` if given)."""
        name = self._name(hint or op_type)
        out = output or f"{name}_output"
        node = helper.make_node(op_type, list(inputs), [out], name=name, **attrs)
        if domain:
            node.domain = domain
        self.nodes.append(node)
        return out

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Unsqueeze", [x, self.const(list(axes))])

    def squeeze(self, x: str, axes: Sequence[int], output: str | None = None) -> str:
        return self.op("Squeeze", [x, self.const(list(axes))], output=output)

    def reduce(self, op_type: str, x: str, axes: Sequence[int], *, keepdims: int) -> str:
        """``ReduceL2`` / ``ReduceMin`` / … over ``axes`` (an input from opset 18, else an
        attribute)."""
        if self.opset >= 18:
            return self.op(op_type, [x, self.const(list(axes))], keepdims=keepdims)
        return self.op(op_type, [x], axes=list(axes), keepdims=keepdims)

    def normalize(self, x: str, eps: float = 1e-12, output: str | None = None) -> str:
        """``x / max(‖x‖₂, eps)`` over the last axis, as torch.nn.functional.normalize."""
        norm = self.reduce("ReduceL2", x, [-1], keepdims=1)
        floor = self.op("Clip", [norm, self.const([eps], dtype=TensorProto.FLOAT, scalar=True)])
        return self.op("Div", [x, floor], output=output)


def default_opset(model: onnx.ModelProto) -> int:
    """The version of the default (ai.onnx) domain the model imports."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def set_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    """Import ``domain`` at ``version`` (raised to it if the model imports an older one)."""
    for entry in model.opset_import:
        if entry.domain == domain or (domain == "" and entry.domain == "ai.onnx"):
            entry.version = max(entry.version, version)
            return
    model.opset_import.append(helper.make_opsetid(domain, version))


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs held in a node's attributes (If branches, Loop and Scan bodies)."""
    found = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            found.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            found.extend(attr.graphs)
    return found


def names_read(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    """Every value name the nodes read, those read inside their subgraphs included (a body may
    read outer-scope values by name)."""
    read: set[str] = set()
    for node in nodes:
        read.update(x for x in node.input if x)
        for sub in subgraphs(node):
            read |= names_read(sub.node)
            read.update(o.name for o in sub.output)
    return read


def consumers(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """Value name → indices of the main-graph nodes reading it (subgraph reads included)."""
    found: dict[str, list[int]] = defaultdict(list)
    for i, node in enumerate(graph.node):
        for name in names_read([node]):
            found[name].append(i)
    return found


def producers(graph: onnx.GraphProto) -> dict[str, int]:
    """Value name → index of the main-graph node writing it."""
    return {out: i for i, node in enumerate(graph.node) for out in node.output}


def prune(graph: onnx.GraphProto) -> int:
    """Drop nodes whose outputs nothing needs, and initializers nothing reads; returns the number
    of nodes dropped. Needs are traced back from the graph outputs, through subgraph reads."""
    needed = {o.name for o in graph.output}
    keep: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(out in needed for out in node.output):
            keep.append(node)
            needed |= names_read([node])
    dropped = len(graph.node) - len(keep)
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    inits = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    produced = {o for n in graph.node for o in n.output} | {t.name for t in graph.initializer}
    infos = [v for v in graph.value_info if v.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    return dropped


def initializer_names(graph: onnx.GraphProto) -> set[str]:
    """Initializers and Constant-node outputs: the graph's fixed values."""
    return {t.name for t in graph.initializer} | {n.output[0] for n in graph.node
                                                  if n.op_type == "Constant"}


def name_nodes(graph: onnx.GraphProto) -> int:
    """Give every unnamed or duplicate-named main-graph node a unique name (rewrites find nodes
    by name); returns how many were renamed."""
    seen: set[str] = set()
    renamed = 0
    for i, node in enumerate(graph.node):
        if not node.name or node.name in seen:
            node.name = f"/bgeserve_node/{i}"
            renamed += 1
        seen.add(node.name)
    return renamed
