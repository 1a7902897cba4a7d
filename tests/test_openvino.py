"""The OpenVINO backend (bf16 variant): export, resolution, shared compiled model, serving.

Parity with FlagEmbedding lives in test_parity.py (case export-bf16). Everything here skips
when the openvino package is not installed (``bgeserve[openvino]``, part of the dev extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bgeserve.engine import Engine, EngineConfig
from bgeserve.engine.scheduler import SchedulerConfig
from bgeserve.model.artifacts import resolve
from bgeserve.runtime import SessionConfig
from tests.oracle import BF16, _cos, dense_rows
from tests.test_service import TEXTS, base_env, serving, wait_health

pytestmark = pytest.mark.slow


def test_export_writes_an_ir_with_its_runtime_in_the_manifest(tiny_export_bf16: Path) -> None:
    manifest = json.loads((tiny_export_bf16 / "manifest.json").read_text())
    entry = manifest["variants"]["bf16"]
    assert entry["path"] == "bf16/model.xml" and entry["runtime"] == "openvino"
    xml, weights = tiny_export_bf16 / "bf16" / "model.xml", tiny_export_bf16 / "bf16" / "model.bin"
    assert entry["total_bytes"] == xml.stat().st_size + weights.stat().st_size
    # The plain-attention graph it was made from is temporary.
    assert sorted(p.name for p in (tiny_export_bf16 / "bf16").iterdir()) == ["model.bin",
                                                                           "model.xml"]
    assert not (tiny_export_bf16 / "fp32").exists()  # only bf16 was asked for


def test_resolve_names_the_runtime_and_the_weights(tiny_export_bf16: Path, tmp_path: Path) -> None:
    art = resolve(model_path=tiny_export_bf16, variant="bf16", cache_dir=tmp_path)
    assert art.runtime == "openvino" and art.onnx_path.suffix == ".xml"
    assert [p.name for p in art.external_data] == ["model.bin"]
    assert "model.bin:" in art.identity()  # a new IR invalidates cached probe coefficients


def test_missing_weights_file_is_a_clear_error(tiny_export_bf16: Path, tmp_path: Path) -> None:
    import shutil

    from bgeserve.errors import ModelUnavailable

    copy = tmp_path / "export"
    shutil.copytree(tiny_export_bf16, copy)
    (copy / "bf16" / "model.bin").unlink()
    with pytest.raises(ModelUnavailable, match="model.bin"):
        resolve(model_path=copy, variant="bf16", cache_dir=tmp_path / "cache")


def _closed_over(fn: object) -> list[object]:
    """Every value ``fn``'s closures hold, nested closures included."""
    out: list[object] = []
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        out.append(value)
        if callable(value):
            out.extend(_closed_over(value))
    return out


def _key_transposes(xml: Path) -> tuple[int, int]:
    """(Transposes [0, 2, 3, 1] feeding a MatMul, MatMuls with transpose_b) in an IR."""
    from bgeserve.runtime import openvino

    model = openvino._ov().Core().read_model(str(xml))
    left = sum(op.get_type_name() == "MatMul"
               and op.input_value(1).get_node().get_type_name() == "Transpose"
               and list(op.input_value(1).get_node().input_value(1).get_node().get_data())
               == [0, 2, 3, 1]
               for op in model.get_ops())
    folded = sum(op.get_type_name() == "MatMul" and bool(op.get_attributes().get("transpose_b"))
                 for op in model.get_ops())
    return left, folded


def test_export_folds_the_key_transposes(tiny_export_bf16: Path) -> None:
    """q·kᵀ's [0, 2, 3, 1] Transpose (a reference kernel outside OpenVINO's fused attention)
    is gone: each of the tiny model's 2 layers multiplies by the head split with transpose_b."""
    assert _key_transposes(tiny_export_bf16 / "bf16" / "model.xml") == (0, 2)


def test_folding_a_key_transpose_keeps_the_product() -> None:
    import openvino as ov
    import openvino.opset13 as ops

    from bgeserve.runtime.openvino import fold_key_transposes

    q = ops.parameter([2, 3, 5, 4], np.float32, name="q")  # [B, heads, L, d]
    k = ops.parameter([2, 5, 3, 4], np.float32, name="k")  # [B, L, heads, d]
    scores = ops.matmul(q, ops.transpose(k, ops.constant(np.array([0, 2, 3, 1]))), False, False)
    model = ov.Model([scores], [q, k])
    rng = np.random.default_rng(0)
    feed = {"q": rng.standard_normal((2, 3, 5, 4), np.float32),
            "k": rng.standard_normal((2, 5, 3, 4), np.float32)}
    want = np.einsum("bhld,bmhd->bhlm", feed["q"], feed["k"])
    assert fold_key_transposes(model) == 1 and fold_key_transposes(model) == 0
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    np.testing.assert_allclose(compiled(feed)[0], want, rtol=1e-5, atol=1e-5)
    assert [op.get_attributes().get("transpose_b") for op in model.get_ops()
            if op.get_type_name() == "MatMul"] == [True]


def test_workers_share_one_compiled_model(tiny_export_bf16: Path, tmp_path: Path) -> None:
    """Two workers = two infer requests on one compiled model; it goes with the last session."""
    config = EngineConfig(session=SessionConfig(threads=1, streams=2),
                          scheduler=SchedulerConfig(workers=2))
    with Engine(tiny_export_bf16, "bf16", config=config, cache_dir=tmp_path) as engine:
        one = engine.embed(TEXTS, dense=True, sparse=True, colbert=True)
        # The factory's SharedModel, held by the runtime's session opener inside it.
        owner = next(v for v in _closed_over(engine.open_forward) if hasattr(v, "streams"))
        assert owner.streams == 2 and owner.users == 2
        again = engine.embed(list(reversed(TEXTS)), dense=True)
    assert owner.users == 0
    np.testing.assert_allclose(again.dense[::-1], one.dense, atol=1e-6)
    assert [len(c) for c in one.colbert] == [n - 1 for n in one.n_tokens]


def test_bf16_agrees_with_fp32(tiny_export: Path, tiny_export_bf16: Path, tmp_path: Path) -> None:
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine:
        want = engine.embed(TEXTS, dense=True, sparse=True)
    with Engine(tiny_export_bf16, "bf16", cache_dir=tmp_path) as engine:
        got = engine.embed(TEXTS, dense=True, sparse=True)
    assert _cos(got.dense, want.dense).min() >= BF16.dense_cos
    for (gi, gv), (wi, wv) in zip(got.sparse, want.sparse):
        g, w = dict(zip(gi.tolist(), gv.tolist())), dict(zip(wi.tolist(), wv.tolist()))
        assert max(abs(g.get(k, 0.0) - w.get(k, 0.0)) for k in set(g) | set(w)) <= BF16.sparse_abs


def test_server_on_openvino_reports_its_backend(tiny_export: Path, tiny_export_bf16: Path,
                                                tmp_path: Path) -> None:
    env = base_env(tiny_export_bf16, tmp_path, BGE_M3_EP="openvino", BGE_M3_WORKERS="2",
                   BGE_M3_INTRA_THREADS="1")
    with serving(env) as (client, _):
        health = wait_health(client)
        assert health["model"]["variant"] == "bf16"
        assert health["model"]["backend"].startswith("openvino ")
        assert health["model"]["execution_provider"] == "openvino"
        assert health["workers"]["total"] == 2
        r = client.post("/v1/embeddings", json={"model": "bge-m3", "input": TEXTS})
        assert r.status_code == 200, r.text
        got = dense_rows(r.json())
    with Engine(tiny_export, "fp32", cache_dir=tmp_path) as engine:
        want = engine.embed(TEXTS).dense
    assert _cos(got, want).min() >= BF16.dense_cos


def test_asking_openvino_for_another_variant_fails_fast(tiny_export_bf16: Path,
                                                        tmp_path: Path) -> None:
    env = base_env(tiny_export_bf16, tmp_path, BGE_M3_EP="openvino", BGE_M3_MODEL="int8")
    with serving(env) as (client, _service):
        body = wait_health(client, status=503, body_status="fail")
    assert body["status"] == "fail" and "bf16" in json.dumps(body)


def _shapes(seed: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` padded chunks of random shapes (1-4 texts, 3-40 tokens), as the packer makes."""
    from bgeserve.engine.forward import pad_chunk

    rng = np.random.default_rng(seed)
    chunks = []
    for _ in range(n):
        texts = int(rng.integers(1, 5))
        rows = [rng.integers(5, 90, int(rng.integers(3, 40))) for _ in range(texts)]
        chunks.append(pad_chunk([np.r_[0, r, 2].astype(np.int64) for r in rows],
                                max(len(r) + 2 for r in rows)))
    return chunks


def test_runs_bind_their_inputs_without_the_data_dispatcher(tiny_export_bf16: Path,
                                                            monkeypatch) -> None:
    """A run binds tensors over its own arrays and calls infer() without inputs: openvino's
    Python data dispatcher (which reshapes the request's tensors in place, where two workers
    once hung for good) is never entered, and the results are still right."""
    import openvino._ov_api as ov_api

    from bgeserve.runtime.openvino import SharedModel

    xml = tiny_export_bf16 / "bf16" / "model.xml"
    want = SharedModel(xml, precision="bf16", threads=1, streams=1).session()
    (ids, mask), = _shapes(1, 1)
    expected = want.run(ids, mask, ["dense"])["dense"]
    want.close()
    dispatch = ov_api._data_dispatch

    def no_inputs(request, inputs=None, is_shared=False):
        assert inputs is None, "a run went through openvino's data dispatcher"
        return dispatch(request, inputs, is_shared)

    monkeypatch.setattr(ov_api, "_data_dispatch", no_inputs)
    session = SharedModel(xml, precision="bf16", threads=1, streams=1).session()
    try:
        np.testing.assert_allclose(session.run(ids, mask, ["dense"])["dense"], expected,
                                   atol=1e-6)
    finally:
        session.close()


def test_two_workers_run_new_shapes_at_once_without_hanging(tiny_export_bf16: Path) -> None:
    """Two threads, one compiled model with two streams, a new shape on almost every run: both
    finish in bounded time, and every result is the one that chunk gives run alone (nothing
    is shared between the two requests' inputs or outputs)."""
    import threading

    from bgeserve.runtime.openvino import SharedModel

    xml = tiny_export_bf16 / "bf16" / "model.xml"
    chunks = {k: _shapes(10 + k, 150) for k in range(2)}
    alone = SharedModel(xml, precision="bf16", threads=1, streams=1).session()
    expected = {k: [alone.run(i, m, ["dense"])["dense"] for i, m in chunks[k]] for k in chunks}
    alone.close()
    shared = SharedModel(xml, precision="bf16", threads=1, streams=2)
    sessions = [shared.session(), shared.session()]
    got: dict[int, list[np.ndarray]] = {0: [], 1: []}

    def work(k: int) -> None:
        for ids, mask in chunks[k]:
            got[k].append(sessions[k].run(ids, mask, ["dense"])["dense"])

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    hung = [t.is_alive() for t in threads]
    for s in sessions:
        if not any(hung):
            s.close()
    assert not any(hung), (f"runs on the shared compiled model hung: {len(got[0])} and "
                           f"{len(got[1])} of 150 done")
    for k in chunks:
        for a, b in zip(got[k], expected[k]):
            np.testing.assert_allclose(a, b, atol=1e-5)
