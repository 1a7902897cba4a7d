"""Progress of the long start-up steps (downloads, ``prepare``), where people look for it.

One ``Progress`` per start-up. Each step and transfer is logged (JSON lines when the log is
JSON: step names, bytes done / total, at most every ``period`` seconds per transfer, and at its
end); on a terminal a tqdm bar shows the steps as well (huggingface_hub draws its own download
bars there). ``snapshot()`` is what ``/health`` shows while loading: the current step and its
progress in [0, 1].
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

__all__ = ["Progress"]

log = logging.getLogger("bgeserve.progress")


def on_terminal() -> bool:
    """Whether stderr is a terminal (bars drawn); False where it is closed (``2>&-``: Python's
    ``sys.stderr`` is then None, and the start died on it, exit 1 with no word)."""
    return sys.stderr is not None and sys.stderr.isatty()


class Progress:
    """Thread-safe record of the current start-up step, logged as it moves."""

    def __init__(self, *, bars: bool = False, period: float = 10.0,
                 logger: logging.Logger = log):
        self.bars = bars  # tqdm bars on a terminal (the caller knows whether it is one)
        self.period = period
        self._log = logger
        self._lock = threading.Lock()
        self._step: str | None = None
        self._fraction = 0.0
        self._detail: dict[str, Any] = {}
        self._logged: dict[str, float] = {}
        self._bar: Any = None

    def step(self, name: str, index: int | None = None, total: int | None = None) -> None:
        """Enter step ``name`` (``index`` of ``total`` steps, 1-based, when they are counted)."""
        with self._lock:
            self._step = name
            self._fraction = (index - 1) / total if index and total else 0.0
            self._detail = {"index": index, "of": total} if index and total else {}
        counted = f" ({index}/{total})" if index and total else ""
        self._log.info("start-up step: %s%s", name, counted,
                       extra={"step": name, "step_index": index, "steps": total})
        if self.bars and index and total:
            self._draw(name, index, total)

    def transfer(self, name: str, done: int, total: int | None) -> None:
        """Bytes ``done`` of ``total`` (None: unknown) of ``name`` (a file being downloaded)."""
        now = time.monotonic()
        finished = total is not None and done >= total
        with self._lock:
            # A transfer is the download step (only files that are not cached report one).
            entering = self._step != "download"
            if entering:
                self._step = "download"
            if total:
                self._fraction = min(1.0, done / total)
            self._detail = {"file": name, "bytes_done": done, "bytes_total": total}
            # The first report is due whatever the clock reads (monotonic time starts near 0
            # at boot: under an hour after it, a period of 3600 s logged nothing).
            last = self._logged.get(name)
            due = last is None or now - last >= self.period or finished
            if due:
                self._logged[name] = now
        if entering:
            self._log.info("start-up step: download", extra={"step": "download"})
        if due:
            pct = f" ({100 * done / total:.0f}%)" if total else ""
            self._log.info("download %s: %d of %s MiB%s", name, done >> 20,
                           total >> 20 if total is not None else "?", pct,
                           extra={"file": name, "bytes_done": done, "bytes_total": total})

    def note(self, text: str) -> None:
        """A line of detail inside the current step (a child process's own progress line)."""
        with self._lock:
            step = self._step
        self._log.info("%s: %s", step or "start-up", text, extra={"step": step})

    def done(self) -> None:
        """The steps are over: /health stops showing them."""
        with self._lock:
            self._step = None
            self._detail = {}
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def snapshot(self) -> dict[str, Any]:
        """{"step": name, "progress": fraction, **detail} while a step runs, else {}."""
        with self._lock:
            if self._step is None:
                return {}
            return {"step": self._step, "progress": round(self._fraction, 3),
                    **{k: v for k, v in self._detail.items() if v is not None}}

    def _draw(self, name: str, index: int, total: int) -> None:
        try:
            from tqdm import tqdm  # huggingface_hub's dependency: always there with it
        except ImportError:  # pragma: no cover - a bare environment: the log lines suffice
            return
        if self._bar is None or self._bar.total != total:
            if self._bar is not None:
                self._bar.close()
            self._bar = tqdm(total=total, unit="step", leave=True)
        self._bar.set_description(name)
        self._bar.n = index - 1
        self._bar.refresh()
