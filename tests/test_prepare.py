"""Tests for bgeserve.export.prepare: a hub snapshot becomes a bgeserve export, without torch.

The snapshots are the tiny model as the hub's own exporters write it (conftest.hub_snapshots);
``bgeserve prepare`` runs in a child whose path makes ``import torch`` and ``import
transformers`` fail, as in a serving-only install, and which checks at exit that neither got
imported. The prepared variants must match FlagEmbedding (tests/oracle.py tolerances).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bgeserve.engine import Engine, EngineConfig
from bgeserve.engine.scheduler import SchedulerConfig
from bgeserve.export.texts import random_texts
from bgeserve.runtime import openvino
from tests.oracle import BF16, FP32, INT8, assert_matches, reference

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
# `bgeserve prepare`, then a check that the PyTorch stack was never imported.
PREPARE = ("import sys\nfrom bgeserve.cli import main\nrc = main(sys.argv[1:])\n"
           "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
           "assert not bad, f'imported {bad}'\nsys.exit(rc)\n")


def serving_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BGE_M3_", "HF_"))}
    env.update(HF_HUB_OFFLINE="1", BGE_M3_LOG_FORMAT="json", OMP_NUM_THREADS="1", **extra)
    return env


def run_prepare(snapshot: Path, cache: Path, path: str, *args: str) -> subprocess.CompletedProcess:
    env = serving_env(BGE_M3_MODEL_PATH=str(snapshot), BGE_M3_CACHE_DIR=str(cache),
                      PYTHONPATH=path)
    return subprocess.run([sys.executable, "-c", PREPARE, "prepare", *args], env=env,
                          capture_output=True, text=True, timeout=900, check=False)


def exported(result: subprocess.CompletedProcess) -> Path:
    """The directory ``bgeserve prepare`` printed: its whole stdout (the log is on stderr, so
    ``D=$(bgeserve prepare)`` gets the path alone)."""
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout[-3000:]
    return Path(lines[0])


OV_INT8 = openvino.available() and importlib.util.find_spec("nncf") is not None
VARIANTS = ["fp32", "int8", *(["bf16"] if openvino.available() else []),
            *(["ov-int8"] if OV_INT8 else [])]


@pytest.fixture(scope="module")
def prepared(hub_snapshots, tmp_path_factory, no_torch_path):
    """`bgeserve prepare` of the BAAI-layout snapshot: every CPU variant this install has."""
    cache = tmp_path_factory.mktemp("prepare-cache")
    result = run_prepare(hub_snapshots["baai"], cache, no_torch_path,
                         *(x for v in VARIANTS for x in ("--variant", v)))
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    return exported(result), result


def test_torch_is_really_unimportable_on_the_childs_path(no_torch_path) -> None:
    """The check is real: on that path, ``import torch`` fails."""
    result = subprocess.run([sys.executable, "-c", "import torch"],
                            env=serving_env(PYTHONPATH=no_torch_path), capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode != 0 and "not installed here" in result.stderr


def test_prepare_writes_a_bgeserve_export_without_torch(prepared, hub_snapshots) -> None:
    """The printed directory is a bgeserve export in the cache: every variant asked for, its
    graph in place, the sizes and the source files' hashes in the manifest."""
    path, _ = prepared
    manifest = json.loads((path / "manifest.json").read_text())

    assert path.parent.name == "prepared" and manifest["format"] == "bgeserve-export"
    assert sorted(manifest["variants"]) == sorted(VARIANTS)
    assert manifest["model"] == {"hidden": 32, "heads": 4, "intermediate": 64, "layers": 2,
                                 "max_positions": 8192, "attention_block": 256, "ffn_rows": 2048}
    for variant, entry in manifest["variants"].items():
        assert (path / entry["path"]).is_file(), variant
        assert set(entry["agreement"]) == {"dense_cos_min", "dense_cos_mean", "sparse_max_abs",
                                           "texts"}
    assert manifest["variants"]["fp32"]["agreement"]["dense_cos_min"] >= 0.99999
    # int8's weight encoding, in the entry as an export records it (runtime.select reads it)
    assert manifest["variants"]["int8"]["quantization"] == {
        "weights": manifest["prepared"]["int8_weights"]}
    if OV_INT8:  # NNCF's report, as `bgeserve export` records it; the encoding this CPU gets
        from bgeserve.model.prepared import sums_int8_in_int32

        entry = manifest["variants"]["ov-int8"]
        assert entry["path"] == "ov-int8/model.xml" and entry["runtime"] == "openvino"
        quantization = entry["quantization"]
        assert quantization["tool"].startswith("nncf ") and quantization["int8_matmuls"] == 12
        assert quantization["weights"] == ("8-bit" if sums_int8_in_int32() else "7-bit")
        assert entry["agreement"]["dense_cos_min"] >= INT8.dense_cos
        assert sorted(p.name for p in (path / "ov-int8").iterdir()) == ["model.bin", "model.xml"]
    files = manifest["source"]["files"]
    assert {"model.onnx", "model.onnx_data", "tokenizer.json"} <= set(files)
    assert manifest["source"]["layout"] == "baai" and not manifest["prepared"]["skipped"]
    assert not (path / ".work").exists()
    assert (hub_snapshots["baai"] / "onnx" / "model.onnx_data").stat().st_nlink == 1


def test_prepare_logs_each_step_as_json(prepared) -> None:
    """Every step is a JSON log line with its name and place, and the children's own lines
    follow under the step's name."""
    _, result = prepared
    lines = [json.loads(x) for x in result.stderr.splitlines() if x.startswith("{")]
    steps = [x["step"] for x in lines if x.get("msg", "").startswith("start-up step:")]
    names = ["graphs", *(v for v in VARIANTS if v != "fp32"), "FFN row blocks", "validation"]
    assert steps == ["hashing the model files", *(f"prepare: {n}" for n in names)]
    details = [x for x in lines if x.get("step") == "prepare: validation"
               and "fp32:" in x.get("msg", "")]
    assert details and "dense_cos_min" in details[0]["msg"]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """1 to 8192+ tokens: short texts in padded chunks, long ones in several attention
    blocks, and one past 8192 tokens that runs alone (the fused, unpadded attention)."""
    short = random_texts(2024, 16, 1, 60)
    long = [" ".join(random_texts(s, 40, 30, 40)) for s in (1, 2)]
    return short + ["", "a"] + long + [" ".join(random_texts(99, 400, 30, 40))]


@pytest.fixture(scope="module")
def ref(flag_model, texts):
    return reference(flag_model, texts)


@pytest.mark.parametrize(("variant", "tol"), [("fp32", FP32), ("int8", INT8), ("bf16", BF16),
                                              ("ov-int8", INT8)])
def test_prepared_variants_match_flagembedding(variant, tol, prepared, texts, ref,
                                               tmp_path) -> None:
    """Each prepared variant agrees with FlagEmbedding fp32 within its variant's tolerance."""
    path, _ = prepared
    if variant not in VARIANTS:
        pytest.skip("openvino (and, for ov-int8, nncf) is not installed")
    config = EngineConfig(scheduler=SchedulerConfig(max_chunk=8))
    with Engine(path, variant, config=config, cache_dir=tmp_path, offline=True) as engine:
        ours = engine.embed(texts, dense=True, sparse=True, colbert=True)
    assert ours.n_tokens[-1] == 8192
    assert_matches(ours, ref, tol)


def _inodes(root: Path, manifest: dict, variant: str) -> dict[str, int]:
    graph = root / manifest["variants"][variant]["path"]
    return {p.name: p.stat().st_ino for p in (graph, *graph.parent.iterdir())}


def _validated(result: subprocess.CompletedProcess) -> list[str]:
    """What the validation step said it validates ("int8 against the hub graph", ...)."""
    lines = [json.loads(x) for x in result.stderr.splitlines() if x.startswith("{")]
    return [m.split("validating ", 1)[1] for x in lines if x.get("step") == "prepare: validation"
            and "validating " in (m := x.get("msg", ""))]


def _steps(result: subprocess.CompletedProcess) -> list[str]:
    lines = [json.loads(x) for x in result.stderr.splitlines() if x.startswith("{")]
    return [x["step"] for x in lines if x.get("msg", "").startswith("start-up step:")]


def test_a_variant_asked_for_later_is_added_and_the_others_kept(hub_snapshots, tmp_path,
                                                                no_torch_path, prepared) -> None:
    """A preparation asked for a variant the cached one lacks makes that one only: the others
    are the earlier files (hard links, one link each once the old directory is gone) with
    their recorded agreement, only the new one is validated, and the graphs are those one
    preparation of all of them writes."""
    cache = tmp_path / "cache"
    first = run_prepare(hub_snapshots["baai"], cache, no_torch_path, "--variant", "fp32")
    assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]
    path = exported(first)
    before = json.loads((path / "manifest.json").read_text())
    fp32_files = _inodes(path, before, "fp32")

    second = run_prepare(hub_snapshots["baai"], cache, no_torch_path,
                         "--variant", "fp32", "--variant", "int8")
    assert second.returncode == 0, second.stderr[-3000:] + second.stdout[-3000:]
    assert exported(second) == path
    after = json.loads((path / "manifest.json").read_text())
    assert sorted(after["variants"]) == ["fp32", "int8"]
    assert after["prepared"]["reused"] == ["fp32"]
    assert _inodes(path, after, "fp32") == fp32_files
    assert all(p.stat().st_nlink == 1 for p in (path / "fp32").iterdir())
    assert after["variants"]["fp32"]["agreement"] == before["variants"]["fp32"]["agreement"]
    assert _validated(second) == ["int8 against the hub graph"]
    assert not list(cache.glob("prepared/.*.tmp"))  # the old directory is gone, not left over
    whole = json.loads((prepared[0] / "manifest.json").read_text())  # all variants at once
    for variant in ("fp32", "int8"):
        assert after["variants"][variant]["sha256"] == whole["variants"][variant]["sha256"]
    if not openvino.available():
        return
    # bf16 on top, asked for without int8 (`prepare --variant bf16`): fp32 and int8 kept
    # (int8 used to be dropped from the export that replaced the old one), nothing new to cut
    # into FFN row blocks.
    int8_files = _inodes(path, after, "int8")
    third = run_prepare(hub_snapshots["baai"], cache, no_torch_path,
                        *(x for v in ("fp32", "bf16") for x in ("--variant", v)))
    assert third.returncode == 0, third.stderr[-3000:] + third.stdout[-3000:]
    assert exported(third) == path
    last = json.loads((path / "manifest.json").read_text())
    assert sorted(last["variants"]) == ["bf16", "fp32", "int8"]
    assert last["prepared"]["reused"] == ["fp32", "int8"]
    assert _inodes(path, last, "fp32") == fp32_files and _inodes(path, last, "int8") == int8_files
    assert _validated(third) == ["bf16 against the hub graph"]
    assert _steps(third) == ["hashing the model files", "prepare: graphs", "prepare: bf16",
                             "prepare: validation"]
    assert last["variants"]["bf16"]["sha256"] == whole["variants"]["bf16"]["sha256"]


def test_a_xenova_snapshot_is_prepared_from_its_fp32_graph(hub_snapshots, tmp_path,
                                                           no_torch_path) -> None:
    """Xenova's layout (model.onnx beside model_fp16 / model_quantized, last_hidden_state) is
    prepared from its fp32 graph, read as the hidden-state layout; ``--out`` writes the export
    where asked."""
    root = tmp_path / "xenova"
    shutil.copytree(hub_snapshots["optimum"], root)
    for name in ("model_fp16.onnx", "model_quantized.onnx"):  # only their outputs are read
        shutil.copyfile(root / "onnx" / "model.onnx", root / "onnx" / name)

    out = tmp_path / "standalone"
    result = run_prepare(root, tmp_path / "cache", no_torch_path, "--variant", "fp32",
                         "--out", str(out))

    assert result.returncode == 0, result.stderr[-3000:]
    assert exported(result) == out  # --out: a copy outside the cache
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["layout"] == "hidden" and list(manifest["variants"]) == ["fp32"]
    assert (out / "fp32" / "model.onnx").is_file() and (out / "tokenizer.json").is_file()
    assert manifest["variants"]["fp32"]["agreement"]["dense_cos_min"] >= 0.99999



# The prepare child running one step (a sleep that prints its pid), as ``main`` sets it up.
STEP_CHILD = (
    "import sys\nfrom bgeserve.export import prepare as p\n"
    "p._stop_on_sigterm()\np.die_with_parent()\n"
    "step = 'import os, sys, time; print(os.getpid(), file=sys.stderr, flush=True); "
    "time.sleep(120)'\n"
    "p._Runner(['step'], None, lambda line: print(line, flush=True))("
    "'step', ['timeit', '-n1', '-r1', step])\n")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_step_ends_with_the_prepare_child(sig) -> None:
    """SIGTERM (the server stopping it, or dying: die_with_parent) or SIGKILL to the prepare
    child: the step it runs ends too (SIGKILL: by the step's own parent-death signal), never
    orphaned holding gigabytes."""
    import signal
    import time

    child = subprocess.Popen([sys.executable, "-c", STEP_CHILD], stdout=subprocess.PIPE,
                             text=True, cwd=REPO)
    assert child.stdout is not None
    step = int(child.stdout.readline())
    try:
        os.kill(child.pid, getattr(signal, sig))
        child.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(step) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(step) and child.returncode == (143 if sig == "SIGTERM" else -9)
    finally:  # nothing left running when it fails
        for pid in (child.pid, step):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        child.wait()


def test_a_failed_step_says_its_exception_not_its_traceback(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A step that raises: its progress lines are reported, its traceback is not (a disk
    filling up gave 95 INFO lines of it as progress), and the failure names the exception's
    line (it was a traceback fragment: "... writable.write(content) | OSError: ...")."""
    from bgeserve.export.prepare import PrepareFailed, _Runner

    (tmp_path / "failing_step.py").write_text(
        "import sys\n"
        "print('writing the graph', file=sys.stderr)\n"
        "def write():\n"
        "    raise OSError(28, 'No space left on device')\n"
        "write()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    lines: list[str] = []
    run = _Runner(["graphs"], None, lines.append)
    with pytest.raises(PrepareFailed) as failed:
        run("graphs", ["failing_step"])
    assert str(failed.value).endswith("OSError: [Errno 28] No space left on device"), failed.value
    assert "Traceback" not in str(failed.value) and "write()" not in str(failed.value)
    assert lines[0] == "writing the graph"
    assert not any("Traceback" in line or line.startswith("  ") for line in lines), lines
