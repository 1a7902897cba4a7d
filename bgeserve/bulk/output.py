"""The output folder of a bulk job: its lock, its manifest, and what its shards already hold.

``_bulk.json`` (the manifest) records what decides the rows of every shard: the columns, the
outputs, the model, and each input file's size and mtime. A rerun with other options, another
model, or an input that changed since (its row numbers would no longer name the same rows)
is refused before any model loads; a rerun with more inputs adds them. Names starting with
``_`` or ``.`` are skipped by Parquet dataset readers (pyarrow, Spark, Ray, DuckDB), so
``pyarrow.parquet.read_table(DIR)`` reads the shards and nothing else.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import orjson

from bgeserve.bulk.coverage import Coverage
from bgeserve.bulk.shards import ShardInfo, is_temp, read_info
from bgeserve.bulk.sources import Source
from bgeserve.errors import InvalidInput

log = logging.getLogger("bgeserve.bulk")
MANIFEST = "_bulk.json"
LOCK = ".bulk.lock"


class OutputDir:
    """An output folder, locked against a second job for as long as this object is open."""

    def __init__(self, path: Path):
        self.path = Path(path).expanduser().resolve()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise InvalidInput(f"another bulk job is writing to {self.path}; wait for it or "
                               "choose another --output", param="--output") from None

    def close(self) -> None:
        os.close(self._lock)  # releases the lock

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the manifest ----------------------------------------------------------------------
    def check_manifest(self, spec: dict[str, Any], sources: Sequence[Source]) -> None:
        """Refuse a rerun that would mix shards of another job; record this one."""
        path = self.path / MANIFEST
        old = orjson.loads(path.read_bytes()) if path.exists() else None
        files = {s.key: s.fingerprint() for s in sources}
        if old is not None:
            before = old.get("spec", {})
            for key in sorted(set(before) | set(spec)):
                if before.get(key) != spec.get(key):
                    raise InvalidInput(
                        f"{self.path} holds shards of a job with {key}={before.get(key)!r}, "
                        f"this run has {spec.get(key)!r}: rerun with the same options and "
                        "BGE_M3_* model settings, or write to a new --output", param="--output")
            for key, fingerprint in files.items():
                seen = old.get("sources", {}).get(key)
                if seen is not None and seen != fingerprint:
                    raise InvalidInput(
                        f"{key} changed since this job started (size/mtime {seen} → "
                        f"{fingerprint}): its row numbers no longer name the rows the shards "
                        "hold; restore it, or write to a new --output", param="INPUT")
            files = {**old.get("sources", {}), **files}
        body = orjson.dumps({"bgeserve_bulk": 1, "spec": spec, "sources": files},
                            option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        temp = self.path / f".{MANIFEST}.tmp"
        temp.write_bytes(body)
        os.replace(temp, path)

    # -- the shards ------------------------------------------------------------------------
    def scan(self) -> tuple[Coverage, list[ShardInfo]]:
        """Rows the finished shards hold. Temporary files of a killed job are removed (the
        lock proves no writer is left); a Parquet file that is no shard is refused."""
        coverage = Coverage()
        shards = []
        for entry in sorted(self.path.iterdir()):
            if is_temp(entry):
                log.info("removing %s, left unfinished by an earlier run", entry.name)
                entry.unlink(missing_ok=True)
            elif entry.suffix == ".parquet" and not entry.name.startswith((".", "_")):
                info = read_info(entry)
                if info is None:
                    raise InvalidInput(f"{entry} is not a bgeserve bulk shard: the output "
                                       "folder must hold this job's shards only", param="--output")
                for source, spans in info.coverage.items():
                    coverage.add(source, spans, entry.name)
                shards.append(info)
        coverage.verify()
        return coverage, shards


def log_bad_rows(source: str, bad: Sequence[Sequence[Any]], *, earlier: bool = False) -> None:
    """One warning line naming ``bad`` rows (``[source, row, id, reason]``) of ``source``."""
    if not bad:
        return
    log.warning("%s %d bad rows of %s: %s", "an earlier run skipped" if earlier else "skipped",
                len(bad), source, "; ".join(f"row {r} (id {i!r}): {why}" for _, r, i, why in bad),
                extra={"bad_rows": [{"row": r, "id": i, "reason": why} for _, r, i, why in bad]})


def log_earlier_bad_rows(shards: Sequence[ShardInfo]) -> None:
    """The bad rows that finished shards record, logged again per source when a job resumes:
    a run killed before it logged them (the Ray path logs them when its job ends) would
    otherwise leave them named nowhere, their rows being done."""
    by_source: dict[str, list[Sequence[Any]]] = {}
    for shard in shards:
        for item in shard.bad:
            by_source.setdefault(item[0], []).append(item)
    for source, bad in by_source.items():
        log_bad_rows(source, sorted(bad, key=lambda item: item[1]), earlier=True)
