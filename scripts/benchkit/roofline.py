"""Each path's share of its precision's roofline, so figures from different CPUs compare.

The work is counted from the model's own dimensions (the export's manifest), for the texts as
they are (padding is waste, not work): per token and layer, the Q, K, V and output projections
(4 · 2h²) and the FFN (2 · 2hi), plus attention (q·kᵀ and scores·v: 2 · 2nh for a text of n
tokens). For bge-m3 (h 1024, i 4096, 24 layers) that is 0.604 GFLOP per token plus 0.0984 MFLOP
per token of context: 0.63 GFLOP per token at 256 tokens. The heads (ColBERT's 2h², sparse's 2h)
are left out: under 0.4 %.

The ceiling of each precision is ``scripts/gemm_ceiling.py``'s GEMM of bge-m3's FFN shape on
the runtime that serves it; the share is useful GFLOP/s ÷ that ceiling.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchkit.common import REPO, log

# Which GEMM ceiling a row's precision runs into: (mode, variant) → gemm_ceiling.py's key.
PRECISION = {"fp32": "fp32", "int8": "int8-ort", "bf16": "bf16-openvino",
             "ov-int8": "int8-openvino"}
FP32_MODES = ("flag", "ort1")  # fp32 whatever the variant column says


@dataclass(frozen=True)
class Dims:
    """The encoder's sizes: hidden, FFN intermediate, layers."""

    hidden: int = 1024
    intermediate: int = 4096
    layers: int = 24

    @classmethod
    def of_export(cls, export_dir: Path) -> Dims:
        """From a ``bgeserve export``'s manifest (bge-m3's sizes when it does not say)."""
        try:
            model = json.loads((export_dir / "manifest.json").read_text()).get("model") or {}
        except (OSError, ValueError):
            model = {}
        return cls(int(model.get("hidden", 1024)), int(model.get("intermediate", 4096)),
                   int(model.get("layers", 24)))

    def flops(self, n: int) -> float:
        """FLOPs of the encoder over one text of ``n`` tokens (alone: no padding)."""
        h, i = self.hidden, self.intermediate
        return self.layers * n * (8 * h * h + 4 * h * i + 4 * n * h)


def corpus_gflop(lengths: Sequence[int], dims: Dims) -> float:
    """The useful work of a corpus, GFLOP."""
    return sum(dims.flops(n) for n in lengths) / 1e9


def precision_of(mode: str, variant: str) -> str | None:
    """The gemm_ceiling.py key a row's path computes in (None: unknown variant)."""
    return "fp32" if mode in FP32_MODES else PRECISION.get(variant)


def ceilings(threads: int, timeout: float = 600.0) -> dict[str, Any]:
    """``scripts/gemm_ceiling.py --json`` in a child (its runtimes stay out of the parent)."""
    cmd = [sys.executable, str(REPO / "scripts" / "gemm_ceiling.py"), "--json",
           "--threads", str(threads)]
    log(f"GEMM ceilings: {' '.join(cmd[1:])}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True,
                             cwd=str(REPO))
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        log(f"GEMM ceilings unavailable ({exc}): no roofline shares")
        return {}


def shares(rows: list[dict[str, Any]], corpora: dict[str, list[int]], dims: Dims,
           ceiling: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per successful corpus run: useful GFLOP/s, its precision's ceiling, the share."""
    out = []
    for r in rows:
        if not r.get("ok") or r["corpus"] not in corpora or not r.get("wall_s"):
            continue
        key = precision_of(r["mode"], r["variant"])
        gflops = corpus_gflop(corpora[r["corpus"]], dims) / r["wall_s"]
        peak = ceiling.get(key) if key else None
        out.append({"corpus": r["corpus"], "mode": r["mode"], "variant": r["variant"],
                    "precision": key, "gflops": gflops, "ceiling": peak,
                    "share": gflops / peak if peak else None})
    return out


def table(rows: list[dict[str, Any]], ceiling: dict[str, Any]) -> str:
    """The roofline section: ceilings, then each path's share of its own."""
    native = ceiling.get("bf16_native")
    lines = [f"GEMM ceilings ({ceiling.get('rows')}×1024×4096, {ceiling.get('threads')} "
             "threads, `scripts/gemm_ceiling.py`): " + ", ".join(
                 f"{k} {ceiling[k]:,.0f} GFLOP/s" for k in PRECISION.values()
                 if isinstance(ceiling.get(k), (int, float)))
             + ("; no native bf16 on this CPU: bf16 runs in fp32" if native is False else ""),
             "", ("| corpus | mode | variant | precision | useful GFLOP/s | ceiling GFLOP/s "
                  "| share of roofline |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['corpus']} | {r['mode']} | {r['variant']} | {r['precision']} | "
                     f"{r['gflops']:,.1f} | "
                     + (f"{r['ceiling']:,.0f} | {100 * r['share']:.0f} % |" if r["ceiling"]
                        else "— | — |"))
    return "\n".join(lines)
