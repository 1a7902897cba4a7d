"""Deterministic random-weight models with BAAI/bge-m3's exact Hugging Face layout.

Tests and benchmarks never download anything (SPEC §1), so they build their own bge-m3: an
XLM-RoBERTa config, seeded random weights in ``model.safetensors``, an XLM-R-style Unigram
tokenizer trained here on generated multilingual text, and the ``sparse_linear.pt`` /
``colbert_linear.pt`` heads. Random weights cost exactly the same compute and memory as the real
ones, so speed and memory figures measured on the ``full`` size are honest; only semantic quality
is meaningless. ``tiny`` (2 layers, hidden 32) is for tests; ``full`` has bge-m3's exact shape.

Run ``python -m bgeserve.testing.randmodel --size full --out DIR`` to build one by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import string
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bgeserve.export.texts import random_texts

_COMMON: dict[str, Any] = {
    "max_position_embeddings": 8194, "type_vocab_size": 1, "layer_norm_eps": 1e-5,
    "hidden_act": "gelu", "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
    "architectures": ["XLMRobertaModel"],
}
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
             "intermediate_size": 64, **_COMMON},
    "full": {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
             "intermediate_size": 4096, "vocab_size": 250002, **_COMMON},
}
_TINY_VOCAB = 3000
_MAX_TRAINED = 50_000  # real pieces; the generated corpus supports about this many
_MAX_PIECE = 16
_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0..3; "<mask>" is always the last id
MARKER = "bgeserve-random-model.json"
_BUILDER_VERSION = 1

# ------------------------------------------------------------------------------ tokenizer
def _train_pieces(words: Counter[str], size: int) -> list[tuple[str, float]]:
    """Viterbi-train Unigram pieces (at most ``size``) for pre-tokenized ``words``.

    Not ``tokenizers.trainers.UnigramTrainer``: its output changes from run to run (hash-map
    order decides ties and the scores of the required characters, floats are summed in parallel),
    and a test model must be byte-identical per seed. Here ``tokenizers`` only segments; counting,
    tie-breaking and pruning are ordered, so the same words always give the same pieces.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import Unigram

    # Every character is kept, so no generated text and no ASCII text ever becomes <unk>.
    chars = sorted({ch for word in words for ch in word} | set(string.printable.strip()))
    if size < len(chars):
        raise ValueError(f"vocab_size must be at least {len(chars) + 5} (alphabet + specials)")
    subs: Counter[str] = Counter()
    for word, count in words.items():
        for i in range(len(word)):
            for j in range(i + 2, min(len(word), i + _MAX_PIECE) + 1):
                subs[word[i:j]] += count
    # Seed like sentencepiece: frequent long substrings first, then let segmentation prune them.
    frequent = sorted((p for p, c in subs.items() if c > 1), key=lambda p: (-subs[p] * len(p), p))
    counts = {p: float(subs[p]) for p in frequent[: 2 * size]}
    counts.update((ch, 1.0) for ch in chars)
    order, weights = list(words), list(words.values())
    for _ in range(2):
        total = math.log(sum(counts.values()))
        scored = [(p, math.log(c) - total) for p, c in sorted(counts.items())]
        segmenter = Tokenizer(Unigram([("<unk>", 0.0), *scored], unk_id=0, byte_fallback=False))
        usage: Counter[str] = Counter()
        for encoding, weight in zip(segmenter.encode_batch(order), weights):
            for token in encoding.tokens:
                usage[token] += weight
        ranked = sorted((p for p in usage if len(p) > 1), key=lambda p: (-usage[p], p))
        counts = {p: usage[p] + 0.5 for p in (*chars, *ranked[: size - len(chars)])}
    total = math.log(sum(counts.values()))
    scored = [(p, math.log(c) - total) for p, c in counts.items()]
    return sorted(scored, key=lambda item: (-item[1], item[0]))


def _train_tokenizer(seed: int, vocab_size: int, n_texts: int) -> Any:
    """An XLM-R-style Unigram tokenizer of exactly ``vocab_size`` pieces, ``<mask>`` last."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram

    # No normalizer, and exactly the pre-tokenizer transformers 5 rebuilds for XLMRobertaTokenizer:
    # it keeps only a sentencepiece Precompiled normalizer from tokenizer.json (which cannot be made
    # here without sentencepiece), so anything else (e.g. NFKC) would make FlagEmbedding's ids
    # differ from tokenizer.json's. WhitespaceSplit already collapses and strips whitespace.
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
    ])
    words: Counter[str] = Counter()
    for text in random_texts(seed, n_texts, max_words=60):
        words.update(w for w, _ in pre_tokenizer.pre_tokenize_str(text))
    trained = _train_pieces(words, min(vocab_size - 5, _MAX_TRAINED))
    pieces = [(t, 0.0) for t in _SPECIALS] + trained
    # The corpus cannot support 250k real pieces; pad with private-use-area pieces that no
    # generated text contains, scored below every trained piece so they never win a split.
    floor = trained[-1][1] - 10.0
    for i in range(vocab_size - 1 - len(pieces)):
        pieces.append(("▁" + chr(0xE000 + i % 6400) + chr(0xE000 + i // 6400), floor))
    pieces.append(("<mask>", 0.0))

    tok = Tokenizer(Unigram(pieces, unk_id=3, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIALS])
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    return tok


def _tokenizer_configs(mask_id: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` as bge-m3 ships them."""
    def added(content: str, lstrip: bool = False) -> dict[str, Any]:
        return {"content": content, "lstrip": lstrip, "normalized": False, "rstrip": False,
                "single_word": False, "special": True}

    names = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
             "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}
    decoder = {str(i): added(t) for i, t in enumerate(_SPECIALS)}
    decoder[str(mask_id)] = added("<mask>", lstrip=True)
    config = {"added_tokens_decoder": decoder, "clean_up_tokenization_spaces": True,
              "model_max_length": 8192, "tokenizer_class": "XLMRobertaTokenizer", **names}
    mask = {k: v for k, v in added("<mask>", lstrip=True).items() if k != "special"}
    return config, {**names, "mask_token": mask}


# -------------------------------------------------------------------------------- weights
def _random_tensor(seed: int, name: str, shape: tuple[int, ...], layers: int = 1) -> Any:
    import torch

    # One stream per tensor keeps each tensor independent of build order and library version.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    out = torch.empty(shape, dtype=torch.float32)
    # Not transformers' std-0.02 init: a random 24-layer post-LN stack collapses every token of a
    # text onto one vector (token cosine 1.0, no sparse weight survives). Residual-branch outputs
    # are scaled by 1/sqrt(2·layers) (GPT-2 style) so tokens stay distinct, and q/k are scaled up
    # so attention is peaked (logit std ~4) and the CLS vector depends on the text.
    if "LayerNorm.weight" in name:
        return out.normal_(1.0, 0.2, generator=gen)
    if name.endswith("embeddings.weight"):
        return out.normal_(0.0, 0.5 if "word" in name else 0.2, generator=gen)
    if name.endswith("bias"):  # small: a shared offset added at every layer drowns the tokens
        return out.normal_(0.0, 0.02, generator=gen)
    std = shape[-1] ** -0.5
    if ".query." in name or ".key." in name:
        std *= 2.0
    elif "output.dense" in name:
        std *= (2 * layers) ** -0.5
    return out.normal_(0.0, std, generator=gen)


def _write_weights(tmp: Path, config: Any, seed: int) -> int:
    """Write ``model.safetensors`` and the two head files; return the encoder's parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import XLMRobertaModel

    with torch.device("meta"):  # names and shapes only, no memory for a throwaway init
        meta = XLMRobertaModel(config, add_pooling_layer=True)
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    del meta
    layers = config.num_hidden_layers
    tensors = {name: _random_tensor(seed, name, shape, layers) for name, shape in shapes.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    count = sum(t.numel() for t in tensors.values())
    del tensors

    hidden = config.hidden_size
    for head, out_features in (("sparse_linear", 1), ("colbert_linear", hidden)):
        layer = torch.nn.Linear(hidden, out_features)
        with torch.no_grad():
            layer.weight.copy_(_random_tensor(seed, f"{head}.weight", (out_features, hidden)))
            layer.bias.copy_(_random_tensor(seed, f"{head}.bias", (out_features,)))
            if head == "sparse_linear":
                layer.bias.fill_(0.05)  # measured: 40-80% of tokens keep a weight, by seed
        torch.save(layer.state_dict(), tmp / f"{head}.pt")
    return count


# ---------------------------------------------------------------------------------- build
def write_tokenizer(directory: Path, seed: int, vocab: int, size: str) -> None:
    """Train the seed's tokenizer and write ``tokenizer.json`` and its two config files; the
    same ``(seed, vocab, size)`` gives the same files (a reranker built with them shares the
    embedding model's tokenizer, as bge-reranker-v2-m3 shares bge-m3's)."""
    tok = _train_tokenizer(seed, vocab, 3000 if size == "tiny" else 20000)
    tok.save(str(directory / "tokenizer.json"))
    tok_config, special_map = _tokenizer_configs(vocab - 1)
    for name, data in (("tokenizer_config.json", tok_config),
                       ("special_tokens_map.json", special_map)):
        (directory / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def build_atomically(out_dir: Path, size: str, fill: Callable[[Path, Callable[[str], None]],
                                                               None],
                     progress: bool | None = None) -> Path:
    """Create ``out_dir`` by ``fill(tmp, step)`` in a hidden sibling, then one rename, so the
    directory is complete whenever it exists; ``step(message)`` logs progress (by default for
    the full size only).

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty, or appeared meanwhile.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} already exists; delete it or choose another directory")
    show = size == "full" if progress is None else progress
    start = time.monotonic()

    def step(message: str) -> None:
        if show:
            print(f"[randmodel {time.monotonic() - start:5.1f}s] {message}", file=sys.stderr)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        fill(tmp, step)
        # mkdtemp's private 0700 would lock out other users of a shared model (e.g. a container).
        for file in tmp.iterdir():
            file.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out_dir)
        except OSError as exc:  # another builder won the race, or out_dir appeared meanwhile
            raise FileExistsError(f"{out_dir} appeared while building it") from exc
        step(f"done: {out_dir}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def build_random_model(
    out_dir: Path, size: str = "tiny", seed: int = 0, vocab_size: int | None = None,
    *, progress: bool | None = None,
) -> Path:
    """Build a random-weight bge-m3 directory at ``out_dir`` and return it.

    Same ``(size, seed, vocab_size)`` gives identical files. The directory appears atomically
    (built in a hidden sibling, then renamed), so it is complete whenever it exists.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
        ValueError: unknown ``size``, or a ``vocab_size`` below the alphabet (about 970).
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    fields = dict(SIZES[size])
    vocab = fields["vocab_size"] = vocab_size or fields.get("vocab_size", _TINY_VOCAB)

    def fill(tmp: Path, step: Callable[[str], None]) -> None:
        from transformers import XLMRobertaConfig

        step(f"training a {vocab}-piece Unigram tokenizer")
        write_tokenizer(tmp, seed, vocab, size)
        config = XLMRobertaConfig(**fields)
        config.save_pretrained(tmp)
        step(f"writing {size} weights (seed {seed})")
        params = _write_weights(tmp, config, seed)
        meta = {"builder_version": _BUILDER_VERSION, "size": size, "seed": seed,
                "vocab_size": vocab, "parameters": params}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        step(f"{params:,} parameters")

    return build_atomically(out_dir, size, fill, progress)


def cached_random_model(root: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Return ``root/f"{size}-seed{seed}"``, building it first if missing; safe under races."""
    return built_once(Path(root) / f"{size}-seed{seed}",
                      lambda path: build_random_model(path, size, seed))


def built_once(path: Path, build: Callable[[Path], object]) -> Path:
    """``path``, built by ``build(path)`` unless complete already; another process building
    the same path at once (``FileExistsError`` from the atomic rename) is no error."""
    if not (path / MARKER).is_file():
        try:
            build(path)
        except FileExistsError:
            if not (path / MARKER).is_file():
                raise
    return path


def main(argv: list[str] | None = None) -> int:
    """CLI: build a random-weight bge-m3 (or its reranker) and print its directory."""
    parser = argparse.ArgumentParser(
        prog="bgeserve build-random-model",
        description="Build a deterministic random-weight model with bge-m3's layout "
                    "(--kind reranker: bge-reranker-v2-m3's).",
    )
    parser.add_argument("--kind", choices=["embedding", "reranker"], default="embedding")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="tokenizer/embedding rows (default: 3000 tiny, 250002 full)")
    parser.add_argument("--out", type=Path, required=True, help="directory to create")
    args = parser.parse_args(argv)
    build = build_random_model
    if args.kind == "reranker":
        from bgeserve.testing.randreranker import build_random_reranker as build
    try:
        path = build(args.out, args.size, args.seed, args.vocab_size)
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
