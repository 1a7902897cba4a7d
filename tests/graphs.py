"""Tiny ONNX graphs with chosen input and output names, for layout detection without a model."""

from __future__ import annotations

from collections.abc import Sequence

BAAI_OUTPUTS = ("sentence_embedding", "token_embeddings")
HIDDEN_OUTPUTS = ("last_hidden_state",)


def graph_bytes(outputs: Sequence[str],
                inputs: Sequence[str] = ("input_ids", "attention_mask")) -> bytes:
    """A valid ONNX model: every output is a Cast of the first input (nothing that runs well,
    only names that ``layout.graph_layout`` reads)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Cast", [inputs[0]], [name], to=TensorProto.FLOAT)
             for name in outputs]
    graph = helper.make_graph(
        nodes, "names", [helper.make_tensor_value_info(n, TensorProto.INT64, [None, None])
                         for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def padded_batch(lengths: Sequence[int], seed: int = 0, vocab: int = 100):
    """(input_ids, attention_mask) int64: texts of ``lengths`` tokens (<s> … </s>, ids from
    [4, vocab)), right-padded with <pad> = 1 to the longest."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.ones((len(lengths), max(lengths)), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(4, vocab, n)
        ids[row, 0], ids[row, n - 1] = 0, 2
        mask[row, :n] = 1
    return ids, mask


# Unpadded and padded batches, some longer than a 4-row attention block.
BATCHES = ([7], [20, 20], [3, 9, 12], [1, 2, 13], [2])


def load_stock(path):
    """The ONNX model at ``path`` with its weights (a tiny model: inline is fine)."""
    import onnx

    return onnx.load(str(path), load_external_data=True)


def run(model, names: Sequence[str], ids, mask) -> list:
    """``names`` of ``model`` (a ModelProto or a path) on one batch, with ONNX Runtime."""
    import onnxruntime as ort

    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return session.run(list(names), {"input_ids": ids, "attention_mask": mask})
