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
import shutil
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
# Peak memory of each step against the fp32 weights' size W (measured, full-size bge-m3,
# W = 2.27 GB; docs/benchmarks.md): int8 holds the weights twice while quantizing, the
# OpenVINO conversion about twice, validation one session at a time; NNCF's ov-int8 peaked at
# 7,068 MiB (the model, its statistics-collecting copies and the int8 IR being written).
PEAK = {"int8": (3.0, 1 * GiB), "bf16": (2.5, 1 * GiB), "ov-int8": (3.0, 1 * GiB),
        "fp32": (1.5, 1 * GiB)}


# Disk each variant takes against W (full-size: fp32 a copy of the weights, int8 1.37 GB,
# the bf16 IR 1.14 GB, the ov-int8 IR 0.58 GB for W = 2.27 GB).
DISK = {"fp32": 1.02, "int8": 0.62, "bf16": 0.52, "ov-int8": 0.26}


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
                "another bgeserve is preparing %s: waiting for it", source.description)):
            # An earlier preparation of this key (unless forced): served as it is when it
            # covers what is wanted, else what it has is linked, not made again (prepare.py
            # checks it is whole), so only the others are weighed against memory and disk
            # (fp32 always: its graphs are rewritten again to make the others from).
            earlier = None if force else store.manifest(key)
            have = set(earlier["variants"]) - {"fp32"} if earlier is not None else set()
            new = [v for v in wanted if v not in have]
            weights = source.weight_bytes
            available = memory.detect_available_memory(s.available_memory_bytes).available_bytes
            if earlier is not None:
                refit = _refit(earlier, new, lambda: _limits(weights, available, store.root,
                                                             new))
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
                raise _Skip(f"preparing needs ~{need / GiB:.1f} GiB and {available / GiB:.1f} "
                            "GiB are available: serving the snapshot's own graph (plain "
                            "attention)")
            reuse = store.path(key) if earlier is not None else None
            skip = _limits(weights, available, store.root, new)
            log.info("preparing %s (variants %s%s%s) into %s", source.description,
                     ", ".join(new), f"; skipping {skip}" if skip else "",
                     f"; {', '.join(sorted(have))} kept from {reuse}" if have else "",
                     store.path(key))
            staged = store.staging(key)
            try:
                outcome = run_recipe(source, staged, wanted, skip=skip, hashes=digests,
                                     weights=encoding, progress=self.progress, reuse=reuse)
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
            final = store.commit(key, staged)
        skipped = outcome.get("skipped") or {}
        self.status = {"status": "prepared", "key": key, "seconds": outcome.get("seconds"),
                       **({"skipped": skipped} if skipped else {})}
        log.info("prepared %s in %.0fs: %s", source.description, outcome.get("seconds", 0),
                 ", ".join(outcome.get("variants", [])), extra={
                     "skipped": skipped or None, "steps": outcome.get("steps"),
                     "reused": outcome.get("reused") or None})
        return final, {"skipped": skipped}

    def _fallback(self, status: str, reason: str, error: BaseException | None = None) -> None:
        self.status = {"status": status, "reason": reason}
        log.warning("not serving a prepared graph: %s. Serving the snapshot as it is (stock "
                    "graph: plain attention, exact fp32); BGE_M3_PREPARE=0 skips this step",
                    reason, exc_info=error is not None and not isinstance(
                        error, (PrepareFailed, ModelUnavailable)))


def _limits(weights: int, available: int, root: Path, variants: list[str]) -> dict[str, str]:
    """The variants of ``variants`` (never fp32) this machine has no room to make now, with
    why: memory for their step, then disk for their files. _Skip when not even fp32 fits."""
    skip = {v: f"needs ~{peak_bytes(v, weights) / GiB:.1f} GiB, "
               f"{available / GiB:.1f} GiB available"
            for v in variants if v != "fp32" and available < peak_bytes(v, weights)}
    skip.update(_disk_skips(root, weights, [v for v in variants if v not in skip]))
    return skip


def _disk_skips(root: Path, weights: int, wanted: list[str]) -> dict[str, str]:
    """Variants left out because the cache's file system cannot hold them (ov-int8, bf16, then
    int8); _Skip when not even fp32 fits."""
    free = shutil.disk_usage(root).free
    need = {v: int(DISK[v] * weights) for v in wanted}
    if free < need["fp32"]:
        raise _Skip(f"the prepared graphs need ~{need['fp32'] / GiB:.1f} GiB on "
                    f"BGE_M3_CACHE_DIR ({root}), {free / GiB:.1f} GiB are free")
    skips: dict[str, str] = {}
    for variant in ("ov-int8", "bf16", "int8"):
        if variant in need and sum(need.values()) > free:
            skips[variant] = (f"needs ~{need.pop(variant) / GiB:.1f} GiB of disk in "
                              f"BGE_M3_CACHE_DIR, {free / GiB:.1f} GiB free")
    return skips


def run_recipe(source: PrepareSource, out: Path, wanted: list[str], *, skip: dict[str, str],
               hashes: dict[str, str], weights: str, progress: Progress,
               reuse: Path | None = None) -> dict[str, Any]:
    """Make the export in ``out`` with ``python -m bgeserve.export.prepare`` (a child: the
    build tools never load into the server), relaying its steps and lines to ``progress``;
    ``reuse``: an earlier export of the same key whose variants are linked, not made again.
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
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          errors="replace") as child:
        assert child.stdout is not None and child.stderr is not None
        errors = child.stderr

        def keep_tail() -> None:  # the child's own stderr: only its last lines, for the error
            tail.extend(line.rstrip() for line in errors)

        drain = threading.Thread(target=keep_tail, daemon=True)
        drain.start()
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

