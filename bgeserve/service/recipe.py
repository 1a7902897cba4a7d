"""The prepare child: ``python -m bgeserve.export.prepare`` run, relayed and ended.

The build tools (the rewriter, ONNX Runtime's quantizer, NNCF) never load into the server: the
export is made in a child of its own process group, whose JSON events on stdout become
``Progress`` steps and lines, whose last lines of stderr explain an exit that sent no
``failed`` event (SIGKILL: most likely out of memory), and which ``end_group`` can end with
the step it runs when the server shuts down or ``bgeserve prepare`` is interrupted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bgeserve.model.prepared import HEADS_FILE, PrepareSource, write_heads
from bgeserve.progress import Progress

# How long a prepare child has to end after SIGTERM (its step's own cleanup) before SIGKILL.
STOP_GRACE_SECS = 3.0


class PrepareFailed(Exception):
    """The prepare child failed; ``step`` names the step, the message says why."""

    def __init__(self, step: str, message: str):
        super().__init__(message)
        self.step = step


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
