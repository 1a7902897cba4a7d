"""The probe's outcome on disk: kept across restarts, valid only for the fingerprint it was saved
under (everything that changes memory use: model files, variant, runtime and its version,
threads, CPU, max_seq; see ``service.plan.probe_parts``).

The outcome is a fit, or a failure (``Failure``: why, and how many starts have tried), so a
start that would repeat a probe that already failed for the same fingerprint knows it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bgeserve.tuning.costmodel import Fit, Sample
from bgeserve.tuning.runcost import RunCost

logger = logging.getLogger("bgeserve.probe")

# 2: the fit may carry a fixed per-run term c. 3: the fit is raised to cover every measured
# shape, OpenVINO is measured cumulatively, failures are kept. 4: the record carries the run
# cost the packer pads by (a cache without it would keep a server off that rule until cleared).
# 5: the run cost carries what a new shape costs (engine/shapes.py).
PROBE_SCHEMA = 5
CACHE_FILE = "probe-coefficients.json"  # in BGE_M3_CACHE_DIR
# Records of other fingerprints (keys) kept beside the newest, each under its own name in a
# folder beside the file: one cache directory serving several models or variants by turns (a
# server and a `bgeserve bulk` job of another variant, `BGE_M3_MODEL` switched back and forth,
# replicas of other settings on one volume) re-measured at every switch when the file held one.
KEPT_RECORDS = 16


def kept_path(path: Path, key: str) -> Path | None:
    """Where the record of ``key`` is kept beside ``path`` (the newest record's file); None
    for a key that is no plain name in that folder (the fingerprints are hex digests)."""
    if not key or "/" in key or key.startswith("."):
        return None
    return path.with_name(f"{path.stem}.d") / f"{key}.json"


def _read_kept(path: Path, key: str) -> str | None:
    """The text of ``key``'s kept record, None where there is none (or it cannot be read)."""
    kept = kept_path(path, key)
    return _read_text(kept) if kept is not None else None


def fingerprint(parts: Mapping[str, object]) -> str:
    """A stable hex digest of ``parts`` and the probe schema: changes when any part changes."""
    payload = json.dumps(
        {"probe_schema": PROBE_SCHEMA, "parts": dict(parts)}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(payload.encode()).hexdigest()


PLAUSIBLE = float(1 << 40)  # bytes: no coefficient of a real fit comes near


def _coefficient(value: object) -> float | None:
    """``value`` as a finite float, or None for anything else (bools and strings included)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass(frozen=True)
class Failure:
    """A probe that gave no fit for this fingerprint: why, how many starts tried, when the last
    did, and whether its process died (killed for memory, say) rather than measured badly."""

    error: str
    attempts: int
    at_unix: int
    process_died: bool = False


def _parse_failure(data: dict) -> Failure | str:
    failed = data.get("failed")
    if not isinstance(failed, dict) or not isinstance(failed.get("error"), str):
        return "has an unreadable failure record"
    attempts, at = failed.get("attempts"), failed.get("at_unix")
    if not isinstance(attempts, int) or attempts < 1 or not isinstance(at, int):
        return "has an unreadable failure record"
    return Failure(failed["error"], attempts, at, bool(failed.get("process_died")))


def _parse_record(text: str, fingerprint: str) -> Fit | Failure | str:
    """The fit (or failure) stored in a cache file's text, or why it cannot be used."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # nested past the parser's depth: no record
        return f"is corrupt or truncated ({type(exc).__name__}: {exc})"
    if not isinstance(data, dict):
        return "is not a JSON object"
    if data.get("schema") != PROBE_SCHEMA:
        return f"has probe schema {data.get('schema')!r}, expected {PROBE_SCHEMA}"
    if data.get("fingerprint") != fingerprint:
        return "was made for another model, runtime or configuration"
    if "failed" in data:
        return _parse_failure(data)
    a, b = _coefficient(data.get("a")), _coefficient(data.get("b"))
    # A token costs at least a byte and less than a tebibyte: beyond either a hand-edited or
    # damaged record made every start fail (a=1e-300: an OverflowError; 1e300: a refusal
    # asking for 10^240 MiB), not a measurement.
    if a is None or b is None or a < 0 or b < 0 or max(a, b) < 1 or max(a, b) > PLAUSIBLE:
        return f"has unusable coefficients a={data.get('a')!r}, b={data.get('b')!r}"
    residual, held = _coefficient(data.get("max_rel_residual")), data.get("held_out_rel_error")
    if residual is None or (held is not None and _coefficient(held) is None):
        return "is missing its fit-quality fields"
    c = _coefficient(data.get("c", 0.0))
    if c is None or c < 0 or c > PLAUSIBLE:
        return f"has an unusable fixed term c={data.get('c')!r}"
    cover = data.get("cover", "")
    return Fit(a, b, residual, _coefficient(held), c, cover if isinstance(cover, str) else "")


class ProbeCache:
    """A fitted (a, b) on disk, valid only for the fingerprint it was saved under."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def at(cls, cache_dir: Path) -> ProbeCache:
        """The cache file in ``cache_dir`` (BGE_M3_CACHE_DIR)."""
        return cls(Path(cache_dir) / CACHE_FILE)

    def load(self, fingerprint: str) -> Fit | None:
        """The cached fit for ``fingerprint``, or None (with a logged reason if unusable)."""
        outcome = self.outcome(fingerprint)
        return outcome if isinstance(outcome, Fit) else None

    def outcome(self, fingerprint: str) -> Fit | Failure | None:
        """The cached fit or failure for ``fingerprint``; None (with a logged reason if the
        file is unusable) when there is neither."""
        reason: Fit | Failure | str | None
        try:
            reason = _parse_record(self.path.read_text(), fingerprint)
        except FileNotFoundError:
            reason = None
        except (OSError, UnicodeDecodeError) as exc:
            reason = f"cannot be read ({exc})"
        # The newest is another's, damaged, gone, or of another schema (an older replica on
        # the same volume): this fingerprint's own record, kept beside it.
        kept = _read_kept(self.path, fingerprint) if not isinstance(reason, Fit | Failure) \
            else None
        if kept is not None:
            reason = _parse_record(kept, fingerprint)
        if not isinstance(reason, str):
            return reason
        logger.warning("probe cache %s %s; ignoring it and probing again", self.path, reason)
        return None

    def covering(self, key: str, parts: Mapping[str, object]) -> str:
        """The key to read the probe's outcome for ``key`` (made of ``parts``) under: its own
        where it has a fit; else that of a fit made for a longer ``max_seq``, all its other
        parts alike (the shortest such); else its own.

        The probe measures shapes up to max_seq, so a fit made for a longer one has measured
        every shape a shorter one runs. Keyed on max_seq alone, a start refused at 8,192
        tokens with "longest that fits: 2,278" (the cached fit) probed again at 2,278, in what
        memory was left, and said "1,119" (QA): the advice moved as it was followed."""
        wanted = parts.get("max_seq")
        if type(wanted) is not int or fingerprint(parts) != key:
            return key
        others = json.loads(json.dumps({k: v for k, v in parts.items() if k != "max_seq"}))
        best: tuple[int, str] | None = None
        for text in self._texts():
            try:
                record = json.loads(text)
            except (ValueError, RecursionError):
                continue
            theirs = record.get("parts") if isinstance(record, dict) else None
            found = record.get("fingerprint") if isinstance(record, dict) else None
            if not isinstance(theirs, dict) or not isinstance(found, str):
                continue
            if not isinstance(_parse_record(text, found), Fit):
                continue
            if found == key:
                return key
            seq = theirs.get("max_seq")
            if (type(seq) is int and seq > wanted and (best is None or seq < best[0])
                    and {k: v for k, v in theirs.items() if k != "max_seq"} == others
                    and fingerprint(theirs) == found):
                best = (seq, found)
        if best is None:
            return key
        logger.info("probe cache: using the fit measured for max_seq %d, which covers %d",
                    best[0], wanted)
        return best[1]

    def _texts(self) -> list[str]:
        """The texts of the newest record and of those kept beside it."""
        folder = self.path.with_name(f"{self.path.stem}.d")
        try:
            kept = sorted(folder.glob("*.json"))
        except OSError:
            kept = []
        texts = (_read_text(path) for path in (self.path, *kept))
        return [text for text in texts if text is not None]

    def save_failure(self, fingerprint: str, error: str, parts: Mapping[str, object],
                     samples: Sequence[Sample], *, held_out: Sample | None = None,
                     process_died: bool = False) -> Failure:
        """Record that the probe gave no fit for ``fingerprint`` (one more attempt than the
        record there held); returns the record. A failure only logs, as ``save`` does."""
        previous = self.outcome(fingerprint)
        attempts = previous.attempts + 1 if isinstance(previous, Failure) else 1
        failure = Failure(error, attempts, int(time.time()), process_died)
        self._write({"schema": PROBE_SCHEMA, "fingerprint": fingerprint,
                     "failed": asdict(failure), "parts": dict(parts),
                     "samples": [asdict(s) for s in samples],
                     "held_out": asdict(held_out) if held_out else None})
        return failure

    def _saved(self, fingerprint: str) -> dict:
        """The record saved with ``fingerprint``'s fit; {} if none can be read."""
        for text in (_read_text(self.path), _read_kept(self.path, fingerprint)):
            try:
                record = json.loads(text or "")
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict) and record.get("fingerprint") == fingerprint:
                return record
        return {}

    def chunk_rates(self, fingerprint: str) -> dict[int, float]:
        """The chunk budgets' tokens/s saved with ``fingerprint``'s fit; {} if none."""
        try:
            saved = self._saved(fingerprint).get("chunk_rates") or {}
            rates = {int(k): float(v) for k, v in saved.items()}
            return {k: v for k, v in rates.items() if k > 0 and math.isfinite(v) and v > 0}
        except (ValueError, TypeError, AttributeError):
            return {}

    def short_budget(self, fingerprint: str) -> tuple[int, int] | None:
        """The probe's memory budget (bytes per worker) and the sessions it counted beside
        the workers (1: a probe process, 0: on the serving session) when the guard skipped
        shapes for that budget in the probe that made ``fingerprint``'s fit; None when it
        skipped none (or the record predates saying so)."""
        saved = self._saved(fingerprint)
        budget, skipped = saved.get("probe_budget_bytes"), saved.get("skipped_for_memory")
        extra = saved.get("probe_extra_sessions", 1)
        if (type(budget) is not int or type(skipped) is not int or skipped <= 0
                or extra not in (0, 1)):
            return None
        return budget, extra

    def run_cost(self, fingerprint: str) -> RunCost | None:
        """What a run costs, saved with ``fingerprint``'s fit; None if not saved (a probe that
        could not measure it) or damaged."""
        return RunCost.from_json(self._saved(fingerprint).get("run_cost"))

    def save(
        self, fingerprint: str, fit: Fit, parts: Mapping[str, object], samples: Sequence[Sample],
        chunk_rates: Mapping[int, float] | None = None, held_out: Sample | None = None,
        run_cost: RunCost | None = None, probe_budget: int | None = None,
        skipped_for_memory: int = 0, probe_extra_sessions: int = 1,
    ) -> None:
        """Write the fit atomically (temp file, fsync, rename); a failure only logs a warning.
        The measurements go with it (``samples``, ``held_out``): what an operator reads."""
        self._write({
            "schema": PROBE_SCHEMA,
            "fingerprint": fingerprint,
            **asdict(fit),
            "fitted_at_unix": int(time.time()),
            "parts": dict(parts),
            "samples": [asdict(s) for s in samples],
            "held_out": asdict(held_out) if held_out else None,
            "chunk_rates": {str(k): v for k, v in (chunk_rates or {}).items()},
            "run_cost": asdict(run_cost) if run_cost else None,
            # Shapes the guard skipped for this budget: the fit is extrapolated beyond them,
            # and a start with more memory measures them (``short_budget``).
            "probe_budget_bytes": probe_budget,
            "skipped_for_memory": skipped_for_memory,
            "probe_extra_sessions": probe_extra_sessions,
        })

    def _write(self, record: Mapping[str, object]) -> None:
        write_keyed(self.path, str(record["fingerprint"]), record)


def _read_text(path: Path) -> str | None:
    """``path``'s text; None where it cannot be read (missing, a folder, not UTF-8)."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def write_keyed(path: Path, key: str, record: Mapping[str, object]) -> None:
    """``record`` at ``path`` (the newest) and kept under ``key`` beside it, the oldest kept
    records beyond ``KEPT_RECORDS`` removed; a failure only logs, as ``write_atomic``'s."""
    if not write_atomic(path, record):  # the same failure would be said again for the copy
        return
    kept = kept_path(path, key)
    if kept is None:
        return
    folder = kept.parent
    write_atomic(kept, record)
    # Two processes pruning at once may remove a record the other just wrote (past 16 keys,
    # among the oldest): that key is measured again once.
    try:
        records = sorted(folder.glob("*.json"), key=lambda p: (p.stat().st_mtime_ns, p.name))
        for old in records[:-KEPT_RECORDS]:
            old.unlink(missing_ok=True)
    except OSError as exc:  # another process pruning at once, say: the next save prunes
        logger.debug("cannot prune %s (%s)", folder, exc)


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it, racing threads
    that create files meanwhile); 022 where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_atomic(path: Path, record: Mapping[str, object]) -> bool:
    """``record`` as JSON at ``path`` (temp file, fsync, rename); a failure only logs (and
    is False)."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        # mkstemp makes it 0600 whatever the umask: a cache written by one uid (an init job as
        # root) was unreadable to the server's, which measured again at every start.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        return True
    except (OSError, TypeError, ValueError) as exc:
        logger.warning("cannot save %s (%s); the next start will measure again", path, exc)
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


CHOICE_FILE = "variant-choice.json"  # in BGE_M3_CACHE_DIR, beside the fit


@dataclass(frozen=True)
class Choice:
    """A measured default variant: which one, on which provider, and every candidate's
    tokens/s (``rates``) or why it was not timed (``left_out``)."""

    variant: str
    provider: str
    rates: dict[str, float]
    left_out: dict[str, str]
    # Bytes each candidate left out for want of memory asked for: a start with that much free
    # measures again (a choice made in less memory kept its candidates out for good).
    needs: dict[str, int] = field(default_factory=dict)


class ChoiceCache:
    """The measured default variant on disk, valid only for the key it was saved under.

    The key (``fingerprint`` of ``service.choice.choice_parts``) holds what the timings
    depend on, every candidate's files and runtime included, but not the choice: a start
    computes it before knowing the variant, and finds the choice, then that variant's fit.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def at(cls, cache_dir: Path) -> ChoiceCache:
        return cls(Path(cache_dir) / CHOICE_FILE)

    def load(self, key: str) -> Choice | None:
        """The choice saved under ``key``; None (with a logged reason if unusable) if none."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            logger.warning("variant choice %s cannot be read (%s); measuring again", self.path,
                           exc)
            return None
        if isinstance(data, dict) and data.get("key") != key:  # another's: this key's own
            try:
                data = json.loads(_read_kept(self.path, key) or "null")
            except (ValueError, RecursionError):
                data = None
        if not isinstance(data, dict) or data.get("key") != key:
            return None
        variant, provider, rates = data.get("variant"), data.get("provider"), data.get("rates")
        left_out = data.get("left_out") or {}
        if not (isinstance(variant, str) and isinstance(provider, str)
                and isinstance(rates, dict) and isinstance(left_out, dict)):
            logger.warning("variant choice %s is malformed; measuring again", self.path)
            return None
        clean = {str(k): float(v) for k, v in rates.items()
                 if isinstance(v, int | float) and math.isfinite(v) and v > 0}
        if variant not in clean:
            logger.warning("variant choice %s names an untimed variant; measuring again",
                           self.path)
            return None
        needs = data.get("needs") or {}
        return Choice(variant, provider, clean, {str(k): str(v) for k, v in left_out.items()},
                      {str(k): int(v) for k, v in needs.items() if isinstance(v, int)}
                      if isinstance(needs, dict) else {})

    def save(self, key: str, choice: Choice, parts: Mapping[str, object]) -> None:
        write_keyed(self.path, key, {"key": key, **asdict(choice), "parts": dict(parts),
                                     "measured_at_unix": int(time.time())})
