"""Each measurement in its own interpreter (``bench.py _child SPEC``): spawn, dispatch, collect.

A child per measurement keeps its peak RSS (VmHWM) its own and its imports (torch, OpenVINO)
out of the parent; a child that crashes or overruns becomes an error row, never a lost run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchkit.common import REPO, log, peak_rss

SCRIPT = REPO / "scripts" / "bench.py"


def _measure(mode: str, spec: dict[str, Any], corpus: dict[str, Any]) -> dict[str, Any]:
    """Run one mode's child function (imported here: a child loads only its own mode)."""
    if mode == "flag":
        from benchkit.flag import child_flag

        return child_flag(spec, corpus)
    if mode in ("raw", "raw1", "ort1"):
        from benchkit.raw import child_raw

        return child_raw(spec, corpus, batch1=mode != "raw")
    if mode in ("engine", "rss"):
        from benchkit.engine import child_engine, child_rss

        return (child_engine if mode == "engine" else child_rss)(spec, corpus)
    if mode in ("http", "serve", "load"):
        from benchkit.http import child_http, child_load

        return (child_load if mode == "load" else child_http)(spec, corpus)
    raise ValueError(mode)


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    corpus = json.loads(Path(spec["corpus"]).read_text())
    try:
        result = _measure(spec["mode"], spec, corpus)
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as an error row
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    result["peak_rss"] = peak_rss()
    Path(spec["result"]).write_text(json.dumps(result, default=str))
    return 0 if result["ok"] else 1


def _kill_group(proc: subprocess.Popen) -> None:
    """End what is left of a child's process group (the child itself included)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(10 if sig == signal.SIGTERM else 5)
        except subprocess.TimeoutExpired:
            continue
        # the child is gone; a leftover server may still be stopping: give it a moment
        time.sleep(0.5 if sig == signal.SIGTERM else 0)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break


class Runner:
    def __init__(self, args: argparse.Namespace, work: Path, export_dir: Path,
                 model_dir: Path | None, run_id: str):
        self.args = args
        self.work = work
        self.export_dir = export_dir
        self.model_dir = model_dir
        self.run_id = run_id
        self.run_dir = work / "runs" / run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def child(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Run one measurement in a fresh interpreter; never raises."""
        spec = {
            "work_dir": str(self.work), "export_dir": str(self.export_dir),
            "model_dir": str(self.model_dir) if self.model_dir else None,
            "threads": self.args.threads, "workers": self.args.workers, "ep": self.args.ep,
            "latency_pass": not self.args.no_latency_pass,
            "plain_graph": self.args.plain_graph,
            "http_clients": self.args.http_clients,
            "http_batch": self.args.http_batch, "http_budget": self.args.http_budget,
            "http_env": dict(kv.split("=", 1) for kv in self.args.http_env),
            "server_timeout": self.args.server_timeout, "request_timeout": 3600.0,
            "vectors": str(self.run_dir / f"{name}.npz"),
            "result": str(self.run_dir / f"{name}.result.json"), **spec,
        }
        spec_path = self.run_dir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = self.run_dir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(self.args.threads),
               "MKL_NUM_THREADS": str(self.args.threads), "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "TOKENIZERS_PARALLELISM": "true"}
        log(f"{name}: running (log {log_path})")
        started = time.perf_counter()
        with open(log_path, "wb") as out:
            # Its own session (process group): a killed or crashed child must not leave its
            # server behind, so the whole group is ended once the child is done.
            proc = subprocess.Popen([sys.executable, str(SCRIPT), "_child",
                                     str(spec_path)], stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd=str(REPO), start_new_session=True)
            try:
                rc: int | str = proc.wait(self.args.child_timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            finally:
                _kill_group(proc)
        elapsed = time.perf_counter() - started
        result_path = Path(spec["result"])
        if result_path.exists():
            result = json.loads(result_path.read_text())
        else:
            tail = log_path.read_bytes()[-800:].decode("utf-8", "replace")
            why = (f"killed after --child-timeout {self.args.child_timeout:g}s"
                   if rc == "timeout" else f"child exited with {rc} (killed? out of memory?)")
            result = {"ok": False, "error": f"{why}: {tail}"}
        result["child_seconds"] = elapsed
        result["vectors"] = spec["vectors"] if result.get("ok") else None
        if not result.get("ok"):
            log(f"{name}: FAILED: {result.get('error')}")
        return result

