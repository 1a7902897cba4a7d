"""bgeserve's exception hierarchy.

Foreign exceptions (ONNX Runtime, tokenizers, huggingface_hub) are translated into these where
they enter the code base; the HTTP layer maps each class to a status in exactly one table.
No HTTP codes live here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping


class BgeServeError(Exception):
    """Base class: every error bgeserve raises on purpose.

    ``code`` is a stable machine-readable identifier (used in the JSON error envelope);
    ``param`` names the request field or setting at fault, when there is one.
    """

    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class ConfigError(BgeServeError):
    """A setting is missing, malformed or out of range (raised at start-up)."""

    code = "invalid_config"


class InvalidInput(BgeServeError):
    """The caller's input cannot be embedded as given."""

    code = "invalid_input"


class TooLarge(BgeServeError):
    """The input is valid but exceeds a size or memory limit."""

    code = "too_large"


class Overloaded(BgeServeError):
    """The queue is full; the caller should retry after ``retry_after`` seconds."""

    code = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kwargs: str | None):
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class DeadlineExceeded(BgeServeError):
    """The request did not finish before its deadline."""

    code = "timeout"


class NotReady(BgeServeError):
    """The engine is loading, shutting down, or has no live worker; ``retry_after`` seconds
    where retrying this server soon will do (loading), None where it will not."""

    code = "not_ready"

    def __init__(self, message: str, *, retry_after: float | None = None,
                 **kwargs: str | None):
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ModelUnavailable(BgeServeError):
    """The model files cannot be found, downloaded or opened."""

    code = "model_unavailable"


class EngineFailed(BgeServeError):
    """Inference failed for a reason that is not the caller's fault."""

    code = "engine_failed"


class OutOfMemory(EngineFailed):
    """The runtime failed to allocate memory for a chunk (the engine splits and retries)."""

    code = "out_of_memory"


# Half of a UTF-16 pair alone (JSON's "\ud800", Python's "\ud800"): a code point but no
# character; no UTF-8 encodes it, so tokenizers refuse it with a message naming neither the
# text nor the character.
_SURROGATE = re.compile("[\ud800-\udfff]")


def surrogate_error(value: object, name: str, code: str = "invalid_input"
                    ) -> InvalidInput | None:
    """The refusal of the first string in ``value`` (named ``name``; lists and objects walked,
    ``name[3]``, ``name.key``) that holds a lone surrogate; None when none does."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found is None:
            return None
        return InvalidInput(f"{name} holds a lone surrogate (U+{ord(found.group()):04X} at "
                            f"character {found.start()}), which is no Unicode character: send "
                            "valid text (in JSON, escape a character outside the BMP as a "
                            "high and low surrogate pair)", param=name, code=code)
    if isinstance(value, Mapping):
        for key, item in value.items():
            found_in = surrogate_error(item, f"{name}.{key}" if name else str(key), code)
            if found_in is not None:
                return found_in
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found_in = surrogate_error(item, f"{name}[{i}]", code)
            if found_in is not None:
                return found_in
    return None
