"""Embeddings of texts seen before: a bounded in-memory LRU, sized in bytes.

Real corpora repeat 10-40 % of their rows (boilerplate, titles, FAQ entries, re-ingested
documents), and a query front end sees the same questions again and again. A text whose token
ids were embedded before is answered from here and never reaches the queue.

Keyed by the model (a fingerprint of its files, the variant and the graph layout: one cache
never mixes two models) and the text's token ids after truncation. An entry holds the outputs
computed for that text so far (dense, sparse, ColBERT); a lookup hits only when every output
the caller asks for is there, and a later run that computes more outputs adds them to the entry.
Sizes count the arrays held (ids of the key included) plus a fixed overhead per entry.

Only sound where a text's results do not depend on what it ran with (``applies``): the dynamic
int8 variant quantizes activations with a scale taken over the whole chunk, so its vectors move
with their batch-mates and a cached vector would differ from a fresh one.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bgeserve.results import EmbedOptions
from bgeserve.tuning import memory

# Python objects around each entry (dict slot, key tuple and bytes, record, array headers):
# tracemalloc measured 8,192 bytes per entry of 200 ids, a dense vector and 150 sparse weights,
# whose arrays hold 7,496. The arrays themselves are counted exactly.
ENTRY_OVERHEAD = 700
# One entry may use at most this share of the cache: a single 8,192-token ColBERT matrix
# (32 MiB) must not flush thousands of short entries.
MAX_ENTRY_SHARE = 16
# Variants whose results do not depend on their batch-mates: no statistic is taken over the
# chunk (fp32 / fp16 / bf16 differ between batch compositions by float rounding only, within
# the parity tolerances). int8 (ONNX Runtime dynamic quantization) takes its activation scales
# per run, over every text of the chunk, padding included.
BATCH_INVARIANT = frozenset({"fp32", "fp16", "bf16"})
# Entries are small long-lived blocks made on the worker threads, among the chunks' large
# short-lived ones: glibc cannot give back the heap between them, and RSS grew to 2-20x what the
# cache holds (tiny model, 15,000 texts: 991 MiB with 42 MB cached, 535 MiB without a cache).
# ``malloc_trim`` returns those pages (~25 ms on a 1 GiB heap): at most once per this period
# while entries are stored.
TRIM_EVERY_S = 10.0

Sparse = tuple[np.ndarray, np.ndarray]


def applies(variant: str, max_chunk: int, pad_multiple: int = 1) -> bool:
    """Whether cached results equal fresh ones for ``variant``: always for the batch-invariant
    variants; for the others only when every text runs alone, unpadded (``BGE_M3_MAX_CHUNK=1``
    and no rounding of lengths)."""
    return variant in BATCH_INVARIANT or (max_chunk == 1 and pad_multiple <= 1)


@dataclass
class Entry:
    """The outputs cached for one text (read-only arrays; callers get copies)."""

    dense: np.ndarray | None = None
    sparse: Sparse | None = None
    colbert: np.ndarray | None = None
    nbytes: int = 0

    def has(self, options: EmbedOptions) -> bool:
        """Whether every output ``options`` asks for is here."""
        return ((not options.dense or self.dense is not None)
                and (not options.sparse or self.sparse is not None)
                and (not options.colbert or self.colbert is not None))


def _frozen(array: np.ndarray) -> np.ndarray:
    out = np.array(array, copy=True)
    out.flags.writeable = False
    return out


def _size(key: bytes, entry: Entry) -> int:
    arrays = [entry.dense, entry.colbert, *(entry.sparse or ())]
    return ENTRY_OVERHEAD + len(key) + sum(a.nbytes for a in arrays if a is not None)


class EmbeddingCache:
    """A thread-safe LRU of per-text outputs holding at most ``max_bytes``.

    ``namespace`` names the model (see the module doc); lookups and stores take a text's token
    ids (int64, as the tokenizer gives them).
    """

    def __init__(self, max_bytes: int, namespace: str = "", *,
                 trim: Callable[[], object] = memory.trim_heap, trim_every_s: float = TRIM_EVERY_S):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be positive (0 means no cache: "
                             "build none)")
        self.max_bytes = max_bytes
        self.namespace = namespace
        self._entries: collections.OrderedDict[tuple[str, bytes], Entry] = (
            collections.OrderedDict())
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.skipped = 0  # stores refused: one entry over max_bytes / MAX_ENTRY_SHARE
        self.repeats = 0  # texts repeated within one call, computed once (Job.reuse)
        self._trim, self._trim_every_s = trim, trim_every_s
        self._trimmed = time.monotonic()

    def key(self, ids: np.ndarray) -> tuple[str, bytes]:
        """The key of a text with these token ids under this cache's model."""
        return self.namespace, np.ascontiguousarray(ids, dtype=np.int64).tobytes()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, ids: np.ndarray, options: EmbedOptions, late: bool = False) -> Entry | None:
        """The entry for ``ids`` if it holds every output ``options`` asks for (a hit: it
        becomes the most recently used), else None (a miss). ``late``: a second look for a
        text that missed when it was queued (a hit then turns that miss into a hit; a miss
        counts nothing more), so ``misses`` counts the texts that ran."""
        key = self.key(ids)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.has(options):
                self.misses += not late
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            self.misses -= late
            return entry

    def count_late_hits(self, n: int) -> None:
        """``n`` texts that missed when queued were answered without running after all (they
        repeated a text of the same chunk)."""
        with self._lock:
            self.hits += n
            self.misses -= n

    def put(self, ids: np.ndarray, *, dense: np.ndarray | None = None,
            sparse: Sparse | None = None, colbert: np.ndarray | None = None) -> None:
        """Store (copies of) the outputs computed for ``ids``, merged into its entry; evicts
        the least recently used entries past ``max_bytes``."""
        key = self.key(ids)
        with self._lock:
            old = self._entries.get(key)
            entry = Entry(old.dense, old.sparse, old.colbert) if old is not None else Entry()
        # Copied outside the lock: a ColBERT matrix can be megabytes.
        if dense is not None and entry.dense is None:
            entry.dense = _frozen(dense)
        if sparse is not None and entry.sparse is None:
            entry.sparse = (_frozen(sparse[0]), _frozen(sparse[1]))
        if colbert is not None and entry.colbert is None:
            entry.colbert = _frozen(colbert)
        entry.nbytes = _size(key[1], entry)
        with self._lock:
            if entry.nbytes > self.max_bytes // MAX_ENTRY_SHARE:
                self.skipped += 1
                return
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[key] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self.bytes -= gone.nbytes
                self.evictions += 1
            now = time.monotonic()
            due = now - self._trimmed >= self._trim_every_s
            if due:
                self._trimmed = now
        if due:  # outside the lock: other workers' lookups do not wait for it
            self._trim()

    def count_repeats(self, n: int) -> None:
        """Count ``n`` texts that repeated another text of the same call."""
        if n:
            with self._lock:
                self.repeats += n

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int]:
        """Counters and size: hits, misses, repeats, evictions, skipped, entries, bytes,
        max_bytes."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "repeats": self.repeats,
                    "evictions": self.evictions, "skipped": self.skipped,
                    "entries": len(self._entries),
                    "bytes": self.bytes, "max_bytes": self.max_bytes}
