"""The import-direction rules of docs/architecture.md, checked on every module's ``ast``.

Every ``import`` statement counts, including those inside functions (lazy imports still run at
serve time); only ``if TYPE_CHECKING:`` blocks are skipped, since they never execute.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bgeserve"
# Importable from anywhere (the layer contracts themselves are import-linter's, in
# pyproject.toml and tests/test_lint.py); these import nothing of bgeserve but errors and
# cgroup (a leaf itself: the settings size their threads by it).
LEAVES = ("bgeserve.config", "bgeserve.errors", "bgeserve.results", "bgeserve.logs",
          "bgeserve.vocab", "bgeserve.cgroup", "bgeserve.tuning.costmodel")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute dotted names a module imports (``from . import x`` gives ``pkg`` and ``pkg.x``)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            found.add(base_name)
            found.update(f"{base_name}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


MODULES = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def importers_of(top: str) -> set[str]:
    """Modules importing the third-party package ``top`` (or any of its submodules)."""
    return {m for m, imps in MODULES.items()
            if any(i == top or i.startswith(top + ".") for i in imps)}


def internal_imports(module: str) -> set[str]:
    """bgeserve modules that ``module`` imports, as real module names (``a.b.name`` → ``a.b``
    when ``name`` is not itself a module)."""
    out = set()
    for imp in MODULES[module]:
        while imp.startswith("bgeserve") and imp not in MODULES:
            imp = imp.rpartition(".")[0]
        if imp.startswith("bgeserve.") and imp != module:
            out.add(imp)
    return out


def in_package(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# ----------------------------------------------------------------------------- the walker
def test_the_walker_sees_every_module_and_lazy_imports():
    """The scan covers all of bgeserve, resolves relative imports and finds function-level ones."""
    assert {"bgeserve.config", "bgeserve.engine.scheduler", "bgeserve.http.app",
            "bgeserve.runtime.onnx", "bgeserve.export.graph"} <= set(MODULES)
    assert "bgeserve.errors" in internal_imports("bgeserve.config")
    assert "bgeserve.service" in internal_imports("bgeserve.http.app")  # imported in a function
    assert "onnxruntime" in MODULES["bgeserve.runtime.onnx"]


def test_the_walker_skips_type_checking_blocks(tmp_path: Path):
    """Imports under ``if TYPE_CHECKING:`` are annotations only and are not counted."""
    pkg = tmp_path / "bgeserve"
    pkg.mkdir()
    module = pkg / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
                      "else:\n    import json\ndef f():\n    from .x import y\n")
    found = imports_of(module, root=tmp_path)
    assert "torch" not in found and "json" in found and "bgeserve.x.y" in found


# ------------------------------------------------------------------------------ the rules
def test_only_the_runtime_imports_onnxruntime_at_serve_time():
    """onnxruntime is imported by bgeserve/runtime/* alone; bgeserve/export/* may use its
    offline tools (quantization, graph optimizer), never at serve time."""
    importers = importers_of("onnxruntime")
    assert "bgeserve.runtime.onnx" in importers
    strays = {m for m in importers if not in_package(m, "bgeserve.runtime", "bgeserve.export")}
    assert strays == set()


def test_only_the_openvino_adapter_imports_openvino():
    """openvino (the optional backend) is imported by bgeserve/runtime/openvino.py alone."""
    importers = importers_of("openvino")
    assert importers == {"bgeserve.runtime.openvino"}


def test_only_the_tokenizer_module_imports_tokenizers():
    """`tokenizers` is imported by bgeserve/engine/tokenizer.py alone (and the offline builder of test
    models in bgeserve/testing/, which trains one)."""
    importers = importers_of("tokenizers")
    assert "bgeserve.engine.tokenizer" in importers
    strays = {m for m in importers if not in_package(m, "bgeserve.engine.tokenizer", "bgeserve.testing")}
    assert strays == set()


@pytest.mark.parametrize("top", ["torch", "transformers", "safetensors", "FlagEmbedding"])
def test_only_export_and_testing_import_torch_or_transformers(top):
    """The PyTorch stack appears only in bgeserve/export/ and bgeserve/testing/."""
    strays = {m for m in importers_of(top)
              if not in_package(m, "bgeserve.export", "bgeserve.testing")}
    assert strays == set()


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_import_only_errors(leaf):
    """The leaves and the pure cost model import no bgeserve module except errors and cgroup
    (which imports none)."""
    assert internal_imports(leaf) - {"bgeserve.errors", "bgeserve.cgroup"} == set()
    assert internal_imports("bgeserve.cgroup") == set()


def test_errors_imports_nothing_from_bgeserve():
    """errors.py is the bottom of the graph."""
    assert internal_imports("bgeserve.errors") == set()


def test_only_config_reads_the_environment():
    """Nothing but config.py (and the CLI edges) reads os.environ (settings arrive as values)."""
    # Edges: the CLI, `bgeserve bulk`'s, and a Ray actor's (its environment is where its
    # settings come from, as the server's come from its own).
    allowed = {"bgeserve.config", "bgeserve.cli", "bgeserve.bulk.main", "bgeserve.ray.embedder"}
    readers = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if in_package(name, "bgeserve.export", "bgeserve.testing") or name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.add(name)
    assert readers == set()


# --------------------------------------------------------------------------- at runtime
def test_serving_never_loads_torch_or_transformers():
    """Importing the service, the engine and the HTTP app leaves the PyTorch stack unloaded."""
    code = ("import sys\n"
            "import bgeserve.service, bgeserve.engine, bgeserve.http.app\n"
            "print(sorted(m for m in ('torch', 'transformers', 'FlagEmbedding', 'safetensors')"
            " if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["build-random-model", "--out", "OUT"],
                                  ["export", "--model", "M", "--out", "OUT"]])
def test_commands_that_need_torch_say_which_extra_in_a_serving_install(argv, tmp_path,
                                                                        monkeypatch, capsys):
    """``export`` and ``build-random-model`` in an install without torch (the serving one):
    exit 2 with the extra to install, not a 30-line traceback from a child step."""
    import importlib.util

    from bgeserve.cli import main

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else found(name, *a))
    argv = [str(tmp_path / x) if x in ("M", "OUT") else x for x in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"bgeserve {argv[0]}: needs torch," in err and "pip install 'bgeserve[export]'" in err
    assert not (tmp_path / "OUT").exists()
