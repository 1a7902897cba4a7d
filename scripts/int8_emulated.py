#!/usr/bin/env python3
"""An int8 OpenVINO IR's agreement with fp32 as a CPU with VNNI / AMX-INT8 computes it.

An NNCF IR (the ov-int8 variant) quantizes each linear layer's input with a FakeQuantize. On a
CPU without VNNI, OpenVINO's int8 kernels add pairs of u8·s8 products into int16, which
saturates for 8-bit weights, so this machine's figure is not what a VNNI / AMX CPU serves. Here
every FakeQuantize is rebuilt from plain float ops (clamp, scale, round half to even, scale
back): the plugin then sees no quantized layer and runs each one in fp32 on exactly the int8
values (the weights are int8 constants already), which is what an int32-accumulating kernel
computes. The figures are ``export.validate``'s (12 texts, alone and in padded batches, the
worse of the two) against the export's fp32 graph, for the IR as it is served here and
emulated:

    python scripts/int8_emulated.py --export-dir EXPORT [--ir OTHER/model.xml ...]

(default: the export's own ov-int8). One IR compiled at a time; ~1 minute per IR at full size.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def emulate(model: Any) -> int:
    """Replace every FakeQuantize of ``model`` by the same arithmetic in float ops; returns
    how many were replaced."""
    from openvino import opset13 as ops

    replaced = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "FakeQuantize":
            continue
        x, in_lo, in_hi, out_lo, out_hi = (op.input_value(i) for i in range(5))
        steps = ops.constant(np.float32(op.get_attributes()["levels"] - 1))
        clamped = ops.minimum(ops.maximum(x, in_lo), in_hi)
        level = ops.round(ops.multiply(ops.divide(ops.subtract(clamped, in_lo),
                                                  ops.subtract(in_hi, in_lo)), steps),
                          "half_to_even")
        y = ops.add(ops.multiply(ops.divide(level, steps), ops.subtract(out_hi, out_lo)), out_lo)
        op.output(0).replace(y.output(0))
        replaced += 1
    return replaced


def main(argv: list[str] | None = None) -> int:
    import openvino as ov

    from bgeserve.export import corpus, validate
    from bgeserve.export.main import GRAPH_PATHS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export-dir", type=Path, required=True, help="holds fp32 and the tokenizer")
    p.add_argument("--ir", type=Path, action="append", default=[],
                   help="int8 IRs to check (default: the export's ov-int8)")
    p.add_argument("--max-tokens", type=int, default=corpus.MAX_TOKENS)
    args = p.parse_args(argv)
    irs = args.ir or [args.export_dir / GRAPH_PATHS["ov-int8"]]
    rows = validate.texts(args.export_dir / "tokenizer.json", max_tokens=args.max_tokens)
    reference = args.export_dir / GRAPH_PATHS["fp32"]
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ir in irs:
            model = ov.Core().read_model(str(ir))
            replaced = emulate(model)
            emulated = Path(tmp) / f"{len(report)}" / "model.xml"
            emulated.parent.mkdir()
            ov.save_model(model, str(emulated), compress_to_fp16=False)
            del model
            found = validate.agreement_with(reference, {
                "served here": (ir, "openvino"), "int32 accumulation": (emulated, "openvino")},
                rows)
            report[str(ir)] = {"fake_quantize_replaced": replaced, **found}
            print(json.dumps({str(ir): report[str(ir)]}), flush=True)
            for path in emulated.parent.iterdir():
                path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
