"""``bgeserve.export.graph.M3Graph``, the module every export traces: its encoder is the
model's own forward (transformers' XLMRobertaModel is the reference), whatever the
activation; a model padded otherwise than bge-m3 is refused. No ONNX export here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import XLMRobertaConfig, XLMRobertaModel

from bgeserve.export.graph import M3Graph


def tiny(**changes) -> tuple[XLMRobertaModel, XLMRobertaConfig]:
    config = XLMRobertaConfig(vocab_size=64, hidden_size=32, num_attention_heads=4,
                              num_hidden_layers=2, intermediate_size=48,
                              max_position_embeddings=40, initializer_range=0.2, **changes)
    torch.manual_seed(0)
    return XLMRobertaModel(config, add_pooling_layer=False).eval(), config


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_new", "silu"])
@pytest.mark.parametrize("block", [0, 4])
def test_the_encoder_is_the_models_own_whatever_its_activation(act: str, block: int) -> None:
    """A padded batch's real positions equal transformers' last hidden state: a fixed gelu
    exported a relu model at dense cosine 0.96 (and gelu_new past the fp32 tolerance) while
    its agreement, measured against itself, read 1.0."""
    model, config = tiny(hidden_act=act)
    graph = M3Graph(model, nn.Linear(32, 1), nn.Linear(32, 32), config, attention_block=block)
    ids = torch.tensor([[0, 5, 9, 17, 30, 2], [0, 7, 2, 1, 1, 1]])
    mask = (ids != 1).long()
    with torch.no_grad():
        got, _ = graph.encode(ids, mask)
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=0)


def test_a_model_padded_otherwise_than_bge_m3_is_refused() -> None:
    """Positions count from the pad id and the server pads with XLM-R's (1): a model with
    another pad id was exported into other vectors (dense cosine 0.57) without a word."""
    model, config = tiny(pad_token_id=3)
    with pytest.raises(ValueError, match="pad_token_id is 3"):
        M3Graph(model, nn.Linear(32, 1), nn.Linear(32, 32), config)


def test_export_refuses_a_tokenizer_the_server_refuses_before_writing(
        tiny_model: Path, tmp_path: Path) -> None:
    """Special tokens numbered otherwise than bge-m3's: serve refuses the tokenizer, and the
    export wrote minutes of graphs first (QA); now it refuses at once, writing nothing."""
    import json
    import shutil

    from bgeserve.errors import ModelUnavailable
    from bgeserve.export.main import export

    model = tmp_path / "swapped"
    shutil.copytree(tiny_model, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab[0], vocab[1] = vocab[1], vocab[0]  # <s> and <pad>
    for token in spec["added_tokens"]:
        token["id"] = {0: 1, 1: 0}.get(token["id"], token["id"])
    (model / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ModelUnavailable, match="numbers its special tokens"):
        export(str(model), tmp_path / "out", ("fp32",))
    assert not (tmp_path / "out").exists()
