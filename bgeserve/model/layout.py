"""Graph layouts: which outputs a graph has, read from the graph itself, never from file names.

A snapshot's ``onnx/model.onnx`` may be BAAI/bge-m3's (``sentence_embedding``,
``token_embeddings``), Xenova/bge-m3's or an ``optimum-cli export onnx`` (``last_hidden_state``),
all under the same name: the outputs, read without loading the weights (``onnxmeta``), decide.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from pathlib import Path

from bgeserve.errors import ModelUnavailable
from bgeserve.model.onnxmeta import read_graph_io

__all__ = ["INPUTS", "Layout", "graph_layout", "layout_of"]

INPUTS = ("input_ids", "attention_mask")  # what every runtime adapter feeds (+ token_type_ids)


class Layout(str, enum.Enum):
    """The outputs a graph has, which decides where the heads are computed."""

    BGESERVE = (
        "bgeserve"  # dense [B,H], sparse_weights [B,L], colbert [B,L-1,H]: heads in the graph
    )
    BAAI = "baai"  # sentence_embedding [B,H], token_embeddings [B,L,H]; heads from .pt
    HIDDEN = "hidden"  # last_hidden_state [B,L,H]; heads from .pt
    # Rerankers (a (query, document) pair per row): a bgeserve export's ``score`` [B], a
    # stock hub / optimum export's ``logits`` [B, 1].
    SCORE = "score"
    LOGITS = "logits"

    @property
    def outputs(self) -> tuple[str, ...]:
        """The graph output names this layout promises (for the runtime to check)."""
        return _OUTPUTS[self]

    @property
    def exported(self) -> bool:
        """A ``bgeserve export`` graph: its manifest records the model's sizes."""
        return self in (Layout.BGESERVE, Layout.SCORE)

    @property
    def reranker(self) -> bool:
        """A cross-encoder's graph: one relevance logit per row."""
        return self in (Layout.SCORE, Layout.LOGITS)

    @property
    def hidden_output(self) -> str | None:
        """The output holding the last hidden state [B, L, H] (None: heads are in the graph)."""
        return {Layout.BAAI: "token_embeddings", Layout.HIDDEN: "last_hidden_state"}.get(self)


_OUTPUTS = {
    Layout.BGESERVE: ("dense", "sparse_weights", "colbert"),
    Layout.BAAI: ("sentence_embedding", "token_embeddings"),
    Layout.HIDDEN: ("last_hidden_state",),
    Layout.SCORE: ("score",),
    Layout.LOGITS: ("logits",),
}


def layout_of(outputs: Sequence[str]) -> Layout | None:
    """The layout whose outputs ``outputs`` has (the most specific one), or None."""
    have = set(outputs)
    for layout in (Layout.BGESERVE, Layout.BAAI, Layout.HIDDEN, Layout.SCORE, Layout.LOGITS):
        if have.issuperset(layout.outputs):
            return layout
    return None


def graph_layout(path: Path) -> Layout:
    """The layout of the ONNX graph at ``path``, from its own output names.

    Raises ModelUnavailable naming the outputs (and BGE_M3_MODEL_PATH) when the file is not an
    ONNX graph, lacks bgeserve's inputs, or has outputs of none of the layouts.
    """
    try:
        io = read_graph_io(path)
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(f"{path} is not a readable ONNX graph ({exc})",
                               param="BGE_M3_MODEL_PATH") from exc
    missing = [name for name in INPUTS if name not in io.inputs]
    if missing:
        raise ModelUnavailable(
            f"{path} has inputs {', '.join(io.inputs) or 'none'}; bgeserve feeds "
            f"{', '.join(INPUTS)} (+ token_type_ids): not a bge-m3 text encoder graph",
            param="BGE_M3_MODEL_PATH")
    layout = layout_of(io.outputs)
    if layout is None:
        known = "; ".join(f"{ly.value}: {', '.join(ly.outputs)}" for ly in Layout)
        raise ModelUnavailable(
            f"{path} has outputs {', '.join(io.outputs)}, which match no layout bgeserve reads "
            f"({known})", param="BGE_M3_MODEL_PATH")
    return layout
