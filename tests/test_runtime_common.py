"""One failure rule for every runtime adapter (bgeserve/runtime/common.py)."""

import numpy as np
import pytest

from bgeserve.errors import EngineFailed, OutOfMemory
from bgeserve.runtime.common import feeds, run_failure


@pytest.mark.parametrize("message", [
    "Failed to allocate memory for requested buffer of size 123",  # ORT CPU
    "std::bad_alloc", "CUDA failure 2: out of memory", "Cannot allocate memory",  # OpenVINO
])
def test_allocation_failures_become_out_of_memory(message):
    err = run_failure(RuntimeError(message), (4, 512), "onnxruntime")
    assert isinstance(err, OutOfMemory) and "(4, 512)" in err.message


def test_other_failures_become_engine_failed():
    err = run_failure(RuntimeError("Invalid rank for input"), (1, 8), "OpenVINO")
    assert isinstance(err, EngineFailed) and not isinstance(err, OutOfMemory)


def test_token_type_ids_only_where_the_graph_has_them():
    ids, mask = np.ones((1, 3), np.int64), np.ones((1, 3), np.int64)
    assert set(feeds(["input_ids", "attention_mask"], ids, mask)) == {"input_ids",
                                                                      "attention_mask"}
    with_types = feeds(["input_ids", "attention_mask", "token_type_ids"], ids, mask)
    assert not with_types["token_type_ids"].any()
