"""scripts/ov_nodes.py: OpenVINO's time by node type, and two IRs side by side."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from tests.scriptload import load_script


@pytest.fixture(scope="module")
def script():
    module = load_script("ov_nodes")
    yield module
    sys.modules.pop("ov_nodes_under_test", None)


def test_shapes_parse_and_bad_ones_are_refused(script) -> None:
    assert script.parse_shape("4x256") == (4, 256) and script.parse_shape("1X512") == (1, 512)
    for bad in ("4", "x256", "0x8", "4x1", "ax2"):
        with pytest.raises(argparse.ArgumentTypeError):
            script.parse_shape(bad)


def test_counters_sum_by_type_and_kernel_with_their_shares(script) -> None:
    types, kernels = script.by_type([("FullyConnected", "brgemm_i8", 0.006),
                                     ("Transpose", "ref", 0.001),
                                     ("FullyConnected", "brgemm_i8", 0.002),
                                     ("FullyConnected", "brgemm_bf16", 0.001)])
    assert types == pytest.approx({"FullyConnected": 0.009, "Transpose": 0.001})
    assert kernels[("FullyConnected", "brgemm_i8")] == pytest.approx(0.008)
    assert script.shares(types) == [("FullyConnected", pytest.approx(9.0), pytest.approx(90.0)),
                                    ("Transpose", pytest.approx(1.0), pytest.approx(10.0))]


@pytest.mark.slow
def test_it_profiles_an_ir_and_compares_two(script, tiny_export_bf16: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    xml = str(tiny_export_bf16 / "bf16" / "model.xml")
    assert script.main([xml, "--shape", "2x16", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "| FullyConnected |" in out
    assert script.main([xml, "--against", xml, "--shape", "2x16", "--rounds", "2",
                        "--tokens", "64"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2x16"))
    assert row.split("|")[-2].strip() == "1.000000"  # the same IR: the same vectors
