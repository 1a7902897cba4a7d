"""``flag``: FlagEmbedding's BGEM3FlagModel fp32 on the CPU, the reference and the baseline."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from benchkit.common import FLAG_BATCH, MAX_SEQ, rss_now, save_vectors


def child_flag(spec: dict[str, Any], corpus: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from FlagEmbedding import BGEM3FlagModel

    texts = corpus["texts"]
    kwargs = {"batch_size": FLAG_BATCH, "max_length": MAX_SEQ, "return_dense": True,
              "return_sparse": True, "return_colbert_vecs": False}
    t0 = time.perf_counter()
    model = BGEM3FlagModel(spec["model_dir"], use_fp16=False, devices="cpu")
    load_s = time.perf_counter() - t0
    rss_load = rss_now()
    model.encode(["warm up"], **kwargs)
    t0 = time.perf_counter()
    out = model.encode(texts, **kwargs)
    wall = time.perf_counter() - t0
    latencies = []
    if spec["latency_pass"]:
        for t in texts:
            s = time.perf_counter()
            model.encode([t], **{**kwargs, "batch_size": 1})
            latencies.append(time.perf_counter() - s)
    dense = np.asarray(out["dense_vecs"], dtype=np.float32)
    sparse = []
    for weights in out["lexical_weights"]:
        ids = np.asarray(sorted(int(k) for k in weights), dtype=np.int64)
        sparse.append((ids, np.asarray([weights[str(i)] for i in ids], dtype=np.float32)))
    save_vectors(Path(spec["vectors"]), dense, sparse)
    return {"wall_s": wall, "load_s": load_s, "rss_after_load": rss_load,
            "latencies": latencies, "chunks": None}

