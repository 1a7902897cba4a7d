"""The probe's fit on disk: kept across restarts, valid only for the fingerprint it was saved
under (everything that changes memory use: model files, variant, runtime and its version,
threads, CPU, max_seq; see ``service.plan.probe_parts``)."""

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
from dataclasses import asdict
from pathlib import Path

from bgeserve.tuning.costmodel import Fit, Sample

logger = logging.getLogger("bgeserve.probe")

PROBE_SCHEMA = 2  # 2: the fit may carry a fixed per-run term c
CACHE_FILE = "probe-coefficients.json"  # in BGE_M3_CACHE_DIR


def fingerprint(parts: Mapping[str, str | int | float]) -> str:
    """A stable hex digest of ``parts`` and the probe schema: changes when any part changes."""
    payload = json.dumps(
        {"probe_schema": PROBE_SCHEMA, "parts": dict(parts)}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def _coefficient(value: object) -> float | None:
    """``value`` as a finite float, or None for anything else (bools and strings included)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _parse_record(text: str, fingerprint: str) -> Fit | str:
    """The fit stored in a cache file's text, or why it cannot be used."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        return f"is corrupt or truncated ({exc})"
    if not isinstance(data, dict):
        return "is not a JSON object"
    if data.get("schema") != PROBE_SCHEMA:
        return f"has probe schema {data.get('schema')!r}, expected {PROBE_SCHEMA}"
    if data.get("fingerprint") != fingerprint:
        return "was made for another model, runtime or configuration"
    a, b = _coefficient(data.get("a")), _coefficient(data.get("b"))
    if a is None or b is None or a < 0 or b < 0 or a + b == 0:
        return f"has unusable coefficients a={data.get('a')!r}, b={data.get('b')!r}"
    residual, held = _coefficient(data.get("max_rel_residual")), data.get("held_out_rel_error")
    if residual is None or (held is not None and _coefficient(held) is None):
        return "is missing its fit-quality fields"
    c = _coefficient(data.get("c", 0.0))
    if c is None or c < 0:
        return f"has an unusable fixed term c={data.get('c')!r}"
    return Fit(a, b, residual, _coefficient(held), c)


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
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            reason: Fit | str = f"cannot be read ({exc})"
        else:
            reason = _parse_record(text, fingerprint)
        if isinstance(reason, Fit):
            return reason
        logger.warning("probe cache %s %s; ignoring it and probing again", self.path, reason)
        return None

    def chunk_rates(self, fingerprint: str) -> dict[int, float]:
        """The chunk budgets' tokens/s saved with ``fingerprint``'s fit; {} if none."""
        try:
            record = json.loads(self.path.read_text())
            if record.get("fingerprint") != fingerprint:
                return {}
            rates = {int(k): float(v) for k, v in (record.get("chunk_rates") or {}).items()}
            return {k: v for k, v in rates.items() if k > 0 and math.isfinite(v) and v > 0}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def save(
        self, fingerprint: str, fit: Fit, parts: Mapping[str, object], samples: Sequence[Sample],
        chunk_rates: Mapping[int, float] | None = None,
    ) -> None:
        """Write the fit atomically (temp file, fsync, rename); a failure only logs a warning."""
        record = {
            "schema": PROBE_SCHEMA,
            "fingerprint": fingerprint,
            **asdict(fit),
            "fitted_at_unix": int(time.time()),
            "parts": dict(parts),
            "samples": [asdict(s) for s in samples],
            "chunk_rates": {str(k): v for k, v in (chunk_rates or {}).items()},
        }
        tmp: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(
                dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"
            )
            with os.fdopen(fd, "w") as f:
                json.dump(record, f, indent=2, default=str)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            tmp = None
        except (OSError, TypeError, ValueError) as exc:
            logger.warning(
                "cannot save probe cache %s (%s); the next start will probe again", self.path, exc
            )
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
