"""bgeserve's cache directory (prepared graphs, probe fits, TensorRT engines): made and proved
writable before anything is written there or downloaded."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from bgeserve.errors import ModelUnavailable

__all__ = ["validate_cache_dir"]

log = logging.getLogger("bgeserve.model")


def validate_cache_dir(path: Path, *, required: bool = True) -> Path:
    """Create ``path`` if needed and prove it writable with a real write; else ModelUnavailable.

    ``required=False`` (a local model: nothing has to be downloaded) turns the refusal into a
    warning: the server runs, and only what it would cache there (the probe's fit) is lost.
    """
    path = Path(path).expanduser()
    if required:
        return _check_cache_dir(path)
    try:
        return _check_cache_dir(path)
    except ModelUnavailable as exc:
        log.warning("%s. Serving anyway: the model is local, but the probe's fit will not be "
                    "cached (every start probes again)", exc.message)
        return path


def _check_cache_dir(path: Path) -> Path:
    def refuse(cause: str) -> ModelUnavailable:
        return ModelUnavailable(
            f"cache directory {path} cannot be used: {cause}; set BGE_M3_CACHE_DIR to a writable "
            "directory",
            param="BGE_M3_CACHE_DIR",
        )

    blocker = next(
        (p for p in (*reversed(path.parents), path) if p.exists() and not p.is_dir()), None
    )
    if blocker is not None:
        raise refuse(f"{blocker} is a regular file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise refuse(f"cannot create it: {exc.strerror or exc} (is a parent read-only?)") from exc
    try:
        fd, probe = tempfile.mkstemp(prefix=".bgeserve-write-test-", dir=path)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise refuse(f"not writable ({exc.strerror or exc})") from exc
    return path
