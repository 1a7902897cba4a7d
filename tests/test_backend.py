"""Which runtime and variant serve (bgeserve/backend.py): pure rules, a fake machine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bgeserve.config import Settings
from bgeserve.errors import ConfigError
from bgeserve.runtime.select import Machine
from bgeserve.service.plan import resolve

BF16_CPU = Machine(openvino=lambda: True, native_bf16=lambda: True, amx=lambda: False)
AMX_CPU = Machine(openvino=lambda: True, native_bf16=lambda: True, amx=lambda: True)
NO_BF16 = Machine(openvino=lambda: True, native_bf16=lambda: False, amx=lambda: False)
NO_OPENVINO = Machine(openvino=lambda: False, native_bf16=lambda: True, amx=lambda: False)


def export_dir(tmp_path: Path, *variants: str, int8_cos: float | None = None) -> Path:
    entries: dict = {v: {"path": f"{v}/model.onnx"} for v in variants}
    if int8_cos is not None:
        entries["int8"]["agreement"] = {"dense_cos_min": int8_cos, "dense_cos_mean": int8_cos}
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": "bgeserve-export", "schema": 1, "variants": entries}))
    return tmp_path


def auto(settings: Settings, machine: Machine) -> Settings:
    return resolve(settings, model_explicit=False, ep_explicit=False, machine=machine)


def test_default_is_bf16_on_openvino_where_everything_allows_it(tmp_path):
    s = auto(Settings(model_path=export_dir(tmp_path, "fp32", "int8", "bf16")), BF16_CPU)
    assert (s.execution_provider, s.variant) == ("openvino", "bf16")


@pytest.mark.parametrize(("machine", "variants", "int8_cos", "why"), [
    (NO_OPENVINO, ("fp32", "bf16"), None, "openvino is not installed"),
    (NO_BF16, ("fp32", "bf16"), None, "no native bf16"),
    (BF16_CPU, ("fp32", "int8"), None, "did not measure its agreement"),
    (BF16_CPU, ("fp32", "int8"), 0.9977, "0.9977 < 0.999"),
])
def test_default_stays_exact_fp32_otherwise(tmp_path, caplog, machine, variants, int8_cos, why):
    caplog.set_level("INFO", "bgeserve.backend")
    s = auto(Settings(model_path=export_dir(tmp_path, *variants, int8_cos=int8_cos)), machine)
    assert (s.execution_provider, s.variant) == ("cpu", "fp32")
    assert why in caplog.text


@pytest.mark.parametrize(("machine", "int8_cos", "want"), [
    (BF16_CPU, 0.9994, ("cpu", "int8")),  # VNNI int8 beats AVX512_BF16 bf16 (benchmarks.md)
    (BF16_CPU, 0.998, ("openvino", "bf16")),
    (AMX_CPU, 0.9994, ("openvino", "bf16")),  # AMX bf16 is the fastest there
    (NO_OPENVINO, 0.9994, ("cpu", "int8")),
])
def test_fastest_variant_that_keeps_the_bar(tmp_path, machine, int8_cos, want):
    s = auto(Settings(model_path=export_dir(tmp_path, "fp32", "int8", "bf16", int8_cos=int8_cos)),
             machine)
    assert (s.execution_provider, s.variant) == want


def test_amx_flag_is_read_from_cpuinfo(tmp_path):
    from bgeserve.runtime.select import cpu_has_amx

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_has_amx(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n")
    assert not cpu_has_amx(info)
    assert not cpu_has_amx(tmp_path / "missing")


def test_hub_download_default_is_fp32():
    """No local export: the hub has no bf16 graph."""
    s = auto(Settings(model_path=None), BF16_CPU)
    assert (s.execution_provider, s.variant) == ("cpu", "fp32")


def test_an_explicit_choice_is_never_overridden(tmp_path):
    root = export_dir(tmp_path, "fp32", "int8", "bf16")
    for explicit in ({"model_explicit": True, "ep_explicit": False},
                     {"model_explicit": False, "ep_explicit": True}):
        s = resolve(Settings(model_path=root), machine=BF16_CPU, **explicit)
        assert (s.execution_provider, s.variant) == ("cpu", "fp32")
    s = resolve(Settings(model_path=root, variant="int8"), machine=BF16_CPU)
    assert (s.execution_provider, s.variant) == ("cpu", "int8")


def test_openvino_ep_implies_bf16_and_bf16_implies_openvino():
    s = resolve(Settings(execution_provider="openvino"), model_explicit=False, machine=BF16_CPU)
    assert s.variant == "bf16"
    s = resolve(Settings(variant="bf16"), ep_explicit=False, machine=BF16_CPU)
    assert s.execution_provider == "openvino"


def test_contradictions_are_config_errors_naming_the_variable():
    with pytest.raises(ConfigError) as err:
        resolve(Settings(variant="bf16"), machine=BF16_CPU)  # BGE_M3_EP=cpu given explicitly
    assert err.value.param == "BGE_M3_MODEL" and "BGE_M3_EP=openvino" in err.value.message
    with pytest.raises(ConfigError) as err:
        resolve(Settings(execution_provider="openvino", variant="int8"), machine=BF16_CPU)
    assert err.value.param == "BGE_M3_MODEL" and "bf16" in err.value.message


def test_missing_openvino_fails_fast_unless_cpu_fallback_is_allowed():
    with pytest.raises(ConfigError) as err:
        resolve(Settings(execution_provider="openvino"), machine=NO_OPENVINO)
    assert err.value.param == "BGE_M3_EP" and "bgeserve[openvino]" in err.value.message
    s = resolve(Settings(execution_provider="openvino", allow_cpu_fallback=True),
                machine=NO_OPENVINO)
    assert (s.execution_provider, s.variant) == ("cpu", "fp32")


def test_resolving_is_idempotent(tmp_path):
    s = auto(Settings(model_path=export_dir(tmp_path, "bf16")), BF16_CPU)
    assert resolve(s, machine=BF16_CPU) == s


def test_environment_pairs_openvino_with_bf16():
    """Like the GPU EPs' fp16 default: each of BGE_M3_EP=openvino / BGE_M3_MODEL=bf16 implies
    the other when the other is not given."""
    assert resolve(Settings.from_env({"BGE_M3_EP": "openvino"}), machine=BF16_CPU).variant == "bf16"
    assert resolve(Settings.from_env({"BGE_M3_MODEL": "bf16"}),
                   machine=BF16_CPU).execution_provider == "openvino"
    both = Settings.from_env({"BGE_M3_MODEL": "bf16", "BGE_M3_EP": "cpu"})
    assert (both.execution_provider, both.variant) == ("cpu", "bf16")
    with pytest.raises(ConfigError, match="BGE_M3_EP=openvino"):  # both given: refused
        resolve(both, machine=BF16_CPU)


def test_chunk_tokens_default_per_backend_and_explicit_wins():
    from bgeserve.service.plan import chunk_tokens

    assert chunk_tokens(Settings()) == 256  # ONNX Runtime CPU
    assert chunk_tokens(Settings(execution_provider="openvino", variant="bf16")) == 1024
    assert chunk_tokens(Settings(execution_provider="cuda")) == 8192
    assert chunk_tokens(Settings(execution_provider="tensorrt")) == 8192
    assert chunk_tokens(Settings(max_chunk_tokens=4096)) == 4096


def test_pad_multiple_rounds_on_gpus_only_and_explicit_wins():
    from bgeserve.service.plan import pad_multiple

    assert pad_multiple(Settings()) == 1
    assert pad_multiple(Settings(execution_provider="openvino", variant="bf16")) == 1
    assert pad_multiple(Settings(execution_provider="cuda")) == 32
    assert pad_multiple(Settings(execution_provider="tensorrt")) == 32
    assert pad_multiple(Settings(execution_provider="cuda", pad_multiple=1)) == 1
    assert pad_multiple(Settings(pad_multiple=16)) == 16


def test_ov_int8_runs_on_openvino_when_asked_for():
    """BGE_M3_MODEL=ov-int8 alone implies OpenVINO, with BGE_M3_EP=openvino it is kept, and
    with BGE_M3_EP=cpu it is a contradiction naming both ways out."""
    s = resolve(Settings.from_env({"BGE_M3_MODEL": "ov-int8"}), machine=NO_BF16)
    assert (s.execution_provider, s.variant) == ("openvino", "ov-int8")
    s = resolve(Settings(execution_provider="openvino", variant="ov-int8"), machine=NO_BF16)
    assert s.variant == "ov-int8"
    with pytest.raises(ConfigError) as err:
        resolve(Settings(variant="ov-int8"), machine=BF16_CPU)  # BGE_M3_EP=cpu given explicitly
    assert err.value.param == "BGE_M3_MODEL" and "BGE_M3_EP=openvino" in err.value.message


def test_the_default_does_not_pick_ov_int8_by_itself(tmp_path):
    """ov-int8 is chosen by measurement (the tuned default), never by a rule that calls it
    the fastest: with only the rules, an export that has it still serves what it served."""
    root = export_dir(tmp_path, "fp32", "int8", "bf16", "ov-int8", int8_cos=0.9994)
    for machine in (AMX_CPU, BF16_CPU, NO_BF16):
        assert auto(Settings(model_path=root), machine).variant != "ov-int8"


# -- the measured default's candidates and pick (runtime/select.py) ------------------------------
def test_candidates_are_every_variant_meeting_the_bar_on_a_runtime_this_machine_has():
    """Read from the manifest: a new variant (an OpenVINO int8) is a candidate by its entry's
    runtime alone; fp16 (GPU) and variants below the bar or unmeasured are not."""
    from bgeserve.runtime.select import Candidate, cpu_candidates

    good = {"agreement": {"dense_cos_min": 0.9993}}
    variants = {"fp32": {}, "int8": good, "bf16": {"runtime": "openvino", **good},
                "ov-int8": {"runtime": "openvino", **good}, "fp16": good,
                "int4": {"agreement": {"dense_cos_min": 0.98}}, "odd": {"runtime": "tvm", **good},
                "raw": {}}
    found, left_out = cpu_candidates(variants, BF16_CPU)
    assert found == [Candidate("fp32", "cpu"), Candidate("int8", "cpu"),
                     Candidate("bf16", "openvino"), Candidate("ov-int8", "openvino")]
    assert set(left_out) == {"fp16", "int4", "odd", "raw"}
    assert "0.9800 < 0.999" in left_out["int4"] and "did not measure" in left_out["raw"]
    found, left_out = cpu_candidates(variants, NO_OPENVINO)
    assert [c.variant for c in found] == ["fp32", "int8"]
    assert "openvino is not installed" in left_out["ov-int8"]


def test_an_8_bit_openvino_int8_is_a_candidate_only_where_int8_sums_in_int32():
    """ov-int8 with 8-bit weights (exported on a VNNI / AMX CPU) saturates on a CPU without
    VNNI or AMX-INT8: never timed there, whatever its recorded agreement; its 7-bit form is."""
    from bgeserve.runtime.select import cpu_candidates

    good = {"runtime": "openvino", "agreement": {"dense_cos_min": 0.9995}}
    variants = {"fp32": {}, "ov-int8": {**good, "quantization": {"weights": "8-bit"}}}
    no_vnni = dataclasses.replace(BF16_CPU, int8_dot=lambda: False)
    vnni = dataclasses.replace(BF16_CPU, int8_dot=lambda: True)
    found, left_out = cpu_candidates(variants, no_vnni)
    assert [c.variant for c in found] == ["fp32"]
    assert "VNNI or AMX-INT8" in left_out["ov-int8"]
    assert [c.variant for c in cpu_candidates(variants, vnni)[0]] == ["fp32", "ov-int8"]
    seven = {"fp32": {}, "ov-int8": {**good, "quantization": {"weights": "7-bit"}}}
    assert [c.variant for c in cpu_candidates(seven, no_vnni)[0]] == ["fp32", "ov-int8"]


@pytest.mark.parametrize(("weights", "ok_without_vnni"), [
    ("s8", False), ("u8", True), ("s7", True), (None, True)])
def test_a_signed_8_bit_int8_is_neither_timed_nor_the_rule_where_it_saturates(
        weights, ok_without_vnni):
    """int8 exported (or prepared) on a VNNI / AMX CPU has signed 8-bit weights: on a CPU
    without VNNI neither the rule nor the measured default serves it; unsigned 8-bit, signed
    7-bit and an entry that does not say (exports before the encoding was recorded: 7-bit)
    serve anywhere."""
    from bgeserve.runtime.select import cpu_candidates, cpu_default

    entry = {"agreement": {"dense_cos_min": 0.9995}}
    if weights is not None:
        entry["quantization"] = {"weights": weights}
    variants = {"fp32": {}, "int8": entry}
    no_vnni = dataclasses.replace(NO_BF16, int8_dot=lambda: False)
    vnni = dataclasses.replace(NO_BF16, int8_dot=lambda: True)
    assert cpu_default(variants, vnni).variant == "int8"
    assert [c.variant for c in cpu_candidates(variants, vnni)[0]] == ["fp32", "int8"]
    choice = cpu_default(variants, no_vnni)
    found, left_out = cpu_candidates(variants, no_vnni)
    if ok_without_vnni:
        assert choice.variant == "int8" and [c.variant for c in found] == ["fp32", "int8"]
    else:
        assert choice.variant == "fp32" and [c.variant for c in found] == ["fp32"]
        assert any("VNNI" in note for note in choice.notes) and "VNNI" in left_out["int8"]


@pytest.mark.parametrize("rates,prior,chosen", [
    ({"fp32": 250.0, "int8": 800.0}, "fp32", "int8"),
    ({"int8": 800.0, "bf16": 830.0}, "int8", "int8"),  # within 5 %: the prior stays
    ({"int8": 800.0, "bf16": 850.0}, "int8", "bf16"),
    ({"int8": 800.0, "bf16": 830.0}, "fp32", "bf16"),  # the prior was not timed
    ({"int8": 800.0}, None, "int8"),
])
def test_pick_is_the_fastest_unless_the_prior_is_within_the_margin(rates, prior, chosen):
    from bgeserve.runtime.select import pick

    assert pick(rates, prior) == chosen


def test_pick_needs_a_timed_candidate():
    from bgeserve.runtime.select import pick

    with pytest.raises(ValueError):
        pick({}, "fp32")
