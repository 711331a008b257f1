"""pt_reader: torch.save archives read without torch, hostile ones refused unexecuted."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
from lmserve_nanochat.config import CheckpointError
from lmserve_nanochat.pt_reader import read_state_dict

torch = pytest.importorskip("torch")


def _ref(t: object) -> np.ndarray:
    t = t.detach()
    return t.float().numpy() if t.is_floating_point() else t.numpy()


def _roundtrip(tmp_path: Path, sd: dict, **save: object) -> dict[str, np.ndarray]:
    path = tmp_path / "m.pt"
    torch.save(sd, path, **save)
    got = read_state_dict(path)
    assert list(got) == list(sd)
    for name, t in sd.items():
        want = _ref(t)
        assert got[name].shape == want.shape, name
        assert got[name].dtype == (np.float32 if t.is_floating_point() else want.dtype), name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    return got


def test_dtypes_shapes_views(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g) * 100
    base[0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0])
    sd = {
        "_orig_mod.transformer.wte.weight": base.to(torch.bfloat16),
        "f16": base.half(),
        "f32": base.clone(),
        "f64": base.double(),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
        "ints": torch.arange(7),
        "int32": torch.arange(5, dtype=torch.int32),
        "bools": torch.tensor([True, False]),
        "uint8": torch.arange(4, dtype=torch.uint8),
        "transposed": base.t(),
        "rows": base[2:5],
        "strided": base[::2, 1::3],
        "bf16_view": base.to(torch.bfloat16)[1:, 2:].t(),
        "param": torch.nn.Parameter(base.clone()),
        "x4": torch.randn(2, 3, 4, 5, generator=g).permute(3, 1, 0, 2),
    }
    got = _roundtrip(tmp_path, sd)
    # bf16 widened exactly: the high half of the float32 bits
    bits = sd["_orig_mod.transformer.wte.weight"].view(torch.int16).numpy().astype(np.uint16)
    assert (got["_orig_mod.transformer.wte.weight"].view(np.uint32) >> 16 == bits).all()
    assert np.isnan(got["f32"][0, 2]) and np.signbit(got["f32"][0, 3])
    # a contiguous float32 tensor is a read-only view of the file, not a copy
    assert not got["f32"].flags.writeable and not got["f32"].flags.owndata


def test_shared_storage(tmp_path: Path) -> None:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"a": w, "b": w, "c": w[1], "d": w.view(6, 4)}
    got = _roundtrip(tmp_path, sd)
    assert np.shares_memory(got["a"], got["b"]) and np.shares_memory(got["a"], got["c"])


def test_state_dict_of_a_compiled_module(tmp_path: Path) -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 4, bias=False)
            self.lam = torch.nn.Parameter(torch.ones(2))

    sd = {f"_orig_mod.{k}": v for k, v in M().to(torch.bfloat16).state_dict().items()}
    assert set(_roundtrip(tmp_path, sd)) == {"_orig_mod.lin.weight", "_orig_mod.lam"}
    # the OrderedDict of Module.state_dict, with its _metadata
    _roundtrip(tmp_path, M().state_dict())


def test_deflated_members(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    sd = {"w": torch.randn(3, 5).to(torch.bfloat16), "v": torch.randn(4)}
    torch.save(sd, path)
    redone = tmp_path / "z.pt"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(redone, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    got = read_state_dict(redone)
    for k, t in sd.items():
        np.testing.assert_array_equal(got[k], _ref(t))


# -- hostile and broken files ------------------------------------------------------------------


def _archive(tmp_path: Path, pkl: bytes, members: dict[str, bytes] | None = None) -> Path:
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        for name, data in (members or {}).items():
            z.writestr(f"archive/data/{name}", data)
    return path


class _Call:
    """Pickles as a call of ``func(*args)``."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(CheckpointError) as info:
        read_state_dict(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message, message
    return message


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


def test_code_is_never_run(tmp_path: Path, canary: Path) -> None:
    import builtins
    import os
    import subprocess

    calls = {
        "posix.system": _Call(os.system, f"touch {canary}"),
        "builtins.eval": _Call(builtins.eval, f"open({str(canary)!r}, 'w')"),
        "builtins.exec": _Call(builtins.exec, f"open({str(canary)!r}, 'w')"),
        "subprocess.call": _Call(subprocess.call, ["touch", str(canary)]),
        "io.open": _Call(builtins.open, str(canary), "w"),
    }
    for name, call in calls.items():
        for obj in ({"w": call}, call, [call]):
            # protocol 2 writes builtins as __builtin__ (Python 2's name)
            short = "." + name.split(".")[1]
            _refused(_archive(tmp_path, pickle.dumps(obj, protocol=2)), short, "refers to")
            _refused(_archive(tmp_path, pickle.dumps(obj, protocol=4)), name)
    assert not canary.exists()


def test_other_globals_are_refused(tmp_path: Path) -> None:
    # a global that exists in torch but is not a state dict's
    pkl = b"\x80\x02ctorch._utils\n_rebuild_qtensor\nq\x00."
    _refused(_archive(tmp_path, pkl), "torch._utils._rebuild_qtensor")
    pkl = b"\x80\x02ccollections\ndefaultdict\n)R."
    _refused(_archive(tmp_path, pkl), "collections.defaultdict")
    pkl = b"\x80\x02ctorch\nComplexFloatStorage\n."
    _refused(_archive(tmp_path, pkl), "torch.ComplexFloatStorage")


def _raw_tensor_pickle(
    size: tuple[int, ...], stride: tuple[int, ...], offset: int, numel: int, key: str = "0"
) -> bytes:
    """Hand-assembled data.pkl (protocol 2) of {"w": _rebuild_tensor_v2(...)}."""

    def tup(values: tuple[int, ...]) -> bytes:
        return b"(" + b"".join(b"J" + v.to_bytes(4, "little", signed=True) for v in values) + b"t"

    k = key.encode()
    return (
        b"\x80\x02}X\x01\x00\x00\x00w"
        b"ctorch._utils\n_rebuild_tensor_v2\n("
        b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX"
        + len(k).to_bytes(4, "little") + k
        + b"X\x03\x00\x00\x00cpuJ" + numel.to_bytes(4, "little") + b"tQ"
        + b"J" + offset.to_bytes(4, "little") + tup(size) + tup(stride)
        + b"\x89ccollections\nOrderedDict\n)RtRs."
    )  # fmt: skip


def test_hand_made_pickle_reads(tmp_path: Path) -> None:
    data = np.arange(12, dtype="<f4").tobytes()
    got = read_state_dict(
        _archive(tmp_path, _raw_tensor_pickle((3, 4), (4, 1), 0, 12), {"0": data})
    )
    np.testing.assert_array_equal(got["w"], np.arange(12, dtype=np.float32).reshape(3, 4))


def test_broken_archives(tmp_path: Path) -> None:
    data = np.arange(12, dtype="<f4").tobytes()
    good = _raw_tensor_pickle((3, 4), (4, 1), 0, 12)
    _refused(_archive(tmp_path, good), "archive/data/0", "missing")
    _refused(
        _archive(tmp_path, _raw_tensor_pickle((3, 4), (4, 1), 0, 12, "7"), {"0": data}), "data/7"
    )
    _refused(_archive(tmp_path, good, {"0": data[:40]}), "holds 40 bytes")
    for size, stride, offset in (((4, 4), (4, 1), 0), ((3, 4), (4, 1), 1), ((3, 4), (1, 3), 2)):
        _refused(
            _archive(tmp_path, _raw_tensor_pickle(size, stride, offset, 12), {"0": data}),
            "does not fit its storage",
        )
    # stride 0: more elements than the storage (an expanded view)
    _refused(
        _archive(tmp_path, _raw_tensor_pickle((1000, 12), (0, 1), 0, 12), {"0": data}),
        "does not fit",
    )
    _refused(_archive(tmp_path, _raw_tensor_pickle((3, 4), (4,), 0, 12), {"0": data}), "strides")
    # a truncated archive
    path = tmp_path / "m.pt"
    torch.save({"w": torch.randn(64, 64)}, path)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _refused(cut, "zip")
    # a truncated pickle
    _refused(_archive(tmp_path, good[:-10], {"0": data}), "pickle")
    # not a dict of tensors
    _refused(_archive(tmp_path, pickle.dumps([1, 2], protocol=2)), "not a state dict")
    _refused(_archive(tmp_path, pickle.dumps({"w": 3}, protocol=2)), "'w' is a int")
    # no data.pkl, not a zip at all, an empty file, a missing file
    with zipfile.ZipFile(tmp_path / "nopkl.pt", "w") as z:
        z.writestr("archive/other", b"x")
    _refused(tmp_path / "nopkl.pt", "data.pkl")
    (tmp_path / "text.pt").write_text("hello")
    _refused(tmp_path / "text.pt", "not a torch.save archive")
    (tmp_path / "empty.pt").write_bytes(b"")
    _refused(tmp_path / "empty.pt", "not a torch.save archive")
    _refused(tmp_path / "absent.pt", "cannot be read")


def test_deep_and_bomb_pickles(tmp_path: Path, canary: Path) -> None:
    # 100k nested lists, built without recursion by the unpickler
    deep = b"\x80\x02}X\x01\x00\x00\x00w" + b"]" * 100_000 + b"a" * 99_999 + b"s."
    _refused(_archive(tmp_path, deep), "'w' is a list")
    # a "billion laughs" of shared references
    laughs = b"\x80\x02}X\x01\x00\x00\x00w]q\x000" + b"(h\x00h\x00tq\x000" * 60
    laughs += b"h\x00s."
    _refused(_archive(tmp_path, laughs), "'w' is a tuple")
    # a data.pkl far larger than any state dict's
    with zipfile.ZipFile(tmp_path / "big.pt", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02N" + b"N0" * (40 << 20) + b".")
    _refused(tmp_path / "big.pt", "data.pkl is")
    assert not canary.exists()


def test_legacy_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    _refused(path, "legacy torch serialization")
