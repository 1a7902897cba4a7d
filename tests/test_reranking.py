"""Tests for bgeserve.service.reranking: the reranker beside bge-m3 in one service."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from bgeserve.config import Settings
from bgeserve.errors import InvalidInput, ModelUnavailable, Overloaded
from bgeserve.results import RerankOptions
from bgeserve.service import Service
from bgeserve.service.reranking import configured, reranker_settings

pytestmark = pytest.mark.slow
GiB = 1 << 30


def settings(export: Path, reranker: Path, cache: Path, **extra) -> Settings:
    return Settings(model_path=export, variant="fp32", rerank_model_path=reranker,
                    cache_dir=cache, max_seq_length=512, rerank_max_length=512,
                    available_memory_bytes=8 * GiB, heartbeat_secs=0, **extra)


def test_reranker_settings_follow_bge_m3s() -> None:
    """The reranker's engine takes its own model, variant, length and workers, and runs on the
    CPU's ONNX Runtime unless its variant is bf16 (OpenVINO's)."""
    s = Settings(model_path=Path("/m3"), rerank_model_path=Path("/rr"), rerank_variant="int8",
                 rerank_max_length=1024, workers=2, execution_provider="openvino",
                 variant="bf16")
    r = reranker_settings(s)
    assert (r.model_path, r.variant, r.max_seq_length, r.workers, r.execution_provider) == (
        Path("/rr"), "int8", 1024, 2, "cpu")
    assert reranker_settings(Settings(rerank_variant="bf16")).execution_provider == "openvino"
    assert configured(Settings(rerank=True)) and not configured(Settings())


def test_both_models_split_the_memory_probe_in_turn_and_cache_apart(
        tiny_export: Path, tiny_reranker_export: Path, tmp_path: Path) -> None:
    """Both tuners plan within their parts of the memory (together the whole), each probes
    (the reranker after bge-m3) and caches its own fit; a restart finds both cached; the
    service reranks with either scorer and reports both in /health."""
    service = Service(settings(tiny_export, tiny_reranker_export, tmp_path))
    service.load_blocking()
    try:
        m3, rr = service.tuner, service.reranking.tuner
        assert m3 is not None and rr is not None
        assert m3.state.available_bytes + rr.state.available_bytes == 8 * GiB
        assert "shared with the reranker" in m3.state.memory_source
        assert m3.wait(120) and _wait_started(rr) and rr.wait(120)
        assert (m3.state.probe_status, rr.state.probe_status) == ("complete", "complete")
        fits = [json.loads(p.read_text())["fingerprint"]
                for p in (tmp_path / "probe-coefficients.json",
                          tmp_path / "reranker" / "probe-coefficients.json")]
        assert fits[0] != fits[1]
        cross = asyncio.run(service.rerank("a query", ["one text", "another text"],
                                           RerankOptions(normalize=True)))
        assert cross.model == "bge-reranker-v2-m3" and ((0 < cross.scores) & (cross.scores < 1)).all()
        hybrid = asyncio.run(service.rerank("a query", ["one text", "another text"],
                                            RerankOptions(model="bge-m3")))
        assert hybrid.model == "bge-m3" and np.isfinite(hybrid.scores).all()
        health = service.health()
        assert health["status"] == "ok" and health["reranker"]["tuning"]["probe_status"] == \
            "complete"
        # The cross-encoder's admission: its own drain rate, nothing left reserved, and a full
        # queue refuses before tokenizing (counted with bge-m3's).
        admission = service.reranking.admission
        assert admission is not None and admission.gate.reserved == 0
        assert service.reranking.drain.rate() > 0 and service.drain.rate() > 0
        admission.gate.queued = lambda: admission.gate.max_tokens  # full
        with pytest.raises(Overloaded, match="BGE_M3_MAX_QUEUE_TOKENS"):
            asyncio.run(service.rerank("a query", ["one text"], RerankOptions()))
        assert service.rejected_at_admission == 1 and admission.gate.reserved == 0
        admission.gate.queued = service.reranking.engine.queued_tokens
        # bge-m3's own scores are admitted on bge-m3's queue the same way (a bad mode is still
        # a 400 first).
        m3 = service.admission
        assert m3 is not None
        m3.gate.queued = lambda: m3.gate.max_tokens
        with pytest.raises(InvalidInput, match="mode"):
            asyncio.run(service.rerank("a query", ["one text"],
                                       RerankOptions(model="bge-m3", mode="nonsense")))
        with pytest.raises(Overloaded, match="BGE_M3_MAX_QUEUE_TOKENS"):
            asyncio.run(service.rerank("a query", ["one text"], RerankOptions(model="bge-m3")))
        assert service.rejected_at_admission == 2 and m3.gate.reserved == 0
        m3.gate.queued = service.engine.queued_tokens
        again = asyncio.run(service.rerank("a query", ["one text", "another text"],
                                           RerankOptions(model="bge-m3")))
        np.testing.assert_array_equal(again.scores, hybrid.scores)
    finally:
        asyncio.run(service.stop())
    again = Service(settings(tiny_export, tiny_reranker_export, tmp_path))
    again.load_blocking()
    try:
        assert again.tuner is not None and again.reranking.tuner is not None
        assert again.tuner.state.probe_status == "cache_hit"
        assert again.reranking.tuner.state.probe_status == "cache_hit"
    finally:
        asyncio.run(again.stop())


def test_the_start_never_waits_out_the_batch_window(tiny_export: Path, tiny_reranker_export: Path,
                                                    tmp_path: Path) -> None:
    """bge-m3's canary and the reranker's priming pair run alone (solo jobs): a 10 s
    BGE_M3_BATCH_DELAY_MS holds neither start-up run (each waited the whole window, 20 s)."""
    import time

    service = Service(settings(tiny_export, tiny_reranker_export, tmp_path, batch_delay_ms=10_000,
                               disable_auto_budget=True))
    started = time.monotonic()
    service.load_blocking()
    try:
        took = time.monotonic() - started
        assert took < 6, f"the start took {took:.1f}s"  # 0.4 s here; >= 10 s if one waits
    finally:
        asyncio.run(service.stop())


def _wait_started(tuner, timeout: float = 120.0) -> bool:
    """The reranker's probe starts when bge-m3's ends (on its thread): wait for its thread."""
    import time

    deadline = time.monotonic() + timeout
    while tuner._thread is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return tuner._thread is not None


def test_a_missing_reranker_fails_the_start(tiny_export: Path, tmp_path: Path) -> None:
    """A configured reranker that cannot be opened is a start-up failure naming the variable."""
    service = Service(settings(tiny_export, tmp_path / "nowhere", tmp_path))
    with pytest.raises(ModelUnavailable, match="does not exist"):
        service.load_blocking()


def test_a_refusing_estimate_is_measured_on_the_rerankers_serving_sessions(
        tiny_export: Path, tiny_reranker_export: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the reranker's conservative estimate refuses (UnmeasuredFloor), its probe runs on
    its own serving sessions (``probe_mode: in_process``), not in a child loading a third model
    copy: at full size (int8 pair, 4 GiB cgroup) that child had no room and the start failed."""
    from bgeserve.tuning.probe import LocalProbe
    from bgeserve.tuning.tuner import Tuner, UnmeasuredFloor

    initial, measure_first = Tuner.initial, Tuner.measure_first
    sources: list[object] = []

    def refusing(self, model_cost, fingerprint, parts=None):  # the reranker's first refuses
        if self.config.cache_dir.name == "reranker" and self._measured is None:
            raise UnmeasuredFloor("one 512-token text needs more than the estimate allows")
        return initial(self, model_cost, fingerprint, parts)

    def recording(self, source, *args, **kwargs):
        sources.append(source)
        return measure_first(self, source, *args, **kwargs)

    monkeypatch.setattr(Tuner, "initial", refusing)
    monkeypatch.setattr(Tuner, "measure_first", recording)
    service = Service(settings(tiny_export, tiny_reranker_export, tmp_path))
    service.load_blocking()
    try:
        rr = service.reranking.tuner
        assert rr is not None and [type(s) for s in sources] == [LocalProbe]
        assert rr.state.probe_mode == "in_process" and rr.state.probe_status == "complete"
        cross = asyncio.run(service.rerank("a query", ["one text"], RerankOptions()))
        assert np.isfinite(cross.scores).all()
    finally:
        asyncio.run(service.stop())


def test_bge_m3_options_sent_to_the_cross_encoder_are_refused() -> None:
    """``mode`` and ``weights`` are bge-m3's: given to a request the cross-encoder scores, a
    400 naming them and how to get bge-m3 (they were dropped without a word). Parsed from
    the body, only the fields sent count as given."""
    from types import SimpleNamespace

    from bgeserve.errors import InvalidInput
    from bgeserve.http.rerank_schemas import parse_rerank_request
    from bgeserve.service.metrics import Metrics
    from bgeserve.service.reranking import Reranking

    ids = ("bge-m3", "bge-reranker-v2-m3")
    body = {"query": "q", "documents": ["a"], "mode": "sparse"}
    parsed = parse_rerank_request(json.dumps(body).encode(), Settings(), ids)
    assert parsed.options.given == {"mode"}
    plain = parse_rerank_request(b'{"query": "q", "documents": ["a"]}', Settings(), ids)
    assert plain.options.given == frozenset()

    reranking = Reranking(Metrics())
    reranking.reranker = SimpleNamespace()  # type: ignore[assignment]  # loaded: the default
    for options, param in ((parsed.options, "mode"),
                           (RerankOptions(model="bge-reranker-v2-m3", given=frozenset(
                               {"weights"})), "weights")):
        with pytest.raises(InvalidInput, match='"model": "bge-m3"') as info:
            asyncio.run(reranking.rerank(None, None, "q", ["a"], options, None))  # type: ignore
        assert info.value.param == param


def test_rerank_aliases_name_the_cross_encoder_and_never_bge_m3s_aliases() -> None:
    """``BGE_M3_RERANK_MODEL_ALIASES`` names the loaded reranker (a client's default name then
    gets the cross-encoder, where a bge-m3 alias silently got bge-m3's hybrid score); a name in
    both alias lists stops the start; with no reranker loaded the aliases name nothing."""
    from types import SimpleNamespace

    from bgeserve.errors import ConfigError
    from bgeserve.service.metrics import Metrics
    from bgeserve.service.reranking import Reranking

    s = Settings(model_aliases=("text-embedding-3-small",),
                 rerank_model_aliases=("rerank-english-v3.0",))
    s.validate()
    reranking = Reranking(Metrics())
    reranking.settings = s
    assert reranking.model_ids == () and not reranking.cross_encoder("rerank-english-v3.0")
    reranking.reranker = SimpleNamespace()  # type: ignore[assignment]  # loaded
    assert reranking.model_ids == ("bge-reranker-v2-m3", "BAAI/bge-reranker-v2-m3",
                                   "rerank-english-v3.0")
    assert reranking.cross_encoder("rerank-english-v3.0") and reranking.cross_encoder(None)
    assert not reranking.cross_encoder("text-embedding-3-small")
    assert not reranking.cross_encoder("bge-m3")
    for given in ({"model_aliases": ("x",), "rerank_model_aliases": ("x",)},
                  {"rerank_model_aliases": ("bge-m3",)}):  # bge-m3's own name too
        with pytest.raises(ConfigError, match="names bge-m3") as info:
            Settings(**given).validate()  # type: ignore[arg-type]
        assert info.value.param == "BGE_M3_RERANK_MODEL_ALIASES"
