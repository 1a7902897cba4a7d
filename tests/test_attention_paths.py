"""The exported graph's two attention paths agree: fused MultiHeadAttention (a chunk without
padding) and the masked loop over query-row blocks (a padded chunk)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from bgeserve.engine.forward import pad_chunk
from bgeserve.export import ATTENTION_BLOCK
from bgeserve.runtime import SessionConfig
from bgeserve.runtime.onnx import OnnxSession


def _ids(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([[0], rng.integers(5, 2000, n - 2), [2]]).astype(np.int64)


def test_the_export_has_both_paths(tiny_export: Path) -> None:
    graph = onnx.load(str(tiny_export / "fp32" / "model.onnx"), load_external_data=False).graph
    branches = [{a.name: {n.op_type for n in a.g.node} for a in node.attribute}
                for node in graph.node if node.op_type == "If"]
    assert branches and all("MultiHeadAttention" in b["then_branch"] for b in branches)
    assert all("MultiHeadAttention" not in b["else_branch"] for b in branches)


@pytest.mark.parametrize("lengths", [(40, 25), (ATTENTION_BLOCK + 60, ATTENTION_BLOCK - 9),
                                     (5 * ATTENTION_BLOCK + 220, 4 * ATTENTION_BLOCK + 74)])
def test_padded_chunk_equals_each_text_alone(tiny_export: Path, lengths: tuple[int, int]) -> None:
    session = OnnxSession(tiny_export / "fp32" / "model.onnx", SessionConfig(threads=1))
    texts = [_ids(n, seed) for seed, n in enumerate(lengths)]
    together = session.run(*pad_chunk(texts, max(lengths)))  # padded: the blocked path
    for row, ids in enumerate(texts):
        alone = session.run(*pad_chunk([ids], len(ids)))  # unpadded: MultiHeadAttention
        np.testing.assert_allclose(together["dense"][row], alone["dense"][0], atol=2e-5)
        n = len(ids)
        np.testing.assert_allclose(together["sparse_weights"][row, :n],
                                   alone["sparse_weights"][0], atol=2e-5)
        np.testing.assert_allclose(together["colbert"][row, : n - 1], alone["colbert"][0],
                                   atol=2e-5)
