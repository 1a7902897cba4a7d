"""``bgeserve.ray.Embedder`` called as Ray Data calls it, without a cluster: Arrow, pandas and
numpy batches in, the documented Arrow columns out, bad rows kept in place with nulls."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from bgeserve import Engine
from bgeserve.engine import EngineConfig
from bgeserve.ray import Embedder
from bgeserve.ray.embedder import actor_environ

pytestmark = pytest.mark.slow
TEXTS = ["a short text", "a somewhat longer text about the weather in the hills", "x"]


@pytest.fixture(scope="module")
def embedder(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Embedder:
    return Embedder("dense,sparse", env={
        "BGE_M3_MODEL_PATH": str(tiny_export), "BGE_M3_MODEL": "fp32",
        "BGE_M3_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
        "BGE_M3_DISABLE_AUTO_BUDGET": "1", "BGE_M3_MAX_SEQ_LENGTH": "128"})


def one_table(tables: Iterator[pa.Table]) -> pa.Table:
    """The Embedder's output of a batch whose vectors need no cut: one table."""
    got = list(tables)
    assert len(got) == 1
    return got[0]


@pytest.fixture(scope="module")
def engine(tiny_export: Path) -> Iterator[Engine]:
    with Engine(tiny_export, "fp32", config=EngineConfig(max_seq=128)) as e:
        yield e


@pytest.mark.parametrize("kind", ["arrow", "pandas", "numpy"])
def test_batches_of_every_format_give_the_engines_vectors(embedder: Embedder, engine: Engine,
                                                          kind: str) -> None:
    """The text column is replaced by n_tokens, truncated, dense, sparse_*; other columns
    pass through; the vectors are Engine.embed's."""
    data = {"id": np.array([1, 2, 3]), "text": np.array(TEXTS, dtype=object)}
    batch = {"arrow": pa.table(data), "pandas": pd.DataFrame(data), "numpy": data}[kind]
    out = one_table(embedder(batch))
    assert out.column_names == ["id", "n_tokens", "truncated", "dense", "sparse_indices",
                                "sparse_values"]
    assert out["id"].to_pylist() == [1, 2, 3]
    want = engine.embed(TEXTS, dense=True, sparse=True)
    np.testing.assert_allclose(np.stack(out["dense"].to_numpy(zero_copy_only=False)),
                               want.dense, atol=1e-5, rtol=0)
    assert out["sparse_indices"].to_pylist() == [i.tolist() for i, _ in want.sparse]
    assert out["n_tokens"].to_pylist() == want.n_tokens.tolist()


def test_rows_without_a_string_text_keep_their_place_with_nulls(
        embedder: Embedder, engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """A null or non-string text gives null outputs in its row, and a warning naming its id."""
    batch = {"id": np.array(["a", "b", "c", "d"]),
             "text": np.array([TEXTS[0], None, 7, TEXTS[1]], dtype=object)}
    out = one_table(embedder(batch))
    assert out["n_tokens"].to_pylist()[1:3] == [None, None]
    assert out["dense"].null_count == 2
    want = engine.embed([TEXTS[0], TEXTS[1]])
    dense = out["dense"].to_pylist()
    np.testing.assert_allclose([dense[0], dense[3]], want.dense, atol=1e-5, rtol=0)
    assert "id 'b'" in caplog.text and "id 'c'" in caplog.text


@pytest.mark.parametrize("batch", [
    pa.table({"body": ["a"], "id": ["1"]}),
    pd.DataFrame({"body": ["a"], "id": ["1"]}),
    {"body": np.array(["a"]), "id": np.array(["1"])},
], ids=["pyarrow", "pandas", "numpy"])
def test_a_batch_without_the_text_column_says_which_it_has(embedder: Embedder, batch) -> None:
    """It was pyarrow's or pandas' bare KeyError ('text') from inside Ray's wrapper (QA)."""
    from bgeserve.errors import InvalidInput

    with pytest.raises(InvalidInput, match="no column 'text'.*'body', 'id'.*text_column"):
        embedder(batch)


def test_an_actor_gets_its_cpus_as_threads_and_their_share_of_memory() -> None:
    """On a node of 8 CPUs, an actor of 2 runs 2 threads in a quarter of the memory; explicit
    variables win."""
    env = actor_environ({"BGE_M3_AVAILABLE_MEMORY_BYTES": "800"}, 2.0, node_cpus=8)
    assert env["BGE_M3_INTRA_THREADS"] == "2" and env["BGE_M3_AVAILABLE_MEMORY_BYTES"] == "800"
    shared = actor_environ({}, 2.0, node_cpus=8)
    from bgeserve.tuning import memory

    total = memory.detect_available_memory().available_bytes
    assert abs(int(shared["BGE_M3_AVAILABLE_MEMORY_BYTES"]) - total / 4) < total * 0.05
    whole = actor_environ({}, 8.0, node_cpus=8)  # the whole node: no share is imposed
    assert whole.get("BGE_M3_AVAILABLE_MEMORY_BYTES") == os.environ.get(
        "BGE_M3_AVAILABLE_MEMORY_BYTES")


def test_an_actors_share_of_memory_counts_the_node_cpus_the_pod_may_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pod limited to 8 CPUs on a 64-core host, an actor of 2 gets a quarter of the
    pod's memory, not a 32nd."""
    from bgeserve.cgroup import Cpus
    from bgeserve.ray import embedder as module
    from bgeserve.tuning import memory

    monkeypatch.setattr(module, "usable_cpus", lambda: Cpus(8, 64, 8.0))
    monkeypatch.delenv("BGE_M3_AVAILABLE_MEMORY_BYTES", raising=False)
    total = memory.detect_available_memory().available_bytes
    shared = actor_environ({}, 2.0)
    assert abs(int(shared["BGE_M3_AVAILABLE_MEMORY_BYTES"]) - total / 4) < total * 0.05


def test_the_identity_column_names_the_model_files_in_every_row(
        embedder: Embedder, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``identity`` is the variant and the export's graph sha256 (what bgeserve bulk records);
    ``identity_column`` adds it to every row, bad rows included (bgeserve bulk --ray checks it
    before writing a shard)."""
    from bgeserve.model.artifacts import export_variants

    assert embedder.identity == f"fp32 sha256:{export_variants(tiny_export)['fp32']['sha256']}"
    monkeypatch.setattr(embedder, "identity_column", "_model")
    out = one_table(embedder({"id": np.array(["a", "b"]),
                              "text": np.array([TEXTS[0], None], dtype=object)}))
    assert out["_model"].to_pylist() == [embedder.identity] * 2
    assert out.column_names[-1] == "_model" and out["n_tokens"].to_pylist()[1] is None


def test_a_batch_of_long_texts_is_given_in_parts_within_half_the_colbert_limit(
        tiny_export: Path, engine: Engine, tmp_path: Path) -> None:
    """With ColBERT, a batch whose vectors pass half of BGE_M3_MAX_COLBERT_MB comes back as
    consecutive tables within it (the whole batch's vectors were held at once, twice: review);
    the rows in order, bad rows in their places, every vector as embed's."""
    cut = Embedder("colbert", env={
        "BGE_M3_MODEL_PATH": str(tiny_export), "BGE_M3_MODEL": "fp32",
        "BGE_M3_CACHE_DIR": str(tmp_path / "cache"), "BGE_M3_DISABLE_AUTO_BUDGET": "1",
        "BGE_M3_MAX_SEQ_LENGTH": "128", "BGE_M3_MAX_COLBERT_MB": "1"})
    texts = [" ".join(["word"] * 200) + f" {i}" for i in range(40)]
    texts[5] = None  # a bad row, kept in its place
    out = list(cut({"id": np.arange(40), "text": np.array(texts, dtype=object)}))
    per_text = 127 * 32 * 4  # 128 tokens, CLS excluded, 32 floats each
    assert cut.limit == (1 << 20) // 2 and cut.limit // per_text == 32
    assert [t.num_rows for t in out] == [33, 7]  # 32 texts, and the bad row's none
    table = pa.concat_tables(out)
    assert table["id"].to_pylist() == list(range(40)) and table["n_tokens"][5].as_py() is None
    good = [t for t in texts if t is not None]
    want = iter(engine.embed(good, dense=False, colbert=True).colbert)
    for i, got in enumerate(table["colbert"].to_pylist()):
        if i != 5:
            np.testing.assert_allclose(np.array(got, np.float32), next(want), atol=1e-5, rtol=0)
    short = cut({"id": np.arange(2), "text": np.array(["a", "b"], dtype=object)})
    assert [t.num_rows for t in short] == [2]  # one table
