"""Torch-free, restricted reader of ``torch.save(state_dict)`` files (``sparse_linear.pt``, ...).

A ``.pt`` file written by torch ≥ 1.6 is a zip archive: ``<prefix>/data.pkl`` (a protocol-2
pickle describing the tensors) and ``<prefix>/data/<key>`` (each storage's raw bytes, in the
byte order named by ``<prefix>/byteorder``). The pickle is run by an unpickler that admits only
the globals tensor rebuilding needs, each mapped to a local numpy stand-in: any other global —
``os.system``, ``builtins.eval``, a model class — is refused before it can be called, and torch
is never imported.
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from bgeserve.errors import ModelUnavailable

# A state dict's pickle is a few hundred bytes per tensor; anything this large is not one.
_MAX_PICKLE_BYTES = 16 << 20
# A stride-0 view can describe far more elements than its storage holds; refuse to materialise one.
_MAX_TENSOR_ELEMENTS = 1 << 28


@dataclass(frozen=True, slots=True)
class _StorageType:
    """Stand-in for ``torch.FloatStorage`` & co: the numpy dtype of the raw bytes."""

    name: str
    dtype: np.dtype[Any]
    bfloat16: bool = False


@dataclass(frozen=True, slots=True)
class _Storage:
    """One storage read from the archive: a flat array of ``numel`` elements."""

    data: np.ndarray
    bfloat16: bool


def _storage_types() -> dict[tuple[str, str], _StorageType]:
    types: dict[str, np.dtype[Any]] = {
        "FloatStorage": np.dtype(np.float32),
        "HalfStorage": np.dtype(np.float16),
        "DoubleStorage": np.dtype(np.float64),
        "LongStorage": np.dtype(np.int64),
        "IntStorage": np.dtype(np.int32),
        "ShortStorage": np.dtype(np.int16),
        "CharStorage": np.dtype(np.int8),
        "ByteStorage": np.dtype(np.uint8),
        "BoolStorage": np.dtype(np.bool_),
    }
    table = {("torch", name): _StorageType(name, dtype) for name, dtype in types.items()}
    # bfloat16 has no numpy dtype: keep the raw 16 bits and widen to float32 after slicing.
    table[("torch", "BFloat16Storage")] = _StorageType("BFloat16Storage", np.dtype(np.uint16), True)
    untyped = _StorageType("UntypedStorage", np.dtype(np.uint8))
    table[("torch", "UntypedStorage")] = untyped
    table[("torch.storage", "UntypedStorage")] = untyped
    return table


def _rebuild_tensor_v2(
    storage: _Storage,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool = False,
    backward_hooks: object = None,
    metadata: object = None,
) -> np.ndarray:
    """Stand-in for ``torch._utils._rebuild_tensor_v2``: a bounds-checked strided copy."""
    if not isinstance(storage, _Storage):
        raise TypeError("tensor storage is not a persistent storage reference")
    dims = (storage_offset, *size, *stride)
    if not all(type(v) is int and v >= 0 for v in dims) or len(size) != len(stride):
        raise ValueError(
            f"bad tensor geometry: offset={storage_offset} size={size} stride={stride}"
        )
    count = math.prod(size)
    if count > _MAX_TENSOR_ELEMENTS:
        raise ValueError(f"tensor of {count} elements exceeds the limit of {_MAX_TENSOR_ELEMENTS}")
    data = storage.data
    if count:
        last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if last >= data.size:
            raise ValueError(f"tensor view reaches element {last} of a {data.size}-element storage")
        view = np.lib.stride_tricks.as_strided(
            data[storage_offset:],
            shape=size,
            strides=tuple(s * data.itemsize for s in stride),
            writeable=False,
        )
        array = np.array(view, dtype=data.dtype.newbyteorder("="), order="C", copy=True)
    else:
        array = np.zeros(size, dtype=data.dtype.newbyteorder("="))
    if storage.bfloat16:
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array


def _rebuild_parameter(data: np.ndarray, requires_grad: bool, backward_hooks: object) -> np.ndarray:
    """Stand-in for ``torch._utils._rebuild_parameter``: a Parameter is just its data."""
    return data


def _rebuild_parameter_with_state(
    data: np.ndarray, requires_grad: bool, backward_hooks: object, state: object
) -> np.ndarray:
    """Stand-in for ``torch._utils._rebuild_parameter_with_state``."""
    return data


_ALLOWED: dict[tuple[str, str], object] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
    ("collections", "OrderedDict"): OrderedDict,
    **_storage_types(),
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits only the globals in ``_ALLOWED``; storages come from the archive via ``load``."""

    def __init__(self, data: bytes, path: Path, load: Callable[[_StorageType, str, int], _Storage]):
        super().__init__(io.BytesIO(data))
        self._path = path
        self._load = load

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise ModelUnavailable(
                f"{self._path}: refusing to load global {module}.{name!s}; a weights file may "
                "only rebuild tensors (this file is either not a plain state dict or is malicious)"
            ) from None

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ValueError(f"unsupported persistent id {pid!r:.80}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or type(numel) is not int or numel < 0:
            raise ValueError(f"malformed storage reference {pid!r:.80}")
        return self._load(storage_type, str(key), numel)


def _find_prefix(archive: zipfile.ZipFile, path: Path) -> str:
    names = [n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") <= 1]
    prefixes = [n[: -len("data.pkl")] for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
    if len(prefixes) != 1:
        raise ModelUnavailable(f"{path}: not a torch.save archive (expected one */data.pkl entry)")
    return prefixes[0]


def load_state_dict(path: Path) -> dict[str, np.ndarray]:
    """Read a ``torch.save(module.state_dict())`` file into numpy arrays, without torch.

    float32/float16/float64/int64 (and other integer) tensors keep their dtype; bfloat16 becomes
    float32. Raises ``ModelUnavailable`` for a missing, legacy (non-zip), truncated or malformed
    file, a missing storage, or a pickle that reaches for any global beyond tensor rebuilding.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelUnavailable(f"{path}: weights file not found")
    try:
        if not zipfile.is_zipfile(path):
            raise ModelUnavailable(
                f"{path}: not a zip-format torch file (legacy torch.save format, or not a .pt file "
                "at all); re-save it with torch >= 1.6"
            )
        with zipfile.ZipFile(path) as archive:
            return _load_archive(archive, path)
    except ModelUnavailable:
        raise
    except OSError as exc:
        raise ModelUnavailable(f"{path}: cannot read weights file: {exc}") from exc
    # A malformed pickle or archive can fail with nearly any exception type (EOFError,
    # UnpicklingError, TypeError from a bad REDUCE, BadZipFile on a bad CRC...): all mean the same.
    except Exception as exc:
        raise ModelUnavailable(f"{path}: malformed torch weights file: {exc!r:.200}") from exc


def _load_archive(archive: zipfile.ZipFile, path: Path) -> dict[str, np.ndarray]:
    prefix = _find_prefix(archive, path)
    byteorder = "little"  # torch < 1.11 wrote no byteorder record, and only little-endian
    if f"{prefix}byteorder" in archive.namelist():
        byteorder = archive.read(f"{prefix}byteorder").decode()
    if byteorder not in ("little", "big"):
        raise ModelUnavailable(f"{path}: unknown byte order {byteorder!r:.20}")
    order: Literal["<", ">"] = "<" if byteorder == "little" else ">"
    if archive.getinfo(f"{prefix}data.pkl").file_size > _MAX_PICKLE_BYTES:
        raise ModelUnavailable(f"{path}: data.pkl is too large to be a state dict")
    storages: dict[str, _Storage] = {}

    def load(storage_type: _StorageType, key: str, numel: int) -> _Storage:
        if key in storages:
            return storages[key]
        member = f"{prefix}data/{key}"
        if "/" in key or key in ("", ".", "..") or member not in archive.namelist():
            raise ModelUnavailable(f"{path}: storage {key!r:.40} is missing from the archive")
        dtype = storage_type.dtype.newbyteorder(order)
        if archive.getinfo(member).file_size != numel * dtype.itemsize:
            raise ModelUnavailable(
                f"{path}: storage {key} holds {archive.getinfo(member).file_size} bytes, "
                f"expected {numel} × {dtype.itemsize}"
            )
        data = np.frombuffer(archive.read(member), dtype=dtype)
        storages[key] = _Storage(data, storage_type.bfloat16)
        return storages[key]

    result = _RestrictedUnpickler(archive.read(f"{prefix}data.pkl"), path, load).load()
    if not isinstance(result, dict):
        raise ModelUnavailable(f"{path}: holds a {type(result).__name__}, not a state dict")
    for key, value in result.items():
        if not isinstance(key, str) or not isinstance(value, np.ndarray):
            raise ModelUnavailable(f"{path}: entry {key!r:.40} is not a named tensor")
    return dict(result)


@dataclass(frozen=True, eq=False)
class HeadWeights:
    """bge-m3's sparse and ColBERT heads (``nn.Linear`` weights) as float32 numpy arrays."""

    sparse_weight: np.ndarray  # (H,): Linear(H → 1).weight[0]
    sparse_bias: float
    colbert_weight: np.ndarray  # (H_out, H_in) as in nn.Linear
    colbert_bias: np.ndarray  # (H_out,)

    @property
    def hidden_size(self) -> int:
        """H, the width of the hidden states the heads consume."""
        return int(self.sparse_weight.shape[0])


def _linear(path: Path, out_features: int | None) -> tuple[np.ndarray, np.ndarray]:
    state = load_state_dict(path)
    weight, bias = state.get("weight"), state.get("bias")
    if weight is None or bias is None:
        raise ModelUnavailable(
            f"{path}: expected an nn.Linear state dict (weight, bias), got {sorted(state)}"
        )
    weight, bias = weight.astype(np.float32), bias.astype(np.float32)
    rows = (
        out_features if out_features is not None else (weight.shape[1] if weight.ndim == 2 else -1)
    )
    if weight.ndim != 2 or weight.shape[0] != rows or bias.shape != (rows,):
        want = f"weight [{rows}, H], bias [{rows}]" if out_features else "weight [H, H], bias [H]"
        raise ModelUnavailable(
            f"{path}: expected {want}, got weight {list(weight.shape)}, bias {list(bias.shape)}"
        )
    if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
        raise ModelUnavailable(f"{path}: weights contain NaN or infinity")
    return np.ascontiguousarray(weight), np.ascontiguousarray(bias)


def load_heads(sparse_path: Path, colbert_path: Path) -> HeadWeights:
    """Load and shape-check ``sparse_linear.pt`` (Linear(H→1)) and ``colbert_linear.pt`` (Linear(H→H))."""
    sparse_w, sparse_b = _linear(Path(sparse_path), 1)
    colbert_w, colbert_b = _linear(Path(colbert_path), None)
    if colbert_w.shape[1] != sparse_w.shape[1]:
        raise ModelUnavailable(
            f"head sizes disagree: {sparse_path} expects hidden size {sparse_w.shape[1]}, "
            f"{colbert_path} expects {colbert_w.shape[1]}"
        )
    return HeadWeights(
        sparse_weight=sparse_w[0].copy(),
        sparse_bias=float(sparse_b[0]),
        colbert_weight=colbert_w,
        colbert_bias=colbert_b,
    )
