"""Deterministic random-weight rerankers with BAAI/bge-reranker-v2-m3's exact layout.

bge-reranker-v2-m3 is an ``XLMRobertaForSequenceClassification`` with one label: bge-m3's
encoder (the same shapes, 8,194 positions, the same tokenizer), no pooler, and a classification
head ``out_proj(tanh(dense(h[CLS])))`` giving one logit per (query, document) pair. This
builds that layout with seeded random weights (``randmodel``'s scaled initialisation, so the
logit depends on the text) and the tokenizer ``randmodel`` trains for the same seed: a tiny
reranker and a tiny bge-m3 of one seed tokenize identically, as the real pair does.

Run ``bgeserve build-random-model --kind reranker --size full --out DIR`` to build one by hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bgeserve.testing.randmodel import (
    _BUILDER_VERSION,
    _TINY_VOCAB,
    MARKER,
    SIZES,
    _random_tensor,
    build_atomically,
    built_once,
    write_tokenizer,
)

ARCHITECTURE = "XLMRobertaForSequenceClassification"
# The logit's spread: out_proj's std-1/sqrt(hidden) init gives logits of std ~0.5, so
# sigmoid scores would all sit near 0.5; real bge-reranker-v2-m3 logits span about -10..10.
# This widens them (measured on the tiny seed-0 model: logits about -4..4) so rankings and
# sigmoids in tests are not ties in disguise.
LOGIT_GAIN = 8.0


def _write_weights(tmp: Path, config: Any, seed: int) -> int:
    """Write ``model.safetensors`` (the classification model's exact keys); return the count."""
    import torch
    from safetensors.torch import save_file
    from transformers import XLMRobertaForSequenceClassification

    with torch.device("meta"):  # names and shapes only
        meta = XLMRobertaForSequenceClassification(config)
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    del meta
    layers = config.num_hidden_layers
    tensors = {}
    for name, shape in shapes.items():
        tensor = _random_tensor(seed, name, shape, layers)
        if name == "classifier.out_proj.weight":
            tensor *= LOGIT_GAIN
        tensors[name] = tensor
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    count = sum(t.numel() for t in tensors.values())
    del tensors
    return count


def build_random_reranker(
    out_dir: Path, size: str = "tiny", seed: int = 0, vocab_size: int | None = None,
    *, progress: bool | None = None,
) -> Path:
    """Build a random-weight bge-reranker-v2-m3 directory at ``out_dir`` and return it.

    It holds ``config.json`` (``architectures: [XLMRobertaForSequenceClassification]``,
    ``num_labels`` 1), ``model.safetensors``, the tokenizer files (identical to
    ``build_random_model``'s for the same size, seed and vocabulary) and the marker file. Same
    arguments give identical files; the directory appears atomically.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
        ValueError: unknown ``size``, or a ``vocab_size`` below the alphabet (about 970).
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    fields = dict(SIZES[size])
    vocab = fields["vocab_size"] = vocab_size or fields.get("vocab_size", _TINY_VOCAB)
    fields["architectures"] = [ARCHITECTURE]

    def fill(tmp: Path, step: Callable[[str], None]) -> None:
        from transformers import XLMRobertaConfig

        step(f"training a {vocab}-piece Unigram tokenizer")
        write_tokenizer(tmp, seed, vocab, size)
        # id2label {"0": "LABEL_0"}, as the hub model's config.json has: one logit.
        config = XLMRobertaConfig(**fields, num_labels=1)
        config.save_pretrained(tmp)
        step(f"writing {size} reranker weights (seed {seed})")
        params = _write_weights(tmp, config, seed)
        meta = {"builder_version": _BUILDER_VERSION, "kind": "reranker", "size": size,
                "seed": seed, "vocab_size": vocab, "parameters": params}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        step(f"{params:,} parameters")

    return build_atomically(out_dir, size, fill, progress)


def cached_random_reranker(root: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Return ``root/f"reranker-{size}-seed{seed}"``, building it first if missing."""
    return built_once(Path(root) / f"reranker-{size}-seed{seed}",
                      lambda path: build_random_reranker(path, size, seed))
