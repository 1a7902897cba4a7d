"""Shared fixtures: a tiny random bge-m3 (built once per run), its exports, FlagEmbedding."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The oracle and the exporter import torch; keep them from oversubscribing the 2 CI cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Fake hubs serve files at bge-m3's and the reranker's pinned revisions: a test that forgets
# its own cache must not leave them in the user's Hugging Face cache (a later real start
# would take them for the hub's).
if "HF_HUB_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="bgeserve-tests-hf-")
    # Removed at the end of the run (each run left one behind in /tmp).
    atexit.register(shutil.rmtree, os.environ["HF_HUB_CACHE"], ignore_errors=True)


def in_parallel(*argvs: list[str]) -> None:
    """Run independent build steps as concurrent children; fail if any fails. Each spends
    most of its ~8 s importing torch and transformers on one core: two at once on the
    2-core CI machine take the time of one."""
    import subprocess

    children = [subprocess.Popen(argv, stdout=subprocess.DEVNULL) for argv in argvs]
    failed = [c.args for c in children if c.wait() != 0]
    assert not failed, f"build steps failed: {failed}"


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_root: Path) -> Path:
    """A tiny (2 layers, hidden 32) random-weight bge-m3 in Hugging Face layout."""
    from bgeserve.testing.randmodel import cached_random_model

    return cached_random_model(models_root, "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_export(tiny_model: Path, models_root: Path) -> Path:
    """``bgeserve export`` of the tiny model: fp32, fp16 and int8."""
    from bgeserve.export.main import export

    out = models_root / "tiny-export"
    if not (out / "manifest.json").exists():
        export(str(tiny_model), out, ("fp32", "fp16", "int8"))
    return out


@pytest.fixture(scope="session")
def tiny_fp32_unblocked(tiny_model: Path, models_root: Path) -> Path:
    """The tiny model's fp32 graph without FFN row blocks (``--ffn-rows 0``): what the int8
    step smooths and quantizes."""
    from bgeserve.export.main import export

    out = models_root / "tiny-export-unblocked"
    if not (out / "manifest.json").exists():
        export(str(tiny_model), out, ("fp32",), ffn_rows=0)
    return out / "fp32" / "model.onnx"


@pytest.fixture(scope="session")
def tiny_export_bf16(tiny_model: Path, models_root: Path) -> Path:
    """``bgeserve export --variant bf16`` of the tiny model (an OpenVINO IR); skips without
    the openvino package (``bgeserve[openvino]``, in the dev extra)."""
    from bgeserve.export.main import export
    from bgeserve.runtime import openvino

    if not openvino.available():
        pytest.skip("openvino is not installed: pip install 'bgeserve[openvino]'")
    out = models_root / "tiny-export-bf16"
    if not (out / "manifest.json").exists():
        export(str(tiny_model), out, ("bf16",))
    return out


@pytest.fixture(scope="session")
def tiny_export_ov_int8(tiny_model: Path, models_root: Path) -> Path:
    """``bgeserve export --variant fp32 --variant ov-int8`` of the tiny model (NNCF's int8 IR,
    validated against the fp32 graph); skips without openvino or nncf (bgeserve's own
    dependencies on x86-64)."""
    from bgeserve.export import ovint8
    from bgeserve.export.main import export
    from bgeserve.runtime import openvino

    if not (openvino.available() and ovint8.available()):
        pytest.skip("ov-int8 needs openvino and nncf (bgeserve installs both on x86-64)")
    out = models_root / "tiny-export-ov-int8"
    if not (out / "manifest.json").exists():
        export(str(tiny_model), out, ("fp32", "ov-int8"))
    return out


@pytest.fixture(scope="session")
def hub_layouts(tiny_model: Path, models_root: Path) -> dict[str, Path]:
    """Fake hub snapshots of the tiny model in the reference server's layouts.

    ``baai``: ``onnx/model.onnx`` (sentence_embedding, token_embeddings) + head .pt files;
    ``xenova``: ``onnx/model_fp16.onnx`` and ``onnx/model_quantized.onnx`` (last_hidden_state).
    """
    import json
    import shutil
    import subprocess
    import sys

    def step(*args: str) -> list[str]:
        # In a child, like `bgeserve export`: torch's tracer must not run inside pytest, whose
        # warnings-as-errors turn its internal warnings into SystemErrors.
        return [sys.executable, "-m", "bgeserve.export.steps", *args]

    baai, xenova = models_root / "hub-baai", models_root / "hub-xenova"
    if not (baai / "onnx" / "model.onnx").exists():
        hidden = xenova / "fp32.onnx"
        in_parallel(step("fp32", str(tiny_model), str(baai / "onnx" / "model.onnx"),
                         "--layout", "baai"),
                    step("fp32", str(tiny_model), str(hidden), "--layout", "xenova"))
        cfg = json.loads((tiny_model / "config.json").read_text())
        subprocess.run(step("fp16", str(hidden), str(xenova / "onnx" / "model_fp16.onnx"),
                            "--heads", str(cfg["num_attention_heads"]),
                            "--hidden", str(cfg["hidden_size"])), check=True)
        # Xenova's hub graph is plain dynamic quantization; our export adds SmoothQuant.
        subprocess.run(step("int8", str(hidden), str(xenova / "onnx" / "model_quantized.onnx"),
                            "--recipe", "dynamic"), check=True)
        hidden.unlink()
    # As on the hub, each snapshot has the model's config.json (its sizes) beside the tokenizer.
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "sparse_linear.pt", "colbert_linear.pt", "config.json"):
        for root in (baai, xenova):
            if not (root / name).exists():
                shutil.copyfile(tiny_model / name, root / name)
    return {"baai": baai, "xenova": xenova}


@pytest.fixture(scope="session")
def flag_model(tiny_model: Path):
    """FlagEmbedding's BGEM3FlagModel on the tiny model, fp32 on CPU: the oracle."""
    from FlagEmbedding import BGEM3FlagModel

    return BGEM3FlagModel(str(tiny_model), use_fp16=False, devices="cpu")


@pytest.fixture(scope="session")
def hub_snapshots(tiny_model: Path, models_root: Path) -> dict[str, Path]:
    """Hub-layout snapshots of the tiny model made by transformers' own encoder traced with
    torch.onnx (bgeserve.testing.hubsnap), as the hub's exporters write them: ``baai``
    (sentence_embedding + token_embeddings, opset 17, one external weights file) and
    ``optimum`` (last_hidden_state, opset 14: LayerNorm spelled out), both with the head files."""
    import sys

    out = {layout: models_root / f"snapshot-{layout}" for layout in ("baai", "optimum")}
    # Children, as for hub_layouts: torch's tracer must not run under pytest's warnings.
    in_parallel(*([sys.executable, "-m", "bgeserve.testing.hubsnap", str(tiny_model),
                   str(path), "--layout", layout] for layout, path in out.items()
                  if not (path / "onnx" / "model.onnx").exists()))
    return out


@pytest.fixture(scope="session")
def tiny_reranker(models_root: Path) -> Path:
    """A tiny random-weight bge-reranker-v2-m3 (XLMRobertaForSequenceClassification, one
    label) with the tiny bge-m3's tokenizer."""
    from bgeserve.testing.randreranker import cached_random_reranker

    return cached_random_reranker(models_root, "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_reranker_export(tiny_reranker: Path, models_root: Path) -> Path:
    """``bgeserve export`` of the tiny reranker: fp32 and int8, and bf16 (an OpenVINO IR)
    where the openvino package is installed; validated against fp32 in the manifest."""
    from bgeserve.export.main import export

    out = models_root / "tiny-reranker-export"
    if not (out / "manifest.json").exists():
        export(str(tiny_reranker), out)
    return out


@pytest.fixture(scope="session")
def no_torch_path(tmp_path_factory) -> str:
    """A PYTHONPATH on which ``import torch`` / ``import transformers`` raise ImportError."""
    root = tmp_path_factory.mktemp("no-torch")
    for name in ("torch", "transformers"):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not installed here (serving-only install)')\n")
    return f"{root}{os.pathsep}{Path(__file__).resolve().parent.parent}"


@pytest.fixture(scope="session")
def flag_reranker(tiny_reranker: Path):
    """FlagEmbedding's FlagReranker on the tiny reranker, fp32 on CPU: the oracle."""
    from FlagEmbedding import FlagReranker

    return FlagReranker(str(tiny_reranker), use_fp16=False, devices="cpu")


@pytest.fixture(scope="session")
def tiny_reranker_stock(tiny_reranker: Path, models_root: Path) -> Path:
    """The tiny reranker as the hub ships one: config, tokenizer, weights and a
    plain-attention ``onnx/model.onnx`` whose output is ``logits`` [B, 1]."""
    import shutil
    import subprocess
    import sys

    out = models_root / "reranker-stock"
    if not (out / "onnx" / "model.onnx").exists():
        shutil.copytree(tiny_reranker, out, dirs_exist_ok=True)
        subprocess.run([sys.executable, "-m", "bgeserve.export.steps", "fp32", str(tiny_reranker),
                        str(out / "onnx" / "model.onnx"), "--layout", "logits"], check=True)
    return out
