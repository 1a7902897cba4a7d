"""Where prepared exports live: ``{cache_dir}/prepared/<key>/``, keyed by the source's content.

The key hashes (SHA-256) every source file (graph, weights, tokenizer, config), the head
weights and the recipe (``PREPARE_SCHEMA``, attention block, FFN rows): a changed source file
means a new key, so a new preparation. Hashing 2.3 GB takes seconds, so each file's digest is
remembered in ``prepared/digests.json`` against its path, size, mtime and inode; a second start
re-hashes nothing. Builds take an exclusive lock per key (two servers starting together prepare
once) and are staged in a temporary directory renamed into place when complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bgeserve.export import ATTENTION_BLOCK, FFN_ROWS
from bgeserve.export.main import sha256
from bgeserve.model.ptload import HeadWeights

__all__ = ["PreparedStore", "source_key"]

_DIGESTS = "digests.json"


def _stamp(path: Path) -> str:
    stat = path.stat()  # follows the hub cache's symlinks to the blob
    return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"


def file_digests(files: Sequence[Path], memo: Path) -> dict[str, str]:
    """{file name: SHA-256} of ``files``, reusing digests remembered in ``memo`` for files whose
    size, mtime and inode have not changed (and remembering the new ones)."""
    try:
        known: dict[str, Any] = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    found: dict[str, str] = {}
    changed = False
    for path in files:
        real, stamp = str(Path(path).resolve()), _stamp(path)
        entry = known.get(real)
        if not (isinstance(entry, dict) and entry.get("stamp") == stamp):
            entry = known[real] = {"stamp": stamp, "sha256": sha256(path)}
            changed = True
        name = path.name if path.name not in found else f"{path.parent.name}/{path.name}"
        found[name] = entry["sha256"]
    if changed:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, memo)
    return found


def heads_digest(heads: HeadWeights) -> str:
    """SHA-256 of the head weights' values."""
    digest = hashlib.sha256()
    for array in (heads.sparse_weight, np.float32(heads.sparse_bias), heads.colbert_weight,
                  heads.colbert_bias):
        digest.update(np.ascontiguousarray(array, dtype="<f4").tobytes())
    return digest.hexdigest()


def source_key(digests: dict[str, str], heads: HeadWeights, schema: int,
               **recipe_parts: object) -> str:
    """The cache key of a preparation: its sources' digests and the recipe (``recipe_parts``:
    choices made for this machine, e.g. int8's weight bits)."""
    recipe = {"schema": schema, "files": digests, "heads": heads_digest(heads),
              "attention_block": ATTENTION_BLOCK, "ffn_rows": FFN_ROWS, **recipe_parts}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:32]


class PreparedStore:
    """Prepared exports under ``{cache_dir}/prepared``: find, lock, stage, commit."""

    def __init__(self, cache_dir: Path):
        self.root = Path(cache_dir) / "prepared"

    @property
    def digests(self) -> Path:
        """The file-digest memo."""
        return self.root / _DIGESTS

    def path(self, key: str) -> Path:
        return self.root / key

    def manifest(self, key: str) -> dict[str, Any] | None:
        """The manifest of the complete export for ``key``, or None."""
        try:
            data = json.loads((self.path(key) / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("format") == "bgeserve-export" \
            else None

    @contextmanager
    def lock(self, key: str, on_wait: Any = None) -> Iterator[None]:
        """Hold the build lock of ``key`` (waiting for another process that holds it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".{key}.lock", "w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def staging(self, key: str) -> Path:
        """A fresh, empty directory to build ``key`` in (left-overs of crashed builds removed:
        the caller holds the lock)."""
        for stale in self.root.glob(f".{key}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        staged = self.root / f".{key}.{os.getpid()}.tmp"
        staged.mkdir(parents=True)
        return staged

    def commit(self, key: str, staged: Path) -> Path:
        """Move a complete build into place (replacing an older, smaller one); returns it."""
        final = self.path(key)
        if final.exists():
            old = final.with_name(f".{key}.{os.getpid()}.old.tmp")
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(staged, final)
        return final
