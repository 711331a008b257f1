"""Validated, memory-mapped access to GGUF model files.

The header is parsed with bounds checks on every read, so a truncated, malformed or hostile
file raises :class:`GGUFError` instead of crashing or allocating without limit. Tensor data is
never copied: each :class:`TensorInfo` carries a zero-copy ``uint8`` view into the mapping, and
every size and offset has been checked before such a view can reach native code.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

__all__ = ["GGUFError", "GGUFFile", "TensorInfo", "SUPPORTED_VERSIONS"]

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS

# (struct format, size) of each scalar value type, little-endian.
_SCALARS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
    GGUFValueType.BOOL: ("<?", 1),
}
_NUMPY_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
    GGUFValueType.BOOL: "?",
}
_MAX_ARRAY_DEPTH = 4


class GGUFError(ValueError):
    """The file is not a GGUF this server can use; the message names the file and the fault."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a GGUF file.

    ``shape`` is in row-major numpy order (``(rows, cols)`` for a matrix: the reverse of
    GGUF's ``ne``); ``data`` is a zero-copy ``uint8`` view of the tensor's bytes in the mapped
    file; ``offset`` is the absolute file offset of those bytes.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    n_elements: int
    nbytes: int
    offset: int
    data: np.ndarray

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the innermost dimension) in this tensor's encoding."""
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        cols = self.shape[-1] if self.shape else 1
        return cols // block * size


class _Cursor:
    """Bounds-checked little-endian reader over the mapped header."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated header while reading {what} at offset {self.pos}")

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, n = _SCALARS[vtype]
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT64, what))

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Keep the file usable: a stray byte in one token must not make the model unloadable.
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            if depth >= _MAX_ARRAY_DEPTH:
                raise self.fail(f"{what}: arrays nested too deeply")
            itype = self.u32(f"element type of {what}")
            count = self.u64(f"element count of {what}")
            return self.array(itype, count, what, depth + 1)
        raise self.fail(f"{what}: unknown value type {vtype}")

    def array(self, itype: int, count: int, what: str, depth: int) -> list[Any]:
        if itype in _NUMPY_SCALARS:
            _, n = _SCALARS[itype]
            self.need(count * n, f"{what} ({count} elements)")
            arr = np.frombuffer(self.buf, dtype=_NUMPY_SCALARS[itype], count=count, offset=self.pos)
            self.pos += count * n
            return arr.tolist()
        if itype == GGUFValueType.STRING:
            # Every string needs at least its 8-byte length: this bounds `count` by the file size.
            self.need(count * 8, f"{what} ({count} strings)")
            return self._strings(count, what)
        if itype == GGUFValueType.ARRAY:
            # An array header is at least 12 bytes.
            self.need(count * 12, f"{what} ({count} arrays)")
            return [self.value(GGUFValueType.ARRAY, what, depth) for _ in range(count)]
        raise self.fail(f"{what}: unknown array element type {itype}")

    def _strings(self, count: int, what: str) -> list[str]:
        buf, size, pos = self.buf, self.size, self.pos
        unpack = struct.Struct("<Q").unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"truncated header in {what}[{i}] at offset {pos}")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                raise self.fail(f"truncated header in {what}[{i}] at offset {pos}")
            raw = buf[pos : pos + n]
            pos += n
            try:
                append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                append(raw.decode("utf-8", errors="replace"))
        self.pos = pos
        return out


class GGUFFile:
    """A GGUF file opened read-only and memory-mapped; use :meth:`open`."""

    path: Path
    version: int
    architecture: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int

    def __init__(
        self,
        path: Path,
        version: int,
        metadata: dict[str, Any],
        tensors: dict[str, TensorInfo],
        alignment: int,
        data_offset: int,
        mapping: mmap.mmap | None,
    ) -> None:
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset
        self.architecture = str(metadata.get("general.architecture", ""))
        self._mmap = mapping

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        """Map and validate ``path``; raises :class:`GGUFError` if it is not a usable GGUF."""
        p = Path(path)
        try:
            with open(p, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size == 0:
                    raise GGUFError(f"{p}: file is empty, not a GGUF file")
                mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise GGUFError(f"{p}: cannot open: {exc.strerror or exc}") from exc
        try:
            return cls._parse(p, mapping)
        except BaseException:
            # Views made during parsing may still be referenced by the traceback; the
            # mapping is then released by the garbage collector instead.
            with contextlib.suppress(BufferError):
                mapping.close()
            raise

    @classmethod
    def _parse(cls, path: Path, mapping: mmap.mmap) -> GGUFFile:
        cur = _Cursor(mapping, path)
        if cur.size < 24:
            raise cur.fail(f"file too small for a GGUF header ({cur.size} bytes)")
        magic = struct.unpack_from("<I", mapping, 0)[0]
        if magic != GGUF_MAGIC:
            raise cur.fail(f"not a GGUF file (bad magic {mapping[0:4]!r})")
        cur.pos = 4
        version = cur.u32("version")
        if version & 0xFFFF == 0 and version != 0:
            raise cur.fail("big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            raise cur.fail(
                f"unsupported GGUF version {version} (supported: {list(SUPPORTED_VERSIONS)})"
            )
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        remaining = cur.size - cur.pos
        # A key/value pair takes at least 8 (key length) + 4 (type) + 1 bytes, a tensor info
        # at least 8 + 4 + 4 + 8: absurd counts are rejected before any loop runs.
        if n_kv * 13 > remaining:
            raise cur.fail(f"metadata count {n_kv} is impossible for a {cur.size}-byte file")
        if n_tensors * 24 > remaining:
            raise cur.fail(f"tensor count {n_tensors} is impossible for a {cur.size}-byte file")

        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.u32(f"type of {key!r}")
            if key in metadata:
                raise cur.fail(f"duplicate metadata key {key!r}")
            metadata[key] = cur.value(vtype, f"metadata {key!r}")

        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if (
            not isinstance(alignment, int)
            or isinstance(alignment, bool)
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            raise cur.fail(f"invalid general.alignment {alignment!r}")

        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            name = cur.string(f"name of tensor #{i}")
            if name in seen:
                raise cur.fail(f"duplicate tensor name {name!r}")
            seen.add(name)
            n_dims = cur.u32(f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.fail(f"tensor {name!r}: {n_dims} dimensions (must be 1..{MAX_DIMS})")
            ne = tuple(cur.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims))
            ggml_type = cur.u32(f"type of tensor {name!r}")
            rel = cur.u64(f"offset of tensor {name!r}")
            infos.append((name, ne, ggml_type, rel))

        pad = cur.pos % alignment
        data_offset = cur.pos + (alignment - pad if pad else 0)
        tensors: dict[str, TensorInfo] = {}
        base = np.frombuffer(mapping, dtype=np.uint8)
        for name, ne, ggml_type, rel in infos:
            tensors[name] = _check_tensor(
                cur, base, name, ne, ggml_type, rel, data_offset, alignment
            )
        # Overlapping tensors mean a corrupt table: two weights would alias the same bytes.
        prev: TensorInfo | None = None
        for info in sorted(tensors.values(), key=lambda t: t.offset):
            if prev is not None and info.offset < prev.offset + prev.nbytes:
                raise cur.fail(f"tensor {info.name!r} overlaps tensor {prev.name!r}")
            prev = info
        return cls(path, version, metadata, tensors, alignment, data_offset, mapping)

    # -- access -------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value stored under ``key``, or ``default``."""
        return self.metadata.get(key, default)

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """The metadata value ``{architecture}.{suffix}``, or ``default``."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def require(
        self,
        name: str,
        *,
        ggml_types: Iterable[int] | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> TensorInfo:
        """The tensor ``name``, checked against allowed types and an exact shape.

        ``shape`` is in numpy order; ``-1`` in it matches any size.
        """
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing")
        if ggml_types is not None:
            allowed = {int(t) for t in ggml_types}
            if info.ggml_type not in allowed:
                names = sorted(_type_name(t) for t in allowed)
                raise GGUFError(
                    f"{self.path}: tensor {name!r} has type {info.type_name}, expected one of "
                    f"{', '.join(names)}"
                )
        if shape is not None and (
            len(shape) != len(info.shape)
            or any(want != -1 and want != got for want, got in zip(shape, info.shape, strict=True))
        ):
            raise GGUFError(
                f"{self.path}: tensor {name!r} has shape {info.shape}, expected {shape}"
            )
        return info

    def close(self) -> None:
        """Drop this object's hold on the mapping.

        Tensor views handed out earlier stay valid: the mapping is released when the last of
        them is gone, so native code can never see unmapped memory.
        """
        self.tensors = {}
        self._mmap = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, arch={self.architecture!r}, "
            f"tensors={len(self.tensors)}, metadata={len(self.metadata)})"
        )


def _type_name(t: int) -> str:
    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return str(t)


def _check_tensor(
    cur: _Cursor,
    base: np.ndarray,
    name: str,
    ne: tuple[int, ...],
    ggml_type: int,
    rel: int,
    data_offset: int,
    alignment: int,
) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor {name!r}: unknown GGML type {ggml_type}") from None
    n_elements = 1
    for d in ne:
        n_elements *= d
    if n_elements >= 1 << 62:
        raise cur.fail(f"tensor {name!r}: element count overflows ({ne})")
    if ne[0] % block:
        raise cur.fail(
            f"tensor {name!r}: row length {ne[0]} is not a multiple of the "
            f"{qtype.name} block size {block}"
        )
    nbytes = n_elements // block * type_size
    if rel % alignment:
        raise cur.fail(f"tensor {name!r}: data offset {rel} is not {alignment}-byte aligned")
    start = data_offset + rel
    if start + nbytes > cur.size:
        raise cur.fail(
            f"tensor {name!r}: data [{start}, {start + nbytes}) lies beyond the end of the "
            f"file ({cur.size} bytes); the file is truncated or corrupt"
        )
    data = base[start : start + nbytes]
    return TensorInfo(
        name=name,
        ggml_type=int(ggml_type),
        shape=tuple(reversed(ne)),
        n_elements=n_elements,
        nbytes=nbytes,
        offset=start,
        data=data,
    )
