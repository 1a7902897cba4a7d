"""Where a probe runs: a ``ProbeSource``, or what the tuner's callers hand it instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bgeserve.tuning.child import ChildProbe
from bgeserve.tuning.probe import LocalProbe, ProbeSource

__all__ = ["Source", "as_source"]

Source = ProbeSource | Callable[[int, int], None] | dict[str, Any]


def as_source(source: Source) -> ProbeSource:
    """A ``ProbeSource``: a bare ``run(batch, seq)`` runs here (tests, tools), a dict is the
    spec of a probe child."""
    if isinstance(source, dict):
        return ChildProbe(source)
    if hasattr(source, "measure"):
        return source
    assert callable(source)
    return LocalProbe(source)
