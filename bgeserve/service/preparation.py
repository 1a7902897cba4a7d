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
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bgeserve.config import Settings
from bgeserve.errors import ModelUnavailable
from bgeserve.model.artifacts import export_variants, resolve
from bgeserve.model.prepared import (
    HEADS_FILE,
    PreparedStore,
    PrepareSource,
    file_digests,
    int8_weights,
    source_key,
    sums_int8_in_int32,
    write_heads,
)
from bgeserve.progress import Progress
from bgeserve.runtime import openvino
from bgeserve.service import plan
from bgeserve.tuning import memory

log = logging.getLogger("bgeserve.prepare")

GiB = 1 << 30
MiB = 1 << 20
# How long a prepare child has to end after SIGTERM (its step's own cleanup) before SIGKILL.
STOP_GRACE_SECS = 3.0
# Peak memory of each step against the fp32 weights' size W (measured, full-size bge-m3,
# W = 2.27 GB; docs/benchmarks.md): int8 holds the weights twice while quantizing, the
# OpenVINO conversion about twice, validation one session at a time; NNCF's ov-int8 peaked at
# 7,068 MiB (the model, its statistics-collecting copies and the int8 IR being written).
PEAK = {"int8": (3.0, 1 * GiB), "bf16": (2.5, 1 * GiB), "ov-int8": (3.0, 1 * GiB),
        "fp32": (1.5, 1 * GiB)}


# Disk each variant takes against W (full-size: fp32 a copy of the weights, int8 1.37 GB,
# the bf16 IR 1.14 GB, the ov-int8 IR 0.58 GB for W = 2.27 GB).
DISK = {"fp32": 1.02, "int8": 0.62, "bf16": 0.52, "ov-int8": 0.26}
# Disk a step needs for a while besides what it leaves: int8's writes the smoothed fp32 graph
# (a copy of the weights) and the quantized graph into a temporary directory beside its output
# before saving that in place (export/steps.py export_int8). The tiny model's preparation
# peaked at 4.2 W for 2.1 W left, as these predict (int8 there is ~W: its embeddings stay fp32).
SCRATCH = {"int8": 1.0 + DISK["int8"]}


def size(n: float) -> str:
    """``n`` bytes in a unit that shows it: MiB below 1 GiB, else GiB."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def peak_bytes(step: str, weights: int) -> int:
    """The memory ``step`` is expected to need for fp32 weights of ``weights`` bytes."""
    factor, extra = PEAK[step]
    return int(factor * weights + extra)


class PrepareFailed(Exception):
    """The prepare child failed; ``step`` names the step, the message says why."""

    def __init__(self, step: str, message: str):
        super().__init__(message)
        self.step = step


class Preparation:
    """One start's prepare step: decides, finds or makes the export, says what happened."""

    def __init__(self, progress: Progress | None = None):
        self.progress = progress or Progress()
        self.status: dict[str, Any] = {"status": "not_run"}
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
        reason = _not_needed(s)
        if reason is not None:
            self.status = {"status": "disabled" if not s.prepare else "not_needed",
                           "reason": reason}
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
            prepared, outcome = self.find_or_make(s, cache_dir,
                                                  PrepareSource.from_artifacts(art), _wanted(s))
        except _Skip as exc:
            self._fallback("skipped", str(exc))
            return s
        except Exception as exc:  # noqa: BLE001 - any failure: serve the stock graph, say why
            self._fallback("failed", str(exc), error=exc)
            return s
        variants = export_variants(prepared)
        if not choose and s.variant not in variants:
            why = outcome.get("skipped", {}).get(s.variant) or (
                "it is made with OpenVINO and NNCF, which are not both installed"
                if s.variant == "ov-int8" and not _nncf() else "not made")
            self._fallback("skipped", f"BGE_M3_MODEL={s.variant} was not prepared ({why})")
            return s
        self.status.update(path=str(prepared), variants=sorted(variants))
        chosen = dataclasses.replace(s, model_path=prepared)
        if choose:  # the rule again, now over the prepared export's variants
            chosen = plan.resolve(dataclasses.replace(chosen, variant_choice=""))
        return chosen

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
        with store.lock(key, on_wait=lambda: log.info(
                "another bgeserve is preparing %s: waiting for it", source.description)) \
                as writable:
            if not writable:
                return self._read_only(store, key, wanted, force=force)
            # An earlier preparation of this key (unless forced): served as it is when it
            # covers what is wanted, else what it has is linked, not made again (prepare.py
            # checks it is whole), so only the others are weighed against memory and disk
            # (fp32 always: its graphs are rewritten again to make the others from).
            earlier = None if force else _earlier(store, key)
            have = set(earlier["variants"]) - {"fp32"} if earlier is not None else set()
            new = [v for v in wanted if v not in have]
            weights = source.weight_bytes
            available = memory.detect_available_memory(s.available_memory_bytes).available_bytes
            if earlier is not None:
                refit = _refit(earlier, new, lambda: _limits(
                    weights, available, store.root, new, copied=_copied(source, store.root)))
                if _covers(earlier, wanted) and not refit:
                    self.status = {"status": "cached", "key": key}
                    log.info("prepared export found: %s (variants %s)", store.path(key),
                             ", ".join(sorted(earlier["variants"])))
                    return store.path(key), earlier.get("prepared", {})
                if refit:
                    log.info("the prepared export %s left out %s for want of memory or disk; "
                             "there is room now: adding it", store.path(key), ", ".join(refit))
            need = peak_bytes("fp32", weights)
            if available < need:
                raise _Skip(f"preparing needs ~{size(need)} and {size(available)} are "
                            "available: serving the snapshot's own graph (plain "
                            "attention)")
            reuse = store.path(key) if earlier is not None else None
            skip = _limits(weights, available, store.root, new,
                           copied=_copied(source, store.root))
            log.info("preparing %s (variants %s%s%s) into %s", source.description,
                     ", ".join(new), f"; skipping {skip}" if skip else "",
                     f"; {', '.join(sorted(have))} kept from {reuse}" if have else "",
                     store.path(key))
            staged = store.staging(key)
            try:
                outcome = run_recipe(source, staged, wanted, skip=skip, hashes=digests,
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
        lacking = [v for v in wanted if not _covers(earlier, [v])]
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


def _limits(weights: int, available: int, root: Path, variants: list[str], *,
            copied: int = 0) -> dict[str, str]:
    """The variants of ``variants`` (never fp32) this machine has no room to make now, with
    why: memory for their step, then disk for their files (``_disk_skips``). _Skip when not
    even fp32 fits."""
    skip = {v: f"needs ~{size(peak_bytes(v, weights))}, {size(available)} available"
            for v in variants if v != "fp32" and available < peak_bytes(v, weights)}
    skip.update(_disk_skips(root, weights, [v for v in variants if v not in skip],
                            copied=copied))
    return skip


def _copied(source: PrepareSource, root: Path) -> int:
    """Bytes of the snapshot's weights the graphs step copies besides fp32's: its plain graph
    (the reference) hard-links them, which fails from another file system."""
    try:
        same = source.graph.resolve().stat().st_dev == root.stat().st_dev
    except OSError:
        same = False
    return 0 if same else source.weight_bytes


def _disk_skips(root: Path, weights: int, wanted: list[str], *,
                copied: int = 0) -> dict[str, str]:
    """Variants left out because the cache's file system cannot hold them while they are made
    (ov-int8, bf16, then int8): the files left (``DISK``), the weights ``copied`` for the plain
    graph and the largest step's scratch (``SCRATCH``). _Skip when not even fp32 fits."""
    free = shutil.disk_usage(root).free
    need = {v: int(DISK[v] * weights) for v in ("fp32", *wanted)}

    def peak() -> int:
        return copied + sum(need.values()) + max(int(SCRATCH.get(v, 0) * weights)
                                                 for v in need)

    if free < copied + need["fp32"]:
        raise _Skip(f"preparing needs ~{size(copied + need['fp32'])} on BGE_M3_CACHE_DIR "
                    f"({root}) for fp32 alone, {size(free)} are free")
    skips: dict[str, str] = {}
    for variant in ("ov-int8", "bf16", "int8"):
        if variant in need and peak() > free:
            skips[variant] = (f"needs ~{size(peak())} of disk in BGE_M3_CACHE_DIR with the "
                              f"others while it is made, {size(free)} free")
            need.pop(variant)
    return skips


def run_recipe(source: PrepareSource, out: Path, wanted: list[str], *, skip: dict[str, str],
               hashes: dict[str, str], weights: str, progress: Progress,
               reuse: Path | None = None,
               on_start: Callable[[subprocess.Popen[str]], None] | None = None,
               ) -> dict[str, Any]:
    """Make the export in ``out`` with ``python -m bgeserve.export.prepare`` (a child: the
    build tools never load into the server), relaying its steps and lines to ``progress``;
    ``reuse``: an earlier export of the same key whose variants are linked, not made again;
    ``on_start`` gets the child (``Preparation.stop`` ends it and its step).
    Returns its outcome (variants, skipped, seconds, steps, reused). Raises PrepareFailed."""
    inputs = out / ".inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    write_heads(source.heads, inputs / HEADS_FILE)
    (inputs / "hashes.json").write_text(json.dumps(hashes))
    argv = [sys.executable, "-m", "bgeserve.export.prepare", "--graph", str(source.graph),
            "--layout", source.layout.value, "--tokenizer", str(source.tokenizer),
            "--heads", str(inputs / HEADS_FILE), "--hashes", str(inputs / "hashes.json"),
            "--description", source.description, "--out", str(out),
            "--weights", weights]
    argv += [x for p in source.external_data for x in ("--external-data", str(p))]
    argv += ["--config", str(source.config)] if source.config is not None else []
    argv += ["--reuse", str(reuse)] if reuse is not None else []
    argv += [x for v in wanted for x in ("--variant", v)]
    argv += [x for v, why in skip.items() for x in ("--skip", f"{v}={why}")]
    tail: deque[str] = deque(maxlen=8)
    outcome: dict[str, Any] | None = None
    failed: dict[str, Any] | None = None
    # A process group of its own, with its step children: ``end_group`` reaches them all.
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          errors="replace", start_new_session=True) as child:
        assert child.stdout is not None and child.stderr is not None
        errors = child.stderr

        def keep_tail() -> None:  # the child's own stderr: only its last lines, for the error
            tail.extend(line.rstrip() for line in errors)

        drain = threading.Thread(target=keep_tail, daemon=True)
        drain.start()
        if on_start is not None:
            on_start(child)
        try:
            for line in child.stdout:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a stray print: not a progress event
                kind = event.get("event")
                if kind == "step":
                    progress.step(f"prepare: {event['name']}", event["index"], event["of"])
                elif kind == "line":
                    progress.note(event["text"])
                elif kind == "done":
                    outcome = event["outcome"]
                elif kind == "failed":
                    failed = event
        except BaseException:
            # Ctrl-C in `bgeserve prepare`: the terminal's SIGINT no longer reaches the child
            # in its own session, so it is ended here.
            end_group(child, STOP_GRACE_SECS)
            raise
        drain.join(5)
    shutil.rmtree(inputs, ignore_errors=True)
    if failed is not None:
        raise PrepareFailed(failed.get("step", "prepare"), failed.get("message", ""))
    if child.returncode != 0 or outcome is None:
        reason = ("killed (SIGKILL: most likely out of memory)" if child.returncode in (-9, 137)
                  else f"exit code {child.returncode}")
        raise PrepareFailed("prepare", f"the prepare process ended: {reason}"
                            + (f": {' | '.join(tail)}" if tail else ""))
    return outcome


def end_group(child: subprocess.Popen[str], grace: float) -> None:
    """SIGTERM to ``child``'s process group (it and the step it runs), then SIGKILL to what is
    left of it after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except (ProcessLookupError, PermissionError):
            return  # the group is gone already
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            pass


class _Skip(Exception):
    """Preparing is not attempted (the reason is the message)."""


def _not_needed(s: Settings) -> str | None:
    """Why this start serves without preparing, or None if it prepares."""
    if not s.prepare:
        return "BGE_M3_PREPARE=0"
    if s.execution_provider not in ("cpu", "openvino"):
        return f"BGE_M3_EP={s.execution_provider} serves the hub's fp16 graph"
    if s.variant == "fp16":
        return "BGE_M3_MODEL=fp16 is the hub's own graph"
    if s.model_path is not None and export_variants(s.model_path):
        return "BGE_M3_MODEL_PATH is a `bgeserve export` already"
    return None


def _wanted(s: Settings) -> list[str]:
    """fp32 and int8 always; bf16 where OpenVINO is installed and this CPU computes in bf16
    (or bf16 is asked for); ov-int8 where NNCF is installed too and this CPU sums int8
    products in int32 (VNNI, AMX-INT8: where OpenVINO's int8 is fast and its 8-bit weights
    compute right), or ov-int8 is asked for. Elsewhere it would cost minutes of quantizing
    for a graph that is slower than ONNX Runtime's int8 and under the bar (7-bit weights,
    dense cosine 0.9973 on full-size random bge-m3, docs/benchmarks.md)."""
    wanted = ["fp32", "int8"]
    # BGE_M3_EP=openvino asks for OpenVINO's variant: bf16, unless ov-int8 is the one named.
    asked = s.variant == "bf16" or (s.execution_provider == "openvino" and s.variant != "ov-int8")
    if openvino.available() and (asked or openvino.native_bf16()):
        wanted.append("bf16")
    if _nncf() and (s.variant == "ov-int8" or sums_int8_in_int32()):
        wanted.append("ov-int8")
    return wanted


def _nncf() -> bool:
    """Whether ov-int8 can be made here: OpenVINO and NNCF installed (looked up, not imported:
    the prepare child imports NNCF, the server never does)."""
    return openvino.available() and importlib.util.find_spec("nncf") is not None


def _refit(manifest: dict[str, Any], new: list[str],
           limits: Callable[[], dict[str, str]]) -> list[str]:
    """The variants of ``new`` (those ``manifest``'s export lacks) an earlier preparation left
    out for want of memory or disk (``prepared.limited``) that ``limits`` (this machine's
    limits for all of ``new``, as the preparation weighs them) finds room for now. A variant
    whose own step failed is not retried: that takes ``bgeserve prepare --force``."""
    limited = [v for v in new if v in ((manifest.get("prepared") or {}).get("limited") or [])]
    if not limited:
        return []
    try:
        still = limits()
    except _Skip:
        return []
    return [v for v in limited if v not in still]


def _covers(manifest: dict[str, Any], wanted: list[str]) -> bool:
    """Whether an export made every variant of ``wanted`` (or recorded why it could not)."""
    made = manifest.get("variants") or {}
    prepared = manifest.get("prepared") or {}
    skipped = prepared.get("skipped") or {}
    return all(v in made or v in skipped for v in wanted)


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
                                    variants or _wanted(s), force=force)
    except _Skip as exc:
        raise PrepareFailed("prepare", str(exc)) from None
    progress.done()
    if out is not None:
        shutil.copytree(path, out, dirs_exist_ok=True)
        path = out
    log.info("prepared export ready in %.0fs: %s", time.monotonic() - started, path)
    return path

