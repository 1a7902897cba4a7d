"""``bgeserve.bulk.columns``: Embeddings → Arrow columns of the documented types (no model)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from bgeserve.bulk.columns import arrays, parse_outputs, scatter, schema
from bgeserve.errors import InvalidInput
from bgeserve.results import Embeddings


def embeddings() -> Embeddings:
    rng = np.random.default_rng(0)
    return Embeddings(
        dense=rng.standard_normal((2, 4)).astype(np.float32),
        sparse=[(np.array([3, 9]), np.array([0.5, 0.25], np.float32)),
                (np.array([], np.int64), np.array([], np.float32))],
        colbert=[rng.standard_normal((3, 4)).astype(np.float32),
                 rng.standard_normal((1, 4)).astype(np.float32)],
        n_tokens=np.array([4, 2]), truncated=np.array([False, True]))


def test_columns_carry_every_value_in_the_documented_types():
    """dense: fixed-size float32 lists; sparse: int32 ids and float32 weights per row;
    colbert: a list of fixed-size vectors per row; n_tokens int32; truncated bool."""
    emb = embeddings()
    outputs = ("dense", "sparse", "colbert")
    cols = arrays(emb, outputs, 4)
    table = pa.table({"id": ["a", "b"], **cols}, schema=schema(outputs, 4))
    assert table.schema.field("dense").type == pa.list_(pa.float32(), 4)
    np.testing.assert_array_equal(np.stack(table["dense"].to_numpy(zero_copy_only=False)),
                                  emb.dense)
    assert table["sparse_indices"].to_pylist() == [[3, 9], []]
    assert table["sparse_values"].to_pylist() == [[0.5, 0.25], []]
    for got, want in zip(table["colbert"].to_pylist(), emb.colbert, strict=True):
        np.testing.assert_array_equal(np.array(got, np.float32), want)
    assert table["n_tokens"].to_pylist() == [4, 2]
    assert table["truncated"].to_pylist() == [False, True]


def test_only_the_outputs_asked_for_are_built():
    """dense alone gives no sparse or colbert columns."""
    assert set(arrays(embeddings(), ("dense",), 4)) == {"n_tokens", "truncated", "dense"}
    assert schema(("sparse",), 4, with_id=False).names == [
        "n_tokens", "truncated", "sparse_indices", "sparse_values"]


def test_scatter_puts_rows_in_place_and_nulls_elsewhere():
    """Rows of the good positions land there; the others are null in every column."""
    cols = scatter(arrays(embeddings(), ("dense", "sparse"), 4), [0, 2], 3)
    assert cols["n_tokens"].to_pylist() == [4, None, 2]
    assert cols["dense"].null_count == 1 and cols["sparse_indices"].to_pylist()[1] is None


@pytest.mark.parametrize(("text", "want"), [("dense", ("dense",)),
                                            ("colbert, DENSE", ("dense", "colbert")),
                                            (["sparse", "dense"], ("dense", "sparse"))])
def test_outputs_parse_in_canonical_order(text, want):
    """--outputs takes any subset in any order and case."""
    assert parse_outputs(text) == want


@pytest.mark.parametrize("text", ["", "dense,vectors"])
def test_unknown_or_no_outputs_name_the_flag(text):
    with pytest.raises(InvalidInput, match="--outputs"):
        parse_outputs(text)
