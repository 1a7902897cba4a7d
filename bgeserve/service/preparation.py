"""The prepare step of a start: a hub snapshot becomes bgeserve's own export, once, cached.

``Preparation.apply(settings, cache_dir)`` runs before the model loads (``Service._load``): for a
hub snapshot (downloaded, or ``BGE_M3_MODEL_PATH`` pointing at one) served on the CPU it finds
the prepared export for the snapshot's content in ``{cache_dir}/prepared`` or makes it
(``python -m bgeserve.export.prepare``, a child process, which runs each step in its own), and
returns settings that serve it; with neither
``BGE_M3_MODEL`` nor ``BGE_M3_EP`` given, the variant is then chosen from the prepared export's
measured agreement (runtime/select.py), as for a ``bgeserve export``. Whenever it cannot
(``BGE_M3_PREPARE=0``, too little memory for a step, a graph it cannot rewrite) the snapshot is
served as it is and ``status`` says why (``/health`` shows it, the log too).

Which variants, and whether there is room to make them, is prepare_plan.py's to say; running
the child that makes them is recipe.py's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bgeserve.config import Settings
from bgeserve.errors import ModelUnavailable
from bgeserve.model.artifacts import HUB_SOURCES, HubSource, export_variants, resolve
from bgeserve.model.prepared import (
    PreparedStore,
    PrepareSource,
    file_digests,
    int8_weights,
    source_key,
)
from bgeserve.progress import Progress
from bgeserve.service import plan, prepare_plan
from bgeserve.service.prepare_plan import Skip, peak_bytes, size
from bgeserve.service.recipe import STOP_GRACE_SECS, PrepareFailed, end_group, run_recipe
from bgeserve.tuning import memory

log = logging.getLogger("bgeserve.prepare")


class Preparation:
    """One start's prepare step: decides, finds or makes the export, says what happened."""

    def __init__(self, progress: Progress | None = None):
        self.progress = progress or Progress()
        self.status: dict[str, Any] = {"status": "not_run"}
        # The hub graph a served preparation was made from (the model downloaded, not a
        # BGE_M3_MODEL_PATH): /info's model_id and model_sha.
        self.hub: HubSource | None = None
        # The prepare child now running and the directory it builds in, for ``stop``.
        self._guard = threading.Lock()
        self._child: subprocess.Popen[str] | None = None
        self._staged: Path | None = None
        self._stopping = False

    def stop(self) -> None:
        """End a preparation still running (the server is shutting down): the prepare child
        and its step get SIGTERM, then SIGKILL after ``STOP_GRACE_SECS``, and the directory it
        was building in is removed. Without this they outlive the server (holding up to
        3 W of memory for minutes) and leave their staging directory behind."""
        with self._guard:
            self._stopping = True
            child, staged = self._child, self._staged
        if child is None:
            return
        log.info("stopping the preparation in progress (pid %d)", child.pid)
        end_group(child, STOP_GRACE_SECS)
        # Under the lock, and only while the loader still names it: once the child has ended
        # the loader forgets it (``_started(None)``) before committing the export, so a child
        # that finished just before the stop is committed whole, never emptied mid-rename.
        with self._guard:
            if self._staged is not None and self._staged == staged:
                shutil.rmtree(staged, ignore_errors=True)

    def _started(self, child: subprocess.Popen[str] | None, staged: Path | None = None) -> None:
        """Remember the prepare child (None: it ended); one started after ``stop`` ends now."""
        with self._guard:
            self._child, self._staged = child, staged
            stopping = self._stopping
        if child is not None and stopping:
            end_group(child, STOP_GRACE_SECS)

    def apply(self, s: Settings, cache_dir: Path) -> Settings:
        """Settings serving the prepared export of ``s``'s snapshot, or ``s`` unchanged."""
        # Neither BGE_M3_MODEL nor BGE_M3_EP given: the variant is chosen again, from what the
        # prepared export measured.
        choose = not s.is_explicit("BGE_M3_MODEL") and not s.is_explicit("BGE_M3_EP")
        reason = prepare_plan.not_needed(s)
        if reason is not None:
            self.status = {"status": "disabled" if not s.prepare else "not_needed",
                           "reason": reason}
            if not prepare_plan.is_export(s):  # a snapshot served as it is: the log says so
                log.info("serving the snapshot as it is, not prepared (%s)", reason)
            return s
        try:
            art = resolve(model_path=s.model_path, variant="fp32", cache_dir=cache_dir,
                          offline=s.offline, progress=self.progress.bars,
                          report=self.progress.transfer)
        except ModelUnavailable as exc:
            if s.model_path is None:
                raise  # the hub: serving the stock graph would need the same download
            self.status = {"status": "not_needed", "reason": f"no fp32 hub graph to prepare "
                           f"from: {exc.message}"}
            return s
        try:
            prepared, outcome = self.find_or_make(s, cache_dir, PrepareSource.from_artifacts(art),
                                                  prepare_plan.wanted(s))
        except Skip as exc:
            self._fallback("skipped", str(exc))
            return s
        except Exception as exc:  # noqa: BLE001 - any failure: serve the stock graph, say why
            self._fallback("failed", str(exc), error=exc)
            return s
        variants = export_variants(prepared)
        if not choose and s.variant not in variants:
            why = outcome.get("skipped", {}).get(s.variant) or (
                "it is made with OpenVINO and NNCF, which are not both installed"
                if s.variant == "ov-int8" and not prepare_plan.nncf() else "not made")
            self._fallback("skipped", f"BGE_M3_MODEL={s.variant} was not prepared ({why})")
            return s
        self.status.update(path=str(prepared), variants=sorted(variants))
        self.hub = HUB_SOURCES["fp32"] if s.model_path is None else None
        chosen = dataclasses.replace(s, model_path=prepared)
        if choose:  # the rule again, now over the prepared export's variants
            chosen = plan.resolve(dataclasses.replace(chosen, variant_choice=""))
        return chosen

    def _waiting(self, description: str) -> None:
        # On /health too: minutes at "hashing the model files", progress 0, read as a hang.
        log.info("another bgeserve is preparing %s: waiting for it", description)
        self.progress.step(WAITING_STEP)

    def find_or_make(self, s: Settings, cache_dir: Path, source: PrepareSource,
                     wanted: list[str], *, force: bool = False,
                     ) -> tuple[Path, dict[str, Any]]:
        """The prepared export of ``source`` in the cache (made if missing or lacking one of
        ``wanted``); returns its directory and its manifest's ``prepared`` record."""
        store = PreparedStore(cache_dir)
        self.progress.step("hashing the model files")
        digests = file_digests(source.files(), store.digests)
        encoding = int8_weights()
        key = source_key(digests, source.heads, int8_weights=encoding)
        with store.lock(key, on_wait=lambda: self._waiting(source.description)) as writable:
            if self.progress.snapshot().get("step") == WAITING_STEP:
                # The other one's export is there now, most likely: what follows reads it.
                self.progress.step("reading the prepared export")
            if not writable:
                return self._read_only(store, key, wanted, force=force)
            # An earlier preparation of this key (unless forced): served as it is when it
            # covers what is wanted, else what it has is linked, not made again (prepare.py
            # checks it is whole), so only the others are weighed against memory and disk
            # (fp32 always: its graphs are rewritten again to make the others from).
            earlier = None if force else _earlier(store, key)
            # What it holds whole: with its agreement (prepare.py links only those; one from
            # an older version without it is made again, and so weighed as new).
            have = ({v for v, entry in earlier["variants"].items() if isinstance(entry, dict)
                     and "agreement" in entry} - {"fp32"} if earlier is not None else set())
            new = [v for v in wanted if v not in have]
            weights = source.weight_bytes
            available = memory.detect_available_memory(s.available_memory_bytes).available_bytes
            killed_at = _killed_at(store.path(key)) if earlier is not None else {}
            if earlier is not None:
                refit = prepare_plan.refit(earlier, new, lambda: prepare_plan.limits(
                    weights, available, store.root, new,
                    copied=prepare_plan.copied(source, store.root)), killed_at, available)
                if prepare_plan.covers(earlier, wanted) and not refit:
                    self.status = {"status": "cached", "key": key}
                    log.info("prepared export found: %s (variants %s)", store.path(key),
                             ", ".join(sorted(earlier["variants"])))
                    return store.path(key), earlier.get("prepared", {})
                if refit:
                    log.info("the prepared export %s left out %s for want of memory or disk; "
                             "there is room now: adding it", store.path(key), ", ".join(refit))
            need = peak_bytes("fp32", weights)
            if available < need:
                raise Skip(f"preparing needs ~{size(need)} and {size(available)} are "
                           "available: serving the snapshot's own graph (plain attention)")
            reuse = store.path(key) if earlier is not None else None
            skip = prepare_plan.limits(weights, available, store.root, new,
                                       copied=prepare_plan.copied(source, store.root))
            held = {v: why for v, why in prepare_plan.kept_out(killed_at, available).items()
                    if v in new}
            skip.update(held)
            log.info("preparing %s (variants %s%s%s) into %s", source.description,
                     ", ".join(new), f"; skipping {skip}" if skip else "",
                     f"; {', '.join(sorted(have))} kept from {reuse}" if have else "",
                     store.path(key))
            staged = store.staging(key)
            # What the earlier export has is asked for too: the new one replaces it whole, so
            # a variant left out of ``wanted`` (`prepare --variant bf16` after a start that
            # made int8) would be dropped, and made again (minutes, GiBs) by the next start.
            asked = [*wanted, *sorted(have - set(wanted))]
            try:
                outcome = run_recipe(source, staged, asked, skip=skip, hashes=digests,
                                     weights=encoding, progress=self.progress, reuse=reuse,
                                     on_start=lambda child: self._started(child, staged))
            except Exception as exc:
                shutil.rmtree(staged, ignore_errors=True)
                if earlier is None:
                    raise
                # Only adding to an export made before failed: that one still serves.
                added = [v for v in new if v != "fp32"]
                log.warning("adding %s to the prepared export failed (%s): serving it as it "
                            "was", ", ".join(added), exc)
                self.status = {"status": "cached", "key": key,
                               "reason": f"adding {', '.join(added)} failed: {exc}"}
                return store.path(key), earlier.get("prepared", {})
            except BaseException:
                shutil.rmtree(staged, ignore_errors=True)
                raise
            finally:
                self._started(None)
            final = store.commit(key, staged)
            skipped = outcome.get("skipped") or {}
            _record_killed(final, {**{v: killed_at[v] for v in held},
                                   **{v: available for v in prepare_plan.killed(skipped)}})
        self.status = {"status": "prepared", "key": key, "seconds": outcome.get("seconds"),
                       **({"skipped": skipped} if skipped else {})}
        log.info("prepared %s in %.0fs: %s", source.description, outcome.get("seconds", 0),
                 ", ".join(outcome.get("variants", [])), extra={
                     "skipped": skipped or None, "steps": outcome.get("steps"),
                     "reused": outcome.get("reused") or None})
        return final, {"skipped": skipped}

    def _read_only(self, store: PreparedStore, key: str, wanted: list[str], *,
                   force: bool) -> tuple[Path, dict[str, Any]]:
        """The export of ``key`` as a cache that cannot be written holds it (an init container
        ran ``bgeserve prepare``, the volume is mounted read-only): nothing is made or added.
        Raises PrepareFailed when it holds no whole export of ``key``."""
        where = f"BGE_M3_CACHE_DIR ({store.root.parent}) cannot be written"
        if force:
            raise PrepareFailed("prepare", f"{where}: nothing can be prepared again there")
        earlier = store.manifest(key)
        if earlier is None:
            raise PrepareFailed("prepare", f"{where} and holds no prepared export of this "
                                "snapshot: run `bgeserve prepare` with it writable first "
                                "(docs/prepare.md)")
        damaged = store.damage(key, earlier)
        if damaged is not None:
            raise PrepareFailed("prepare", f"the prepared export {store.path(key)} is damaged "
                                f"({damaged}) and {where}: run `bgeserve prepare --force` "
                                f"with it writable, or delete {store.path(key)}")
        lacking = [v for v in wanted if not prepare_plan.covers(earlier, [v])]
        self.status = {"status": "cached", "key": key, "read_only": True}
        log.info("prepared export found: %s (variants %s; read-only cache%s)", store.path(key),
                 ", ".join(sorted(earlier["variants"])),
                 f": {', '.join(lacking)} cannot be added" if lacking else "")
        return store.path(key), earlier.get("prepared", {})

    def _fallback(self, status: str, reason: str, error: BaseException | None = None) -> None:
        if self._stopping:  # stop() ended the child: the server is going, nothing failed
            self.status = {"status": "stopped", "reason": "the server is shutting down"}
            log.info("preparation stopped: the server is shutting down")
            return
        self.status = {"status": status, "reason": reason}
        log.warning("not serving a prepared graph: %s. Serving the snapshot as it is (stock "
                    "graph: plain attention, exact fp32); BGE_M3_PREPARE=0 skips this step",
                    reason, exc_info=error is not None and not isinstance(
                        error, (PrepareFailed, ModelUnavailable)))


WAITING_STEP = "waiting for another bgeserve preparing this model"


def _killed_at(export: Path) -> dict[str, int]:
    """Variants whose step was killed in an earlier preparation of ``export``, with the bytes
    available then ({} when none was, or the record cannot be read)."""
    try:
        record = json.loads((export / prepare_plan.KILLED_FILE).read_text())
        return {str(v): int(at) for v, at in record.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _record_killed(export: Path, killed_at: dict[str, int]) -> None:
    if killed_at:
        (export / prepare_plan.KILLED_FILE).write_text(json.dumps(killed_at) + "\n")


def _earlier(store: PreparedStore, key: str) -> dict[str, Any] | None:
    """The manifest of ``key``'s export when its files are whole; None (so it is prepared
    again) when there is none, or one of its files is missing or of the wrong size."""
    earlier = store.manifest(key)
    damaged = store.damage(key, earlier) if earlier is not None else None
    if damaged is not None:
        log.warning("the prepared export %s is damaged (%s): preparing it again",
                    store.path(key), damaged)
        return None
    return earlier


def prepare_command(s: Settings, cache_dir: Path, variants: list[str] | None, *,
                    force: bool, out: Path | None, progress: Progress) -> Path:
    """``bgeserve prepare``: the prepared export of the configured snapshot (made now if
    needed); with ``out``, copied there as a standalone export. Raises on failure."""
    started = time.monotonic()
    if s.model_path is not None and export_variants(s.model_path):
        raise ModelUnavailable(f"{s.model_path} is a `bgeserve export` already",
                               param="BGE_M3_MODEL_PATH")
    art = resolve(model_path=s.model_path, variant="fp32", cache_dir=cache_dir,
                  offline=s.offline, progress=progress.bars, report=progress.transfer)
    prep = Preparation(progress)
    try:
        path, _ = prep.find_or_make(s, cache_dir, PrepareSource.from_artifacts(art),
                                    variants or prepare_plan.wanted(s), force=force)
    except Skip as exc:
        raise PrepareFailed("prepare", str(exc)) from None
    progress.done()
    if out is not None:
        shutil.copytree(path, out, dirs_exist_ok=True)
        path = out
    log.info("prepared export ready in %.0fs: %s", time.monotonic() - started, path)
    return path

