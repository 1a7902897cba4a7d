"""``bgeserve export``: a PyTorch bge-m3 (hub id or directory) → bgeserve's ONNX export.

The export directory holds ``manifest.json``, the tokenizer files and one graph per variant
(``fp32/model.onnx``, ``fp16/model.onnx``, ``int8/model.onnx``; OpenVINO IRs ``bf16/model.xml``
and ``ov-int8/model.xml``), each with the heads inside so
one ``session.run`` yields dense, sparse and ColBERT outputs. Every heavy step runs in a child
process (see ``steps.py``) so the peak memory is that of one step.

int8 is SmoothQuant + dynamic per-channel quantization, calibrated on texts made with the
export's tokenizer (``smoothquant.py``); ov-int8 is NNCF's static quantization of the
plain-attention graph for OpenVINO (``ovint8.py``). When fp32 is part of the export, a last step measures
each other variant against it (``validate.py``) and the manifest records the figures in that
variant's ``"agreement"``.

A sequence-classification checkpoint (bge-reranker-v2-m3's layout) exports the same way as a
reranker (``"kind": "reranker"`` in the manifest): one output, ``score`` [B], the pair's
relevance logit; int8 calibrates on (query, document) pairs and validation records score and
rank agreement (``rerank_validate.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bgeserve import __version__
from bgeserve.errors import ModelUnavailable
from bgeserve.export import ATTENTION_BLOCK, FFN_ROWS, REFUSED
from bgeserve.logs import setup_logging
from bgeserve.model.dims import position_offset
from bgeserve.model.kind import EMBEDDING, RERANKER, config_kind, num_labels
from bgeserve.model.prepared import int8_weights, sha256
from bgeserve.progress import Progress, on_terminal

log = logging.getLogger("bgeserve.export")

VARIANTS = ("fp32", "fp16", "int8", "bf16", "ov-int8")
# bf16 only where openvino is installed, ov-int8 where nncf is too
CPU_VARIANTS = ("fp32", "int8", "bf16", "ov-int8")
# Where each variant's graph lives in the export, and the runtime that reads it.
GRAPH_PATHS = {"fp32": "fp32/model.onnx", "fp16": "fp16/model.onnx", "int8": "int8/model.onnx",
               "bf16": "bf16/model.xml", "ov-int8": "ov-int8/model.xml"}
RUNTIMES = {"bf16": "openvino", "ov-int8": "openvino"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SOURCE_PATTERNS = ["config.json", "*.safetensors", "pytorch_model.bin", "sparse_linear.pt",
                   "colbert_linear.pt", *TOKENIZER_FILES]
MANIFEST_SCHEMA = 1
OUTPUTS = ["dense", "sparse_weights", "colbert"]
RERANKER_OUTPUTS = ["score"]


def _source_dir(model: str, cache_dir: Path | None) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelUnavailable(f"--model {model}: not a directory")
    from huggingface_hub import snapshot_download

    from bgeserve.model.rerank_artifacts import RERANK_REPO, RERANK_REVISION

    # The reranker comes at its pinned commit (a moving main would change what is served).
    revision = RERANK_REVISION if model == RERANK_REPO else None
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=SOURCE_PATTERNS,
                                      cache_dir=str(cache_dir) if cache_dir else None))
    except Exception as exc:
        raise ModelUnavailable(f"cannot download {model} from the Hugging Face hub: {exc}. "
                               "Pass a local directory with --model instead.") from exc


# What the graph builds (graph.M3Graph): XLM-RoBERTa's embeddings, absolute positions counted
# from the pad id, and its encoder; transformers loads any other checkpoint into that class
# with every weight it does not find newly initialized (a BERT reranker exported as random
# weights, without a word: QA).
MODEL_TYPES = ("xlm-roberta",)


def _checkpoint_config(src: Path) -> dict[str, Any]:
    """``src``'s config.json, refused unless it is of the layout the graph builds."""
    try:
        config = json.loads((src / "config.json").read_text())
    except FileNotFoundError:
        hint = (" (it is a bgeserve export: serve it as it is, BGE_M3_MODEL_PATH or "
                "BGE_M3_RERANK_MODEL_PATH)" if (src / "manifest.json").exists() else "")
        raise ModelUnavailable(f"{src} has no config.json: --model must be a Hugging Face "
                               f"checkpoint (config.json and its weights){hint}") from None
    except ValueError as exc:
        raise ModelUnavailable(f"{src / 'config.json'} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelUnavailable(f"{src / 'config.json'} is not a JSON object")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelUnavailable(
            f"{src} holds a {model_type!r} model; bgeserve exports XLM-RoBERTa checkpoints "
            "(model_type 'xlm-roberta': bge-m3's and bge-reranker-v2-m3's layout) only")
    positions = config.get("position_embedding_type", "absolute")
    if positions != "absolute":
        raise ModelUnavailable(
            f"{src} uses position_embedding_type {positions!r}; bgeserve's graph has XLM-R's "
            "absolute positions (bge-m3's) only")
    return config


# The steps' progress: `bgeserve export` (run()) sets one that logs each step (JSON lines when
# stdout is not a terminal) and draws a tqdm bar of the steps on a terminal; export() called
# as a library (tests, scripts) gets one that only logs.
_progress = Progress()


def _run_step(step: list[str], label: str) -> None:
    """Run one step in a child; ``label`` is "i/N name" (the step's place among N)."""
    counted, _, name = label.partition(" ")
    index, _, total = counted.partition("/")
    if index.isdigit() and total.isdigit():
        _progress.step(name, int(index), int(total))
    else:
        _progress.step(label)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "bgeserve.export.steps", *step],
                          check=False)
    if proc.returncode == REFUSED:  # it said why, in one line: no traceback on top
        raise ModelUnavailable(f"export step {label!r} refused the checkpoint (why: above)")
    if proc.returncode != 0:
        raise RuntimeError(f"export step {label!r} failed with exit code {proc.returncode}")
    seconds = round(time.monotonic() - started, 1)
    log.info("%s: %.1fs", label, seconds, extra={"step": name or label, "seconds": seconds})


def _files_of(graph: Path) -> list[Path]:
    data = (graph.with_suffix(".bin") if graph.suffix == ".xml"
            else graph.with_name(graph.name + ".data"))
    return [graph, data] if data.exists() else [graph]


def _openvino_available() -> bool:
    from bgeserve.runtime import openvino

    return openvino.available()


def default_variants() -> tuple[str, ...]:
    """Every CPU variant this machine can write (bf16 needs the openvino package, ov-int8
    openvino and nncf)."""
    from bgeserve.export import ovint8
    from bgeserve.runtime import openvino

    skip = []
    if not openvino.available():
        print("    bf16 and ov-int8 (OpenVINO) skipped: the openvino package is not installed "
              f"({openvino.INSTALL_HINT})", file=sys.stderr, flush=True)
        skip = ["bf16", "ov-int8"]
    elif not ovint8.available():
        print("    ov-int8 (OpenVINO) skipped: nncf is not installed (bgeserve installs it "
              "on x86-64; elsewhere `pip install nncf`)", file=sys.stderr, flush=True)
        skip = ["ov-int8"]
    return tuple(v for v in CPU_VARIANTS if v not in skip)


def _export_openvino(src: Path, out: Path, opset: int, labels: dict[str, str],
                     tokenizer: Path, limit: list[str]) -> dict[str, dict[str, object]]:
    """A plain-attention fp32 graph (temporary), then each OpenVINO IR in ``labels`` made
    from it; returns what the quantizing steps report, by variant."""
    plain = out / "openvino-plain-attention" / "model.onnx"
    notes: dict[str, dict[str, object]] = {}
    try:
        first = next(iter(labels.values()))
        _run_step(["fp32", str(src), str(plain), "--opset", str(opset), "--attention-block", "0"],
                  f"{first} (plain-attention fp32 graph)")
        for variant, label in labels.items():
            graph = out / GRAPH_PATHS[variant]
            if variant == "bf16":
                _run_step(["openvino", str(plain), str(graph)], f"{label} (OpenVINO IR)")
                continue
            note = graph.with_name("quantization.json")
            _run_step(["ov-int8", str(plain), str(graph), "--tokenizer", str(tokenizer),
                       "--report", str(note), *limit], f"{label} (NNCF int8 IR)")
            notes[variant] = json.loads(note.read_text())
            note.unlink()
    finally:
        shutil.rmtree(plain.parent, ignore_errors=True)
    return notes


def export(model: str, out: Path, variants: tuple[str, ...] | None = None, *, opset: int = 18,
           cache_dir: Path | None = None, attention_block: int | None = None,
           ffn_rows: int | None = None) -> Path:
    """Export ``model`` (bge-m3, or a reranker) into ``out`` (default: ``default_variants()``);
    returns the manifest's path."""
    asked = variants
    variants = default_variants() if variants is None else variants
    # The CPU graphs (fp32, int8) run each layer's FFN over blocks of token rows (rowblock.py);
    # fp16 is the GPU variant and stays one piece for TensorRT. Plain attention means plain
    # graphs throughout (the benchmark's stock baseline).
    rows = (FFN_ROWS if ffn_rows is None else ffn_rows) if attention_block != 0 else 0
    src = _source_dir(model, cache_dir)
    config = _checkpoint_config(src)
    kind = config_kind(config)
    if kind == RERANKER and num_labels(config) != 1:
        raise ModelUnavailable(f"{src} is a classifier with {num_labels(config)} labels; a "
                               "reranker has exactly one (its relevance logit)")
    if kind == RERANKER and "ov-int8" in variants:
        # ov-int8's NNCF calibration and its validation are bge-m3's (single texts, dense and
        # sparse outputs); a reranker's int8 is ONNX Runtime's, calibrated on pairs.
        if asked is not None:
            raise ModelUnavailable("ov-int8 is made for bge-m3 only; a reranker's variants are "
                                   "fp32, int8 and bf16")
        variants = tuple(v for v in variants if v != "ov-int8")
    for head in ("sparse_linear.pt", "colbert_linear.pt"):
        if kind == EMBEDDING and not (src / head).exists():
            raise ModelUnavailable(f"{src / head} is missing: bge-m3's heads are required")
    if not (src / "tokenizer.json").exists():
        raise ModelUnavailable(f"{src / 'tokenizer.json'} is missing: the export needs it "
                               "(the server reads it; int8 calibration uses it)")
    from bgeserve.engine.tokenizer import Tokenizer

    # Read as the server reads it, before minutes of export: one it refuses (special tokens
    # numbered otherwise than bge-m3's) was exported and then refused by serve (QA).
    Tokenizer.load(src / "tokenizer.json", max_seq=8)
    out.mkdir(parents=True, exist_ok=True)
    # The tokenizer first: the int8 calibration and the validation make their texts with it.
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, out / name)
    tokenizer = out / "tokenizer.json"
    # Calibration and validation texts must fit the model's positions (514 in a config left
    # at XLM-R's default holds 512 tokens; bge-m3's 8,194 hold 8,192).
    max_positions = config["max_position_embeddings"] - position_offset(config)
    limit = ["--max-tokens", str(max_positions)]
    fp32 = out / "fp32" / "model.onnx"
    quantization: dict[str, dict[str, object]] = {}  # by variant: how it was quantized
    # fp16 and int8 are made from the blocked-attention fp32 graph; bf16 and ov-int8 from a
    # plain-attention one (OpenVINO fuses plain attention).
    blocked = any(v in variants for v in ("fp32", "fp16", "int8"))
    # The other variants are validated against fp32, when this export writes fp32 (bf16 and
    # ov-int8 run on OpenVINO: only where the package is installed, as it must be to export
    # them at all).
    validated = [v for v in VARIANTS if v in variants and v != "fp32"
                 and (RUNTIMES.get(v) != "openvino" or _openvino_available())] \
        if "fp32" in variants else []
    row_blocked = [out / GRAPH_PATHS[v] for v in ("fp32", "int8") if v in variants] if rows else []
    steps = (int(blocked) + sum(v != "fp32" for v in variants) + int(bool(row_blocked))
             + int(bool(validated)))
    block = [] if attention_block is None else ["--attention-block", str(attention_block)]
    done = 0
    if blocked:
        done += 1
        _run_step(["fp32", str(src), str(fp32), "--opset", str(opset), *block], f"1/{steps} fp32")
    if "fp16" in variants:
        done += 1
        _run_step(["fp16", str(fp32), str(out / "fp16" / "model.onnx"),
                   "--heads", str(config["num_attention_heads"]),
                   "--hidden", str(config["hidden_size"])], f"{done}/{steps} fp16")
    if "int8" in variants:
        done += 1
        pairs = ["--pairs"] if kind == RERANKER else []
        # bge-m3: 8-bit weights in the encoding this CPU cannot saturate, as `prepare` makes
        # them (prepared.int8_weights). Signed 7-bit, which no CPU saturates, measured under the
        # 0.999 bar on the full-size random model (0.99881; u8 0.99942: docs/benchmarks.md),
        # and a variant under the bar is never the default. The manifest records the encoding,
        # and a signed 8-bit graph is never a default candidate on a CPU that would saturate it
        # (runtime.select). A reranker's variant is the operator's pick, which nothing checks
        # against the CPU that serves it: its export stays portable (7-bit).
        weights = int8_weights() if kind == EMBEDDING else "s7"
        quantization["int8"] = {"weights": weights}
        _run_step(["int8", str(fp32), str(out / "int8" / "model.onnx"),
                   "--tokenizer", str(tokenizer), *limit, *pairs, "--weights", weights],
                  f"{done}/{steps} int8")
    labels = {}
    for variant in (v for v in VARIANTS if RUNTIMES.get(v) == "openvino" and v in variants):
        done += 1
        labels[variant] = f"{done}/{steps} {variant}"
    if labels:
        quantization.update(_export_openvino(src, out, opset, labels, tokenizer, limit))
    if row_blocked:
        done += 1
        _run_step(["rowblock", *map(str, row_blocked), "--rows", str(rows)],
                  f"{done}/{steps} FFN row blocks")
    agreement = _validate(out, validated, tokenizer, f"{steps}/{steps} validation",
                          [*limit, "--kind", kind]) if validated else {}
    if "fp32" not in variants and fp32.parent.exists():
        shutil.rmtree(fp32.parent)
    _progress.step("hashing")
    manifest = {
        "format": "bgeserve-export",
        "schema": MANIFEST_SCHEMA,
        "kind": kind,
        "bgeserve_version": __version__,
        "opset": opset,
        "attention_block": attention_block,
        "hidden_size": config["hidden_size"],
        # Encoder sizes: the server derives its conservative memory model from them.
        "model": {"hidden": config["hidden_size"], "heads": config["num_attention_heads"],
                  "intermediate": config["intermediate_size"],
                  "layers": config["num_hidden_layers"],
                  "max_positions": max_positions,
                  "attention_block": ATTENTION_BLOCK if attention_block is None
                  else attention_block,
                  # Token rows per FFN block in the fp32 and int8 graphs (0: not blocked).
                  "ffn_rows": rows},
        "outputs": RERANKER_OUTPUTS if kind == RERANKER else OUTPUTS,
        "variants": {v: _variant_entry(out, v, agreement.get(v), quantization.get(v))
                     for v in VARIANTS if v in variants},
        "tokenizer": "tokenizer.json",
        "source": {
            "model": model,
            "files": {p.name: sha256(p) for p in sorted(src.iterdir())
                      if p.is_file() and p.suffix in (".json", ".safetensors", ".pt", ".bin")},
        },
    }
    path = out / "manifest.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _validate(out: Path, variants: list[str], tokenizer: Path, label: str,
              options: list[str]) -> dict[str, dict[str, float]]:
    """Each of ``variants`` against fp32, in a child step (it loads the graphs one by one)."""
    result = out / ".agreement.json.tmp"
    try:
        _run_step(["validate", str(out), str(result), "--tokenizer", str(tokenizer), *options,
                   *(arg for v in variants for arg in ("--variant", v))], label)
        return json.loads(result.read_text())
    finally:
        result.unlink(missing_ok=True)


def _variant_entry(out: Path, variant: str, agreement: dict[str, float] | None = None,
                   quantization: dict[str, object] | None = None) -> dict[str, object]:
    graph = out / GRAPH_PATHS[variant]
    entry: dict[str, object] = {
        "path": GRAPH_PATHS[variant],
        "sha256": sha256(graph),
        "bytes": graph.stat().st_size,
        "total_bytes": sum(p.stat().st_size for p in _files_of(graph)),
    }
    if variant in RUNTIMES:
        entry["runtime"] = RUNTIMES[variant]
        entry["attention"] = "plain (the runtime fuses it)"
    if quantization is not None:
        entry["quantization"] = quantization
    if agreement is not None:
        # vs this export's fp32 graph on validate.VALIDATION_TEXTS texts (validate.py)
        entry["agreement"] = agreement
    return entry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``bgeserve export`` arguments."""
    parser.add_argument("--model", required=True,
                        help="PyTorch bge-m3 or bge-reranker-v2-m3: a local directory or a hub "
                             "id (BAAI/bge-m3, BAAI/bge-reranker-v2-m3)")
    parser.add_argument("--out", required=True, type=Path, help="export directory")
    parser.add_argument("--variant", action="append", choices=VARIANTS,
                        help="repeatable; default: every CPU variant (fp32, int8, and bf16 — "
                             "an OpenVINO IR — when openvino is installed, ov-int8 — NNCF's "
                             "int8 IR — when nncf is too)")
    parser.add_argument("--opset", type=int, default=18,
                        help="ONNX opset of the graphs (default 18, what ONNX Runtime and "
                             "OpenVINO here load)")
    parser.add_argument("--attention-block", type=int, default=None,
                        help="query rows per attention block for long texts (default 256; "
                             "0 = plain attention, quadratic memory, and no FFN row blocks)")
    parser.add_argument("--ffn-rows", type=int, default=None,
                        help=f"token rows per FFN block in the fp32 and int8 graphs (default "
                             f"{FFN_ROWS}; 0 = one block, as scripts/int8_recipes.py needs)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="hub download cache (default: huggingface_hub's)")


def run(args: argparse.Namespace) -> int:
    """Entry point for ``bgeserve export``."""
    global _progress
    started = time.monotonic()
    setup_logging("auto")  # JSON lines when stdout is not a terminal, as `serve` logs
    _progress = Progress(bars=on_terminal())
    # None, not the defaults, where none was asked: a reranker's export leaves out what is
    # made for bge-m3 only (ov-int8) instead of refusing it as asked (QA: the documented
    # `bgeserve export --model <reranker>` failed where nncf is installed).
    asked = tuple(dict.fromkeys(args.variant)) if args.variant else None
    path = export(args.model, args.out, asked, opset=args.opset, cache_dir=args.cache_dir,
                  attention_block=args.attention_block, ffn_rows=args.ffn_rows)
    _progress.done()
    written = json.loads(Path(path).read_text())["variants"]
    print(f"export written: {path} ({', '.join(written)}) in "
          f"{time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0
