"""GPU plumbing without a GPU: detection, provider options, pinning, warm-up grid, NVML fields."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from bgeserve.config import Settings
from bgeserve.errors import ConfigError
from bgeserve.runtime import SessionConfig, gpu, trt
from bgeserve.runtime.onnx import _providers
from bgeserve.service import plan
from bgeserve.service.plan import engine_config

ALL_EPS = ["cpu", "cuda", "tensorrt"]


def fake_proc(root: Path, devices: int) -> Path:
    """A ``/proc`` with ``devices`` entries under driver/nvidia/gpus (and a stray file)."""
    gpus = root / "proc" / "driver" / "nvidia" / "gpus"
    gpus.mkdir(parents=True)
    for i in range(devices):
        (gpus / f"0000:{i:02x}:00.0").mkdir()
        (gpus / f"0000:{i:02x}:00.0" / "information").write_text("Model: fake\n")
    (gpus / "README").write_text("not a device")
    return root / "proc"


class FakeNvml:
    """Just enough of pynvml: devices with memory, utilisation and temperature."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, free: list[int], total: int = 80 << 30):
        self.free, self.total = free, total

    def nvmlDeviceGetCount(self) -> int:
        return len(self.free)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(free=self.free[h], total=self.total, used=self.total - self.free[h])

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=40 + h, memory=10)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 55 + h


# ----------------------------------------------------------------------------- detection
def test_gpu_count_comes_from_the_proc_tree(tmp_path: Path):
    """Each device directory under driver/nvidia/gpus counts; files and a missing tree don't."""
    assert gpu.detect_gpu_count(fake_proc(tmp_path / "a", 4)) == 4
    assert gpu.detect_gpu_count(fake_proc(tmp_path / "b", 0)) == 0
    assert gpu.detect_gpu_count(tmp_path / "nowhere") == 0


def test_resolve_counts_gpus_and_clamps_workers(tmp_path: Path, caplog):
    """BGE_M3_WORKERS above the GPU count is clamped to it, with a warning naming both."""
    proc = fake_proc(tmp_path, 2)
    with caplog.at_level(logging.WARNING, "bgeserve.gpu"):
        s = plan.resolve_gpu(Settings(execution_provider="cuda", workers=5), proc=proc,
                        available=ALL_EPS)
    assert (s.gpu_count, s.workers) == (2, 2)
    assert "BGE_M3_WORKERS=5 clamped to 2" in caplog.text
    assert plan.resolve_gpu(s, proc=proc, available=ALL_EPS) == s  # idempotent


def test_explicit_gpu_count_wins_over_detection(tmp_path: Path):
    """BGE_M3_GPU_COUNT is trusted even where /proc shows no device (e.g. a masked /proc)."""
    s = plan.resolve_gpu(Settings(execution_provider="tensorrt", gpu_count=4, workers=4),
                    proc=tmp_path, available=ALL_EPS, nvml=FakeNvml([]))
    assert (s.gpu_count, s.workers) == (4, 4)


def test_nvml_counts_devices_when_proc_shows_none(tmp_path: Path):
    """Without /proc entries, NVML's device count is used."""
    s = plan.resolve_gpu(Settings(execution_provider="cuda"), proc=tmp_path, available=ALL_EPS,
                    nvml=FakeNvml([1 << 30] * 3))
    assert s.gpu_count == 3


@pytest.mark.parametrize("ep, available, why", [
    ("tensorrt", ["cpu"], "has no tensorrt execution provider"),
    ("cuda", ["cpu"], "has no cuda execution provider"),
    ("coreml", ["cpu"], "has no coreml execution provider"),
    ("cuda", ALL_EPS, "no NVIDIA GPU was found"),
])
def test_an_unusable_ep_fails_fast_naming_bge_m3_ep(tmp_path: Path, ep, available, why):
    """A provider missing from the build, or no GPU, is a ConfigError about BGE_M3_EP."""
    with pytest.raises(ConfigError) as info:
        plan.resolve_gpu(Settings(execution_provider=ep), proc=tmp_path, available=available,
                    nvml=FakeNvml([]))
    assert info.value.param == "BGE_M3_EP"
    assert f"BGE_M3_EP={ep}" in info.value.message and why in info.value.message
    assert "BGE_M3_ALLOW_CPU_FALLBACK=1" in info.value.message


def test_cpu_fallback_warns_and_uses_the_cpu(tmp_path: Path, caplog):
    """With BGE_M3_ALLOW_CPU_FALLBACK=1 the same situation is a warning and the CPU EP."""
    with caplog.at_level(logging.WARNING, "bgeserve.gpu"):
        s = plan.resolve_gpu(Settings(execution_provider="tensorrt", allow_cpu_fallback=True,
                                 workers=3), proc=tmp_path, available=["cpu"])
    assert (s.execution_provider, s.workers, s.variant) == ("cpu", 3, "fp32")
    assert "running on the CPU instead" in caplog.text


def test_fp16_is_the_gpu_default_unless_bge_m3_model_is_set(tmp_path: Path):
    """On cuda/tensorrt the variant becomes fp16 when BGE_M3_MODEL was not given."""
    proc = fake_proc(tmp_path, 1)
    implicit = plan.resolve_gpu(Settings(execution_provider="cuda"), model_explicit=False, proc=proc,
                           available=ALL_EPS)
    explicit = plan.resolve_gpu(Settings(execution_provider="cuda"), model_explicit=True, proc=proc,
                           available=ALL_EPS)
    cpu = plan.resolve_gpu(Settings(), model_explicit=False, available=["cpu"])
    assert (implicit.variant, explicit.variant, cpu.variant) == ("fp16", "fp32", "fp32")


# --------------------------------------------------------------------------------- pinning
def test_worker_i_runs_on_device_i_mod_n():
    """Pinning: worker i → device i % gpu_count; CPU configs are left alone."""
    config = SessionConfig(provider="cuda", device_count=3)
    assert [gpu.pin(config, w).device_id for w in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    cpu = SessionConfig(provider="cpu", device_count=3)
    assert gpu.pin(cpu, 5) is cpu


def test_the_device_reaches_every_gpu_provider_in_the_chain(tmp_path: Path):
    """TensorRT is registered with CUDA under it, both on the worker's device, then the CPU."""
    s = Settings(execution_provider="tensorrt", gpu_count=2, workers=2, cache_dir=tmp_path)
    chain = _providers(gpu.pin(plan.session_config(s), 1))
    assert [p[0] if isinstance(p, tuple) else p for p in chain] == [
        "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert chain[0][1]["device_id"] == chain[1][1]["device_id"] == "1"
    assert chain[1][1]["arena_extend_strategy"] == "kSameAsRequested"
    assert _providers(SessionConfig()) == ["CPUExecutionProvider"]


def test_open_pinned_opens_on_the_workers_device_and_syncs_trt_caches(tmp_path: Path,
                                                                      monkeypatch):
    """Worker 3 of 2 GPUs opens on device 1; a TensorRT open fsyncs both cache folders."""
    opened, synced = [], []
    monkeypatch.setattr(gpu, "OnnxSession", lambda path, config: opened.append(config) or config)
    monkeypatch.setattr(gpu, "fsync_tree", lambda folder: synced.append(folder) or 0)
    s = Settings(execution_provider="tensorrt", gpu_count=2, workers=2, cache_dir=tmp_path)
    gpu.open_pinned(tmp_path / "model.onnx", plan.session_config(s), worker=3)
    assert opened[0].device_id == 1
    assert synced == [tmp_path / "trt-engines", tmp_path / "trt-timing"]
    gpu.open_pinned(tmp_path / "model.onnx", SessionConfig(), worker=3)
    assert opened[1].device_id == 0 and len(synced) == 2


# ------------------------------------------------------------------------ provider options
def test_cuda_options_cap_the_arena():
    """CUDA: the arena grows by what is asked, and gpu_mem_limit caps it when known."""
    assert gpu.cuda_options() == {"arena_extend_strategy": "kSameAsRequested"}
    assert gpu.cuda_options(3 << 30)["gpu_mem_limit"] == str(3 << 30)


def test_the_profile_covers_every_chunk_the_scheduler_can_form(tmp_path: Path):
    """Max shape = (max_chunk, max_seq); the opt shape never exceeds it."""
    assert trt.trt_profile(4, 256) == trt.TrtProfile((1, 1), (4, 256), (4, 256))
    s = Settings(execution_provider="tensorrt", gpu_count=1, cache_dir=tmp_path, max_chunk=16,
                 max_seq_length=1024)
    opts = engine_config(s).session.provider_options
    assert opts["trt_profile_max_shapes"] == "input_ids:16x1024,attention_mask:16x1024"
    legacy = Settings(execution_provider="tensorrt", gpu_count=1, cache_dir=tmp_path,
                      onnx_batch_size=5, max_seq_length=1024)
    assert plan.profile_max_batch(legacy) == 5
    # BGE_M3_MAX_CHUNK, given, wins over the deprecated variable it replaces
    assert plan.profile_max_batch(dataclasses.replace(legacy, max_chunk=16)) == 16


def test_session_config_per_provider(tmp_path: Path, caplog):
    """cpu: plain; cuda: CUDA options and device count; tensorrt: creates and reports caches."""
    assert plan.session_config(Settings(intra_threads=2)) == SessionConfig(threads=2)
    cuda = plan.session_config(Settings(execution_provider="cuda", gpu_count=2, workers=2),
                              gpu_mem_limit=1 << 30)
    assert (cuda.device_count, cuda.provider_options["gpu_mem_limit"]) == (2, str(1 << 30))
    with caplog.at_level(logging.INFO, "bgeserve.gpu"):
        plan.session_config(Settings(execution_provider="tensorrt", gpu_count=1,
                                    cache_dir=tmp_path))
    assert (tmp_path / "trt-engines").is_dir() and (tmp_path / "trt-timing").is_dir()
    assert "trt cache: empty (will compile)" in caplog.text


# ------------------------------------------------------------------------------------ NVML
def test_heartbeat_fields_from_nvml():
    """VRAM used/total, utilisation and temperature per device; {} without NVML."""
    fields = gpu.heartbeat_fields(FakeNvml([30 << 30, 50 << 30]))
    assert fields["gpus"][1] == {"index": 1, "vram_used_bytes": 30 << 30,
                                 "vram_total_bytes": 80 << 30, "utilization_pct": 41,
                                 "temperature_c": 56}

    class Broken(FakeNvml):
        def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    assert gpu.heartbeat_fields(Broken([1])) == {}


def test_without_nvml_nothing_is_measured(monkeypatch):
    """No pynvml installed → no heartbeat fields, no free VRAM, no device count."""
    monkeypatch.setattr(gpu, "_system_nvml", lambda: None)
    assert gpu.heartbeat_fields() == {}
    assert gpu.free_vram_bytes([0]) is None
    assert gpu.nvml_device_count() == 0


def test_vram_budget_prefers_the_setting_then_measures(tmp_path: Path):
    """BGE_M3_GPU_VRAM_BUDGET_BYTES wins; else (min free − model) × safety, per device."""
    model = tmp_path / "model.onnx"
    model.write_bytes(b"\0" * (1 << 20))
    nvml = FakeNvml([10 << 30, 8 << 30])
    pinned = Settings(execution_provider="cuda", gpu_count=2, workers=2,
                      gpu_vram_budget_bytes=5 << 30)
    assert plan.vram_budget(pinned, [model], nvml) == 5 << 30
    s = Settings(execution_provider="cuda", gpu_count=2, workers=2, memory_safety_factor=0.5)
    assert plan.vram_budget(s, [model], nvml) == int(((8 << 30) - (1 << 20)) * 0.5)
    assert plan.vram_budget(Settings(), [model], nvml) is None
