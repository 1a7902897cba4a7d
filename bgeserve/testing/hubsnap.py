"""Hub-layout snapshots of a PyTorch bge-m3, made locally (tests, benchmarks: nothing is downloaded).

The graphs are what the hub's own exporters write, not bgeserve's: transformers'
``XLMRobertaModel`` (its SDPA attention, its masking) traced by ``torch.onnx.export``.

- ``baai``: ``onnx/model.onnx`` + ``onnx/model.onnx_data`` (one external weights file) with
  outputs ``sentence_embedding`` (normalised CLS) and ``token_embeddings``, opset 17;
  ``sparse_linear.pt``, ``colbert_linear.pt``, the tokenizer files and config.json beside, as in
  BAAI/bge-m3.
- ``optimum``: what ``optimum-cli export onnx`` writes for bge-m3: ``onnx/model.onnx``
  (``last_hidden_state``, opset 14: LayerNorm spelled out) with the head files beside.
- ``xenova``: Xenova/bge-m3's layout: ``onnx/model.onnx`` (``last_hidden_state``),
  ``onnx/model_fp16.onnx`` and ``onnx/model_quantized.onnx`` (plain dynamic int8), no head
  files (``--heads`` copies them in).

``python -m bgeserve.testing.hubsnap --layout baai SRC OUT`` (needs the export extra: torch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = ("baai", "optimum", "xenova")
OPSETS = {"baai": 17, "optimum": 14, "xenova": 14}
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "config.json")
HEADS = ("sparse_linear.pt", "colbert_linear.pt")
DATA = "model.onnx_data"


def export_graph(src: Path, out: Path, layout: str, opset: int) -> None:
    """Trace transformers' encoder to ``out`` (weights in ``out``'s sibling ``model.onnx_data``
    for baai and for any graph over 2 GB, inline otherwise)."""
    import onnx
    import torch
    from transformers import XLMRobertaModel

    encoder = XLMRobertaModel.from_pretrained(src, add_pooling_layer=False,
                                              dtype=torch.float32).eval()

    class Baai(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask):
            hidden = self.encoder(input_ids=input_ids,
                                  attention_mask=attention_mask).last_hidden_state
            return torch.nn.functional.normalize(hidden[:, 0], dim=-1), hidden

    class Hidden(Baai):
        def forward(self, input_ids, attention_mask):
            return self.encoder(input_ids=input_ids,
                                attention_mask=attention_mask).last_hidden_state

    module = Baai() if layout == "baai" else Hidden()
    names = ["sentence_embedding", "token_embeddings"] if layout == "baai" \
        else ["last_hidden_state"]
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            "sentence_embedding": {0: "batch"}, "token_embeddings": {0: "batch", 1: "seq"},
            "last_hidden_state": {0: "batch", 1: "seq"}}
    ids = torch.tensor([[0, 5, 6, 7, 2], [0, 8, 2, 1, 1]], dtype=torch.int64)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        raw = Path(tmp) / "raw.onnx"
        with torch.no_grad():
            torch.onnx.export(module, (ids, (ids != 1).to(torch.int64)), str(raw),
                              input_names=["input_ids", "attention_mask"], output_names=names,
                              dynamic_axes={k: v for k, v in axes.items()
                                            if k in names or k.startswith(("input", "att"))},
                              opset_version=opset, do_constant_folding=True, dynamo=False)
        del module
        model = onnx.load(str(raw), load_external_data=True)
        external = layout == "baai" or any(
            t.data_location == onnx.TensorProto.EXTERNAL
            for t in onnx.load(str(raw), load_external_data=False).graph.initializer)
        if external:
            onnx.save_model(model, str(out), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=DATA, size_threshold=1024)
            os.chmod(out.parent / DATA, 0o644)
        else:
            onnx.save_model(model, str(out))


def build(src: Path, out: Path, layout: str, *, heads: bool | None = None,
          opset: int | None = None, fp32_only: bool = False) -> Path:
    """A ``layout`` snapshot of the PyTorch bge-m3 at ``src`` in ``out``; returns ``out``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    export_graph(src, out / "onnx" / "model.onnx", layout, opset or OPSETS[layout])
    for name in COMPANIONS:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    if heads if heads is not None else layout != "xenova":
        for name in HEADS:
            shutil.copyfile(src / name, out / name)
    if layout == "xenova" and not fp32_only:
        config = json.loads((src / "config.json").read_text())
        steps = [sys.executable, "-m", "bgeserve.export.steps"]
        graph = str(out / "onnx" / "model.onnx")
        subprocess.run([*steps, "fp16", graph, str(out / "onnx" / "model_fp16.onnx"),
                        "--heads", str(config["num_attention_heads"]),
                        "--hidden", str(config["hidden_size"])], check=True)
        subprocess.run([*steps, "int8", graph, str(out / "onnx" / "model_quantized.onnx"),
                        "--recipe", "dynamic"], check=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bgeserve.testing.hubsnap",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="PyTorch bge-m3 directory (with head files)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--layout", choices=LAYOUTS, default="baai")
    parser.add_argument("--heads", action=argparse.BooleanOptionalAction, default=None,
                        help="copy sparse_linear.pt / colbert_linear.pt (default: not for xenova)")
    parser.add_argument("--opset", type=int, default=None)
    parser.add_argument("--fp32-only", action="store_true",
                        help="xenova: leave out model_fp16.onnx and model_quantized.onnx (the "
                             "full-size fp16 conversion peaks near 12 GiB)")
    args = parser.parse_args(argv)
    print(build(args.src, args.out, args.layout, heads=args.heads, opset=args.opset,
                fp32_only=args.fp32_only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
