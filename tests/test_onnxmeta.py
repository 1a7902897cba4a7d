"""Tests for bgeserve.model.onnxmeta: a graph's names read from the protobuf without its weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bgeserve.model.onnxmeta import GraphIO, read_graph_io
from tests.graphs import BAAI_OUTPUTS, graph_bytes


def _model_with_weights(path: Path, megabytes: int) -> None:
    """A graph whose inline initializer (``megabytes`` MiB) sits between its nodes and outputs."""
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.zeros((megabytes << 18,), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["last_hidden_state"])], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [None, None]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [None, None])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, None)], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14),
                                                    helper.make_opsetid("com.microsoft", 1)])
    path.write_bytes(model.SerializeToString())


def test_names_and_opsets_are_read(tmp_path: Path) -> None:
    """Inputs and outputs come back in graph order, with each imported opset's version."""
    path = tmp_path / "m.onnx"
    path.write_bytes(graph_bytes(BAAI_OUTPUTS))

    assert read_graph_io(path) == GraphIO(("input_ids", "attention_mask"), BAAI_OUTPUTS,
                                          {"": 17})


def test_weights_are_skipped_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64 MiB inline initializer is seeked over: only a few KiB of the file are read."""
    import builtins

    path = tmp_path / "big.onnx"
    _model_with_weights(path, 64)
    read = []
    real_open = builtins.open

    def counting_open(*args, **kwargs):
        handle = real_open(*args, **kwargs)
        original = handle.read

        def read_counted(n=-1):
            data = original(n)
            read.append(len(data))
            return data

        handle.read = read_counted
        return handle

    monkeypatch.setattr(builtins, "open", counting_open)
    io = read_graph_io(path)

    assert io.outputs == ("last_hidden_state",) and io.opsets == {"": 14, "com.microsoft": 1}
    assert sum(read) < 64 << 10


@pytest.mark.parametrize("content", [b"", b"\xff\xff\xff\xff", b"plain text, not a model"])
def test_what_is_not_an_onnx_model_raises_value_error(tmp_path: Path, content: bytes) -> None:
    """Empty, garbage and text files are ValueError, never a wrong answer."""
    path = tmp_path / "x.onnx"
    path.write_bytes(content)
    with pytest.raises(ValueError):
        read_graph_io(path)


def test_a_truncated_model_raises_value_error(tmp_path: Path) -> None:
    """A download cut short (the last bytes missing) is refused."""
    path = tmp_path / "cut.onnx"
    path.write_bytes(graph_bytes(BAAI_OUTPUTS)[:-7])
    with pytest.raises(ValueError):
        read_graph_io(path)
