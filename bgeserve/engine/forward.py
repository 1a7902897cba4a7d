"""One forward pass over a padded chunk, whatever the graph layout: ids in, ``ChunkOutputs`` out.

A bgeserve export computes the heads in the graph; the hub graphs give hidden states and the
heads are applied here in numpy (``HiddenHeads``). Either way the engine sees the same
``ChunkOutputs``. A reranker's graph (``Layout.SCORE`` / ``LOGITS``: one logit per row) fills
the ``dense`` slot with that logit as a (B, 1) column, so the engine, the packer and the tuner
serve it unchanged (``engine/reranker.py`` reads it back).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from bgeserve import runtime
from bgeserve.engine.heads import ChunkOutputs, HiddenHeads, l2_normalize
from bgeserve.errors import ModelUnavailable
from bgeserve.model.artifacts import Layout, ModelArtifacts, export_variants
from bgeserve.runtime import Session, SessionConfig
from bgeserve.vocab import PAD_ID

OpenForward = Callable[..., "Forward"]  # open_forward(worker=0) -> Forward


def pad_chunk(ids: list[np.ndarray], pad_to: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token id arrays with ``<pad>`` into (input_ids, attention_mask), int64."""
    batch = np.full((len(ids), pad_to), PAD_ID, dtype=np.int64)
    mask = np.zeros((len(ids), pad_to), dtype=np.int64)
    for row, x in enumerate(ids):
        batch[row, : len(x)] = x
        mask[row, : len(x)] = 1
    return batch, mask


class Forward:
    """A session plus its layout: ``run(ids, mask, dense, sparse, colbert)`` → ChunkOutputs."""

    def __init__(self, session: Session, layout: Layout, heads: HiddenHeads | None):
        if layout is not Layout.BGESERVE and not layout.reranker and heads is None:
            raise ModelUnavailable(f"the {layout.value} graph layout needs the sparse and "
                                   "ColBERT head weights (sparse_linear.pt, colbert_linear.pt)")
        self.session = session
        self.layout = layout
        self.heads = heads

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, *, dense: bool,
            sparse: bool, colbert: bool) -> ChunkOutputs:
        if self.layout.reranker:  # whatever is asked, a reranker has its logit
            name = self.layout.outputs[0]
            logit = self.session.run(input_ids, attention_mask, [name])[name]
            return ChunkOutputs(np.asarray(logit, dtype=np.float32).reshape(-1, 1), None, None)
        if self.layout is Layout.BGESERVE:
            names = [n for n, want in (("dense", dense), ("sparse_weights", sparse),
                                       ("colbert", colbert)) if want]
            out = self.session.run(input_ids, attention_mask, names)
            return ChunkOutputs(out.get("dense"), out.get("sparse_weights"), out.get("colbert"))
        if self.layout is Layout.BAAI:
            names = ["sentence_embedding"] if dense else []
            if sparse or colbert:
                names.append("token_embeddings")
            out = self.session.run(input_ids, attention_mask, names)
            hidden = out.get("token_embeddings")
            dense_out = l2_normalize(out["sentence_embedding"]) if dense else None
        else:
            hidden = self.session.run(input_ids, attention_mask, ["last_hidden_state"])[
                "last_hidden_state"].astype(np.float32, copy=False)
            dense_out = l2_normalize(hidden[:, 0]) if dense else None
        assert self.heads is not None
        if not (sparse or colbert):
            return ChunkOutputs(dense_out, None, None)
        assert hidden is not None  # the hidden states were asked for above
        return ChunkOutputs(
            dense_out,
            self.heads.sparse(hidden) if sparse else None,
            self.heads.colbert(hidden, attention_mask) if colbert else None,
        )

    def close(self) -> None:
        self.session.close()


def _files(artifacts: ModelArtifacts) -> tuple[str, tuple[int, ...]]:
    """The graph files' names, sizes and mtimes, and their inodes (a copy keeps the first
    three with ``cp -a``)."""
    paths = (artifacts.onnx_path, *artifacts.external_data)
    identity = artifacts.identity()  # ModelUnavailable if one is gone
    try:
        return identity, tuple(os.stat(p).st_ino for p in paths)
    except OSError as exc:
        raise ModelUnavailable(f"model file is gone: {exc}") from exc


def _recorded(artifacts: ModelArtifacts) -> tuple[str, int] | None:
    """The sha256 and size an export's manifest records for this graph; None where there is
    no such record (a hub snapshot served as it is)."""
    entry = export_variants(artifacts.onnx_path.parent.parent).get(artifacts.variant, {})
    try:
        return str(entry["sha256"]), int(entry["bytes"])
    except (KeyError, TypeError, ValueError):
        return None


def forward_factory(artifacts: ModelArtifacts, config: SessionConfig) -> OpenForward:
    """A callable ``open_forward(worker=0)`` that opens a fresh ``Forward`` for that worker.

    Workers call it to load and reload; the runtime registry decides how sessions are shared
    (one for every worker on the CPU and OpenVINO, one per device on GPUs).
    """
    heads = None
    if artifacts.heads is not None:
        h = artifacts.heads
        heads = HiddenHeads(h.sparse_weight.astype(np.float32), float(h.sparse_bias),
                            h.colbert_weight.astype(np.float32), h.colbert_bias.astype(np.float32))
    open_session = runtime.get(runtime.kind_of(artifacts, config.provider)).opener(artifacts,
                                                                                   config)
    loaded, recorded = _files(artifacts), _recorded(artifacts)

    def open_forward(worker: int = 0) -> Forward:
        # A reload (after an idle unload, or a failure) reads the graph from disk again: files
        # replaced since the start (a symlink moved to another export, a copy over them) gave
        # the new weights under the tokenizer and cached vectors of the old, silently. A
        # rebuild of the same graph (another replica preparing the shared cache again) is the
        # same model by its manifest's digest and size.
        if _files(artifacts) != loaded and not (
                recorded is not None and _recorded(artifacts) == recorded
                and artifacts.onnx_path.stat().st_size == recorded[1]):
            raise ModelUnavailable(
                f"the model files of {artifacts.source} changed since bgeserve started; it "
                "serves nothing rather than mix them with the tokenizer and cache it started "
                "with: restart bgeserve to serve the new files")
        return Forward(open_session(worker), artifacts.layout, heads)

    return open_forward
