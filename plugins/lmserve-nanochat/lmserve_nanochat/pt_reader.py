"""Reading a state dict that ``torch.save`` wrote, without torch and without running its
pickle.

``torch.save`` (torch >= 1.6) writes a zip archive: ``<dir>/data.pkl`` pickles the dict,
each tensor as ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)``,
each storage as a persistent id ``('storage', torch.<Dtype>Storage, key, device, numel)``
whose bytes are the member ``<dir>/data/<key>`` (stored uncompressed, little-endian).
:func:`read_state_dict` unpickles ``data.pkl`` with an unpickler that knows only those
globals (and ``collections.OrderedDict``, ``torch._utils._rebuild_parameter``): any other
global is refused by name before anything of it is looked up, so nothing of the file runs.

Floating-point tensors come back as float32 arrays: bfloat16 and float16 widened exactly,
float32 as a read-only view of the file's memory map when the member is stored and the
tensor is a contiguous view (no copy of a 2 GB checkpoint), float64 rounded. Integer and
bool tensors keep their numpy dtype. Views (storage offsets, strides) and storages shared
between tensors are honoured. Not read: the legacy pre-1.6 format
(``_use_new_zipfile_serialization=False``), big-endian archives, and tensors with more
elements than their storage holds (``expand``-ed views): each is refused by a
:class:`CheckpointError` saying so.
"""

from __future__ import annotations

import io
import mmap
import pickle
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from .config import CheckpointError

# torch's storage classes (as data.pkl names them) -> numpy dtype of their bytes
_STORAGE_DTYPES: dict[str, str] = {
    "FloatStorage": "<f4",
    "HalfStorage": "<f2",
    "BFloat16Storage": "<u2",  # widened to float32 by shifting into the high half
    "DoubleStorage": "<f8",
    "LongStorage": "<i8",
    "IntStorage": "<i4",
    "ShortStorage": "<i2",
    "CharStorage": "i1",
    "ByteStorage": "u1",
    "BoolStorage": "?",
}
MAX_PICKLE_BYTES = 64 << 20  # data.pkl of a state dict is a few hundred bytes per tensor
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER


class _StorageType:
    """What ``torch.<Dtype>Storage`` unpickles as: its name, never callable."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


_STORAGE_TYPES = {name: _StorageType(name) for name in _STORAGE_DTYPES}


class _Storage:
    __slots__ = ("dtype", "key", "numel")

    def __init__(self, kind: _StorageType, key: str, numel: int) -> None:
        self.dtype = kind.name
        self.key = key
        self.numel = numel


class _Tensor:
    __slots__ = ("offset", "shape", "storage", "stride")

    def __init__(
        self, storage: _Storage, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]
    ) -> None:
        self.storage = storage
        self.offset = offset
        self.shape = shape
        self.stride = stride


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise CheckpointError(f"{what} is not a tuple of non-negative integers")
    return tuple(value)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise CheckpointError("_rebuild_tensor_v2 of something that is not a storage")
    shape = _ints(size, "a tensor's size")
    strides = _ints(stride, "a tensor's stride")
    (offset,) = _ints((storage_offset,), "a tensor's storage offset")
    if len(shape) != len(strides):
        raise CheckpointError(f"a tensor of size {shape} has strides {strides}")
    count = 1
    for n in shape:
        count *= n
    if count:
        last = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        if last >= storage.numel or count > storage.numel:
            raise CheckpointError(
                f"a tensor of size {shape}, stride {strides} at offset {offset} does not fit "
                f"its storage {storage.key!r} of {storage.numel} elements"
            )
    return _Tensor(storage, offset, shape, strides)


def _rebuild_parameter(data: Any, requires_grad: Any = False, hooks: Any = None) -> Any:
    if not isinstance(data, _Tensor):
        raise CheckpointError("_rebuild_parameter of something that is not a tensor")
    return data


_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", name): kind for name, kind in _STORAGE_TYPES.items()},
}


class _Unpickler(pickle.Unpickler):
    """An unpickler of state dicts: the globals of :data:`_GLOBALS` and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise CheckpointError(
                f"refers to {module}.{name}, which a state dict of tensors does not use "
                "(refused: unpickling it could run code)"
            )
        return found

    def persistent_load(self, pid: Any) -> _Storage:
        match pid:
            case ("storage", _StorageType() as kind, str(key), str(), int(numel)) if (
                numel >= 0 and not isinstance(numel, bool)
            ):
                return _Storage(kind, key, numel)
        raise CheckpointError("a persistent id that is not a torch storage")


def _unpickle(data: bytes) -> Any:
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError("data.pkl nests too deeply") from None
    except Exception as exc:  # any malformed pickle: truncated, bad opcodes, wrong arguments
        raise CheckpointError(f"data.pkl is not a readable pickle ({exc})") from None


class _Archive:
    """The members of a torch zip archive, storages read from a memory map when stored."""

    def __init__(self, path: Path, fh: io.BufferedReader) -> None:
        self.path = path
        try:
            self.zip = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable zip archive ({exc})") from None
        pkls = [i for i in self.zip.infolist() if i.filename.endswith("/data.pkl")]
        pkls = [i for i in pkls if i.filename.count("/") == 1]
        if len(pkls) != 1:
            raise CheckpointError(f"{path}: no <dir>/data.pkl: not written by torch.save")
        self.prefix = pkls[0].filename[: -len("data.pkl")]
        self.pkl = pkls[0]
        size = fh.seek(0, io.SEEK_END)
        self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self.size = size

    def read(self, name: str, limit: int | None = None) -> bytes:
        info = self._info(name)
        if limit is not None and info.file_size > limit:
            raise CheckpointError(f"{self.path}: {name} is {info.file_size} bytes")
        try:
            return self.zip.read(info)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
            raise CheckpointError(f"{self.path}: {name} is unreadable ({exc})") from None

    def _info(self, name: str) -> zipfile.ZipInfo:
        try:
            return self.zip.getinfo(name)
        except KeyError:
            raise CheckpointError(f"{self.path}: the member {name} is missing") from None

    def array(self, storage: _Storage) -> np.ndarray:
        """A storage's elements, 1-D, in the dtype of its bytes."""
        name = f"{self.prefix}data/{storage.key}"
        dtype = np.dtype(_STORAGE_DTYPES[storage.dtype])
        need = storage.numel * dtype.itemsize
        info = self._info(name)
        if info.file_size < need:
            raise CheckpointError(
                f"{self.path}: {name} holds {info.file_size} bytes, its storage needs {need}"
            )
        if info.compress_type == zipfile.ZIP_STORED and self.map is not None:
            header = self.map[info.header_offset : info.header_offset + 30]
            if len(header) == 30 and header[:4] == b"PK\x03\x04":
                n_name, n_extra = struct.unpack("<HH", header[26:30])
                start = info.header_offset + 30 + n_name + n_extra
                if start + need > self.size:
                    raise CheckpointError(f"{self.path}: {name} runs past the end of the file")
                return np.frombuffer(self.map, dtype, count=storage.numel, offset=start)
        data = self.read(name)
        return np.frombuffer(data, dtype, count=storage.numel)


def _float32(view: np.ndarray, kind: str) -> np.ndarray:
    if kind == "BFloat16Storage":
        wide = view.astype(np.uint32)
        wide <<= 16
        return wide.view(np.float32)
    if view.dtype == np.float32:
        return view if view.flags.c_contiguous else np.ascontiguousarray(view)
    if view.dtype.kind == "f":
        return view.astype(np.float32)
    return view if view.flags.c_contiguous else np.ascontiguousarray(view)


def read_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """The tensors of a ``torch.save``-d dict of tensors, by name (names as saved).

    Raises :class:`CheckpointError` naming the file and what is wrong with it."""
    path = Path(path)
    try:
        fh = open(path, "rb")  # noqa: SIM115 - kept open while the archive is read
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
    with fh:
        head = fh.read(16)
        if not head.startswith(b"PK"):
            raise CheckpointError(_not_zip(path, head))
        fh.seek(0)
        archive = _Archive(path, fh)
        byteorder = f"{archive.prefix}byteorder"
        if byteorder in archive.zip.namelist():
            order = archive.read(byteorder, 16)
            if order != b"little":
                raise CheckpointError(f"{path}: byte order {order!r}: only little is read")
        try:
            obj = _unpickle(archive.read(archive.pkl.filename, MAX_PICKLE_BYTES))
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        if not isinstance(obj, dict):
            raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict")
        storages: dict[tuple[str, str, int], np.ndarray] = {}
        out: dict[str, np.ndarray] = {}
        for name, tensor in obj.items():
            if not isinstance(name, str):
                raise CheckpointError(f"{path}: a key of type {type(name).__name__}")
            if not isinstance(tensor, _Tensor):
                raise CheckpointError(
                    f"{path}: {name!r} is a {type(tensor).__name__}, not a tensor"
                )
            st = tensor.storage
            flat = storages.get((st.key, st.dtype, st.numel))
            if flat is None:
                flat = storages[st.key, st.dtype, st.numel] = archive.array(st)
            item = flat.itemsize
            if any(n == 0 for n in tensor.shape):
                view = np.zeros(tensor.shape, flat.dtype)
            else:
                view = np.lib.stride_tricks.as_strided(
                    flat[tensor.offset :],
                    shape=tensor.shape,
                    strides=tuple(s * item for s in tensor.stride),
                    writeable=False,
                )
            out[name] = _float32(view, st.dtype)
        return out


def _not_zip(path: Path, head: bytes) -> str:
    # the legacy format begins with its magic number, pickled: PROTO 2, LONG1 of 10 bytes
    if head[:4] == b"\x80\x02\x8a\x0a" and int.from_bytes(head[4:14], "little") == _LEGACY_MAGIC:
        return (
            f"{path}: the legacy torch serialization (before torch 1.6, or "
            "_use_new_zipfile_serialization=False) is not read: re-save it with torch.save"
        )
    return f"{path}: not a torch.save archive (no zip signature)"
