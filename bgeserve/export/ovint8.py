"""The ``ov-int8`` variant: NNCF post-training quantization of the plain-attention graph for
OpenVINO (int8 linear layers on VNNI / AMX-INT8; ``runtime/openvino.py`` runs it).

What is quantized, and why:

- every linear layer of the encoder (Q, K, V, attention output, both FFN layers), with NNCF's
  transformer preset (``ModelType.TRANSFORMER``: SmoothQuant first, then per-channel weights
  and per-tensor activations, fast bias correction; SmoothQuant's alpha the preset's 0.95,
  ``SMOOTH_QUANT_ALPHA``, or ``FALLBACK_ALPHA`` where measured better, see below), calibrated on ``CALIBRATION_TEXTS`` texts of 16–512
  tokens from ``corpus.py`` (its calibration seed; validation uses another). The activation
  ranges are fixed at export, so the calibration must span long texts too: up to 256 tokens
  only, the tiny model's sparse weights on texts of 3,300 tokens drifted 0.107–0.126 from fp32
  (over the int8 tolerance of 0.1), up to 512 tokens 0.06–0.08;
- not the attention MatMuls (q·kᵀ, scores·v): quantizing their inputs stops OpenVINO fusing
  the attention into its bounded-memory kernel (measured on the tiny model: the compiled graph
  kept two plain MatMuls and a Softmax per layer), and a long text would materialise the
  ``heads × S²`` scores again;
- not the sparse and ColBERT heads (as the ONNX Runtime int8 variant).

Weights are 8-bit where the exporting CPU sums int8 products into int32 (VNNI, AMX-INT8: the
CPUs where OpenVINO's int8 is fast), else 7-bit (NNCF's overflow fix on every layer): without
VNNI, x86 int8 kernels add pairs of u8·s8 products into int16, which saturates with 8-bit
weights (on the tiny model, dense cosine 0.991 → 0.983 on an AVX2-only Zen 3). The manifest
records which (``quantization.weights``), and an 8-bit graph is never a default candidate on a
CPU without VNNI / AMX-INT8 (``runtime.select``). 8 bits are what lets ov-int8 keep the 0.999 bar
at all: full-size random bge-m3, the export's validation (then 12 texts, alone and in padded
batches), dense cosine vs fp32 min 0.99730 with 7-bit weights and 0.99915 with 8-bit, each
activation quantizer evaluated in float as a VNNI / AMX CPU computes it
(``scripts/int8_emulated.py``; docs/benchmarks.md, "int8 and ov-int8 weight encodings").

SmoothQuant's alpha moves more of each activation channel's range into the weights the closer it
is to 1, and which alpha is best depends on the model. On the full-size random bge-m3 (8-bit
weights, an AVX512-VNNI Zen 4; ``scripts/ovint8_recipes.py``, docs/benchmarks.md "ov-int8
recipes"), dense cosine vs fp32 min on the 36 validation texts / 64 held-out texts of ≤ 512
tokens: alpha 0.95 (the preset) 0.99899 / 0.99880 — just under the bar a variant must keep to
be served by default (``runtime.select.MIN_DENSE_COS``, 0.999) — 0.75 0.99915 / 0.99927, 0.5
0.99919 / 0.99922, off 0.99692 / 0.99663, at the same speed. On the tiny test model it is the
other way round (validation 0.99823 at 0.95, 0.99759 at 0.75, 0.99627 at 0.5), and there every
alpha from 0.5 to 0.85 put a long text's sparse weight over the int8 tolerance of
FlagEmbedding's (``tests/test_prepare.py``). So ``quantize_to_bar`` measures rather than picks:
the preset first; only where that graph misses the bar on the validation texts, once more at
``FALLBACK_ALPHA``, kept if it clears the bar (the manifest records both figures). It changes the
graph only where the change admits the variant to the default choice, and costs a second
quantization only there (full size, 2 Zen 4 cores: the step took 6 min 47 s, one quantization
2 min 44 s; the check against fp32 ~1 min wherever it runs). Keeping the FFN down-projections in
float (0.99899 / 0.99898, 22 % slower) or the first and last layer (0.99905 / 0.99892) did not
help: the loss is not in one kind of layer. Longer calibration texts (2,048 and 8,192 tokens
besides the 48 of ≤ 512) did not settle it either: on the tiny model they moved the largest
sparse difference on the test's long texts by -0.04 to +0.01 depending on alpha, and lowered
the validation minimum at 0.75 and 0.5.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bgeserve.export import corpus

CALIBRATION_TEXTS = 48
SMOOTH_QUANT_ALPHA = 0.95  # for the MatMuls: the transformer preset's; see the module note
FALLBACK_ALPHA = 0.75  # tried where the preset's graph misses the bar (quantize_to_bar)
HEAD_PATTERNS = [".*sparse_linear.*", ".*colbert_linear.*"]
# Weight encodings: "7-bit" (NNCF's overflow fix on every layer) is right on any x86 CPU;
# "8-bit" only where int8 products are summed into int32 (VNNI, AMX-INT8), see above.
WEIGHTS = ("7-bit", "8-bit")


def weights_here() -> str:
    """The encoding for this CPU: 8-bit where it sums int8 products in int32, else 7-bit."""
    from bgeserve.model import prepared

    return "8-bit" if prepared.sums_int8_in_int32() else "7-bit"


def import_nncf() -> Any:
    """NNCF, imported with its usage telemetry off: it reports each use to OpenVINO's
    telemetry service without asking unless ``NNCF_CI`` is set (whose only effect is to stub
    that out), and a server's first start must not phone home."""
    os.environ.setdefault("NNCF_CI", "1")
    import nncf

    return nncf


def overflow_fix(weights: str) -> Any:  # nncf.OverflowFix: nncf is imported only here
    """NNCF's overflow fix for ``weights``: on every layer for 7-bit, off for 8-bit."""
    import_nncf()
    from nncf.quantization.advanced_parameters import OverflowFix

    return OverflowFix.ENABLE if weights == "7-bit" else OverflowFix.DISABLE


def available() -> bool:
    """Whether NNCF (the ``export`` extra) can be imported."""
    import importlib.util

    return importlib.util.find_spec("nncf") is not None


def calibration(tokenizer: Path, n: int, max_tokens: int) -> list[dict[str, np.ndarray]]:
    """``n`` batch-1 samples (input_ids, attention_mask) of generated text, 16..max_tokens."""
    rows = corpus.token_rows(tokenizer, corpus.CALIBRATION_SEED, n, max_tokens=max_tokens)
    return [{"input_ids": r[None, :], "attention_mask": np.ones((1, len(r)), np.int64)}
            for r in rows]


class _Progress:
    """The calibration samples, saying on stderr how far each of NNCF's passes over them got:
    a pass over the full-size model takes ~1.5 minutes on 2 cores, and NNCF's own progress bars
    draw only on a terminal (``prepare`` relays these lines to the server's log)."""

    def __init__(self, samples: list[dict[str, np.ndarray]], reports: int = 4):
        self.samples = samples
        self.every = max(1, len(samples) // reports)
        self.passes = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self):
        # Said as each report's text is handed over (NNCF may stop iterating at the last one
        # without asking for more); a pass is counted at its first report, since NNCF also
        # peeks at a single sample.
        for i, sample in enumerate(self.samples, 1):
            if i % self.every == 0:
                self.passes += i == self.every
                print(f"[ov-int8] statistics pass {self.passes}: text {i}/{len(self)}",
                      file=sys.stderr, flush=True)
            yield sample


def quantize(plain_fp32: Path, out: Path, tokenizer: Path, *, max_tokens: int | None = None,
             texts: int = CALIBRATION_TEXTS, weights: str = "7-bit",
             smooth_quant_alpha: float = SMOOTH_QUANT_ALPHA,
             float_patterns: tuple[str, ...] = ()) -> dict[str, object]:
    """Quantize ``plain_fp32`` (an ONNX graph with plain attention) into the IR ``out`` with
    ``weights`` (WEIGHTS); returns what was done, for the manifest. ``smooth_quant_alpha`` is
    SmoothQuant's alpha for the MatMuls (-1: off) and ``float_patterns`` keeps the matching
    layers in float (both for ``scripts/ovint8_recipes.py``'s comparisons)."""
    if weights not in WEIGHTS:
        raise ValueError(f"ov-int8 weights {weights!r}: expected one of {WEIGHTS}")
    nncf = import_nncf()
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters

    from bgeserve.runtime import openvino

    started = time.monotonic()
    model = openvino.read_model(plain_fp32)
    attention = openvino.attention_matmuls(model)
    samples = calibration(tokenizer, texts, corpus.capped(max_tokens))
    print(f"[ov-int8] {len(samples)} calibration texts, {len(attention)} attention MatMuls "
          "kept in float", file=sys.stderr, flush=True)
    advanced = AdvancedQuantizationParameters(overflow_fix=overflow_fix(weights))
    advanced.smooth_quant_alphas.matmul = smooth_quant_alpha
    quantized = nncf.quantize(
        model, nncf.Dataset(_Progress(samples)), subset_size=len(samples),
        model_type=nncf.ModelType.TRANSFORMER, preset=nncf.QuantizationPreset.MIXED,
        ignored_scope=nncf.IgnoredScope(names=attention,
                                        patterns=HEAD_PATTERNS + list(float_patterns),
                                        validate=False),
        advanced_parameters=advanced)
    del model
    openvino.save_model(quantized, out)
    layers = sum(n > 0 for n in openvino.quantized_inputs(quantized).values())
    done: dict[str, object] = {
        "tool": f"nncf {nncf.__version__}", "model_type": "transformer", "preset": "mixed",
        "calibration_texts": len(samples), "weights": weights, "int8_matmuls": layers,
        "smooth_quant_alpha": smooth_quant_alpha,
        "seconds": round(time.monotonic() - started, 1)}
    if float_patterns:
        done["float_patterns"] = list(float_patterns)
    return done


def quantize_to_bar(plain_fp32: Path, out: Path, tokenizer: Path, *, max_tokens: int | None = None,
                    weights: str = "7-bit") -> dict[str, object]:
    """``quantize`` with the preset's SmoothQuant alpha; where that graph's dense cosine vs
    ``plain_fp32`` on the validation texts (alone and in padded batches, as the export's
    validation measures it) misses ``MIN_DENSE_COS``, once more with ``FALLBACK_ALPHA``, whose
    graph replaces it if it clears the bar (see the module note). The report says which alpha
    was kept and what each measured (``smooth_quant_tried``)."""
    from bgeserve.export import validate
    from bgeserve.runtime.select import MIN_DENSE_COS

    started = time.monotonic()
    done = quantize(plain_fp32, out, tokenizer, max_tokens=max_tokens, weights=weights)
    rows = validate.texts(tokenizer, max_tokens=corpus.capped(max_tokens))
    ref = validate.outputs_of(plain_fp32, "onnxruntime", rows)
    first = validate.against(ref, out, "openvino", rows)["dense_cos_min"]
    tried = [{"alpha": SMOOTH_QUANT_ALPHA, "dense_cos_min": first}]
    if first < MIN_DENSE_COS:
        print(f"[ov-int8] alpha {SMOOTH_QUANT_ALPHA}: dense cosine min {first:.5f} < "
              f"{MIN_DENSE_COS}; quantizing again with alpha {FALLBACK_ALPHA}",
              file=sys.stderr, flush=True)
        # Beside ``out`` (same filesystem, so the replacement is a rename), removed in any case.
        spare = Path(tempfile.mkdtemp(prefix=".alpha-", dir=out.parent.parent))
        try:
            other = quantize(plain_fp32, spare / out.name, tokenizer, max_tokens=max_tokens,
                             weights=weights, smooth_quant_alpha=FALLBACK_ALPHA)
            second = validate.against(ref, spare / out.name, "openvino", rows)["dense_cos_min"]
            tried.append({"alpha": FALLBACK_ALPHA, "dense_cos_min": second})
            if second >= MIN_DENSE_COS:
                for name in (out.name, out.with_suffix(".bin").name):
                    os.replace(spare / name, out.parent / name)
                done = other
        finally:
            shutil.rmtree(spare, ignore_errors=True)
    print(f"[ov-int8] kept alpha {done['smooth_quant_alpha']} (dense cosine min: "
          + ", ".join(f"alpha {t['alpha']} {t['dense_cos_min']:.5f}" for t in tried) + ")",
          file=sys.stderr, flush=True)
    return {**done, "smooth_quant_tried": tried,
            "seconds": round(time.monotonic() - started, 1)}
