"""The fixed corpora: deterministic texts of exact token lengths (mixed, long, load, single)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from benchkit.common import CORPUS_SEED, LOAD_LENGTHS, LONG_LENGTHS, MAX_SEQ, MIXED_RANGE


def _tokenizer(path: Path):
    import tokenizers

    tk = tokenizers.Tokenizer.from_file(str(path))
    tk.no_padding()
    tk.no_truncation()
    return tk


def _exact_text(tk, pool: list[str], start: int, target: int) -> str:
    """A text of exactly ``target`` tokens (special tokens included), when the tokenizer allows.

    Pool texts from ``start`` on are joined until long enough, then cut at a token boundary;
    cut points near the wanted one are tried until re-tokenizing gives exactly ``target``.
    """
    need = target - 2
    parts: list[str] = []
    approx = 0
    k = start
    while approx < need + 16:
        piece = pool[k % len(pool)]
        parts.append(piece)
        approx += len(tk.encode(piece, add_special_tokens=False).ids)
        k += 1
    joined = " ".join(parts)
    enc = tk.encode(joined, add_special_tokens=False)
    while len(enc.ids) < need + 4:  # joins merged pieces; add more
        joined += " " + pool[k % len(pool)]
        k += 1
        enc = tk.encode(joined, add_special_tokens=False)
    offsets = enc.offsets
    best, best_gap = joined[: offsets[need - 1][1]], None
    for delta in (0, -1, 1, -2, 2, -3, 3, -4, 4, -5, 5, -6, 6):
        j = need - 1 + delta
        if not 0 <= j < len(offsets):
            continue
        candidate = joined[: offsets[j][1]].rstrip()
        n = len(tk.encode(candidate, add_special_tokens=True).ids)
        if n == target:
            return candidate
        if best_gap is None or abs(n - target) < best_gap:
            best, best_gap = candidate, abs(n - target)
    for cut in range(1, 24):  # last resort: shorten the nearest candidate char by char
        candidate = best[:-cut].rstrip()
        if len(tk.encode(candidate, add_special_tokens=True).ids) == target:
            return candidate
    return best


def build_corpus(tokenizer_path: Path, kind: str, n: int) -> dict[str, Any]:
    """The fixed corpus: deterministic texts with a spread of exact token lengths."""
    from bgeserve.export.texts import random_texts

    if kind == "mixed":
        lo, hi = MIXED_RANGE
        targets = [round(x) for x in np.linspace(lo, hi, n)] if n > 1 else [lo]
        random.Random(CORPUS_SEED).shuffle(targets)  # input order is not length order
    elif kind == "long":
        targets = list(LONG_LENGTHS)
    elif kind == "load":  # short queries for the load test
        lo, hi = LOAD_LENGTHS
        targets = [round(x) for x in np.linspace(lo, hi, n)]
        random.Random(CORPUS_SEED + 1).shuffle(targets)
    elif kind.startswith("single-"):  # one text of exactly that length (rss-vs-length)
        targets = [int(kind.split("-", 1)[1])]
    else:
        raise ValueError(kind)
    tk = _tokenizer(tokenizer_path)
    pool = random_texts(CORPUS_SEED, 2000, min_words=10, max_words=60)
    texts = []
    for i, t in enumerate(targets):
        start = (i * 7919 + hash_int(kind)) % len(pool)
        for attempt in range(8):  # another start in the pool when no cut gives exactly t
            text = _exact_text(tk, pool, start + attempt, t)
            if len(tk.encode(text, add_special_tokens=True).ids) == t:
                break
        texts.append(text)
    lengths = [len(e.ids) for e in tk.encode_batch(texts, add_special_tokens=True)]
    lengths = [min(x, MAX_SEQ) for x in lengths]
    return {"kind": kind, "targets": targets, "texts": texts, "lengths": lengths}


def hash_int(s: str) -> int:
    return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16)


def corpus_file(work: Path, tokenizer_path: Path, kind: str, n: int) -> Path:
    """Build the corpus once per (tokenizer, kind, n) and keep it in the work dir."""
    tag = hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()[:12]
    path = work / "corpus" / f"{kind}-{n}-{tag}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        corpus = build_corpus(tokenizer_path, kind, n)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(corpus, ensure_ascii=False))
        tmp.rename(path)
    return path

