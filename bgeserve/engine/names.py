"""How an error names the setting that bounds what it refuses.

The engine serves two kinds of callers: a program using ``Engine`` / ``Reranker`` in process,
which sets its limits through ``EngineConfig`` and ``SchedulerConfig``, and the server, whose
operator sets them through environment variables. A library caller told to "lower
BGE_M3_MAX_SEQ_LENGTH" was pointed at a variable nothing of theirs reads. The engine's
defaults name its own fields; the server passes its variables (service/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# The classes named are importable from ``bgeserve.engine`` (``EngineConfig``,
# ``SchedulerConfig``) and ``bgeserve.engine.pairs`` (``PairConfig``).


@dataclass(frozen=True)
class SettingNames:
    """What to tell a caller to change, for each limit an error may name."""

    max_seq: str = "EngineConfig(max_seq=...)"
    pair_length: str = "PairConfig(max_length=...)"  # a reranker's (query, document) windows
    max_colbert: str = "EngineConfig(max_colbert_bytes=...)"
    workers: str = "the workers (EngineConfig(scheduler=SchedulerConfig(workers=...)))"
    max_chunk: str = "EngineConfig(scheduler=SchedulerConfig(max_chunk=1))"
    max_queue: str = "EngineConfig(scheduler=SchedulerConfig(max_queue_tokens=...))"
    timeout: str = "EngineConfig(request_timeout_s=...)"
    max_text_chars: str = "EngineConfig(max_text_chars=...)"
    more_memory: str = "give the process more memory"
