"""Tests for bgeserve.ptload: torch-free, restricted loading of torch.save state dicts."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from bgeserve.errors import ModelUnavailable
from bgeserve.model.ptload import HeadWeights, load_heads, load_state_dict


def _expected(tensor: torch.Tensor) -> np.ndarray:
    """What ptload should return for ``tensor``: its values, bfloat16 widened to float32."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return tensor.numpy()


def _save(path: Path, state: dict[str, torch.Tensor]) -> Path:
    torch.save(state, path)
    return path


# --- hand-built archives -----------------------------------------------------------------------


def _str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _int(value: int) -> bytes:
    return b"J" + struct.pack("<i", value)


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _tensor_pickle(
    *, offset: int, size: list[int], stride: list[int], numel: int, storage: str = "FloatStorage"
) -> bytes:
    """A protocol-2 pickle of ``{"w": tensor}`` written opcode by opcode, geometry as given."""
    storage_ref = _tuple(
        [_str("storage"), f"ctorch\n{storage}\n".encode(), _str("0"), _str("cpu"), _int(numel)]
    )
    args = _tuple(
        [
            storage_ref + b"Q",
            _int(offset),
            _tuple([_int(n) for n in size]),
            _tuple([_int(s) for s in stride]),
            b"\x89",
            b"N",
        ]
    )
    return b"\x80\x02}" + _str("w") + b"ctorch._utils\n_rebuild_tensor_v2\n" + args + b"Rs."


def _write_archive(path: Path, data_pkl: bytes, storages: dict[str, bytes] | None = None) -> Path:
    """A zip laid out exactly like torch.save's: archive/data.pkl, archive/data/<key>, ..."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        for key, raw in (storages or {}).items():
            archive.writestr(f"archive/data/{key}", raw)
        archive.writestr("archive/version", "3\n")
    return path


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_linear_state_dict_round_trips_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    """A Linear's state dict of each float dtype reads back with torch's exact values."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 3).to(dtype)
    path = _save(tmp_path / "linear.pt", linear.state_dict())

    state = load_state_dict(path)

    assert sorted(state) == ["bias", "weight"]
    for name, tensor in linear.state_dict().items():
        want = _expected(tensor)
        assert state[name].dtype == want.dtype
        assert state[name].shape == want.shape
        np.testing.assert_array_equal(state[name], want)
    if dtype == torch.bfloat16:
        assert state["weight"].dtype == np.float32


def test_strided_offset_shared_and_odd_shapes_round_trip(tmp_path: Path) -> None:
    """Transposed, sliced, shared-storage, 0-d, empty and int64 tensors equal torch's values."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
    tensors = {
        "transposed": base.t(),
        "sliced": base[1:3, 2:5],
        "every_other": base[:, ::2],
        "base": base,
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 5),
        "ids": torch.arange(-5, 5, dtype=torch.int64).reshape(2, 5).t(),
        "half_t": torch.randn(5, 3).half().t(),
        "bf16_slice": torch.randn(6, 4).to(torch.bfloat16)[2:, 1:],
    }
    assert not tensors["transposed"].is_contiguous()
    path = _save(tmp_path / "odd.pt", tensors)

    state = load_state_dict(path)

    for name, tensor in tensors.items():
        want = _expected(tensor)
        assert state[name].dtype == want.dtype, name
        assert state[name].shape == want.shape, name
        np.testing.assert_array_equal(state[name], want, err_msg=name)
        assert state[name].flags.c_contiguous and state[name].flags.writeable, name


def test_parameters_and_ordered_dicts_load(tmp_path: Path) -> None:
    """nn.Parameter values (``_rebuild_parameter``) load as plain arrays."""
    param = torch.nn.Parameter(torch.randn(3, 2))
    path = _save(tmp_path / "param.pt", {"p": param})

    np.testing.assert_array_equal(load_state_dict(path)["p"], param.detach().numpy())


def test_hand_built_archive_loads(tmp_path: Path) -> None:
    """The test's own opcode-level pickle builder produces a loadable file (sanity check)."""
    raw = np.arange(6, dtype="<f4").tobytes()
    path = _write_archive(
        tmp_path / "ok.pt",
        _tensor_pickle(offset=1, size=[2, 2], stride=[1, 2], numel=6),
        {"0": raw},
    )

    np.testing.assert_array_equal(
        load_state_dict(path)["w"], np.array([[1, 3], [2, 4]], np.float32)
    )


# --- refusals ------------------------------------------------------------------------------------


class _Exploit:
    """Pickles as a call of ``func(arg)``: what a malicious .pt file carries."""

    def __init__(self, func: object, arg: str):
        self.func, self.arg = func, arg

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return self.func, (self.arg,)


def _exploit_pickles(marker: Path) -> dict[str, bytes]:
    command = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').write('pwned')"
    by_hand = b"\x80\x02cos\nsystem\n" + _tuple([_str(command)]) + b"R."
    return {
        "os.system by hand": by_hand,
        "os.system via __reduce__": pickle.dumps(_Exploit(os.system, command), protocol=2),
        "builtins.eval via __reduce__": pickle.dumps(_Exploit(eval, code), protocol=2),
        "builtins.exec, protocol 4 (STACK_GLOBAL)": pickle.dumps(_Exploit(exec, code), protocol=4),
        "hidden in a tensor's hooks": pickle.dumps({"w": _Exploit(eval, code)}, protocol=2),
    }


@pytest.mark.parametrize("case", sorted(_exploit_pickles(Path("/x"))))
def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path, case: str) -> None:
    """A pickle reaching for os.system / eval / exec is refused before the payload can run."""
    marker = tmp_path / "pwned"
    path = _write_archive(tmp_path / "evil.pt", _exploit_pickles(marker)[case])

    with pytest.raises(ModelUnavailable) as info:
        load_state_dict(path)

    assert not marker.exists()
    assert str(path) in info.value.message
    assert "refusing to load global" in info.value.message
    assert any(name in info.value.message for name in ("system", "eval", "exec"))


@pytest.mark.parametrize(
    "global_ref",
    [
        "torch load",
        "torch._utils _rebuild_device_tensor_from_numpy",
        "numpy.core.multiarray _reconstruct",
        "torch.nn Linear",
    ],
)
def test_unlisted_globals_are_refused(tmp_path: Path, global_ref: str) -> None:
    """Only the tensor-rebuild allow-list passes, even for globals that look harmless."""
    module, name = global_ref.split()
    path = _write_archive(tmp_path / "x.pt", b"\x80\x02" + f"c{module}\n{name}\n.".encode())

    with pytest.raises(ModelUnavailable, match=f"refusing to load global {module}.{name}"):
        load_state_dict(path)


def test_legacy_non_zip_file_is_refused(tmp_path: Path) -> None:
    """A legacy (pre-1.6, non-zip) torch file is refused with a hint to re-save it."""
    path = tmp_path / "legacy.pt"
    torch.save(torch.nn.Linear(4, 1).state_dict(), path, _use_new_zipfile_serialization=False)

    with pytest.raises(ModelUnavailable, match="not a zip-format torch file"):
        load_state_dict(path)


def test_truncated_and_corrupted_archives_are_refused(tmp_path: Path) -> None:
    """A cut-short file and a file with a damaged storage are both refused."""
    good = _save(tmp_path / "good.pt", torch.nn.Linear(64, 64).state_dict()).read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good[: len(good) // 2])
    corrupted = tmp_path / "corrupted.pt"
    middle = len(good) // 2
    corrupted.write_bytes(
        good[:middle] + bytes(b ^ 0xFF for b in good[middle : middle + 16]) + good[middle + 16 :]
    )

    for path in (truncated, corrupted):
        with pytest.raises(ModelUnavailable, match=str(path.name)):
            load_state_dict(path)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    """A path that does not exist gives ModelUnavailable, not FileNotFoundError."""
    with pytest.raises(ModelUnavailable, match="not found"):
        load_state_dict(tmp_path / "nope.pt")


def test_missing_storage_is_refused(tmp_path: Path) -> None:
    """An archive whose pickle names a storage that is not in the zip is refused."""
    path = _write_archive(
        tmp_path / "m.pt", _tensor_pickle(offset=0, size=[2], stride=[1], numel=2)
    )

    with pytest.raises(ModelUnavailable, match="storage '0' is missing"):
        load_state_dict(path)


def test_storage_of_wrong_size_is_refused(tmp_path: Path) -> None:
    """A storage whose byte count disagrees with its declared element count is refused."""
    pkl = _tensor_pickle(offset=0, size=[4], stride=[1], numel=4)
    path = _write_archive(tmp_path / "s.pt", pkl, {"0": b"\0" * 12})

    with pytest.raises(ModelUnavailable, match="holds 12 bytes"):
        load_state_dict(path)


@pytest.mark.parametrize(
    ("offset", "size", "stride"),
    [
        (0, [7], [1]),
        (5, [2], [1]),
        (0, [3, 3], [3, 1]),
        (0, [2], [-1]),
        (-1, [2], [1]),
        (0, [2, 2], [1]),
    ],
)
def test_out_of_bounds_views_are_refused(
    tmp_path: Path, offset: int, size: list[int], stride: list[int]
) -> None:
    """A view reaching past its storage, or with negative numbers, is refused, never read."""
    pkl = _tensor_pickle(offset=offset, size=size, stride=stride, numel=6)
    path = _write_archive(tmp_path / "b.pt", pkl, {"0": np.zeros(6, "<f4").tobytes()})

    with pytest.raises(ModelUnavailable, match="malformed"):
        load_state_dict(path)


def test_non_state_dict_payload_is_refused(tmp_path: Path) -> None:
    """A pickle of something other than name → tensor (a list, a string value) is refused."""
    for i, obj in enumerate([[1, 2], {"w": "text"}]):
        path = _write_archive(tmp_path / f"{i}.pt", pickle.dumps(obj, protocol=2))
        with pytest.raises(ModelUnavailable):
            load_state_dict(path)


# --- heads ---------------------------------------------------------------------------------------


def _heads(
    tmp_path: Path, hidden: int = 16, *, colbert_out: int | None = None
) -> tuple[Path, Path]:
    torch.manual_seed(1)
    sparse = torch.nn.Linear(hidden, 1)
    colbert = torch.nn.Linear(hidden, colbert_out or hidden)
    return _save(tmp_path / "sparse_linear.pt", sparse.state_dict()), _save(
        tmp_path / "colbert_linear.pt", colbert.state_dict()
    )


def test_load_heads_returns_float32_weights(tmp_path: Path) -> None:
    """load_heads flattens the sparse Linear(H→1) and keeps ColBERT's (H_out, H_in) layout."""
    sparse_path, colbert_path = _heads(tmp_path)
    sparse, colbert = torch.load(sparse_path), torch.load(colbert_path)

    heads = load_heads(sparse_path, colbert_path)

    assert isinstance(heads, HeadWeights)
    assert heads.hidden_size == 16
    np.testing.assert_array_equal(heads.sparse_weight, sparse["weight"][0].numpy())
    assert heads.sparse_bias == pytest.approx(float(sparse["bias"][0]), abs=0)
    np.testing.assert_array_equal(heads.colbert_weight, colbert["weight"].numpy())
    np.testing.assert_array_equal(heads.colbert_bias, colbert["bias"].numpy())
    for array in (heads.sparse_weight, heads.colbert_weight, heads.colbert_bias):
        assert array.dtype == np.float32


def test_load_heads_converts_half_precision_files(tmp_path: Path) -> None:
    """fp16 / bf16 head files come back as float32."""
    sparse = _save(tmp_path / "s.pt", torch.nn.Linear(8, 1).half().state_dict())
    colbert = _save(tmp_path / "c.pt", torch.nn.Linear(8, 8).to(torch.bfloat16).state_dict())

    heads = load_heads(sparse, colbert)

    assert heads.sparse_weight.dtype == heads.colbert_weight.dtype == np.float32


def test_load_heads_rejects_wrong_shapes(tmp_path: Path) -> None:
    """Swapped files, non-square ColBERT weights, mismatched H and missing keys are refused."""
    sparse_path, colbert_path = _heads(tmp_path)
    with pytest.raises(ModelUnavailable, match=r"expected weight \[1, H\]"):
        load_heads(colbert_path, sparse_path)

    other = tmp_path / "other"
    other.mkdir()
    _, wide = _heads(other, colbert_out=8)
    with pytest.raises(ModelUnavailable, match=r"expected weight \[H, H\]"):
        load_heads(sparse_path, wide)

    small = tmp_path / "small"
    small.mkdir()
    _, small_colbert = _heads(small, hidden=8)
    with pytest.raises(ModelUnavailable, match="head sizes disagree"):
        load_heads(sparse_path, small_colbert)

    no_bias = _save(tmp_path / "nobias.pt", {"weight": torch.zeros(1, 16)})
    with pytest.raises(ModelUnavailable, match="nn.Linear state dict"):
        load_heads(no_bias, colbert_path)


def test_loading_never_imports_torch(tmp_path: Path) -> None:
    """Importing bgeserve.ptload and loading head files leaves torch out of sys.modules."""
    sparse_path, colbert_path = _heads(tmp_path)
    script = (
        "import sys\n"
        "import bgeserve.model.ptload as p\n"
        f"h = p.load_heads({str(sparse_path)!r}, {str(colbert_path)!r})\n"
        "assert h.hidden_size == 16\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stderr
