"""bge-m3's three heads written into a hub graph, so it gives bgeserve's layout from one run.

From the last hidden state h [B, L, H] (BAAI's ``token_embeddings``, Xenova's and optimum's
``last_hidden_state``), exactly as ``bgeserve export`` (graph.py) and FlagEmbedding compute them:

- ``dense`` [B, H]: h[:, 0] L2-normalised;
- ``sparse_weights`` [B, L]: relu(h·w + b) (``sparse_linear.pt``);
- ``colbert`` [B, L-1, H]: (h[:, 1:]·Wᵀ + b) · mask[:, 1:], each row L2-normalised
  (``colbert_linear.pt``).

The head MatMuls are named under ``/sparse_linear/`` and ``/colbert_linear/``, the prefixes the
int8 step keeps in fp32 (steps.HEAD_NODE_PREFIXES), as the export's are.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bgeserve.export import onnxbuild
from bgeserve.model.ptload import HeadWeights

OUTPUTS = ("dense", "sparse_weights", "colbert")
_INT64_MAX = np.iinfo(np.int64).max


def add_heads(model: onnx.ModelProto, hidden_output: str, heads: HeadWeights) -> None:
    """Replace the graph's outputs by bgeserve's three, computed from ``hidden_output``."""
    graph = model.graph
    if hidden_output not in {o.name for o in graph.output}:
        raise ValueError(f"the graph has no output {hidden_output!r}")
    width = heads.hidden_size
    opset = onnxbuild.default_opset(model)
    weights = {
        "/sparse_linear/weight": heads.sparse_weight.reshape(width, 1),
        "/sparse_linear/bias": np.asarray([heads.sparse_bias], dtype=np.float32),
        "/colbert_linear/weight": np.ascontiguousarray(heads.colbert_weight.T),
        "/colbert_linear/bias": heads.colbert_bias,
    }
    graph.initializer.extend(numpy_helper.from_array(np.asarray(w, dtype=np.float32), name)
                             for name, w in weights.items())
    h = hidden_output

    dense = onnxbuild.Nodes("/dense/", opset)
    dense.normalize(dense.op("Gather", [h, dense.const([0], scalar=True)], axis=1),
                    output="dense")

    sparse = onnxbuild.Nodes("/sparse_linear/", opset)
    logits = sparse.op("Add", [sparse.op("MatMul", [h, "/sparse_linear/weight"]),
                               "/sparse_linear/bias"])
    sparse.squeeze(sparse.op("Relu", [logits]), [-1], output="sparse_weights")

    colbert = onnxbuild.Nodes("/colbert_linear/", opset)
    rest = colbert.op("Slice", [h, colbert.const([1]), colbert.const([_INT64_MAX]),
                                colbert.const([1])])
    projected = colbert.op("Add", [colbert.op("MatMul", [rest, "/colbert_linear/weight"]),
                                   "/colbert_linear/bias"])
    keep = colbert.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    keep = colbert.unsqueeze(colbert.op("Slice", [keep, colbert.const([1]),
                                                  colbert.const([_INT64_MAX]),
                                                  colbert.const([1])]), [-1])
    colbert.normalize(colbert.op("Mul", [projected, keep]), output="colbert")

    graph.node.extend(dense.nodes + sparse.nodes + colbert.nodes)
    del graph.output[:]
    graph.output.extend([
        helper.make_tensor_value_info("dense", TensorProto.FLOAT, ["batch", width]),
        helper.make_tensor_value_info("sparse_weights", TensorProto.FLOAT, ["batch", "seq"]),
        helper.make_tensor_value_info("colbert", TensorProto.FLOAT,
                                      ["batch", "seq_minus_1", width]),
    ])
    onnxbuild.prune(graph)
