"""Prepared exports (``bgeserve prepare``): what one is made from, its key, where it is kept.

A prepared export lives in ``{cache_dir}/prepared/<key>/`` and is a ``bgeserve export`` like
any other. The key hashes (SHA-256) every source file (graph, weights, tokenizer, config), the
head weights, the recipe (``RECIPE``) and the choices made for this machine: a changed source
file means a new key, so a new preparation. Hashing 2.3 GB takes seconds, so each file's digest
is remembered in ``prepared/digests.json`` against its path, size, mtime and inode; a second
start re-hashes nothing. Builds take an exclusive lock per key (two servers starting together
prepare once) and are staged in a temporary directory renamed into place when complete. A
cache that cannot be written (mounted read-only once ``bgeserve prepare`` filled it) is read
without the lock and without saving digests; an export whose files do not have the sizes its
manifest records is ``damage``d (prepared again where the cache can be written).

This is the serving side; the graphs themselves are made by ``python -m
bgeserve.export.prepare`` in a child process (serving never imports the build tools).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bgeserve.model.artifacts import ModelArtifacts
from bgeserve.model.layout import Layout
from bgeserve.model.ptload import HeadWeights

log = logging.getLogger("bgeserve.prepare")

__all__ = ["RECIPE", "PrepareSource", "PreparedStore", "damage", "file_digests", "graph_files",
           "int8_weights", "source_key", "sums_int8_in_int32", "write_heads"]

# What a prepared graph holds besides its sources; part of the key. Bump "schema" whenever the
# recipe changes what a prepared graph holds (a test checks the block sizes against export/).
RECIPE = {"schema": 1, "attention_block": 256, "ffn_rows": 2048}
HEADS_FILE = "heads.npz"  # the head weights handed to the child (it may not re-fetch them)


@dataclass(frozen=True)
class PrepareSource:
    """What a prepared export is made from: a hub-layout fp32 graph and its companions."""

    graph: Path
    layout: Layout
    tokenizer: Path
    heads: HeadWeights
    description: str
    external_data: tuple[Path, ...] = ()
    config: Path | None = None  # config.json, when the snapshot has one

    @classmethod
    def from_artifacts(cls, art: ModelArtifacts) -> PrepareSource:
        """The source behind resolved hub-layout artifacts (BAAI's or a hidden-state graph)."""
        if art.layout is Layout.BGESERVE or art.heads is None:
            raise ValueError(f"{art.source} is already in bgeserve's layout")
        config = next((p for p in (art.tokenizer_path.parent / "config.json",
                                   art.onnx_path.parent / "config.json") if p.is_file()), None)
        return cls(art.onnx_path, art.layout, art.tokenizer_path, art.heads, art.source,
                   art.external_data, config)

    def files(self) -> list[Path]:
        """The files whose content decides the result (the cache key hashes them)."""
        extra = [self.config] if self.config is not None else []
        return [self.graph, *self.external_data, self.tokenizer, *extra]

    @property
    def weight_bytes(self) -> int:
        """Size of the fp32 graph and its weights (what each step's memory scales with)."""
        return sum(p.stat().st_size for p in (self.graph, *self.external_data))


def sums_int8_in_int32(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU sums u8 x s8 products straight into int32 (VNNI, AMX-INT8).

    Without it, x86 int8 kernels (MLAS's u8 x s8, oneDNN's under OpenVINO) add pairs of
    products into int16 first (vpmaddubsw), which saturates for 8-bit weights: a graph with
    8-bit signed weights computes wrong results there, not only slowly.
    """
    try:
        flags = next((line.split(":", 1)[1].split() for line in
                      cpuinfo.read_text(errors="replace").splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


def int8_weights(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """int8's weight encoding for this CPU (``export.steps.export_int8``): ``s8`` where it sums
    u8 x s8 products into int32 (``sums_int8_in_int32``: MLAS's fastest kernels), else ``u8``.

    Without that, MLAS's u8 x u8 kernel widens to 16 bits before multiplying and cannot
    saturate. 7-bit signed weights (``s7``, reduce_range: what a reranker's ``bgeserve export``
    writes, portable) avoid the saturation too, at a cost in agreement: full-size random bge-m3
    on a Zen 3, dense cosine vs fp32 min 0.99879 / 0.99881 with s7, 0.99942 / 0.99947 with u8 on
    two exports (docs/benchmarks.md). A prepared graph serves on the machine that made it, and a
    bge-m3 export records its encoding (``runtime.select`` never defaults to an ``s8`` graph on
    a CPU that would saturate it), so both take the 8-bit encoding that is safe here.
    """
    return "s8" if sums_int8_in_int32(cpuinfo) else "u8"


def write_heads(heads: HeadWeights, path: Path) -> None:
    """Save ``HeadWeights`` for the child that writes them into the graph."""
    np.savez(path, sparse_weight=heads.sparse_weight, sparse_bias=np.float32(heads.sparse_bias),
             colbert_weight=heads.colbert_weight, colbert_bias=heads.colbert_bias)


def read_heads(path: Path) -> HeadWeights:
    """The ``HeadWeights`` that ``write_heads`` saved."""
    with np.load(path) as z:
        return HeadWeights(z["sparse_weight"], float(z["sparse_bias"]), z["colbert_weight"],
                           z["colbert_bias"])


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


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
        _remember(known, memo)
    return found


# What writing into a cache that cannot be written raises: a read-only mount, no permission.
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _remember(known: dict[str, Any], memo: Path) -> None:
    """Save the digests to ``memo``; a cache that cannot be written only costs the next start
    the hashing again (a prepared cache is often mounted read-only), so that is a warning."""
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, memo)
    except OSError as exc:
        if exc.errno not in NOT_WRITABLE:
            raise
        log.warning("cannot save the model files' digests to %s (%s): the next start hashes "
                    "them again", memo, exc.strerror or exc)


def heads_digest(heads: HeadWeights) -> str:
    """SHA-256 of the head weights' values."""
    digest = hashlib.sha256()
    for array in (heads.sparse_weight, np.float32(heads.sparse_bias), heads.colbert_weight,
                  heads.colbert_bias):
        digest.update(np.ascontiguousarray(array, dtype="<f4").tobytes())
    return digest.hexdigest()


def source_key(digests: dict[str, str], heads: HeadWeights, **recipe_parts: object) -> str:
    """The cache key of a preparation: its sources' digests, the recipe (``RECIPE``) and the
    choices made for this machine (``recipe_parts``, e.g. int8's weight encoding)."""
    recipe = {**RECIPE, "files": digests, "heads": heads_digest(heads), **recipe_parts}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:32]


def graph_files(graph: Path) -> list[Path]:
    """A prepared graph and the weight files beside it that belong to it."""
    if graph.suffix == ".xml":
        return [graph, graph.with_suffix(".bin")]
    return [graph, *sorted(p for p in graph.parent.iterdir() if p != graph and p.is_file())]


def damage(root: Path, entry: dict[str, Any]) -> str | None:
    """What is wrong with the files of an export's variant ``entry`` (its ``manifest.json``
    record), or None when they are all there at their recorded sizes (a cheap check: sizes,
    not hashes: a truncated copy or a deleted weight file, not a flipped bit)."""
    graph = root / entry["path"]
    if not graph.is_file():
        return f"{graph} is missing"
    if "bytes" in entry and graph.stat().st_size != entry["bytes"]:
        return (f"{graph} is {graph.stat().st_size} bytes but manifest.json says "
                f"{entry['bytes']}")
    files = graph_files(graph)
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        return f"{graph.parent} lacks {', '.join(missing)}"
    total = sum(p.stat().st_size for p in files)
    if "total_bytes" in entry and total != entry["total_bytes"]:
        return (f"{graph.parent}/ holds {', '.join(p.name for p in files)}: {total} bytes, but "
                f"manifest.json says {entry['total_bytes']}: a weight file is missing or cut "
                "short")
    return None


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

    def damage(self, key: str, manifest: dict[str, Any]) -> str | None:
        """What is wrong with the files of ``key``'s export (``manifest`` its manifest), or
        None when every variant's files are there at their recorded sizes (``damage``)."""
        root = self.path(key)
        if not (root / str(manifest.get("tokenizer", "tokenizer.json"))).is_file():
            return f"{root / 'tokenizer.json'} is missing"
        try:
            return next((why for entry in (manifest.get("variants") or {}).values()
                         if (why := damage(root, entry)) is not None), None)
        except (OSError, KeyError, TypeError) as exc:
            return f"its files cannot be checked against {root / 'manifest.json'}: {exc}"

    @contextmanager
    def lock(self, key: str, on_wait: Any = None) -> Iterator[bool]:
        """Hold the build lock of ``key`` (waiting for another process that holds it); yields
        True, or False without a lock when the cache cannot be written (a read-only mount):
        nothing can build there either, so what it holds is read without a race."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            handle = open(self.root / f".{key}.lock", "w")  # noqa: SIM115 - closed below
        except OSError as exc:
            if exc.errno not in NOT_WRITABLE:
                raise
            handle = None
        if handle is None:  # yielded outside the except: errors after are not "during" it
            yield False
            return
        with handle:
            locked = True
            try:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if on_wait is not None:
                        on_wait()
                    fcntl.flock(handle, fcntl.LOCK_EX)
            except OSError as exc:  # a mount without locks (ENOLCK: NFS without lockd)
                log.warning("cannot lock %s (%s): preparing without waiting for other "
                            "processes on this cache directory", handle.name, exc.strerror)
                locked = False
            try:
                yield True
            finally:
                if locked:
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
