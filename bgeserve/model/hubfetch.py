"""Pinned single-file downloads from the Hugging Face hub; every failure is ``ModelUnavailable``.

Works with huggingface_hub 0.24 to 2.x (pyproject asks for ``>=0.24``; the dev environment is held
below 1.0 by transformers, a serving-only install gets 2.x). Where the versions differ:

* Progress bars: 2.x takes a per-call ``tqdm_class``; older releases do not, so there the
  download's progress-bar groups are switched off for the duration of the call instead.
* Exception classes: 0.24 exports them only from ``huggingface_hub.utils`` (which every version
  still exports them from); ``EntryNotFoundError`` is the remote error before 1.0 and the common
  base of ``RemoteEntryNotFoundError`` / ``LocalEntryNotFoundError`` after.
* Transport errors escape from requests (< 1.0), httpx or httpx2 (>= 1.0).

Retries with backoff stay huggingface_hub's own, but a host that does not resolve fails at once
(``hubnet.resolves``). ``huggingface_hub`` is imported only when the model comes from the hub.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from bgeserve.errors import ModelUnavailable
from bgeserve.model.hubnet import resolves, watch_download

__all__ = ["Fetcher"]


@dataclass(frozen=True)
class Fetcher:
    """Downloads one pinned file into the Hugging Face cache, errors translated.

    ``cache_dir`` is the hub cache (None: huggingface_hub's own, which honours HF_HUB_CACHE and
    HF_HOME); ``legacy_cache`` is looked in too, read-only (bgeserve's cache directory, where
    earlier versions downloaded). A file already in either is used without any request.
    """

    cache_dir: Path | None
    offline: bool
    endpoint: str | None
    progress: bool
    legacy_cache: Path | None = None
    # Called with (file, bytes done, bytes total or None) while a file downloads.
    report: Callable[[str, int, int | None], None] | None = None
    # The setting that points at a local copy instead (the reranker has its own).
    path_variable: str = "BGE_M3_MODEL_PATH"

    def __call__(self, repo_id: str, revision: str, filename: str) -> Path:
        cached = self.cached(repo_id, revision, filename)
        if cached is not None:
            return cached
        from huggingface_hub import constants, hf_hub_download

        if not self.offline:
            self._check_network(repo_id, revision, filename)
        kwargs: dict[str, Any] = {}
        quiet: AbstractContextManager[None] = nullcontext()
        if not self.progress:
            if _takes_tqdm_class():
                kwargs["tqdm_class"] = _NoProgress
            else:
                quiet = _progress_bars_off()
        watch: AbstractContextManager[None] = nullcontext()
        if self.report is not None and not self.offline:
            blobs = Path(self.cache_dir or constants.HF_HUB_CACHE) / (
                "models--" + repo_id.replace("/", "--")) / "blobs"
            watch = watch_download(blobs, filename, lambda: self._size(repo_id, revision,
                                                                       filename), self.report)
        try:
            with quiet, watch:
                return Path(
                    hf_hub_download(
                        repo_id,
                        filename,
                        revision=revision,
                        cache_dir=self.cache_dir,
                        endpoint=self.endpoint,
                        local_files_only=self.offline,
                        **kwargs,
                    )
                )
        # Anything hf_hub_download raises (hub errors, transport errors, OSError from the disk)
        # means "not downloaded": explained below, with the cause chained.
        except Exception as exc:  # noqa: BLE001 - every failure is explained below
            error = exc
        raise ModelUnavailable(
            f"cannot get {filename} from {repo_id}@{revision} into the Hugging Face cache "
            f"{self._cache_name()}: {_explain(error, offline=self.offline)}. Set "
            f"{self.path_variable} to a local copy of the model, pre-fill the cache "
            "(HF_HUB_CACHE / HF_HOME), or allow downloads (HF_HUB_OFFLINE=0)"
        ) from error

    def cached(self, repo_id: str, revision: str, filename: str) -> Path | None:
        """The file from the hub cache (or the legacy one) at ``revision``, without a request."""
        from huggingface_hub import try_to_load_from_cache

        caches = [self.cache_dir]  # None: huggingface_hub's default cache
        if self.legacy_cache is not None and self.legacy_cache != self.cache_dir:
            caches.append(self.legacy_cache)
        for cache in caches:
            try:
                found = try_to_load_from_cache(repo_id, filename, cache_dir=cache,
                                               revision=revision)
            except (OSError, ValueError):
                found = None
            if isinstance(found, str):
                return Path(found)
        return None

    def _cache_name(self) -> str:
        if self.cache_dir is not None:
            return str(self.cache_dir)
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)

    def _check_network(self, repo_id: str, revision: str, filename: str) -> None:
        """Fail at once, not after huggingface_hub's retries, when the hub's host does not
        resolve."""
        from huggingface_hub import constants

        ok, host = resolves(self.endpoint or constants.ENDPOINT)
        if not ok:
            raise ModelUnavailable(
                f"cannot get {filename} from {repo_id}@{revision}: the hub's host {host} does "
                f"not resolve (no network?) and the file is not in the Hugging Face cache "
                f"{self._cache_name()}. Set {self.path_variable} to a local copy of the model, or "
                "fill the cache where there is a network and set HF_HUB_OFFLINE=1")

    def _size(self, repo_id: str, revision: str, filename: str) -> int | None:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(repo_id, filename, revision=revision, endpoint=self.endpoint)
        return get_hf_file_metadata(url).size


def _explain(exc: Exception, *, offline: bool) -> str:
    """Why ``hf_hub_download`` failed, in words, for any supported huggingface_hub version."""
    from huggingface_hub import utils as hub

    if isinstance(exc, hub.LocalEntryNotFoundError):  # a subclass of EntryNotFoundError: first
        if offline:
            return "it is not in the cache and hub access is off (offline / HF_HUB_OFFLINE=1)"
        # Without local_files_only this means the HEAD request failed (the cause, when chained).
        cause = exc.__cause__
        if isinstance(cause, hub.OfflineModeIsEnabled):
            return "it is not in the cache and HF_HUB_OFFLINE is set"
        if isinstance(_status(cause), int):  # HfHubHTTPError, or requests' own after retries
            return f"the hub answered HTTP {_status(cause)} and it is not cached"
        if isinstance(cause, hub.FileMetadataError):
            return (
                f"the endpoint's answer is not a Hugging Face hub's ({cause}; check HF_ENDPOINT, "
                "proxy and certificates) and it is not cached"
            )
        return "the hub could not be reached (or HF_HUB_OFFLINE is set) and it is not cached"
    if isinstance(exc, hub.EntryNotFoundError):
        return "the hub has no such file at that revision"
    if isinstance(exc, hub.RevisionNotFoundError):
        return "the hub has no such revision"
    if isinstance(exc, hub.RepositoryNotFoundError):
        return "repository not found, private or gated (check HF_TOKEN)"
    if isinstance(exc, hub.HfHubHTTPError):
        return f"the hub answered HTTP {_status(exc) or '?'}"
    if isinstance(exc, _transport_errors()):
        return f"the hub could not be reached: {type(exc).__name__}: {exc}"
    return f"download failed: {type(exc).__name__}: {exc}"


def _status(exc: BaseException | None) -> object:
    """The HTTP status of an error that carries a response (requests, httpx, httpx2), else None."""
    return getattr(getattr(exc, "response", None), "status_code", None)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection/timeout error classes of whichever HTTP clients huggingface_hub has imported."""
    names = {"requests": ("ConnectionError", "Timeout"), "httpx": ("TransportError",)}
    names["httpx2"] = names["httpx"]
    found = []
    for module_name, class_names in names.items():
        module = sys.modules.get(module_name)  # never import a client only to name its errors
        found += [getattr(module, n) for n in class_names if hasattr(module, n)]
    return tuple(t for t in found if isinstance(t, type) and issubclass(t, BaseException))


@functools.cache
def _takes_tqdm_class() -> bool:
    """Whether the installed hf_hub_download has a ``tqdm_class`` parameter (huggingface_hub 1+)."""
    from huggingface_hub import hf_hub_download

    try:
        return "tqdm_class" in inspect.signature(hf_hub_download).parameters
    except (TypeError, ValueError):
        return False


class _NoProgress:
    """A do-nothing progress bar for huggingface_hub's ``tqdm_class`` hook."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: float | None = 1) -> None:
        pass

    def close(self) -> None:
        pass


# The progress-bar groups of huggingface_hub < 1.0's single-file downloads (plain HTTP, Xet).
_PROGRESS_GROUPS = ("huggingface_hub.http_get", "huggingface_hub.xet_get")
_quiet_lock = threading.Lock()
_quiet_users = 0
_quiet_switched: list[str] = []


@contextmanager
def _progress_bars_off() -> Iterator[None]:
    """Silence huggingface_hub's download bars while inside; restore the groups we switched off.

    The setting is process-wide in these versions: overlapping users are counted so that the
    last one out restores it. An explicit ``HF_HUB_DISABLE_PROGRESS_BARS`` is left to rule (it
    takes priority anyway, and changing the groups would only warn).
    """
    global _quiet_users
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    env_rules = getattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", None) is not None
    with _quiet_lock:
        if _quiet_users == 0 and not env_rules:
            _quiet_switched[:] = [g for g in _PROGRESS_GROUPS if not are_progress_bars_disabled(g)]
            for group in _quiet_switched:
                disable_progress_bars(group)
        _quiet_users += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_users -= 1
            if _quiet_users == 0:
                for group in _quiet_switched:
                    enable_progress_bars(group)
                _quiet_switched.clear()
