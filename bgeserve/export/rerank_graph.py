"""bge-reranker-v2-m3 as one exportable torch module: the encoder plus its classification head.

The encoder is ``graph.M3Graph``'s own (the same blocked / fused attention, so the reranker's
graph gets the same bounded memory and the same FFN row blocks and int8 recipe); the head is
transformers' ``XLMRobertaClassificationHead`` in eval mode: ``out_proj(tanh(dense(h[:, 0])))``
(its dropouts are the identity). The graph's one output, ``score`` [B], is that raw logit;
the sigmoid (``normalize``) is applied by the server, as FlagReranker applies it after the model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from bgeserve.export import ATTENTION_BLOCK
from bgeserve.export.graph import CheckpointRefused, M3Graph, complete

OUTPUTS = ("score",)
# Torch names the head's nodes after this module attribute; the int8 step keeps them fp32.
HEAD_PREFIX = "/classifier/"


class RerankGraph(M3Graph):
    """input_ids, attention_mask (int64 [B, L]) → score [B] (the pair's relevance logit)."""

    def __init__(self, encoder: nn.Module, classifier: nn.Module, config,
                 attention_block: int = ATTENTION_BLOCK):
        super().__init__(encoder, None, None, config, attention_block)
        self.classifier = classifier

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        x, _ = self.encode(input_ids, attention_mask)
        # Called as a module (not its parts), so its nodes are named /classifier/...
        return self.classifier(x).squeeze(-1)


def load_rerank_graph(model_dir: Path, attention_block: int = ATTENTION_BLOCK) -> RerankGraph:
    """Build the export module from a sequence-classification checkpoint with one label.

    Raises:
        ValueError: the checkpoint has more than one label (not a relevance reranker).
    """
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    config = XLMRobertaConfig.from_pretrained(model_dir)
    if config.num_labels != 1:
        raise CheckpointRefused(f"{model_dir} is a classifier with {config.num_labels} labels; a "
                         "reranker has exactly one (its relevance logit)")
    model = complete(XLMRobertaForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True), model_dir)
    return RerankGraph(model.roberta, model.classifier, config, attention_block).eval()


class LogitsGraph(nn.Module):
    """A stock hub export's shape, for tests: ``logits`` [B, 1] (optimum's / Xenova's)."""

    def __init__(self, graph: RerankGraph):
        super().__init__()
        self.graph = graph

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        return self.graph(input_ids, attention_mask).unsqueeze(-1)
