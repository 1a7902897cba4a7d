"""Where a served model's probe measures: a child process, or the serving engine itself."""

from __future__ import annotations

from typing import Any

from bgeserve.engine import Engine
from bgeserve.tuning import memory
from bgeserve.tuning.child import ChildProbe
from bgeserve.tuning.probe import LocalProbe, ProbeSource
from bgeserve.tuning.synthetic import chunk_timing_run, synthetic_run

__all__ = ["probe_source"]


def probe_source(engine: Engine, spec: dict[str, Any], *, in_process: bool) -> ProbeSource:
    """Where the probe measures (``Tuner.state.probe_mode``): a child process that loads its
    own copy of the model as ``spec`` says (beside the serving server), or, ``in_process``,
    the serving engine's own session before it serves (where a second copy does not fit: no
    extra weights, and the workers' own workspace budget, since nothing else runs)."""
    if not in_process:
        return ChildProbe(spec)
    run, close = synthetic_run(engine.open_forward, engine.tokenizer.vocab_size)
    return LocalProbe(run, chunk_run=chunk_timing_run(run), close=close,
                      pin_heap=memory.PROBE_MMAP_THRESHOLD)
