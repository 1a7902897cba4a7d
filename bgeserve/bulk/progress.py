"""Progress of a bulk job: a tqdm bar (rows/s, tokens/s) on a terminal, log lines otherwise,
and the summary at the end."""

from __future__ import annotations

import logging
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

log = logging.getLogger("bgeserve.bulk")
LOG_EVERY_S = 10.0


@dataclass
class Summary:
    """What a run did (``rows``: embedded and written by this run)."""

    rows: int = 0
    tokens: int = 0
    bad: int = 0
    shards: int = 0
    skipped: int = 0  # rows finished shards held before this run
    skipped_bad: int = 0  # of those, bad rows an earlier run skipped (not embedded)
    duplicate_ids: int = 0  # rows written whose id was written before (see bulk.dupes)
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    bad_examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(rows_per_s=round(self.rows_per_s, 2), tokens_per_s=round(self.tokens_per_s, 1),
                   seconds=round(self.seconds, 2))
        return out


def _duration(seconds: float) -> str:
    """``2h 05m``, ``4m 10s``, ``12s``."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Progress:
    """Counts rows, tokens and bad rows as shards finish; shows them as it goes, and every
    ``every_s`` while a shard runs (``tick``)."""

    def __init__(self, total: int | None, skipped: int = 0, stream: TextIO | None = None,
                 bar: bool | None = None, every_s: float = LOG_EVERY_S):
        self.summary = Summary(skipped=skipped)
        self.total = total  # rows this run reads (bad ones included), where known
        self.every_s = every_s
        self._started = time.monotonic()
        self._logged = self._started
        stream = stream or sys.stderr
        self._bar = None
        if bar if bar is not None else stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="rows", file=stream, dynamic_ncols=True,
                             smoothing=0.1)

    def add(self, rows: int, tokens: int, bad: int, shards: int = 1) -> None:
        s = self.summary
        s.rows += rows
        s.tokens += tokens
        s.bad += bad
        s.shards += shards
        now = time.monotonic()
        s.seconds = now - self._started
        if self._bar is not None:
            self._bar.update(rows + bad)
            self._bar.set_postfix_str(f"{s.tokens_per_s:,.0f} tokens/s, {s.bad} bad",
                                      refresh=False)
        else:
            self._log(now)

    def tick(self, in_flight: int, tokens: int = 0) -> None:
        """Show progress while a shard is still running: ``in_flight`` of its rows (``tokens``
        tokens) are done (a shard of long texts takes minutes; nothing else would be shown
        meanwhile)."""
        now = time.monotonic()
        self.summary.seconds = now - self._started
        if self._bar is not None:
            self._bar.set_postfix_str(f"{in_flight} rows of the next shard done", refresh=True)
        else:
            self._log(now, in_flight, tokens)

    def _log(self, now: float, in_flight: int = 0, in_flight_tokens: int = 0) -> None:
        if now - self._logged < self.every_s:
            return
        self._logged = now
        s = self.summary
        rows = s.rows + in_flight
        rate = rows / s.seconds if s.seconds else 0.0
        tokens_rate = (s.tokens + in_flight_tokens) / s.seconds if s.seconds else 0.0
        extra: dict[str, Any] = {"rows": rows, "rows_per_s": round(rate, 2),
                                 "tokens_per_s": round(tokens_rate, 1), "bad": s.bad}
        count, to_go = f"{rows} rows", ""
        if self.total:  # how far, and how long to go at the pace so far (QA: neither shown)
            done = rows + s.bad
            eta = (self.total - done) * s.seconds / done if done else None
            extra.update(total=self.total, eta_s=None if eta is None else round(eta))
            count = f"{done} of {self.total} rows, {100 * done / self.total:.1f}% done"
            to_go = "" if eta is None else f", about {_duration(eta)} to go"
        log.info("bulk: %s (%d in the shard being written), %.1f rows/s, %.0f tokens/s, %d bad, "
                 "%d shards%s", count, in_flight, rate, tokens_rate, s.bad, s.shards, to_go,
                 extra=extra)

    def close(self) -> Summary:
        """Stop the clock; the summary is logged and returned."""
        s = self.summary
        s.seconds = time.monotonic() - self._started
        s.peak_rss_bytes = max(s.peak_rss_bytes, peak_rss_bytes())
        if self._bar is not None:
            self._bar.close()
        earlier = f" ({s.skipped_bad} of them bad, skipped then)" if s.skipped_bad else ""
        log.info("bulk done: %d rows embedded in %d shards (%.1f rows/s, %.0f tokens/s), %d "
                 "bad rows skipped, %d rows already done%s, %d repeated ids, peak RSS %d MiB",
                 s.rows, s.shards, s.rows_per_s, s.tokens_per_s, s.bad, s.skipped, earlier,
                 s.duplicate_ids, s.peak_rss_bytes >> 20,
                 extra={"summary": s.as_dict()})
        return s
