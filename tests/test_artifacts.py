"""Tests for bgeserve.artifacts: layout detection, cache-dir checks, and hub downloads.

No test touches the network: downloads go to a fake Hugging Face endpoint on 127.0.0.1 that
serves ``/{repo_id}/resolve/{revision}/{filename}`` the way huggingface_hub expects (HEAD with
``X-Repo-Commit`` / ``ETag`` / ``Content-Length``, then GET).
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bgeserve.errors import ConfigError, ModelUnavailable
from bgeserve.model.artifacts import (
    BAAI_REPO,
    BAAI_REVISION,
    HUB_SOURCES,
    XENOVA_REPO,
    XENOVA_REVISION,
    Layout,
    ModelArtifacts,
    resolve,
    validate_cache_dir,
)
from tests.fakehub import FakeHub
from tests.graphs import BAAI_OUTPUTS, HIDDEN_OUTPUTS, graph_bytes

HIDDEN = 8


def _pt_bytes(state: dict[str, np.ndarray]) -> bytes:
    """What ``torch.save(state_dict)`` writes for float32 tensors, built without torch.

    A zip of ``archive/data.pkl`` (a protocol-2 pickle of an OrderedDict of
    ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)``,
    each storage a persistent id) and ``archive/data/<key>`` (the raw little-endian floats), so
    the hub tests run where torch is not installed (a serving-only environment).
    """

    def text(value: str) -> bytes:
        raw = value.encode()
        return b"X" + struct.pack("<I", len(raw)) + raw

    def ints(values: tuple[int, ...]) -> bytes:
        return b"(" + b"".join(b"J" + struct.pack("<i", v) for v in values) + b"t"

    ordered_dict = b"ccollections\nOrderedDict\n)R"
    pickled = b"\x80\x02" + ordered_dict + b"("
    storages = {}
    for key, (name, array) in enumerate(state.items()):
        array = np.ascontiguousarray(array, dtype="<f4")
        storages[str(key)] = array.tobytes()
        storage = b"(" + text("storage") + b"ctorch\nFloatStorage\n" + text(str(key))
        storage += text("cpu") + b"J" + struct.pack("<i", array.size) + b"tQ"
        stride = tuple(int(np.prod(array.shape[i + 1 :])) for i in range(array.ndim))
        pickled += text(name) + b"ctorch._utils\n_rebuild_tensor_v2\n("
        pickled += storage + b"J\0\0\0\0" + ints(array.shape) + ints(stride)
        pickled += b"\x89" + ordered_dict + b"tR"
    pickled += b"u."
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/byteorder", "little")
        for key, raw in storages.items():
            archive.writestr(f"archive/data/{key}", raw)
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


def _heads_bytes() -> dict[str, bytes]:
    """sparse_linear.pt / colbert_linear.pt contents (nn.Linear state dicts) for hidden size 8."""
    rng = np.random.default_rng(0)
    return {
        name: _pt_bytes(
            {"weight": rng.standard_normal((rows, HIDDEN)), "bias": rng.standard_normal(rows)}
        )
        for name, rows in (("sparse_linear.pt", 1), ("colbert_linear.pt", HIDDEN))
    }


@pytest.fixture(scope="module")
def heads() -> dict[str, bytes]:
    return _heads_bytes()


def _write(root: Path, files: dict[str, bytes | str]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return root


# --- local directories -------------------------------------------------------------------------


def _export(
    root: Path,
    names: tuple[str, ...] = ("fp32", "int8"),
    overrides: dict[str, object] | None = None,
) -> Path:
    files: dict[str, bytes | str] = {"tokenizer.json": "{}"}
    entries = {}
    for variant in names:
        files[f"{variant}/model.onnx"] = f"graph-{variant}"
        entries[variant] = {
            "path": f"{variant}/model.onnx",
            "sha256": "0" * 64,
            "bytes": len(f"graph-{variant}"),
        }
    files["fp32/model.onnx_data"] = b"\0" * 32
    manifest = {
        "format": "bgeserve-export",
        "schema": 1,
        "bgeserve_version": "0.1.0",
        "opset": 18,
        "hidden_size": HIDDEN,
        "outputs": ["dense", "sparse_weights", "colbert"],
        "variants": entries,
        "tokenizer": "tokenizer.json",
        "source": {"model": "BAAI/bge-m3"},
    }
    manifest.update(overrides or {})
    files["manifest.json"] = json.dumps(manifest)
    return _write(root, files)


def test_bgeserve_export_is_detected(tmp_path: Path) -> None:
    """A directory with a bgeserve-export manifest resolves to its variant's graph, heads in-graph."""
    root = _export(tmp_path / "export")

    art = resolve(model_path=root, variant="fp32", cache_dir=tmp_path / "cache", offline=True)

    assert art.layout is Layout.BGESERVE and art.layout.outputs == (
        "dense",
        "sparse_weights",
        "colbert",
    )
    assert art.onnx_path == root / "fp32/model.onnx"
    assert art.tokenizer_path == root / "tokenizer.json"
    assert art.heads is None
    assert art.external_data == (root / "fp32/model.onnx_data",)
    assert art.source == f"local export {root} (fp32, onnxruntime)"
    assert (
        resolve(model_path=root, variant="int8", cache_dir=tmp_path / "cache").onnx_path
        == root / "int8/model.onnx"
    )


def test_export_without_the_requested_variant_says_how_to_export_it(tmp_path: Path) -> None:
    """Asking an export for a variant it lacks lists what it has and the export command."""
    root = _export(tmp_path / "export")

    with pytest.raises(ModelUnavailable) as info:
        resolve(model_path=root, variant="fp16", cache_dir=tmp_path / "cache")

    assert "fp32, int8" in info.value.message
    assert f"bgeserve export --model BAAI/bge-m3 --out {root} --variant fp16" in info.value.message
    assert info.value.param == "BGE_M3_MODEL"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"schema": 2}, "schema 2"),
        (
            {"variants": {"fp32": {"path": "../outside.onnx", "bytes": 1}}},
            "not a path inside the export",
        ),
        ({"variants": {"fp32": {"path": "fp32/missing.onnx", "bytes": 1}}}, "is missing"),
        (
            {"variants": {"fp32": {"path": "fp32/model.onnx", "bytes": 999}}},
            "manifest.json says 999",
        ),
        ({"tokenizer": "nope.json"}, "nope.json"),
    ],
)
def test_broken_export_manifests_are_refused(
    tmp_path: Path, overrides: dict[str, object], match: str
) -> None:
    """Unknown schema, escaping or missing paths, size mismatch and a missing tokenizer are refused."""
    (tmp_path / "outside.onnx").write_text("x")
    root = _export(tmp_path / "export", overrides=overrides)

    with pytest.raises(ModelUnavailable, match=match):
        resolve(model_path=root, variant="fp32", cache_dir=tmp_path / "cache")


def _baai(root: Path, heads: dict[str, bytes]) -> Path:
    return _write(
        root,
        {
            "onnx/model.onnx": graph_bytes(BAAI_OUTPUTS),
            "onnx/model.onnx_data": b"\0" * 64,
            "onnx/Constant_7_attr__value": b"\1",
            "onnx/tokenizer.json": "{}",
            "onnx/config.json": "{}",
            "onnx/sentencepiece.bpe.model": "x",
            "tokenizer.json": "{}",
            "config.json": "{}",
            "pytorch_model.bin": "w",
            **heads,
        },
    )


def test_baai_snapshot_is_detected(tmp_path: Path, heads: dict[str, bytes]) -> None:
    """BAAI/bge-m3's layout: onnx/model.onnx with external data, heads loaded from the .pt files."""
    root = _baai(tmp_path / "baai", heads)

    art = resolve(model_path=root, variant="fp32", cache_dir=tmp_path / "cache", offline=True)

    assert art.layout is Layout.BAAI and art.variant == "fp32"
    assert art.onnx_path == root / "onnx/model.onnx"
    assert art.tokenizer_path == root / "tokenizer.json"
    assert art.external_data == (
        root / "onnx/Constant_7_attr__value",
        root / "onnx/model.onnx_data",
    )
    assert art.heads is not None and art.heads.colbert_weight.shape == (HIDDEN, HIDDEN)
    assert art.source == f"local BAAI/bge-m3 snapshot {root} (fp32)"


def test_snapshot_without_the_requested_variant_lists_what_it_has(
    tmp_path: Path, heads: dict[str, bytes]
) -> None:
    """A BAAI snapshot asked for int8 names the graph it lacks, what it has, and the export route."""
    root = _baai(tmp_path / "baai", heads)

    with pytest.raises(ModelUnavailable) as info:
        resolve(model_path=root, variant="int8", cache_dir=tmp_path / "cache", offline=True)

    assert "onnx/model_quantized.onnx" in info.value.message
    assert "fp32 (onnx/model.onnx)" in info.value.message
    assert "bgeserve export" in info.value.message
    # int8 can be made from its fp32 graph (what a server's start does; the library does not)
    assert "bgeserve prepare --variant int8 --out OUT" in info.value.message
    assert "variant=" in info.value.message  # the library's name for BGE_M3_MODEL
    with pytest.raises(ModelUnavailable) as info:  # fp16 is no prepared variant
        resolve(model_path=root, variant="fp16", cache_dir=tmp_path / "cache", offline=True)
    assert "bgeserve prepare" not in info.value.message
    for variant in ("bf16", "ov-int8"):  # no snapshot holds them (a KeyError before)
        with pytest.raises(ModelUnavailable) as info:
            resolve(model_path=root, variant=variant, cache_dir=tmp_path / "cache",
                    offline=True)
        assert f"bgeserve prepare --variant {variant} --out OUT" in info.value.message


@pytest.mark.parametrize(
    ("variant", "graph"), [("fp16", "onnx/model_fp16.onnx"), ("int8", "onnx/model_quantized.onnx")]
)
def test_xenova_snapshot_with_local_heads_is_detected(
    tmp_path: Path, heads: dict[str, bytes], variant: str, graph: str
) -> None:
    """Xenova's fp16/int8 graphs resolve to the hidden-state layout, heads from the same directory."""
    root = _write(
        tmp_path / "xenova",
        {
            graph: graph_bytes(HIDDEN_OUTPUTS),
            "tokenizer.json": "{}",
            "onnx/model.onnx": graph_bytes(HIDDEN_OUTPUTS),
            **heads,
        },
    )

    art = resolve(model_path=root, variant=variant, cache_dir=tmp_path / "cache", offline=True)

    assert art.layout is Layout.HIDDEN and art.layout.outputs == ("last_hidden_state",)
    assert art.onnx_path == root / graph
    assert art.external_data == ()
    assert art.heads is not None and art.heads.hidden_size == HIDDEN


def test_xenova_snapshot_without_heads_offline_and_uncached_is_refused(tmp_path: Path) -> None:
    """No .pt heads beside a Xenova graph, offline, empty cache: a clear error, no download."""
    root = _write(
        tmp_path / "xenova",
        {"onnx/model_quantized.onnx": graph_bytes(HIDDEN_OUTPUTS), "tokenizer.json": "{}"},
    )

    with pytest.raises(ModelUnavailable) as info:
        resolve(
            model_path=root,
            variant="int8",
            cache_dir=tmp_path / "cache",
            hub_cache=tmp_path / "hub",
            offline=True,
        )

    assert "sparse_linear.pt" in info.value.message and str(root) in info.value.message
    assert "offline" in info.value.message and str(tmp_path / "hub") in info.value.message


def test_pytorch_only_directory_says_to_export(tmp_path: Path) -> None:
    """A Hugging Face PyTorch snapshot without ONNX points the user at `bgeserve export`."""
    root = _write(
        tmp_path / "pt", {"config.json": "{}", "model.safetensors": "w", "tokenizer.json": "{}"}
    )

    with pytest.raises(ModelUnavailable) as info:
        resolve(model_path=root, variant="fp32", cache_dir=tmp_path / "cache")

    assert f"bgeserve export --model {root} --out OUT" in info.value.message
    assert "BGE_M3_MODEL_PATH" in info.value.message


def test_unrecognised_and_missing_directories_are_refused(tmp_path: Path) -> None:
    """An empty directory says what was looked for; a missing one says so."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelUnavailable, match="looked for manifest.json"):
        resolve(model_path=tmp_path / "empty", variant="fp32", cache_dir=tmp_path / "cache")
    with pytest.raises(ModelUnavailable, match=r"\(BGE_M3_MODEL_PATH\) does not exist"):
        resolve(model_path=tmp_path / "nope", variant="fp32", cache_dir=tmp_path / "cache")


def test_unknown_variant_is_a_config_error(tmp_path: Path) -> None:
    """A variant outside fp32/fp16/int8 is refused naming BGE_M3_MODEL."""
    with pytest.raises(ConfigError) as info:
        resolve(model_path=tmp_path, variant="q4", cache_dir=tmp_path / "cache")
    assert info.value.param == "BGE_M3_MODEL"


def test_identity_tracks_graph_and_external_data(tmp_path: Path) -> None:
    """identity() names each graph file with size and mtime, and changes when data changes."""
    root = _export(tmp_path / "export")
    art = resolve(model_path=root, variant="fp32", cache_dir=tmp_path / "cache")
    before = art.identity()

    assert before.startswith("model.onnx:") and ";model.onnx_data:32:" in before
    (root / "fp32/model.onnx_data").write_bytes(b"\0" * 33)
    assert art.identity() != before
    (root / "fp32/model.onnx_data").unlink()
    with pytest.raises(ModelUnavailable, match="is gone"):
        art.identity()


def test_local_resolution_imports_neither_torch_nor_the_hub_client(
    tmp_path: Path, heads: dict[str, bytes]
) -> None:
    """Resolving a local BAAI snapshot (heads included) imports no torch, transformers, huggingface_hub."""
    root = _baai(tmp_path / "baai", heads)
    script = (
        "import sys\nfrom pathlib import Path\nfrom bgeserve.model.artifacts import resolve\n"
        f"art = resolve(model_path=Path({str(root)!r}), variant='fp32', cache_dir=Path({str(tmp_path / 'c')!r}))\n"
        "assert art.heads is not None\n"
        "bad = [m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# --- cache directory -----------------------------------------------------------------------------


def test_cache_dir_is_created(tmp_path: Path) -> None:
    """A missing cache directory (and its parents) is created and returned."""
    path = validate_cache_dir(tmp_path / "a" / "b")
    assert path.is_dir() and not list(path.iterdir())


@pytest.mark.parametrize("sub", ["", "sub/dir"])
def test_cache_dir_through_a_regular_file_is_refused(tmp_path: Path, sub: str) -> None:
    """A cache path that is, or runs through, a regular file is refused naming that file."""
    blocker = tmp_path / "file"
    blocker.write_text("x")

    with pytest.raises(ModelUnavailable) as info:
        validate_cache_dir(blocker / sub if sub else blocker)

    assert f"{blocker} is a regular file" in info.value.message
    assert info.value.param == "BGE_M3_CACHE_DIR"


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions"
)
def test_read_only_cache_dir_is_refused(tmp_path: Path) -> None:
    """A read-only directory fails the real write check; a path below it cannot be created."""
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o555)
    try:
        with pytest.raises(ModelUnavailable, match="not writable"):
            validate_cache_dir(readonly)
        with pytest.raises(ModelUnavailable, match="cannot create it"):
            validate_cache_dir(readonly / "cache")
    finally:
        readonly.chmod(0o755)


# --- hub downloads through a fake endpoint ------------------------------------------------------


def _hub_files(heads: dict[str, bytes]) -> dict[tuple[str, str, str], bytes]:
    files = {(BAAI_REPO, BAAI_REVISION, name): content for name, content in heads.items()}
    for variant, source in HUB_SOURCES.items():
        for name in (source.onnx, *source.external_data):
            files[(source.repo_id, source.revision, name)] = f"{variant}:{name}".encode()
        files[(source.repo_id, source.revision, source.tokenizer)] = (
            f'{{"repo": "{source.repo_id}"}}'.encode()
        )
    return files


@pytest.fixture
def hub(heads: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    from huggingface_hub import constants

    # The hub client reads these at import time or per client; make the loopback server reachable.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    fake = FakeHub(_hub_files(heads))
    yield fake
    fake.stop()


def test_fp32_download_fetches_baai_graph_data_tokenizer_and_heads(
    tmp_path: Path, hub: FakeHub
) -> None:
    """fp32 from the hub: BAAI/bge-m3's graph, both external-data files, tokenizer, both heads."""
    cache = tmp_path / "cache"

    art = resolve(
        model_path=None,
        variant="fp32",
        cache_dir=tmp_path / "bgeserve",
        hub_cache=cache,
        endpoint=hub.url,
        progress=False,
    )

    assert sorted(hub.downloaded()) == sorted(
        [
            (BAAI_REPO, f)
            for f in (
                "onnx/model.onnx",
                "onnx/model.onnx_data",
                "onnx/Constant_7_attr__value",
                "tokenizer.json",
                "sparse_linear.pt",
                "colbert_linear.pt",
            )
        ]
    )
    snapshot = cache.resolve() / "models--BAAI--bge-m3" / "snapshots" / BAAI_REVISION
    assert art.layout is Layout.BAAI
    assert art.onnx_path == snapshot / "onnx/model.onnx"
    assert art.onnx_path.read_bytes() == b"fp32:onnx/model.onnx"
    assert art.external_data == (
        snapshot / "onnx/model.onnx_data",
        snapshot / "onnx/Constant_7_attr__value",
    )
    assert art.tokenizer_path == snapshot / "tokenizer.json"
    assert art.heads is not None and art.heads.hidden_size == HIDDEN
    assert art.source == f"hub {BAAI_REPO}@{BAAI_REVISION} (fp32)"
    assert art.identity().count(";") == 2


def test_int8_download_then_offline_from_cache(tmp_path: Path, hub: FakeHub) -> None:
    """int8 comes from Xenova with BAAI's heads; later calls use the cache, offline or not."""
    cache = tmp_path / "cache"

    art = resolve(
        model_path=None,
        variant="int8",
        cache_dir=tmp_path / "bgeserve",
        hub_cache=cache,
        endpoint=hub.url,
        progress=False,
    )

    assert sorted(hub.downloaded()) == sorted(
        [
            (XENOVA_REPO, "onnx/model_quantized.onnx"),
            (XENOVA_REPO, "tokenizer.json"),
            (BAAI_REPO, "sparse_linear.pt"),
            (BAAI_REPO, "colbert_linear.pt"),
        ]
    )
    assert art.layout is Layout.HIDDEN and art.variant == "int8"
    assert art.onnx_path.read_bytes() == b"int8:onnx/model_quantized.onnx"
    assert art.onnx_path.is_relative_to(
        cache.resolve() / "models--Xenova--bge-m3" / "snapshots" / XENOVA_REVISION
    )
    assert b"Xenova" in art.tokenizer_path.read_bytes()
    assert art.heads is not None
    assert "heads from BAAI/bge-m3@" in art.source

    seen = len(hub.requests)
    again = resolve(
        model_path=None,
        variant="int8",
        cache_dir=tmp_path / "bgeserve",
        hub_cache=cache,
        endpoint=hub.url,
        progress=False,
    )
    assert len(hub.requests) == seen  # pinned commits: a warm cache needs no HEAD request at all
    assert again.onnx_path == art.onnx_path

    hub.stop()
    hub.stop = lambda: None  # type: ignore[method-assign]
    offline = resolve(
        model_path=None,
        variant="int8",
        cache_dir=tmp_path / "bgeserve",
        hub_cache=cache,
        endpoint=hub.url,
        offline=True,
    )
    assert (offline.onnx_path, offline.tokenizer_path) == (art.onnx_path, art.tokenizer_path)
    assert offline.heads is not None


def test_local_xenova_directory_downloads_missing_heads(tmp_path: Path, hub: FakeHub) -> None:
    """A Xenova snapshot without .pt heads gets them from BAAI/bge-m3 into the cache dir."""
    root = _write(
        tmp_path / "xenova",
        {
            "onnx/model.onnx": graph_bytes(HIDDEN_OUTPUTS),
            "onnx/model_fp16.onnx": graph_bytes(HIDDEN_OUTPUTS),
            "tokenizer.json": "{}",
        },
    )

    art = resolve(
        model_path=root,
        variant="fp32",
        cache_dir=tmp_path / "bgeserve",
        hub_cache=tmp_path / "cache",
        endpoint=hub.url,
        progress=False,
    )

    assert art.layout is Layout.HIDDEN  # Xenova's own model.onnx outputs last_hidden_state
    assert sorted(hub.downloaded()) == [
        (BAAI_REPO, "colbert_linear.pt"),
        (BAAI_REPO, "sparse_linear.pt"),
    ]
    assert art.heads is not None
    assert (tmp_path / "cache" / "models--BAAI--bge-m3").is_dir()


def _graph_reading(*locations: str) -> bytes:
    """A small ONNX graph whose tensors are kept in ``locations`` (beside it)."""
    import onnx
    from onnx import TensorProto, helper

    tensors = []
    for i, location in enumerate(locations):
        t = helper.make_tensor(f"w{i}", TensorProto.FLOAT, [1], [0.0])
        t.ClearField("float_data")
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", "0"), ("length", "4")):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        tensors.append(t)
    nodes = [helper.make_node("Identity", [f"w{i}"], [f"y{i}"]) for i in range(len(locations))]
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1])
               for i in range(len(locations))]
    return onnx.helper.make_model(helper.make_graph(nodes, "g", [], outputs, tensors)
                                  ).SerializeToString()


def test_a_data_file_the_graph_does_not_read_may_be_missing(tmp_path: Path,
                                                            hub: FakeHub) -> None:
    """BAAI's graph exported again into a hand-filled cache keeps its weights in
    model.onnx_data alone: the missing Constant_7_attr__value is skipped (it was refused for
    a file nothing reads); a file the graph does read is still required, by name."""
    graph = (BAAI_REPO, BAAI_REVISION, "onnx/model.onnx")
    hub.files[graph] = _graph_reading("model.onnx_data")
    del hub.files[(BAAI_REPO, BAAI_REVISION, "onnx/Constant_7_attr__value")]

    def fetch(into: str) -> ModelArtifacts:
        return resolve(model_path=None, variant="fp32", cache_dir=tmp_path / into / "bgeserve",
                       hub_cache=tmp_path / into / "hub", endpoint=hub.url, progress=False)

    assert [p.name for p in fetch("one").external_data] == ["model.onnx_data"]

    hub.files[graph] = _graph_reading("model.onnx_data", "Constant_7_attr__value")
    with pytest.raises(ModelUnavailable, match="onnx/Constant_7_attr__value"):
        fetch("two")


def test_file_missing_on_the_hub_is_named(tmp_path: Path, hub: FakeHub) -> None:
    """A file the endpoint does not have gives ModelUnavailable naming it and its repo."""
    del hub.files[(BAAI_REPO, BAAI_REVISION, "onnx/Constant_7_attr__value")]

    with pytest.raises(ModelUnavailable) as info:
        resolve(
            model_path=None,
            variant="fp32",
            cache_dir=tmp_path / "bgeserve",
            hub_cache=tmp_path / "cache",
            endpoint=hub.url,
            progress=False,
        )

    message = info.value.message
    assert "onnx/Constant_7_attr__value" in message and BAAI_REPO in message
    assert "no such file" in message and "BGE_M3_MODEL_PATH" in message


def test_offline_with_empty_cache_is_refused_without_network(tmp_path: Path, hub: FakeHub) -> None:
    """offline=True and nothing cached: ModelUnavailable naming the cache, and no request sent."""
    with pytest.raises(ModelUnavailable) as info:
        resolve(
            model_path=None,
            variant="fp16",
            cache_dir=tmp_path / "bgeserve",
            hub_cache=tmp_path / "cache",
            endpoint=hub.url,
            offline=True,
        )

    assert "onnx/model_fp16.onnx" in info.value.message and XENOVA_REPO in info.value.message
    assert str(tmp_path / "cache") in info.value.message and "offline" in info.value.message
    assert hub.requests == []


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Skip (and list) huggingface_hub's backoff sleeps: every version sleeps in utils._http."""
    import huggingface_hub.utils._http as hub_http

    slept: list[float] = []
    monkeypatch.setattr(hub_http.time, "sleep", slept.append)
    return slept


def test_unreachable_hub_is_refused(tmp_path: Path, hub: FakeHub, no_backoff: list[float]) -> None:
    """A connection refused with an empty cache becomes ModelUnavailable, not a transport error."""
    url = hub.url
    hub.stop()
    hub.stop = lambda: None  # type: ignore[method-assign]

    with pytest.raises(ModelUnavailable, match="could not be reached"):
        resolve(
            model_path=None,
            variant="int8",
            cache_dir=tmp_path / "bgeserve",
            hub_cache=tmp_path / "cache",
            endpoint=url,
            progress=False,
        )


@pytest.mark.parametrize(
    ("status", "code", "why"),
    [
        (404, "RepoNotFound", "repository not found, private or gated"),
        (404, "RevisionNotFound", "the hub has no such revision"),
        (500, None, "the hub answered HTTP 500 and it is not cached"),
    ],
)
def test_hub_error_answers_are_explained(
    tmp_path: Path, hub: FakeHub, no_backoff: list[float], status: int, code: str | None, why: str
) -> None:
    """Repository / revision not found and server errors each get their own explanation."""
    hub.failures["onnx/model_fp16.onnx"] = (status, code)

    with pytest.raises(ModelUnavailable) as info:
        resolve(
            model_path=None,
            variant="fp16",
            cache_dir=tmp_path / "bgeserve",
            hub_cache=tmp_path / "cache",
            endpoint=hub.url,
            progress=False,
        )

    message = info.value.message
    assert why in message and "onnx/model_fp16.onnx" in message and XENOVA_REPO in message
    assert "BGE_M3_MODEL_PATH" in message


def test_transport_errors_of_the_installed_client_are_explained() -> None:
    """A connection error escaping from requests (hub < 1.0) or httpx/httpx2 (1.0+) says so."""
    from bgeserve.model.hubfetch import _explain

    errors: list[Exception] = []
    if "requests" in sys.modules:
        errors.append(sys.modules["requests"].ConnectionError("connection reset"))
    for client in ("httpx", "httpx2"):
        if client in sys.modules:
            errors.append(sys.modules[client].ConnectError("connection reset"))
    assert errors, "huggingface_hub imported none of requests, httpx, httpx2"
    for error in errors:
        assert _explain(error, offline=False).startswith("the hub could not be reached: ")
    assert _explain(OSError(28, "No space left on device"), offline=False).startswith(
        "download failed: OSError"
    )


class _Terminal(io.StringIO):
    """A stderr that claims to be a terminal, so tqdm draws bars (it hides them for pipes)."""

    def isatty(self) -> bool:
        return True


def test_progress_bars_only_when_asked(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """progress=False downloads draw no bar; a later progress=True download draws them again."""
    from huggingface_hub import constants

    if constants.HF_HUB_DISABLE_PROGRESS_BARS:  # read at import; it outranks everything
        pytest.skip("HF_HUB_DISABLE_PROGRESS_BARS=1 hides every progress bar")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)

    resolve(
        model_path=None,
        variant="int8",
        cache_dir=tmp_path / "c",
        hub_cache=tmp_path / "a",
        endpoint=hub.url,
        progress=False,
    )
    quiet = terminal.getvalue()
    resolve(
        model_path=None,
        variant="fp16",
        cache_dir=tmp_path / "c",
        hub_cache=tmp_path / "b",
        endpoint=hub.url,
        progress=True,
    )
    loud = terminal.getvalue()[len(quiet) :]

    assert "100%" not in quiet and "model_quantized.onnx" not in quiet
    assert "100%" in loud and "model_fp16.onnx" in loud


def test_bad_cache_dir_is_refused_before_any_request(tmp_path: Path, hub: FakeHub) -> None:
    """The cache directory is checked before the hub is contacted."""
    (tmp_path / "file").write_text("x")

    with pytest.raises(ModelUnavailable, match="BGE_M3_CACHE_DIR"):
        resolve(
            model_path=None, variant="fp32", cache_dir=tmp_path / "file" / "cache", endpoint=hub.url
        )

    assert hub.requests == []


def test_model_artifacts_is_frozen(tmp_path: Path) -> None:
    """ModelArtifacts cannot be mutated after resolve()."""
    art = resolve(model_path=_export(tmp_path / "e"), variant="fp32", cache_dir=tmp_path / "c")
    assert isinstance(art, ModelArtifacts)
    with pytest.raises(AttributeError):
        art.variant = "int8"  # type: ignore[misc]


# --- layouts read from the graph -------------------------------------------------------------


def test_an_optimum_export_beside_baai_heads_is_a_hidden_state_graph(
    tmp_path: Path, heads: dict[str, bytes]
) -> None:
    """onnx/model.onnx with output last_hidden_state (optimum-cli's export) next to BAAI's .pt
    heads is read as the hidden-state layout, not guessed to be BAAI's from the file names."""
    root = _write(
        tmp_path / "optimum",
        {"onnx/model.onnx": graph_bytes(HIDDEN_OUTPUTS), "tokenizer.json": "{}", **heads},
    )

    art = resolve(model_path=root, variant="fp32", cache_dir=tmp_path / "cache", offline=True)

    assert art.layout is Layout.HIDDEN and art.heads is not None


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (graph_bytes(("pooler_output",)), "has outputs pooler_output, which match no layout"),
        (graph_bytes(HIDDEN_OUTPUTS, inputs=("ids",)), "bgeserve feeds input_ids"),
        (b"not a protobuf \xff\xff", "is not a readable ONNX graph"),
    ],
)
def test_graphs_of_no_known_layout_are_refused_naming_what_they_have(
    tmp_path: Path, heads: dict[str, bytes], content: bytes, match: str
) -> None:
    """A graph whose outputs or inputs fit no layout, or a file that is no ONNX graph, is refused
    with what the graph has (and BGE_M3_MODEL_PATH)."""
    root = _write(tmp_path / "odd", {"onnx/model.onnx": content, "tokenizer.json": "{}", **heads})

    with pytest.raises(ModelUnavailable, match=match) as info:
        resolve(model_path=root, variant="fp32", cache_dir=tmp_path / "cache", offline=True)
    assert info.value.param == "BGE_M3_MODEL_PATH"


# --- the Hugging Face cache ----------------------------------------------------------------------


def _fill_cache(cache: Path, files: dict[tuple[str, str, str], bytes]) -> None:
    """Files in huggingface_hub's cache layout (snapshots/<commit>/<file>), as a download leaves."""
    for (repo, revision, name), content in files.items():
        path = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / revision / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


@pytest.mark.parametrize("where", ["hub cache", "legacy bgeserve cache"])
def test_a_snapshot_already_cached_is_used_without_any_request(
    tmp_path: Path, hub: FakeHub, where: str
) -> None:
    """A pinned snapshot already in the Hugging Face cache (or in the bgeserve cache directory,
    where earlier versions downloaded) is used as it is: no request reaches the hub."""
    filled = tmp_path / ("hub" if where == "hub cache" else "bgeserve")
    _fill_cache(filled, hub.files)

    art = resolve(
        model_path=None,
        variant="fp32",
        cache_dir=tmp_path / "bgeserve",
        hub_cache=tmp_path / "hub",
        endpoint=hub.url,
        progress=False,
    )

    assert hub.requests == []
    assert art.onnx_path.is_relative_to(filled) and art.heads is not None


def test_a_host_that_does_not_resolve_fails_at_once_naming_the_ways_out(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No DNS for the hub's host and nothing cached: one clear error at once (no retry ladder)
    naming BGE_M3_MODEL_PATH and HF_HUB_OFFLINE."""
    import socket
    import time

    from bgeserve.model import hubnet

    asked: list[str] = []

    def no_dns(host: str, *args: object, **kwargs: object) -> None:
        asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(hubnet.socket, "getaddrinfo", no_dns)
    started = time.monotonic()
    with pytest.raises(ModelUnavailable) as info:
        resolve(
            model_path=None,
            variant="fp32",
            cache_dir=tmp_path / "bgeserve",
            hub_cache=tmp_path / "hub",
            endpoint="https://hub.example.invalid",
            progress=False,
        )

    assert time.monotonic() - started < 5 and asked == ["hub.example.invalid"]
    message = info.value.message
    assert "does not resolve" in message and "hub.example.invalid" in message
    assert "BGE_M3_MODEL_PATH" in message and "HF_HUB_OFFLINE=1" in message


def test_a_resolver_that_hangs_counts_as_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup still blocked after DNS_TIMEOUT_S is taken as unresolved; proxies and IP or
    localhost endpoints are never checked."""
    import threading

    from bgeserve.model import hubnet

    release = threading.Event()
    monkeypatch.setattr(hubnet.socket, "getaddrinfo", lambda *a, **k: release.wait(10))
    monkeypatch.setattr(hubnet, "DNS_TIMEOUT_S", 0.2)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    try:
        assert hubnet.resolves("https://huggingface.co") == (False, "huggingface.co")
        assert hubnet.resolves("http://127.0.0.1:9/x")[0] and hubnet.resolves("http://localhost")[0]
        monkeypatch.setenv("https_proxy", "http://proxy.internal:3128")
        assert hubnet.resolves("https://huggingface.co")[0]
    finally:
        release.set()


def test_a_download_reports_its_bytes_as_it_goes(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a file downloads, report(file, bytes done, bytes total) is called with growing
    counts, and once more with done == total at the end."""
    from bgeserve.model import hubnet

    # 24 MiB sent in 1 MiB pieces 0.03 s apart (huggingface_hub < 1.0 writes 10 MiB at a time).
    big = bytes(range(256)) * (24 << 12)
    hub.files[(BAAI_REPO, BAAI_REVISION, "onnx/model.onnx_data")] = big
    hub.delay["onnx/model.onnx_data"] = 0.03
    monkeypatch.setattr(hubnet, "POLL_S", 0.05)
    seen: list[tuple[str, int, int | None]] = []

    resolve(
        model_path=None,
        variant="fp32",
        cache_dir=tmp_path / "bgeserve",
        hub_cache=tmp_path / "hub",
        endpoint=hub.url,
        progress=False,
        report=lambda name, done, total: seen.append((name, done, total)),
    )

    data = [(done, total) for name, done, total in seen if name == "onnx/model.onnx_data"]
    assert data[-1] == (len(big), len(big))
    partial = [done for done, _ in data[:-1] if 0 < done < len(big)]
    assert partial and partial == sorted(partial)
