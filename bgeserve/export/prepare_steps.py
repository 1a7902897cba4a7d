"""``prepare``'s own steps, each run in a child process (``python -m
bgeserve.export.prepare_steps``), beside the export's int8 / OpenVINO / row-block steps that it
reuses (``steps.py``). No step imports torch or transformers.

- ``graphs``: from the hub graph (read without its weights) write ``plain/model.onnx`` (the hub
  graph with bge-m3's heads inside: the reference, and OpenVINO's source; its weights a hard
  link to the hub graph's) and ``fp32/model.onnx`` (heads inside, LayerNorms fused, bounded
  attention; its weights a copy of the hub graph's files), and ``dims.json``.
- ``check``: the agreement of the prepared graphs with the plain one (``validate.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from bgeserve.export import ATTENTION_BLOCK, FFN_ROWS
from bgeserve.model import prepared
from bgeserve.model.onnxmeta import external_locations


def _log(msg: str, started: float) -> None:
    print(f"[prepare {time.monotonic() - started:7.1f}s] {msg}", file=sys.stderr, flush=True)


def link_data(source_dir: Path, target_dir: Path, locations: set[str], *,
              link: bool) -> None:
    """The weight files at ``locations`` (relative to ``source_dir``) in ``target_dir`` too: a
    hard link when ``link`` (and both are on one file system), else a copy.

    Only a graph that ONNX Runtime and OpenVINO alone read may share its weights through a hard
    link: onnx (1.19+) refuses to load external data from a file with several links ("a
    potential hardlink attack"), and the int8 step loads the fp32 graph with onnx.
    """
    for location in sorted(locations):
        src, dst = (source_dir / location).resolve(), target_dir / location
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        if link:
            try:
                os.link(src, dst)
                continue
            except OSError:  # another file system, or links not allowed: copy
                pass
        shutil.copyfile(src, dst)  # copy_file_range: a reflink where the file system has them


def build_graphs(source: Path, hidden_output: str, work: Path, config: Path | None = None,
                 block: int = ATTENTION_BLOCK) -> dict[str, object]:
    """Write ``plain/`` and ``fp32/`` graphs and ``dims.json`` into ``work``; returns the dims."""
    import onnx

    from bgeserve.export import attention, encoder
    from bgeserve.export.headgraph import add_heads

    started = time.monotonic()
    heads = prepared.read_heads(work / prepared.HEADS_FILE)
    model = onnx.load(str(source), load_external_data=False)
    locations = external_locations(model)
    settings = json.loads(config.read_text()) if config is not None else None
    sizes = encoder.dims(model, settings)
    dims: dict[str, object] = dict(sizes)
    _log(f"read {source}: {dims}", started)
    if heads.hidden_size != sizes["hidden"]:
        raise ValueError(f"the heads are for hidden size {heads.hidden_size}, the graph has "
                         f"{sizes['hidden']}")

    plain = onnx.ModelProto()
    plain.CopyFrom(model)
    add_heads(plain, hidden_output, heads)
    _save(plain, work / "plain" / "model.onnx", source.parent, locations, link=True)
    del plain

    fused = encoder.fuse_layernorms(model)
    add_heads(model, hidden_output, heads)
    layers = attention.bound_attention(model, sizes["heads"], sizes["hidden"], block)
    norms = sum(n.op_type == "LayerNormalization" for n in model.graph.node)
    # The FFN row blocks find each layer between its LayerNorms (rowblock.py).
    dims.update(attention_block=block,
                ffn_rows=FFN_ROWS if norms == 1 + 2 * layers else 0,
                opset=next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")))
    _save(model, work / "fp32" / "model.onnx", source.parent, locations, link=False)
    _log(f"fp32: {layers} layers with bounded attention, {fused} LayerNorms fused, "
         f"FFN row blocks {'on' if dims['ffn_rows'] else 'off'}", started)
    (work / "dims.json").write_text(json.dumps(dims, indent=1))
    return dims


def _save(model, path: Path, source_dir: Path, locations: set[str], *, link: bool) -> None:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    link_data(source_dir, path.parent, locations, link=link)
    onnx.save_model(model, str(path))


def check(work: Path, result: Path, tokenizer: Path, graphs: dict[str, tuple[Path, str]],
          max_tokens: int) -> None:
    """Agreement of each prepared graph with ``work/plain/model.onnx``, as JSON in ``result``."""
    from bgeserve.export import validate

    started = time.monotonic()
    _log(f"validating {', '.join(graphs)} against the hub graph", started)
    rows = validate.texts(tokenizer, max_tokens=max_tokens)
    found = validate.agreement_with(work / "plain" / "model.onnx", graphs, rows)
    for name, figures in found.items():
        _log(f"{name}: {figures}", started)
    result.write_text(json.dumps(found, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bgeserve.export.prepare_steps")
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("graphs")
    p.add_argument("source", type=Path)
    p.add_argument("hidden_output")
    p.add_argument("work", type=Path)
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--attention-block", type=int, default=ATTENTION_BLOCK)
    p = sub.add_parser("check")
    p.add_argument("work", type=Path)
    p.add_argument("result", type=Path)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--graph", action="append", required=True, metavar="NAME=PATH:RUNTIME")
    args = parser.parse_args(argv)
    if args.step == "graphs":
        build_graphs(args.source, args.hidden_output, args.work, args.config,
                     args.attention_block)
    else:
        graphs = {}
        for spec in args.graph:
            name, _, rest = spec.partition("=")
            path, _, runtime = rest.rpartition(":")
            graphs[name] = (Path(path), runtime)
        check(args.work, args.result, args.tokenizer, graphs, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
