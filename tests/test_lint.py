"""The strict, boring tooling (STYLE.md rule 10): ruff over the package, the scripts, the
examples and the tests; the layer contracts (import-linter, ``[tool.importlinter]`` in
pyproject.toml); mypy over the package and the bench kit.

All three come with the dev extra, pinned, so their rules do not move under the code; every
ignore in pyproject.toml, a ``# noqa`` or a ``# type: ignore`` carries its reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    exe = Path(sys.executable).parent / "ruff"
    if exe.exists():
        return [str(exe)]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.skip("ruff is not installed (pip install -e '.[dev]')")


def test_ruff_finds_nothing():
    result = subprocess.run([*_ruff(), "check", "--output-format", "concise", "--no-cache",
                             "bgeserve", "scripts", "tests", "examples"], cwd=ROOT,
                            capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _tool(name: str) -> str:
    exe = Path(sys.executable).parent / name
    assert exe.exists(), f"{name} is missing: pip install -e '.[dev]'"
    return str(exe)


def test_the_layer_contracts_hold():
    """http → service → engine → tuning → runtime → model, leaves importing no layer, serving
    never reaching torch or the build tools: ``lint-imports`` keeps every contract."""
    result = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_mypy_finds_nothing():
    """``mypy`` (configured in pyproject.toml) type-checks bgeserve/ and the bench kit
    (scripts/benchkit) clean."""
    result = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
