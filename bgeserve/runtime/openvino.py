"""OpenVINO adapter: the only module that imports ``openvino`` (the optional ``bgeserve[openvino]``).

It runs the OpenVINO variants of a ``bgeserve export``: ``bf16``, an OpenVINO IR (``model.xml``
+ ``model.bin``, weights stored as fp16) compiled for the CPU with bf16 inference precision, and
``ov-int8``, the same graph with its linear layers quantized to int8 by NNCF (what is not
quantized runs in bf16 where the CPU has it, else fp32). The
IR is read through a memory map and the CPU plugin keeps one bf16 copy of the weights, so a
loaded model costs about one copy of the weights (measured: 1.8 GiB resident for the full-size
model vs 3.5 GiB when compiling the ONNX file itself).

Workers share ONE compiled model with one inference stream per worker (``SharedModel``); each
worker's session is an infer request on it. So two workers cost one copy of the weights, where
ONNX Runtime loads one per session.

The graph carries plain attention: OpenVINO fuses it into its scaled-dot-product-attention
kernel, which never materialises the score matrix (measured: one 8,192-token text adds 0.28 GiB),
and its CPU plugin crashes on the ONNX Loop of bgeserve's blocked attention.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bgeserve.errors import ModelUnavailable
from bgeserve.runtime.common import Shared, feeds, run_failure

INSTALL_HINT = "install it with `pip install 'bgeserve[openvino]'`"


def available() -> bool:
    """Whether the ``openvino`` package is installed (without importing it)."""
    return importlib.util.find_spec("openvino") is not None


def _ov():
    try:
        import openvino
    except ImportError as exc:
        raise ModelUnavailable(f"the OpenVINO backend needs the openvino package: "
                               f"{INSTALL_HINT} ({exc})", param="BGE_M3_EP") from exc
    return openvino


def version() -> str:
    """OpenVINO's version (part of the probe fingerprint)."""
    return str(_ov().__version__)


def native_bf16() -> bool:
    """Whether OpenVINO runs bf16 natively on this CPU (AVX512_BF16 or AMX).

    Without it, OpenVINO ignores the bf16 hint and computes in fp32: no faster than ONNX
    Runtime's fp32, so bgeserve does not choose OpenVINO by itself there.
    """
    if not available():
        return False
    try:
        caps = _ov().Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except Exception:  # noqa: BLE001 - no CPU plugin (an unusual build): not capable
        return False
    return "BF16" in [str(c).upper() for c in caps]


# The inference precision each OpenVINO variant compiles with. ov-int8's int8 layers run in
# int8 whatever the hint; the hint sets what runs the rest (LayerNorm, attention, GELU).
INFERENCE_PRECISION = {"bf16": "bf16", "ov-int8": "bf16"}


def read_model(onnx_path: Path):
    """An ONNX graph read as an ``openvino.Model`` (for conversion and quantization), its
    attention's key transposes folded into the score MatMuls (``fold_key_transposes``)."""
    model = _ov().Core().read_model(str(onnx_path))
    fold_key_transposes(model)
    return model


# q·kᵀ as exported from torch: k's head split ([0, 2, 1, 3]) and kᵀ ([0, 1, 3, 2]) become one
# Transpose [0, 2, 3, 1], which OpenVINO's CPU plugin leaves outside its fused attention and
# runs with a reference kernel: ~1 ms per layer for a 4 x 256 chunk, 3 % of ov-int8's time on
# an AMD Zen 4 (AVX512-VNNI), and a larger share where AMX makes the GEMMs faster. As the head
# split alone plus a MatMul with transpose_b it costs 0.1 ms (docs/benchmarks.md).
_KEY_PERM = [0, 2, 3, 1]
_HEAD_SPLIT = [0, 2, 1, 3]


def fold_key_transposes(model) -> int:
    """Rewrite every ``MatMul(x, Transpose(k, [0, 2, 3, 1]))`` of ``model`` as
    ``MatMul(x, Transpose(k, [0, 2, 1, 3]), transpose_b=True)``: the same product. Returns how
    many were rewritten."""
    _ov()
    ops = importlib.import_module("openvino.opset13")
    done = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul" or op.get_attributes().get("transpose_b"):
            continue
        transpose = op.input_value(1).get_node()
        if transpose.get_type_name() != "Transpose":
            continue
        perm = transpose.input_value(1).get_node()
        if perm.get_type_name() != "Constant" or list(perm.get_data()) != _KEY_PERM:
            continue
        split = ops.transpose(transpose.input_value(0),
                              ops.constant(np.array(_HEAD_SPLIT, np.int64)))
        product = ops.matmul(op.input_value(0), split.output(0),
                             op.get_attributes().get("transpose_a", False), True)
        # the same name: quantization's ignored scope names the attention MatMuls
        product.set_friendly_name(op.get_friendly_name())
        for target in list(op.output(0).get_target_inputs()):
            target.replace_source_output(product.output(0))
        done += 1
    if done:
        model.validate_nodes_and_infer_types()
    return done


def save_model(model, xml_path: Path) -> None:
    """Write an ``openvino.Model`` as an IR, float weights stored as fp16."""
    xml_path.parent.mkdir(parents=True, exist_ok=True)
    _ov().save_model(model, str(xml_path), compress_to_fp16=True)


def save_ir(onnx_path: Path, xml_path: Path) -> None:
    """Convert an ONNX graph (plain attention) to an IR with fp16-stored weights."""
    save_model(read_model(onnx_path), xml_path)


def attention_matmuls(model) -> list[str]:
    """Names of the MatMuls that multiply two activations (q·kᵀ and scores·v), not an
    activation by weights: OpenVINO fuses them with their softmax into one bounded-memory
    attention kernel only while their inputs are not quantized, so a quantizer must leave
    them alone. (An input is an activation when a model input lies behind it.)"""
    live: dict[int, bool] = {}

    def activation(node) -> bool:
        stack = [node]
        while stack:  # iterative: 24 layers of graph are too deep to recurse through
            n = stack[-1]
            key = id(n)
            if key in live:
                stack.pop()
                continue
            if n.get_type_name() == "Parameter":
                live[key] = True
                stack.pop()
                continue
            parents = [v.get_node() for v in n.input_values()]
            todo = [x for x in parents if id(x) not in live]
            if todo:
                stack.extend(todo)
                continue
            live[key] = any(live[id(x)] for x in parents)
            stack.pop()
        return live[id(node)]

    return [op.get_friendly_name() for op in model.get_ops() if op.get_type_name() == "MatMul"
            and all(activation(v.get_node()) for v in op.input_values())]


def quantized_inputs(model) -> dict[str, int]:
    """For each MatMul of ``model``, how many of its inputs come straight from a FakeQuantize
    (int8 in the compiled model)."""
    return {op.get_friendly_name(): sum(op.input_value(i).get_node().get_type_name()
                                        == "FakeQuantize" for i in range(2))
            for op in model.get_ops() if op.get_type_name() == "MatMul"}


class SharedModel:
    """One compiled model for all workers: ``session()`` hands each worker an infer request.

    Compiled on the first ``session()``; released when the last session closes (idle unload),
    recompiled on the next.
    """

    def __init__(self, path: Path, *, precision: str, threads: int, streams: int):
        self.path = path
        # a variant name (bf16, ov-int8) or an OpenVINO precision (bf16, f32)
        self.precision = INFERENCE_PRECISION.get(precision, precision)
        self.threads = threads  # per stream
        self.streams = max(1, streams)
        self._shared = Shared(self._compile)

    def _compile(self):
        ov = _ov()
        config = {
            "INFERENCE_PRECISION_HINT": self.precision,
            "NUM_STREAMS": self.streams,
            "PERFORMANCE_HINT": "THROUGHPUT" if self.streams > 1 else "LATENCY",
        }
        if self.threads:
            config["INFERENCE_NUM_THREADS"] = self.threads * self.streams
        try:
            return ov.Core().compile_model(str(self.path), "CPU", config)
        except Exception as exc:
            raise ModelUnavailable(f"OpenVINO cannot compile {self.path}: {exc}") from exc

    @property
    def users(self) -> int:
        """Sessions open on the compiled model (0: released)."""
        return self._shared.users

    def session(self) -> OpenVinoSession:
        return OpenVinoSession(self, self._shared.acquire())

    def _release(self) -> None:
        self._shared.release()


class OpenVinoSession:
    """One worker's infer request; the same ``run`` / ``close`` as ``onnx.OnnxSession``."""

    def __init__(self, owner: SharedModel, compiled):
        self._owner = owner
        self._compiled = compiled
        self._request = compiled.create_infer_request()
        self._tensor = _ov().Tensor
        self.path = owner.path
        self.input_names = [i.get_any_name() for i in compiled.inputs]
        self.output_names = [o.get_any_name() for o in compiled.outputs]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run one padded chunk; returns the requested outputs (copies) by name."""
        names = list(outputs) if outputs else self.output_names
        request = self._request
        try:
            # The inputs are bound as tensors over the caller's own arrays (no copy; they
            # outlive the run), and infer() gets no inputs. Handing infer() the arrays instead
            # sends them through openvino's Python data dispatcher, which reshapes the
            # request's own input tensors in place for every new shape: two workers doing that
            # on one compiled model were once both found stuck there for good (the full test
            # suite, a 2-core Zen 3, openvino 2026.4; docs/architecture.md, OpenVINO).
            for name, value in feeds(self.input_names, input_ids, attention_mask).items():
                request.set_tensor(name, self._tensor(np.ascontiguousarray(value),
                                                      shared_memory=True))
            result = request.infer()
        except Exception as exc:
            raise run_failure(exc, tuple(input_ids.shape), "OpenVINO") from exc
        # infer() copies its outputs (share_outputs=False): they outlive the next run.
        return {name: result[self._compiled.output(name)] for name in names}

    def close(self) -> None:
        """Drop the request; the compiled model goes when its last session closes."""
        if self._request is not None:
            self._request = None
            self._compiled = None
            self._owner._release()
