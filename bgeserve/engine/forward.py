"""One forward pass over a padded chunk, whatever the graph layout: ids in, ``ChunkOutputs`` out.

A bgeserve export computes the heads in the graph; the hub graphs give hidden states and the
heads are applied here in numpy (``HiddenHeads``). Either way the engine sees the same
``ChunkOutputs``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from bgeserve.engine.heads import ChunkOutputs, HiddenHeads, l2_normalize
from bgeserve.engine.tokenizer import PAD_ID
from bgeserve.errors import ModelUnavailable
from bgeserve.model.artifacts import Layout, ModelArtifacts
from bgeserve.runtime.gpu import open_pinned
from bgeserve.runtime.onnx import OnnxSession, SessionConfig, SharedSession

# Padded tokens per session.run() that gave the most tokens/s on the mixed corpus
# (docs/benchmarks.md, chunk sweep): ORT on the CPU runs small chunks best (its GEMMs gain
# little from batching and padding costs), OpenVINO bf16 ~1,024. GPUs want big chunks: on an
# H200 (CUDA fp16, one run per shape) 1,024 tokens run in ~9 ms (~110k tokens/s), 8,192 in
# ~16 ms (4x2048: 515k tokens/s), 16,384 in 26 ms (32x512: 642k); 8,192 takes most of that
# gain at a run's latency of ~16 ms. (The memory budget still bounds every chunk.)
CHUNK_TOKENS = {"cpu": 256, "openvino": 1024, "cuda": 8192, "tensorrt": 8192}
DEFAULT_CHUNK_TOKENS = 1024


# Chunk lengths rounded up to a multiple of this. On an H200 (CUDA, fp16; docs/benchmarks.md)
# a warm run costs ~9 ms from 1x16 to 8x512 tokens, but a shape's first run costs ~30-50 ms
# more (1 client: p50 7 ms, p99 55 ms over ~25 distinct lengths; a mixed corpus, every chunk a
# new shape, ran at 37-43 ms per chunk): 32 bounds the shapes texts of up to 512 tokens make at
# 16 lengths, for padding the GPU runs nearly for free. CPUs pay for every padded token and
# nothing per shape: no rounding. (The end-to-end gain on a GPU is not measured yet.)
PAD_MULTIPLE = {"cuda": 32, "tensorrt": 32}


def best_chunk_tokens(artifacts: ModelArtifacts, config: SessionConfig) -> int:
    """The measured best padded tokens per chunk for the runtime and EP that will run."""
    key = "openvino" if artifacts.runtime == "openvino" else config.provider
    return CHUNK_TOKENS.get(key, DEFAULT_CHUNK_TOKENS)


def best_pad_multiple(artifacts: ModelArtifacts, config: SessionConfig) -> int:
    """What chunk lengths are rounded up to a multiple of, for the runtime and EP that will run."""
    return 1 if artifacts.runtime == "openvino" else PAD_MULTIPLE.get(config.provider, 1)


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

    def __init__(self, session: OnnxSession, layout: Layout, heads: HiddenHeads | None):
        if layout is not Layout.BGESERVE and heads is None:
            raise ModelUnavailable(f"the {layout.value} graph layout needs the sparse and "
                                   "ColBERT head weights (sparse_linear.pt, colbert_linear.pt)")
        self.session = session
        self.layout = layout
        self.heads = heads

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, *, dense: bool,
            sparse: bool, colbert: bool) -> ChunkOutputs:
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
        return ChunkOutputs(
            dense_out,
            self.heads.sparse(hidden) if sparse else None,
            self.heads.colbert(hidden, attention_mask) if colbert else None,
        )

    def close(self) -> None:
        self.session.close()


def forward_factory(artifacts: ModelArtifacts,
                    config: SessionConfig) -> Callable[..., Forward]:
    """A callable ``open_forward(worker=0)`` that opens a fresh ``Forward`` for that worker.

    Workers call it to load and reload; on a GPU EP worker ``i`` runs on device
    ``i % gpu_count``.
    """
    heads = None
    if artifacts.heads is not None:
        h = artifacts.heads
        heads = HiddenHeads(h.sparse_weight.astype(np.float32), float(h.sparse_bias),
                            h.colbert_weight.astype(np.float32), h.colbert_bias.astype(np.float32))

    if artifacts.runtime == "openvino":
        from bgeserve.runtime import openvino

        # One compiled model, one stream per worker: the weights are resident once.
        shared = openvino.SharedModel(artifacts.onnx_path, precision=artifacts.variant,
                                      threads=config.threads, streams=config.streams)

        def open_openvino(worker: int = 0) -> Forward:
            return Forward(shared.session(), artifacts.layout, heads)  # type: ignore[arg-type]

        return open_openvino

    if config.provider == "cpu":
        # One session, one copy of the weights, however many workers (runtime.onnx.SharedSession).
        session = SharedSession(artifacts.onnx_path, config)

        def open_shared(worker: int = 0) -> Forward:
            return Forward(session.session(), artifacts.layout, heads)  # type: ignore[arg-type]

        return open_shared

    def open_forward(worker: int = 0) -> Forward:
        return Forward(open_pinned(artifacts.onnx_path, config, worker), artifacts.layout, heads)

    return open_forward


def weight_copies(artifacts: ModelArtifacts, config: SessionConfig, workers: int) -> int:
    """How many copies of the weights ``workers`` workers keep resident: one where they share
    a session or compiled model (CPU, OpenVINO), else one per worker (GPU sessions)."""
    if artifacts.runtime == "openvino" or config.provider == "cpu":
        return 1
    return max(1, workers)
