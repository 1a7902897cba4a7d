"""SVG plots for scripts/bench.py (``--plots DIR``): small files, matplotlib only if installed.

- ``throughput-vs-chunk.svg``: ``--chunk-sweep`` rows, raw tokens/s against the mean padded
  tokens per chunk, one line per variant (backend).
- ``rss-vs-length.svg``: ``--rss-vs-length`` rows, RSS growth while embedding one text against
  its length, one line per variant.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
RUNTIME_NAMES = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}


def _lines(rows: list[dict[str, Any]], x: str, y: str) -> dict[str, list[tuple[float, float]]]:
    """Successful rows as sorted (x, y) points per variant, in first-seen variant order."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("ok") and r.get(x) is not None and r.get(y) is not None:
            out.setdefault(r["variant"], []).append((float(r[x]), float(r[y])))
    return {v: sorted(points) for v, points in out.items()}


def write_plots(out_dir: Path, sweep_rows: list[dict[str, Any]], rss_rows: list[dict[str, Any]],
                log: Callable[[str], None]) -> list[Path]:
    """Write the plots that have data; returns their paths ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        log("--plots: matplotlib is not installed (pip install matplotlib): no plots")
        return []
    # Text stays text (not glyph paths) and no date or random ids: small, stable files.
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "bgeserve-bench",
                         "font.size": 9})
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def plot(lines: dict[str, list[tuple[float, float]]], name: str, labels: dict[str, str],
             xlabel: str, ylabel: str, title: str, log2_x: bool = False) -> None:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for variant, points in lines.items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=labels.get(variant, variant))
        if log2_x:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 512, not 2^9
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)
        written.append(path)
        log(f"plot: {path} ({path.stat().st_size / 1024:.0f} KiB)")

    sweep = _lines(sweep_rows, "padded_per_chunk", "tokens_per_s")
    if sweep:
        runtime = {r["variant"]: r.get("runtime") for r in sweep_rows}
        plot(sweep, "throughput-vs-chunk.svg",
             {v: f"{v} ({RUNTIME_NAMES.get(runtime[v], runtime[v])})" for v in sweep},
             "padded tokens per chunk (mean, batch × padded length)", "tokens/s (real tokens)",
             "Raw throughput vs chunk size (mixed corpus)", log2_x=True)
    else:
        log("--plots: no --chunk-sweep results: no throughput plot")

    rss = _lines([{**r, "growth_mib": r["growth"] / MiB} if r.get("ok") else r for r in rss_rows],
                 "length", "growth_mib")
    if rss:
        plot(rss, "rss-vs-length.svg", {}, "text length (tokens)", "RSS growth (MiB)",
             "Memory for one text (engine, peak − before)")
    else:
        log("--plots: no --rss-vs-length results: no RSS plot")
    return written
