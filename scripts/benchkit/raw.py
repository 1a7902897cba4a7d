"""``raw``, ``raw1`` and ``ort1``: the variant's runtime called directly, no bgeserve in between.

``raw`` packs the texts exactly as bgeserve does (``bgeserve.engine.binpack.plan`` +
``pad_chunk``), ``raw1`` runs each text alone, ``ort1`` runs each text alone on a stock
plain-attention fp32 graph with ONNX Runtime's default options (what a user running the stock
export gets). The runtime is the one the export's manifest names; the session options are
bgeserve's own (``bgeserve.runtime.onnx``), so raw differs from the engine only in packing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchkit.common import MAX_SEQ, rss_now, save_vectors


def _session_options(threads: int):
    """The session and run options bgeserve uses (runtime/onnx.py), so raw differs only in
    packing."""
    from bgeserve.runtime import SessionConfig
    from bgeserve.runtime.onnx import run_options, session_options

    config = SessionConfig(threads=threads)
    return session_options(config), run_options(config)


def variant_runtime(export_dir: Path, variant: str) -> str:
    """Which runtime reads a variant: "onnxruntime" or "openvino" (the manifest says)."""
    manifest = json.loads((export_dir / "manifest.json").read_text())
    return manifest["variants"][variant].get("runtime", "onnxruntime")


def engine_chunk_tokens(export_dir: Path, variant: str) -> int:
    """The padded-token budget the engine gives this variant's runtime on the CPU (ONNX
    Runtime 256, OpenVINO 1,024): raw packs with it, so engine / raw measures the engine,
    not another packing."""
    from bgeserve import runtime

    return runtime.get("openvino" if variant_runtime(export_dir, variant) == "openvino"
                       else "cpu").chunk_tokens


def _export_graph(export_dir: Path, variant: str) -> Path:
    manifest = json.loads((export_dir / "manifest.json").read_text())
    return export_dir / manifest["variants"][variant]["path"]


RAW_OUTPUTS = ["dense", "sparse_weights"]


def _check_outputs(have: set[str]) -> None:
    if not set(RAW_OUTPUTS) <= have:
        raise SystemExit(f"raw modes need a bgeserve export (outputs {RAW_OUTPUTS}); "
                         f"got {sorted(have)}")


def _stock_options(threads: int):
    """ORT's default session options (arena on, parallel defaults) with only the thread count
    set: what ``ort1`` uses, as a user running the stock export would."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return opts


def _open_ort(graph: Path, opts, run_opts=None):
    """``run(ids, mask) -> [dense, sparse_weights]`` on an ONNX Runtime CPU session."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph), sess_options=opts,
                                   providers=["CPUExecutionProvider"])
    _check_outputs({o.name for o in session.get_outputs()})
    return lambda ids, mask: session.run(RAW_OUTPUTS, {"input_ids": ids, "attention_mask": mask},
                                         run_opts)


def _open_openvino(xml: Path, variant: str, threads: int):
    """The same ``run`` on a compiled OpenVINO model (one stream, latency hint), in the
    variant's precision as bgeserve compiles it."""
    import openvino as ov  # only in this child: the parent never loads OpenVINO

    from bgeserve.runtime.openvino import INFERENCE_PRECISION

    compiled = ov.Core().compile_model(str(xml), "CPU", {
        "INFERENCE_PRECISION_HINT": INFERENCE_PRECISION.get(variant, variant), "INFERENCE_NUM_THREADS": threads,
        "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"})
    _check_outputs({o.get_any_name() for o in compiled.outputs})
    request = compiled.create_infer_request()
    outputs = [compiled.output(name) for name in RAW_OUTPUTS]

    def run(ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
        result = request.infer({"input_ids": ids, "attention_mask": mask})  # copies outputs
        return [result[o] for o in outputs]

    return run


def child_raw(spec: dict[str, Any], corpus: dict[str, Any], batch1: bool) -> dict[str, Any]:
    from bgeserve.engine.binpack import plan
    from bgeserve.engine.forward import pad_chunk
    from bgeserve.engine.heads import sparse_vector
    from bgeserve.engine.scheduler import SchedulerConfig
    from bgeserve.engine.tokenizer import Tokenizer

    export_dir = Path(spec["export_dir"])
    variant = spec["variant"]
    texts = corpus["texts"]
    t0 = time.perf_counter()
    if spec["mode"] == "ort1":  # the plain-attention graph as a user would run it
        run_graph = _open_ort(Path(spec["plain_graph"]), _stock_options(spec["threads"]))
    elif variant_runtime(export_dir, variant) == "openvino":
        run_graph = _open_openvino(_export_graph(export_dir, variant), variant, spec["threads"])
    else:
        run_graph = _open_ort(_export_graph(export_dir, variant),
                              *_session_options(spec["threads"]))
    tokenizer = Tokenizer.load(export_dir / "tokenizer.json", MAX_SEQ)
    load_s = time.perf_counter() - t0
    rss_load = rss_now()

    def run(ids_list: list[np.ndarray]) -> list[np.ndarray]:
        pad_to = max(len(x) for x in ids_list)
        return run_graph(*pad_chunk(ids_list, pad_to))

    run([tokenizer.encode(["warm up"]).ids[0]])
    dense = np.zeros((len(texts), 0), np.float32)
    sparse_rows: list[np.ndarray | None] = [None] * len(texts)
    all_ids: list[np.ndarray] = []
    latencies: list[float] = []
    chunks: list[tuple[int, int]] = []
    if batch1:
        t0 = time.perf_counter()
        for i, text in enumerate(texts):
            s = time.perf_counter()
            ids = tokenizer.encode([text]).ids[0]
            d, w = run([ids])
            if dense.shape[1] == 0:
                dense = np.zeros((len(texts), d.shape[1]), np.float32)
            dense[i] = d[0]
            sparse_rows[i] = w[0, : len(ids)]
            all_ids.append(ids)
            chunks.append((1, len(ids)))
            latencies.append(time.perf_counter() - s)
        wall = time.perf_counter() - t0
    else:
        cfg = SchedulerConfig()  # the engine's packing rules (max_tokens: --chunk-sweep)
        t0 = time.perf_counter()
        all_ids = tokenizer.encode(texts).ids
        for chunk in plan([len(x) for x in all_ids], fits=lambda b, s: True,
                          max_chunk=cfg.max_chunk,
                          max_tokens=(spec.get("max_tokens")
                                      or engine_chunk_tokens(export_dir, variant)),
                          min_fill=cfg.min_fill):
            d, w = run([all_ids[i] for i in chunk.indices])
            if dense.shape[1] == 0:
                dense = np.zeros((len(texts), d.shape[1]), np.float32)
            for row, i in enumerate(chunk.indices):
                dense[i] = d[row]
                sparse_rows[i] = w[row, : len(all_ids[i])]
            chunks.append((len(chunk.indices), chunk.pad_to))
        wall = time.perf_counter() - t0
    # every text ran in exactly one chunk above, so each row is set
    sparse = [sparse_vector(all_ids[i], row) for i, row in enumerate(sparse_rows)
              if row is not None]
    assert len(sparse) == len(texts), "a text ran in no chunk"
    save_vectors(Path(spec["vectors"]), dense, sparse)
    return {"wall_s": wall, "load_s": load_s, "rss_after_load": rss_load,
            "latencies": latencies if batch1 else [], "chunks": chunks}

