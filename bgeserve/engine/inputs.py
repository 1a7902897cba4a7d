"""The input shapes the engine accepts: a string, strings, token ids, or lists of token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from bgeserve.errors import InvalidInput

Inputs = str | Sequence[str] | Sequence[Sequence[int]]


def normalize_inputs(inputs: Inputs) -> tuple[list[str] | None, list[list[int]] | None]:
    """Split the accepted input shapes into (texts, None) or (None, token id lists)."""
    if isinstance(inputs, str):
        return [inputs], None
    items = list(inputs)
    if items and all(isinstance(x, str) for x in items):
        return cast(list[str], items), None
    if items and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in items):
        return None, [cast(list[int], items)]
    if items and all(not isinstance(x, (str, bytes)) and isinstance(x, Sequence | np.ndarray)
                     for x in items):
        return None, [list(cast(Sequence[int], x)) for x in items]
    if not items:
        return [], None
    raise InvalidInput("input must be a string, a list of strings, a list of token ids or a "
                       "list of lists of token ids", param="input")
