"""``ruff check`` over the package, the scripts and the tests is clean (STYLE.md, tooling).

ruff comes with the dev extra (pinned, so its default rules do not move under the code); every
ignore in pyproject.toml or a ``# noqa`` carries its reason.
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
                             "bgeserve", "scripts", "tests"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
