"""The probe in a process of its own: started, relayed, killed on request, its death a failed
probe rather than the server's.

The child is ``bgeserve.service.probe_child`` (it opens the model the way the service does);
this side only speaks to it through argv (a JSON spec) and stdout (one JSON line, the last).
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from bgeserve.tuning.probe import ProbeRequest, ProbeResult

log = logging.getLogger("bgeserve.tuning")
CHILD_MODULE = "bgeserve.service.probe_child"


class ChildDied(Exception):
    """The child process ended without an answer; the message says how."""


class ChildStopped(ChildDied):
    """The child ended on a signal that asks a process to stop (``STOP_SIGNALS``), not one
    that kills it: systemd's default KillMode, ``timeout`` and supervisord's ``stopasgroup``
    send SIGTERM to the server's whole process group, its children included, before the server
    itself has said it is stopping. A stop, not a fault of the model or of its memory."""


# The kernel's OOM killer sends SIGKILL; these come from someone stopping the process (a
# service manager, mostly; a user-space OOM daemon such as earlyoom sends SIGTERM first, and
# such a stop is then not remembered either: the next start measures again).
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def run_json(spec: dict[str, Any], stop: threading.Event) -> dict[str, Any]:
    """Run ``bgeserve.service.probe_child`` with ``spec``; its answer (the last stdout line).

    Its stderr is relayed to the log line by line. ``stop`` set kills it.

    Raises:
        ChildDied: it was killed (by a signal: the OOM killer, say, or ``stop``) or failed.
    """
    # The context closes both pipes (left open, each call leaked two files).
    with subprocess.Popen([sys.executable, "-m", CHILD_MODULE, json.dumps(spec)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:

        def relay() -> None:
            assert proc.stderr is not None  # Popen(stderr=PIPE)
            for line in proc.stderr:
                log.info("%s", line.rstrip())

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        while proc.poll() is None:
            if stop.wait(0.5):
                proc.kill()
        out = proc.stdout.read() if proc.stdout else ""
        reader.join(1.0)
    if proc.returncode != 0:
        if -proc.returncode in STOP_SIGNALS:
            raise ChildStopped(f"on {signal.Signals(-proc.returncode).name}, asked to stop")
        reason = ("when asked to stop" if stop.is_set() else
                  f"by signal {-proc.returncode} (out of memory?)" if proc.returncode < 0
                  else f"with exit code {proc.returncode}")
        raise ChildDied(reason)
    lines = out.strip().splitlines()
    if not lines:
        raise ChildDied("without an answer")
    answer = json.loads(lines[-1])
    if not isinstance(answer, dict):
        raise ChildDied(f"with an answer that is not an object: {lines[-1][:200]}")
    return answer


def run_child(spec: dict[str, Any], stop: threading.Event) -> ProbeResult:
    """The probe child's result for ``spec``; its death is a failed probe, not ours."""
    try:
        return ProbeResult.from_json(run_json(spec, stop))
    except ChildStopped as exc:
        return ProbeResult.failed(f"the probe process ended {exc}", stopped=True)
    except ChildDied as exc:
        return ProbeResult.failed(f"the probe process ended {exc}", process_died=True)


@dataclass(frozen=True)
class ChildProbe:
    """A ``ProbeSource`` that loads its own copy of the model in a child process (``spec``:
    the model, variant, provider, threads and cache dir, as ``probe_child`` reads them)."""

    spec: dict[str, Any] = field(default_factory=dict)

    def measure(self, request: ProbeRequest, stop: threading.Event) -> ProbeResult:
        guard = request.guard
        return run_child({**self.spec, "shapes": request.shapes, "held_out": request.held_out,
                          "guard_a": guard.a, "guard_b": guard.b, "guard_c": guard.c,
                          "guard_budget": guard.max_workspace_bytes,
                          "chunk_candidates": list(request.chunk_candidates),
                          "cumulative": request.cumulative}, stop)
