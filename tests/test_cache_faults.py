"""A damaged or unwritable cache directory never stops a server whose model is local.

A corrupt or truncated ``probe-coefficients.json`` is ignored with a warning (the probe runs
again and rewrites it); a read-only cache directory is a warning too when nothing has to be
downloaded (only the probe's fit goes uncached), and still a clear refusal when the model
would be downloaded into it. ``ProbeCache`` itself is tested in test_probe.py; this is the
service starting over such a directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from bgeserve.config import Settings
from bgeserve.errors import ModelUnavailable
from bgeserve.service import Service
from bgeserve.tuning.cache import ProbeCache
from bgeserve.tuning.costmodel import Fit

pytestmark = pytest.mark.slow

PROBE_TIMEOUT = 60.0


def env_for(export: Path, cache: Path) -> dict[str, str]:
    """Auto-budget on (so the probe cache is read), a short max_seq (so the probe is quick)."""
    return {"BGE_M3_MODEL_PATH": str(export), "BGE_M3_CACHE_DIR": str(cache),
            "HF_HUB_OFFLINE": "1", "BGE_M3_MODEL": "fp32", "BGE_M3_MAX_SEQ_LENGTH": "256"}


@contextmanager
def loaded(env: dict[str, str]) -> Iterator[Service]:
    service = Service(Settings.from_env(env))
    try:
        service.load_blocking()
        yield service
    finally:
        if service.tuner is not None:
            service.tuner.wait(PROBE_TIMEOUT)
        asyncio.run(service.stop())


def _writable(path: Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(dir=path)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


@contextmanager
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """An existing directory this process cannot write to: a 0555 one, or, for root (whom
    permissions do not stop), /sys (sysfs refuses new files)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if _writable(ro):
            if not (Path("/sys").is_dir() and not _writable(Path("/sys"))):
                pytest.skip("no directory here refuses this process's writes")
            yield Path("/sys")
        else:
            yield ro
    finally:
        ro.chmod(0o755)


def _damaged(kind: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "corrupt":
        path.write_text("{not json")
    else:  # a real record, cut off halfway (a crash mid-write by another tool)
        ProbeCache(path).save("fingerprint", Fit(1.0, 2.0, 0.01, None), {"x": 1}, [])
        text = path.read_text()
        path.write_text(text[: len(text) // 2])


@pytest.mark.parametrize("kind", ["corrupt", "truncated"])
def test_a_damaged_probe_cache_is_ignored_with_a_warning(kind: str, tiny_export: Path,
                                                         tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture):
    """The service starts, warns naming the file, probes again and serves; a completed probe
    replaces the damaged file with a valid record."""
    caplog.set_level(logging.INFO, logger="bgeserve")
    cache = tmp_path / "cache"
    path = cache / "probe-coefficients.json"
    _damaged(kind, path)
    with loaded(env_for(tiny_export, cache)) as service:
        assert service.engine is not None
        assert service.engine.embed("still serving").dense is not None
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(str(path) in w and "ignoring it" in w for w in warnings), warnings
        assert service.tuner is not None and service.tuner.wait(PROBE_TIMEOUT)
        status = service.tuner.state.probe_status
    assert status in ("complete", "failed"), status
    if status == "complete":
        assert json.loads(path.read_text())["fingerprint"]


def test_a_read_only_cache_dir_with_a_local_model_only_warns(tiny_export: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture):
    """BGE_M3_CACHE_DIR unwritable, model local: a warning naming the directory, the server
    serves, and saving the probe's fit only warns."""
    caplog.set_level(logging.INFO, logger="bgeserve")
    with read_only_dir(tmp_path) as ro, loaded(env_for(tiny_export, ro)) as service:
        assert service.fatal_error is None
        assert service.health()["status"] == "ok"
        assert service.engine is not None and service.engine.embed("x").dense is not None
        assert service.tuner is not None and service.tuner.wait(PROBE_TIMEOUT)
        status = service.tuner.state.probe_status
        assert not (ro / "probe-coefficients.json").exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(ro) in w and "Serving anyway" in w for w in warnings), warnings
    if status == "complete":
        assert any("cannot save" in w and "probe-coefficients" in w for w in warnings), warnings


def test_a_hub_model_still_needs_a_writable_cache(tmp_path: Path):
    """With nothing local the model would be downloaded into the cache: an unwritable one is
    a start-up failure naming BGE_M3_CACHE_DIR, before any network call."""
    with read_only_dir(tmp_path) as ro:
        service = Service(Settings.from_env({"BGE_M3_CACHE_DIR": str(ro / "cache"),
                                             "HF_HUB_OFFLINE": "1"}))
        with pytest.raises(ModelUnavailable, match="BGE_M3_CACHE_DIR") as info:
            service.load_blocking()
        with suppress(Exception):
            asyncio.run(service.stop())
    assert "cannot be used" in str(info.value)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_records_are_written_with_the_umasks_mode(tmp_path: Path, umask: int) -> None:
    """A record's mode follows the umask as any file the process makes (mkstemp's 0600 left
    a cache written by one uid unreadable to another, which measured again every start)."""
    from bgeserve.tuning.cache import write_atomic

    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "record.json", {"a": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "record.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert json.loads((tmp_path / "record.json").read_text()) == {"a": 1}


@pytest.mark.parametrize("record", ["nested", "a=1e-300", "a=b=1e300", "c=1e300"])
def test_a_hand_edited_record_is_ignored_not_a_crash_loop(tmp_path: Path, record: str,
                                                          caplog: pytest.LogCaptureFixture):
    """Records no probe could make (nested past the parser's depth, coefficients under a byte
    or over a tebibyte per token) are ignored with the warning, in both files: each was a
    traceback (RecursionError, OverflowError) or an absurd refusal at every start (QA)."""
    from bgeserve.tuning.cache import ChoiceCache

    path = tmp_path / "probe-coefficients.json"
    fields = {"a=1e-300": {"a": 1e-300, "b": 0.0}, "a=b=1e300": {"a": 1e300, "b": 1e300},
              "c=1e300": {"a": 5e4, "b": 10.0, "c": 1e300}}.get(record)
    if fields is None:
        path.write_text("[" * 100_000)
        (tmp_path / "variant-choice.json").write_text("[" * 100_000)
        assert ChoiceCache.at(tmp_path).load("key") is None
    else:
        ProbeCache(path).save("f" * 64, Fit(5e4, 10.0, 0.01, None), {}, [])
        edited = json.dumps({**json.loads(path.read_text()), **fields})
        for copy in (path, *tmp_path.glob("probe-coefficients.d/*.json")):  # the kept one too
            copy.write_text(edited)
    store = ProbeCache(path)
    assert store.load("f" * 64) is None
    if fields is None:  # the records read beside the fit are no crash either
        assert store.chunk_rates("f" * 64) == {} and store.run_cost("f" * 64) is None
    assert any("ignoring it" in r.getMessage() for r in caplog.records)
