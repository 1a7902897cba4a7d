"""The output folder of a bulk job: its lock, its manifest, and what its shards already hold.

``_bulk.json`` (the manifest) records what decides the rows of every shard: the columns, the
outputs, the model, and each input file's size and mtime. A rerun with other options, another
model, or an input that changed since (its row numbers would no longer name the same rows)
is refused before any model loads; a rerun with more inputs adds them. Names starting with
``_`` or ``.`` are skipped by Parquet dataset readers (pyarrow, Spark, Ray, DuckDB), so
``pyarrow.parquet.read_table(DIR)`` reads the shards and nothing else.

A Ray job learns which model files it runs (the ``model_identity``) only once its actors have
loaded them, after the manifest is written: the first of its write tasks records it in
``.bulk.model`` before writing its shard (``pin_identity``), and every other task's shards must
match it; the manifest takes it over at the end of the run, or at the start of the next one
when the run was killed.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
import uuid
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, Self

import orjson

from bgeserve.bulk.coverage import Coverage
from bgeserve.bulk.shards import TEMP_SUFFIX, ShardInfo, is_temp, read_info
from bgeserve.bulk.sources import Source
from bgeserve.errors import InvalidInput

log = logging.getLogger("bgeserve.bulk")
MANIFEST = "_bulk.json"
LOCK = ".bulk.lock"
PIN = ".bulk.model"  # the model identity of shards a Ray run wrote before the manifest had it


class OutputDir:
    """An output folder, locked against a second job for as long as this object is open."""

    def __init__(self, path: Path):
        self.path = Path(path).expanduser().resolve()
        if self.path.exists() and not self.path.is_dir():
            raise InvalidInput(f"--output {self.path} is a file, not a folder: name a folder "
                               "(one that does not exist yet is made)", param="--output")
        self.created = not self.path.exists()
        self._moved: dict[str, str] = {}  # inputs already warned about as moved
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise InvalidInput(f"--output {self.path}: cannot make the folder or open its lock "
                               f"file {LOCK} in it ({exc.strerror})", param="--output") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise InvalidInput(f"another bulk job is writing to {self.path}; wait for it or "
                               "choose another --output", param="--output") from None

    def close(self, failed: bool = False) -> None:
        """Release the lock; after a ``failed`` run, remove the folder if this run made it and
        wrote no shard (a refused first run leaves nothing to trip over)."""
        os.close(self._lock)  # releases the lock
        if failed and self.created and not self.has_shards():
            for name in (LOCK, MANIFEST, PIN):
                (self.path / name).unlink(missing_ok=True)
            try:
                self.path.rmdir()
            except OSError:
                pass  # something else is in it now: left as it is

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=kind is not None)

    # -- the manifest ----------------------------------------------------------------------
    def check_manifest(self, spec: dict[str, Any], sources: Sequence[Source],
                       model_identity: str | None = None, *, write: bool = True) -> str | None:
        """Refuse a rerun that would mix shards of another job (another spec, another model
        at the same path, a changed input); record this one unless ``write`` is false.
        Returns the model identity the shards must have (``model_identity``, else the one
        recorded; None when neither is known).

        The manifest only guards shards: in a folder without any (a first run that failed
        before writing one, e.g. a wrong BGE_M3_MODEL_PATH) it is replaced, never obeyed."""
        path = self.path / MANIFEST
        shards = self.has_shards()
        old = orjson.loads(path.read_bytes()) if path.exists() and shards else None
        files = {s.key: s.fingerprint() for s in sources}
        if old is not None:
            # A Ray run killed before its manifest had the identity left it in the pin.
            recorded = old.get("model_identity") or _read_pin(self.path)
            _check_spec(self.path, old.get("spec", {}), spec,
                        by_content=recorded is not None and "sha256:" in recorded)
            check_identity(self.path, recorded, model_identity)
            moved = _check_sources(old.get("sources", {}), files)
            for key, old_key in moved.items() - self._moved.items():  # once per run
                log.warning("%s looks like %s moved or copied (same name, size and mtime): "
                            "shards name inputs by path, so its rows are embedded again and "
                            "the output will hold them twice; to resume instead, put it back "
                            "at %s", key, old_key, old_key)
            self._moved.update(moved)
            files = {**old.get("sources", {}), **files}
            if model_identity is None:  # not known yet (or a Ray job): keep what was recorded
                model_identity = recorded
        if not write:
            return model_identity
        body = {"bgeserve_bulk": 1, "spec": spec, "sources": files}
        if model_identity is not None:
            body["model_identity"] = model_identity
        temp = self.path / f".{MANIFEST}.tmp"
        temp.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        os.replace(temp, path)
        if model_identity is not None or not shards:  # recorded now, or guarding no shard
            (self.path / PIN).unlink(missing_ok=True)
        return model_identity

    def has_shards(self) -> bool:
        """Whether a finished shard is in the folder."""
        return any(_is_shard(entry) for entry in self.path.iterdir())

    # -- the shards ------------------------------------------------------------------------
    def scan(self) -> tuple[Coverage, list[ShardInfo]]:
        """Rows the finished shards hold. Temporary files of a killed job are removed (the
        lock proves no writer is left); a Parquet file that is no shard is refused."""
        coverage = Coverage()
        shards = []
        strangers = []
        for entry in sorted(self.path.iterdir()):
            if is_temp(entry):
                log.info("removing %s, left unfinished by an earlier run", entry.name)
                entry.unlink(missing_ok=True)
            elif entry.name.startswith((".", "_")):
                continue  # the lock, the manifest, the pin; hidden files readers skip too
            elif _is_shard(entry):
                info = read_info(entry)
                if info is None:
                    raise InvalidInput(f"{entry} is not a bgeserve bulk shard: the output "
                                       "folder must hold this job's shards only", param="--output")
                for source, spans in info.coverage.items():
                    coverage.add(source, spans, entry.name)
                shards.append(info)
            else:
                strangers.append(entry.name)
        if strangers:  # not refused (they are the user's), but the folder no longer reads
            log.warning("%s holds %d entries that are no shards of this job (%s): "
                        "pyarrow.parquet.read_table on the folder reads every file in it and "
                        "fails on them; move them out, or read the shards by name",
                        self.path, len(strangers), ", ".join(strangers[:5]))
        coverage.verify()
        return coverage, shards


def _is_shard(entry: Path) -> bool:
    return entry.suffix == ".parquet" and not entry.name.startswith((".", "_"))


def _check_spec(folder: Path, before: dict[str, Any], spec: dict[str, Any], *,
                by_content: bool = False) -> None:
    """Refuse ``spec`` where it differs from ``before``. ``by_content``: the shards' model
    files are known by their sha256 (``check_identity``), so the variant and runtime each run
    resolved are not compared: a rule's pick differs from machine to machine (VNNI, AMX,
    OpenVINO installed), and a rerun goes on with the shards' variant (``resume_settings``)."""
    if by_content:
        before, spec = _without_runtime(before), _without_runtime(spec)
    for key in sorted(set(before) | set(spec)):
        if before.get(key) != spec.get(key):
            raise InvalidInput(
                f"{folder} holds shards of a job with {key}={before.get(key)!r}, this run has "
                f"{spec.get(key)!r}: rerun with the same options and BGE_M3_* model settings, "
                "or write to a new --output", param="--output")


def _without_runtime(spec: dict[str, Any]) -> dict[str, Any]:
    model = spec.get("model")
    if not isinstance(model, dict):
        return spec
    return {**spec, "model": {k: v for k, v in model.items()
                              if k not in ("variant", "execution_provider")}}


def check_identity(folder: Path, before: str | None, now: str | None) -> None:
    """Refuse (InvalidInput) shards of model files ``now`` beside those of ``before``."""
    # A manifest written before identities were recorded has none: it is accepted (refusing
    # would strand every folder of an older bgeserve mid-job), and this run records its own.
    if before is None or now is None or before == now:
        return
    if "sha256:" not in before:  # names, sizes and mtimes (before 2026-12-03): not content
        return
    raise InvalidInput(
        f"{folder} holds shards made with other model files than this run's ({before} then, "
        f"{now} now; the settings are the same): the model at BGE_M3_MODEL_PATH (or in the "
        "cache) changed, or another variant was chosen for it. Restore that model, pin "
        "BGE_M3_MODEL to the earlier variant, or write to a new --output",
        param="BGE_M3_MODEL_PATH")


def pin_identity(folder: Path, identity: str) -> str:
    """The identity ``folder``'s shards are made with while its manifest records none (a Ray
    run's first shards): the one pinned before, else ``identity``, pinned now. The first of
    several concurrent callers wins (a hard link never replaces a file; where the file system
    has no hard links, an exclusive create); every caller reads the winner's."""
    pinned = _read_pin(folder)
    if pinned is not None:
        return pinned
    temp = folder / f"{PIN}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"  # scan() removes a leftover
    try:
        with open(temp, "w") as f:
            f.write(identity)
            f.flush()
            os.fsync(f.fileno())  # the shard's directory fsync then makes the name durable too
        try:
            os.link(temp, folder / PIN)
        except FileExistsError:
            pass  # another write task pinned first
        except OSError as exc:  # FUSE object stores (gcsfuse, blobfuse) have no hard links
            if exc.errno not in NO_LINKS:
                raise
            _create_pin(folder / PIN, identity)
    finally:
        temp.unlink(missing_ok=True)
    for _ in range(PIN_READ_TRIES):  # an exclusive create is seen before its text
        pinned = _read_pin(folder)
        if pinned is not None:
            return pinned
        time.sleep(0.1)
    raise OSError(f"{folder / PIN} stays empty: cannot tell which model this output's shards "
                  "are made with")


NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS)
PIN_READ_TRIES = 50


def _create_pin(path: Path, identity: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return  # another write task pinned first
    with os.fdopen(fd, "w") as f:
        f.write(identity)
        f.flush()
        os.fsync(f.fileno())


def _read_pin(folder: Path) -> str | None:
    try:
        return (folder / PIN).read_text() or None
    except FileNotFoundError:
        return None


def _check_sources(before: dict[str, Any], files: dict[str, dict[str, int]]
                   ) -> dict[str, str]:
    """Refuse an input changed since its rows were written; return the new inputs that look
    like old ones moved (new path → old path)."""
    moved = {}
    # Earlier inputs by (name, size/mtime): a moved one is found without comparing every pair.
    known = {(Path(k).name, orjson.dumps(v, option=orjson.OPT_SORT_KEYS)): k
             for k, v in before.items()}
    for key, fingerprint in files.items():
        seen = before.get(key)
        if seen is not None and seen != fingerprint:
            raise InvalidInput(
                f"{key} changed since this job started (size/mtime {seen} → {fingerprint}): "
                "its row numbers no longer name the rows the shards hold; restore it, or "
                "write to a new --output", param="INPUT")
        # Shards name sources by absolute path, so a moved input is a new source: its rows are
        # embedded again, beside the old ones. Warned, not refused: a copy may be deliberate.
        old_key = None if seen is not None else known.get(
            (Path(key).name, orjson.dumps(fingerprint, option=orjson.OPT_SORT_KEYS)))
        if old_key is not None and old_key != key:
            moved[key] = old_key
    return moved


def log_bad_rows(source: str, bad: Sequence[Sequence[Any]], *, earlier: bool = False) -> None:
    """One warning line naming ``bad`` rows (``[source, row, id, reason]``) of ``source``."""
    if not bad:
        return
    log.warning("%s %d bad rows of %s: %s", "an earlier run skipped" if earlier else "skipped",
                len(bad), source, "; ".join(f"row {r} (id {i!r}): {why}" for _, r, i, why in bad),
                extra={"bad_rows": [{"row": r, "id": i, "reason": why} for _, r, i, why in bad]})


def earlier_bad_rows(shards: Sequence[ShardInfo], keys: Collection[str]) -> int:
    """Bad rows of the sources ``keys`` that finished shards record: done (a rerun does not
    retry them), counted among the rows the folder already covers."""
    return sum(item[0] in keys for shard in shards for item in shard.bad)


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
