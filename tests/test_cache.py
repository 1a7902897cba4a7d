"""``engine/cache.py``: keys, hits by outputs, LRU eviction and byte accounting (no model)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bgeserve.engine import cache as cache_mod
from bgeserve.engine.cache import ENTRY_OVERHEAD, EmbeddingCache, applies
from bgeserve.results import EmbedOptions

DENSE = EmbedOptions(dense=True)
BOTH = EmbedOptions(dense=True, sparse=True)
WIDTH = 8


def ids(*xs: int) -> np.ndarray:
    return np.array([0, *xs, 2], dtype=np.int64)


def vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(WIDTH).astype(np.float32)


def sparse(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(5, 5 + n, dtype=np.int64), np.full(n, 0.5, dtype=np.float32)


def entry_bytes(key: np.ndarray, *arrays: np.ndarray) -> int:
    return ENTRY_OVERHEAD + key.astype(np.int64).nbytes + sum(a.nbytes for a in arrays)


def test_a_stored_text_hits_with_the_same_values_and_a_new_one_misses() -> None:
    """A text's outputs come back as stored (bitwise); other token ids miss; both counted."""
    cache = EmbeddingCache(1 << 20)
    v = vec(1)
    cache.put(ids(5, 6), dense=v)
    hit = cache.get(ids(5, 6), DENSE)
    assert hit is not None and np.array_equal(hit.dense, v)
    assert cache.get(ids(5, 7), DENSE) is None
    assert cache.get(ids(5, 6, 7), DENSE) is None  # a prefix is another text
    assert (cache.hits, cache.misses) == (1, 2)


def test_the_key_is_the_token_ids_whatever_their_integer_type() -> None:
    """int32 and int64 arrays of the same ids are one key; the namespace tells models apart."""
    cache = EmbeddingCache(1 << 20, namespace="model-a|fp32")
    cache.put(ids(5, 6).astype(np.int32), dense=vec(1))
    assert cache.get(ids(5, 6), DENSE) is not None
    other = EmbeddingCache(1 << 20, namespace="model-b|fp32")
    assert cache.key(ids(5, 6)) != other.key(ids(5, 6))


def test_a_hit_needs_every_output_asked_for_and_later_outputs_merge_in() -> None:
    """An entry with dense only misses a dense+sparse lookup; storing sparse later completes
    it, keeping the first dense vector."""
    cache = EmbeddingCache(1 << 20)
    first = vec(1)
    cache.put(ids(5), dense=first)
    assert cache.get(ids(5), BOTH) is None
    cache.put(ids(5), dense=vec(2), sparse=sparse(3))
    hit = cache.get(ids(5), BOTH)
    assert hit is not None and np.array_equal(hit.dense, first)
    assert np.array_equal(hit.sparse[0], sparse(3)[0])
    assert cache.get(ids(5), EmbedOptions(dense=False, colbert=True)) is None


def test_stored_arrays_are_copies_and_read_only() -> None:
    """Changing the caller's array after storing, or the returned one, cannot change the
    cache: it keeps its own read-only copy."""
    cache = EmbeddingCache(1 << 20)
    v = vec(1)
    cache.put(ids(5), dense=v)
    v[:] = 0
    hit = cache.get(ids(5), DENSE)
    assert hit is not None and np.array_equal(hit.dense, vec(1))
    with pytest.raises(ValueError):
        hit.dense[0] = 1.0


def test_bytes_count_the_key_and_every_array_plus_the_entry_overhead() -> None:
    """``bytes`` is the sum of the entries' sizes: ids, dense, sparse ids and weights,
    ColBERT rows, and ENTRY_OVERHEAD each; merging and replacing keep the sum exact."""
    cache = EmbeddingCache(1 << 20)
    key = ids(5, 6, 7)
    cache.put(key, dense=vec(1))
    assert cache.bytes == entry_bytes(key, vec(1))
    colbert = np.zeros((3, WIDTH), np.float32)
    cache.put(key, sparse=sparse(2), colbert=colbert)
    assert cache.bytes == entry_bytes(key, vec(1), *sparse(2), colbert)
    cache.put(ids(9), dense=vec(2))
    assert cache.bytes == entry_bytes(key, vec(1), *sparse(2), colbert) + entry_bytes(ids(9),
                                                                                     vec(2))
    assert cache.stats()["entries"] == 2
    cache.clear()
    assert (cache.bytes, len(cache)) == (0, 0)


def test_the_least_recently_used_entry_goes_first_past_the_limit() -> None:
    """At the byte limit the entry used longest ago is evicted; a hit counts as a use."""
    one = entry_bytes(ids(1), vec(0))
    n = 2 * cache_mod.MAX_ENTRY_SHARE
    cache = EmbeddingCache(n * one)
    for t in range(1, n + 1):
        cache.put(ids(t), dense=vec(t))
    assert cache.get(ids(1), DENSE) is not None  # 1 is now the most recent; 2 the oldest
    cache.put(ids(n + 1), dense=vec(n + 1))
    assert cache.get(ids(2), DENSE) is None
    assert all(cache.get(ids(t), DENSE) is not None for t in (1, 3, n, n + 1))
    assert cache.evictions == 1 and cache.bytes == n * one <= cache.max_bytes


def test_an_entry_over_its_share_of_the_cache_is_not_stored() -> None:
    """One entry larger than max_bytes / MAX_ENTRY_SHARE is skipped (counted), so one long
    ColBERT matrix cannot flush the cache."""
    cache = EmbeddingCache(64 * 1024)
    cache.put(ids(1), dense=vec(1))
    big = np.zeros((cache_mod.ENTRY_OVERHEAD + 64 * 1024 // cache_mod.MAX_ENTRY_SHARE, 1),
                   np.float32)
    cache.put(ids(2), colbert=big)
    assert cache.get(ids(2), EmbedOptions(dense=False, colbert=True)) is None
    assert cache.skipped == 1 and len(cache) == 1


def test_concurrent_stores_keep_the_byte_count_exact() -> None:
    """Threads storing and evicting at once leave ``bytes`` equal to what the entries hold."""
    cache = EmbeddingCache(3 * cache_mod.MAX_ENTRY_SHARE * entry_bytes(ids(1), vec(0)))

    def work(base: int) -> None:
        for t in range(200):
            cache.put(ids(base + t % 80), dense=vec(t))
            cache.get(ids(base + (t * 7) % 80), DENSE)

    threads = [threading.Thread(target=work, args=(1000 * k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.bytes == sum(e.nbytes for e in cache._entries.values()) <= cache.max_bytes


def test_a_cache_of_no_bytes_is_refused() -> None:
    """0 means no cache: the engine builds none, so building one of 0 bytes is a bug."""
    with pytest.raises(ValueError, match="no cache"):
        EmbeddingCache(0)


@pytest.mark.parametrize(("variant", "max_chunk", "pad_multiple", "expected"), [
    ("fp32", 64, 1, True), ("bf16", 64, 1, True), ("fp16", 64, 32, True),
    ("int8", 64, 1, False), ("int8", 1, 1, True), ("int8", 1, 32, False),
])
def test_the_cache_applies_only_where_results_do_not_depend_on_batch_mates(
        variant: str, max_chunk: int, pad_multiple: int, expected: bool) -> None:
    """fp32 / fp16 / bf16 always; int8 (activation scales per run) only when each text runs
    alone and unpadded."""
    assert applies(variant, max_chunk, pad_multiple) is expected


def test_storing_entries_gives_the_heap_back_at_most_once_a_period(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries kept among the chunks' freed buffers pin glibc's heap (RSS 2-20x the cache's
    bytes): stores trim it, at most once per period, whatever the number of stores."""
    clock = [1000.0]
    monkeypatch.setattr(cache_mod.time, "monotonic", lambda: clock[0])
    trims: list[float] = []
    cache = EmbeddingCache(1 << 20, trim=lambda: trims.append(clock[0]), trim_every_s=10.0)
    for i in range(50):  # 5 s of stores: none due yet
        cache.put(ids(i), dense=vec(i))
        clock[0] += 0.1
    assert trims == []
    clock[0] = 1010.0
    for i in range(50, 60):
        cache.put(ids(i), dense=vec(i))
    assert trims == [1010.0]
    clock[0] = 1025.0
    cache.get(ids(1), EmbedOptions())  # lookups never trim
    assert trims == [1010.0]
    cache.put(ids(99), dense=vec(99))
    assert trims == [1010.0, 1025.0]
