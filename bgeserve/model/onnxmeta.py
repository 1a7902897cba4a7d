"""A graph's input and output names and opsets, read from the ONNX file without its weights.

ONNX files are protobuf ``ModelProto`` messages. This reads the few fields that decide a
snapshot's layout (``graph.input`` / ``graph.output`` names, ``opset_import``) by walking the wire
format and seeking over everything else, so a 1 GB graph with inline weights costs a few reads,
not a parse of the whole file, and neither ``onnx`` nor ``onnxruntime`` is imported.
``external_locations`` (which files hold a graph's external tensors) takes a graph that ``onnx``
loaded without its weights.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = ["GraphIO", "external_locations", "read_graph_io"]

# Field numbers of onnx.proto3 (stable since ONNX 1.0).
_MODEL_GRAPH, _MODEL_OPSET = 7, 8
_GRAPH_INPUT, _GRAPH_OUTPUT = 11, 12
_VALUE_INFO_NAME = 1
_OPSET_DOMAIN, _OPSET_VERSION = 1, 2
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True)
class GraphIO:
    """The names of a graph's inputs and outputs, and its opsets ({domain: version})."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    opsets: dict[str, int]


def read_graph_io(path: Path) -> GraphIO:
    """The inputs, outputs and opsets of the ONNX graph at ``path``; ValueError if it is not one."""
    with open(path, "rb") as f:
        size = f.seek(0, io.SEEK_END)
        f.seek(0)
        inputs: list[str] = []
        outputs: list[str] = []
        opsets: dict[str, int] = {}
        graphs = 0
        for field, wire, length in _fields(f, size):
            if field == _MODEL_GRAPH and wire == _LENGTH:
                graphs += 1
                end = f.tell() + length
                for gfield, gwire, glength in _fields(f, end):
                    if gfield in (_GRAPH_INPUT, _GRAPH_OUTPUT) and gwire == _LENGTH:
                        name = _string_field(f, f.tell() + glength, _VALUE_INFO_NAME)
                        (inputs if gfield == _GRAPH_INPUT else outputs).append(name)
                    else:
                        _skip(f, gwire, glength)
            elif field == _MODEL_OPSET and wire == _LENGTH:
                domain, version = _opset(f, f.tell() + length)
                opsets[domain] = version
            else:
                _skip(f, wire, length)
    if graphs != 1 or not outputs:
        raise ValueError(f"{path} is not an ONNX model with a graph")
    return GraphIO(tuple(inputs), tuple(outputs), opsets)


def _varint(f: BinaryIO) -> int:
    value = shift = 0
    while True:
        byte = f.read(1)
        if not byte:
            raise ValueError("truncated varint")
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(f: BinaryIO, end: int):
    """(field number, wire type, length) per field up to ``end``; for a length-delimited field
    the file is left at its payload (the caller reads or skips it), else ``length`` is 0 and the
    caller skips the value."""
    while f.tell() < end:
        key = _varint(f)
        field, wire = key >> 3, key & 7
        if wire not in (_VARINT, _FIXED64, _LENGTH, _FIXED32) or field == 0:
            raise ValueError(f"not a protobuf message (wire type {wire})")
        length = _varint(f) if wire == _LENGTH else 0
        if wire == _LENGTH and f.tell() + length > end:
            raise ValueError("field runs past its message")
        yield field, wire, length
    if f.tell() != end:
        raise ValueError("message overruns its length")


def _skip(f: BinaryIO, wire: int, length: int) -> None:
    if wire == _VARINT:
        _varint(f)
    elif wire == _LENGTH:
        f.seek(length, io.SEEK_CUR)
    else:
        f.seek(8 if wire == _FIXED64 else 4, io.SEEK_CUR)


def _string_field(f: BinaryIO, end: int, number: int) -> str:
    found = ""
    for field, wire, length in _fields(f, end):
        if field == number and wire == _LENGTH:
            found = f.read(length).decode("utf-8", errors="replace")
        else:
            _skip(f, wire, length)
    return found


def _opset(f: BinaryIO, end: int) -> tuple[str, int]:
    domain, version = "", 0
    for field, wire, length in _fields(f, end):
        if field == _OPSET_DOMAIN and wire == _LENGTH:
            domain = f.read(length).decode("utf-8", errors="replace")
        elif field == _OPSET_VERSION and wire == _VARINT:
            version = _varint(f)
        else:
            _skip(f, wire, length)
    return ("" if domain == "ai.onnx" else domain), version


def external_locations(model) -> set[str]:
    """Relative paths of the files holding the model's external tensors (initializers and
    Constant attributes, subgraphs included)."""
    import onnx

    found: set[str] = set()

    def tensor(t) -> None:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            found.update(e.value for e in t.external_data if e.key == "location")

    def graph(g) -> None:
        for t in g.initializer:
            tensor(t)
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    tensor(attr.t)
                for t in attr.tensors:
                    tensor(t)
                if attr.HasField("g"):
                    graph(attr.g)
                for sub in attr.graphs:
                    graph(sub)

    graph(model.graph)
    for location in found:
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise ValueError(f"external data location {location!r} is outside the graph's "
                             "directory")
    return found
