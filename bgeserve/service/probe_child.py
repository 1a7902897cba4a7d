"""The probe's own process: ``python -m bgeserve.service.probe_child SPEC_JSON`` → result JSON on stdout.

Two tasks: the memory probe (the default), and ``"task": "time"``, which times one variant on
the measured default's workload (``service.choice``): loaded alone in its own process, a
candidate's memory is all given back when it ends, and one that dies (OOM) takes only itself.

Measuring peak RSS inside the serving process is unreliable: serving threads allocate at the
same time, and glibc keeps freed blocks in per-thread heaps, so a shape that reuses them reads
as ~0. A child process that loads its own session, pins glibc's mmap threshold (every large
block is mapped on allocation and unmapped on free) and runs one shape at a time measures each
shape's workspace alone. If the child is killed (say by the OOM killer), the server survives
and reports the probe as failed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from bgeserve.engine.forward import forward_factory
from bgeserve.engine.tokenizer import Tokenizer
from bgeserve.model.artifacts import resolve
from bgeserve.model.rerank_artifacts import resolve_reranker
from bgeserve.runtime.session import SessionConfig
from bgeserve.tuning import memory, probe
from bgeserve.tuning.costmodel import CostModel
from bgeserve.tuning.synthetic import chunk_timing_run, synthetic_run, time_workload

PIN_THRESHOLD = memory.PROBE_MMAP_THRESHOLD  # blocks ≥ 1 MiB are returned to the OS on free


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the model as ``spec`` says, probe, and return the result as plain data."""
    memory.pin_mmap_threshold(PIN_THRESHOLD)
    find = resolve_reranker if spec.get("reranker") else resolve
    artifacts = find(model_path=Path(spec["model_path"]) if spec["model_path"] else None,
                     variant=spec["variant"], cache_dir=Path(spec["cache_dir"]),
                     offline=True, progress=False)
    vocab = Tokenizer.load(artifacts.tokenizer_path, spec["max_seq"]).vocab_size
    config = SessionConfig(provider=spec["provider"], threads=spec["threads"])
    run_shape, close = synthetic_run(forward_factory(artifacts, config), vocab)
    run_shape(1, 8)
    guard = CostModel(spec["guard_a"], spec["guard_b"], spec["guard_budget"],
                      spec.get("guard_c", 0.0))
    held_out = spec["held_out"]
    result = probe.run_probe(run_shape, shapes=[(int(b), int(s)) for b, s in spec["shapes"]],
                             held_out=(int(held_out[0]), int(held_out[1])) if held_out else None,
                             guard=guard, log=lambda line: print(line, file=sys.stderr, flush=True),
                             chunk_candidates=spec.get("chunk_candidates", ()),
                             chunk_run=chunk_timing_run(run_shape),
                             meter=probe.PeakMeter(bool(spec.get("cumulative"))))
    close()
    return result.to_json()


def time_variant(spec: dict[str, Any]) -> dict[str, Any]:
    """Load ``spec``'s variant, time the choice workload on it; tokens/s and what it took."""
    started = time.perf_counter()
    artifacts = resolve(model_path=Path(spec["model_path"]) if spec["model_path"] else None,
                        variant=spec["variant"], cache_dir=Path(spec["cache_dir"]),
                        offline=True, progress=False)
    vocab = Tokenizer.load(artifacts.tokenizer_path, 512).vocab_size
    config = SessionConfig(provider=spec["provider"], threads=spec["threads"])
    before = memory.rss_bytes()
    run_shape, close = synthetic_run(forward_factory(artifacts, config), vocab)
    run_shape(1, 8)
    loaded = memory.rss_bytes() - before
    load_seconds = time.perf_counter() - started
    rate, rounds = time_workload(run_shape, int(spec["chunk_tokens"]),
                                 max_seq=spec.get("max_seq"),
                                 rounds=int(spec.get("rounds", 2)),
                                 max_seconds=float(spec.get("max_seconds", 60.0)))
    peak = memory.peak_rss_bytes()
    close()
    return {"tokens_per_s": rate, "rounds": rounds, "model_rss_bytes": loaded,
            "peak_rss_bytes": peak, "load_seconds": load_seconds,
            "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(args[0])
    print(json.dumps(time_variant(spec) if spec.get("task") == "time" else run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
