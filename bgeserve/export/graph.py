"""bge-m3 as one exportable torch module: encoder plus all three heads in a single graph.

The forward pass is written out here (rather than calling transformers' module) so that the
exported ONNX graph is exactly what we choose: ONNX Runtime's fused MultiHeadAttention for chunks
without padding and masked attention over blocks of query rows for padded ones (``attention``;
plain MatMul/Softmax attention for the hub layouts and OpenVINO), no dependence on the transformers version's masking or attention dispatch, and the
heads inside the graph so one ``session.run`` gives any subset of outputs. Parity with
FlagEmbedding is proved by the test suite, not assumed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bgeserve.export import ATTENTION_BLOCK

PAD_ID = 1


class CheckpointRefused(ValueError):
    """The checkpoint is not one this graph can carry (the export step says why in one line)."""
OUTPUTS = ("dense", "sparse_weights", "colbert")


# ``bgeserve::mha``: multi-head attention over [B, L, D] projections without a mask, exported as
# ONNX Runtime's com.microsoft MultiHeadAttention. On the CPU that op runs MLAS's flash attention
# when it gets no mask (the score matrix is never materialised: bounded memory, no transposes); on
# CUDA its fused kernels. The torch implementation is the plain math, used only while tracing.
_LIBRARY = torch.library.Library("bgeserve", "DEF")
_LIBRARY.define("mha(Tensor q, Tensor k, Tensor v, int heads) -> Tensor")


def _mha_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, d = q.shape
    hd = d // heads

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(b, n, heads, hd).transpose(1, 2)

    scores = split(q) @ split(k).transpose(-1, -2) * (1.0 / math.sqrt(hd))
    return (torch.softmax(scores, dim=-1) @ split(v)).transpose(1, 2).reshape(b, n, d)


_LIBRARY.impl("mha", _mha_reference, "CPU")


def _mha_symbolic(g, q, k, v, heads):
    from torch.onnx.symbolic_helper import _get_const

    return g.op("com.microsoft::MultiHeadAttention", q, k, v,
                num_heads_i=_get_const(heads, "i", "heads"))


torch.onnx.register_custom_op_symbolic("bgeserve::mha", _mha_symbolic, 1)


@torch.jit.script
def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                      block: int) -> torch.Tensor:
    """softmax(q·kᵀ + bias)·v, computed ``block`` query rows at a time when seq > block.

    Exact, since softmax is per query row. Scripted, so the export keeps the branch and the
    loop (ONNX If + Loop) for any length. The rows stay fixed: the exported loop collects its
    parts with SequenceInsert, which ONNX Runtime copies whole on every iteration, so smaller
    blocks at long lengths cost more time and memory than they save (measured: rows shrinking
    to 32 at 8,192 tokens took 239 s and +683 MiB against 198 s and +555 MiB).
    """
    kt = k.transpose(-1, -2)
    seq = q.size(2)
    if seq <= block:
        return torch.matmul(torch.softmax(torch.matmul(q, kt) + bias, dim=-1), v)
    parts: list[torch.Tensor] = []
    for start in range(0, seq, block):
        scores = torch.matmul(q[:, :, start:start + block], kt) + bias
        parts.append(torch.matmul(torch.softmax(scores, dim=-1), v))
    return torch.cat(parts, dim=2)


@torch.jit.script
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
              unpadded: torch.Tensor, heads: int, block: int) -> torch.Tensor:
    """Attention over the [B, L, D] projections; exported as If(unpadded, MHA, blocked).

    A chunk without padding (every text alone, and every long text, is one) needs no mask, so
    it takes the fused MultiHeadAttention (flash attention on the CPU); a padded chunk takes the
    masked, blocked path.
    """
    if bool(unpadded):
        return torch.ops.bgeserve.mha(q, k, v, heads)
    b, n, d = q.size(0), q.size(1), q.size(2)
    hd = d // heads
    qs = q.view(b, n, heads, hd).transpose(1, 2) * (1.0 / math.sqrt(hd))
    ks = k.view(b, n, heads, hd).transpose(1, 2)
    vs = v.view(b, n, heads, hd).transpose(1, 2)
    ctx = blocked_attention(qs, ks, vs, bias, block)
    return ctx.transpose(1, 2).reshape(b, n, d)


class M3Graph(nn.Module):
    """input_ids, attention_mask (int64 [B, L]) → dense [B,H], sparse_weights [B,L], colbert [B,L-1,H]."""

    def __init__(self, encoder: nn.Module, sparse: nn.Linear, colbert: nn.Linear, config,
                 attention_block: int = ATTENTION_BLOCK):
        super().__init__()
        self.attention_block = attention_block
        # transformers' submodules by attribute (embeddings, encoder.layer[i]...): torch types
        # Module attributes as Tensor | Module, so the model is used untyped.
        self.encoder_model: Any = encoder
        self.sparse_linear = sparse
        self.colbert_linear = colbert
        self.heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.eps = config.layer_norm_eps
        if config.pad_token_id != PAD_ID:
            # Positions count from the pad id and the server pads with XLM-R's: another pad
            # gave other vectors (dense cosine 0.57) without a word.
            raise CheckpointRefused(
                f"the model's pad_token_id is {config.pad_token_id}, not bge-m3's (XLM-R's) "
                f"{PAD_ID}: bgeserve serves bge-m3's layout only")

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self.encoder_model.embeddings
        # XLM-R positions count real tokens from padding_idx + 1 (transformers'
        # create_position_ids_from_input_ids); pads get padding_idx.
        not_pad = input_ids.ne(PAD_ID).to(torch.int64)
        positions = torch.cumsum(not_pad, dim=1) * not_pad + PAD_ID
        x = (emb.word_embeddings(input_ids) + emb.position_embeddings(positions)
             + emb.token_type_embeddings.weight[0])
        return emb.LayerNorm(x)

    def _attention(self, layer: Any, x: torch.Tensor, bias: torch.Tensor,
                   unpadded: torch.Tensor) -> torch.Tensor:
        att = layer.attention.self
        b, n, _ = x.shape
        if self.attention_block > 0:
            return attention(att.query(x), att.key(x), att.value(x), bias, unpadded, self.heads,
                             self.attention_block)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

        q = split(att.query(x)) * (1.0 / math.sqrt(self.head_dim))
        k, v = split(att.key(x)), split(att.value(x))
        # Plain attention (hub layouts, the OpenVINO variant: OpenVINO fuses this pattern).
        ctx = torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1) @ v
        return ctx.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """Last hidden state [B, L, H] and the float mask [B, L]."""
        x = self._embed(input_ids)
        mask = attention_mask.to(x.dtype)
        # Additive key mask, as transformers' eager attention: finfo.min on padded keys.
        bias = (1.0 - mask)[:, None, None, :] * torch.finfo(x.dtype).min
        unpadded = attention_mask.min() == 1
        for layer in self.encoder_model.encoder.layer:
            ctx = self._attention(layer, x, bias, unpadded)
            x = layer.attention.output.LayerNorm(layer.attention.output.dense(ctx) + x)
            # The model's own activation (config.hidden_act; bge-m3's is gelu): a fixed gelu
            # exported another model's relu or gelu_new with an agreement of 1.0 to itself.
            inter = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(x))
            x = layer.output.LayerNorm(layer.output.dense(inter) + x)
        return x, mask

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        x, mask = self.encode(input_ids, attention_mask)
        dense = nn.functional.normalize(x[:, 0], dim=-1)
        sparse = torch.relu(self.sparse_linear(x)).squeeze(-1)
        colbert = self.colbert_linear(x[:, 1:]) * mask[:, 1:, None]
        colbert = nn.functional.normalize(colbert, dim=-1)
        return dense, sparse, colbert


def complete(loaded: tuple[Any, dict[str, list[str]]], model_dir: Path) -> Any:
    """The model ``from_pretrained(..., output_loading_info=True)`` gave, refused where a
    weight of it was not in the checkpoint: transformers initializes it at random with a
    warning, and the export would serve those random weights (another architecture's
    checkpoint, a file of the wrong model)."""
    model, info = loaded
    missing = [k for k in info.get("missing_keys", []) if not k.endswith("position_ids")]
    if missing:
        shown = ", ".join(sorted(missing)[:5]) + (", ..." if len(missing) > 5 else "")
        raise CheckpointRefused(
            f"{model_dir}: {len(missing)} weights of the model are not in the checkpoint "
            f"({shown}): it is not of the layout bgeserve exports (bge-m3's, "
            "bge-reranker-v2-m3's)")
    return model


def load_graph(model_dir: Path, attention_block: int = ATTENTION_BLOCK) -> M3Graph:
    """Build the export module from a bge-m3 directory (Hugging Face layout + head files)."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    config = XLMRobertaConfig.from_pretrained(model_dir)
    encoder = complete(XLMRobertaModel.from_pretrained(
        model_dir, add_pooling_layer=False, dtype=torch.float32, output_loading_info=True),
        model_dir)
    hidden = config.hidden_size
    sparse, colbert = nn.Linear(hidden, 1), nn.Linear(hidden, hidden)
    for head, name in ((sparse, "sparse_linear.pt"), (colbert, "colbert_linear.pt")):
        path = Path(model_dir) / name
        if not path.exists():
            # FlagEmbedding silently uses random heads here; an export must not.
            raise CheckpointRefused(f"{path} is missing: bge-m3's {name} head is required")
        head.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return M3Graph(encoder, sparse, colbert, config, attention_block).eval()


class HiddenGraph(nn.Module):
    """The hub graphs' shape, for tests: BAAI (sentence_embedding, token_embeddings) or
    Xenova (last_hidden_state)."""

    def __init__(self, graph: M3Graph, kind: str):
        super().__init__()
        self.graph = graph
        self.kind = kind

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        x, _ = self.graph.encode(input_ids, attention_mask)
        if self.kind == "baai":
            return nn.functional.normalize(x[:, 0], dim=-1), x
        return x
