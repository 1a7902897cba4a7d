"""The probe in a process of its own: started, relayed, killed on request, its death a failed
probe rather than the server's.

The child is ``bgeserve.service.probe_child`` (it opens the model the way the service does);
this side only speaks to it through argv (a JSON spec) and stdout (``ProbeResult.to_json``).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from typing import Any

from bgeserve.tuning.probe import ProbeResult

log = logging.getLogger("bgeserve.tuning")
CHILD_MODULE = "bgeserve.service.probe_child"


def run_child(spec: dict[str, Any], stop: threading.Event) -> ProbeResult:
    """Run ``bgeserve.service.probe_child`` with ``spec``; its death is a failed probe, not ours."""
    proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

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
        reason = (f"killed by signal {-proc.returncode} (out of memory?)"
                  if proc.returncode < 0 else f"exit code {proc.returncode}")
        return ProbeResult.failed(f"probe process {reason}")
    return ProbeResult.from_json(json.loads(out.strip().splitlines()[-1]))
