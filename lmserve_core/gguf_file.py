"""Validated, memory-mapped access to GGUF model files.

The ``gguf`` package's reader parses the file (memory-mapped); this module turns whatever it
raises on a truncated, malformed or hostile file into :class:`GGUFError`, and re-checks every
tensor's type, shape, alignment and extent against the file itself before a view of its bytes
can reach native code (and tells the two block layouts of Q2_0, GGML type 42, apart by that
extent). Tensor data is never copied: each :class:`TensorInfo` carries a
zero-copy ``uint8`` view into the mapping.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

__all__ = ["GGUFError", "GGUFFile", "TensorInfo", "SUPPORTED_VERSIONS", "Q2_0", "Q2_0_128"]

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
# Arrays of strings are read element by element; real vocabularies hold a few hundred
# thousand entries, so this bounds what a hostile file can make the reader allocate.
MAX_ARRAY_ITEMS = 1 << 22
# Numeric arrays at least this long (a vocabulary's scores, token types) stay numpy views of
# the file instead of lists.
LARGE_ARRAY = 4096

# GGML type 42, Q2_0, has two block layouts in the wild, with the same 2-bit codes (value
# (code - 1) * d): llama.cpp's, 64 elements in 18 bytes, and that of the Ternary-Bonsai files
# PrismML published, 128 elements in 34 bytes. The file does not say which: a tensor's bytes
# do (the span up to the next tensor, or to the end of the file, less the alignment padding),
# and a tensor of the second layout gets lmserve's own type id Q2_0_128 (lm_type's
# LM_Q2_0_128: the id PrismML's llama.cpp later gave that layout, which a file may carry too).
Q2_0 = 42
Q2_0_128 = 142
# (name, elements per block, bytes per block) of the types the gguf package may not know
_OWN_TYPES: dict[int, tuple[str, int, int]] = {
    Q2_0: ("Q2_0", 64, 18),
    Q2_0_128: ("Q2_0_128", 128, 34),
}


class GGUFError(ValueError):
    """The file is not a GGUF this server can use; the message names the file and the fault."""


class _Malformed(ValueError):
    """Raised inside the reader; ``open`` adds the file and the place."""


class _BoundedReader(GGUFReader):
    """The gguf package's reader, made safe for hostile files.

    The reader walks arrays element by element and trusts every count it reads, and past
    the end of the mapping its reads come back empty instead of failing: one absurd array
    length would loop (and allocate) without end. Here every read is bounded, an array is
    refused up front when its count cannot fit in the rest of the file, and faults are
    reported by name. Tensor data views are made by ``GGUFFile`` after its own checks.
    """

    def __init__(self, path: Path) -> None:
        self.tensor_infos: list[Any] = []
        self.string_arrays: dict[str, list[str]] = {}  # string-array values, decoded
        self._pending_strings: list[str] | None = None
        super().__init__(path)

    def _get(  # type: ignore[override]
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:
        count = int(count)
        if offset < 0 or count < 0 or offset + np.dtype(dtype).itemsize * count > len(self.data):
            raise _Malformed("truncated header: a value runs past the end of the file")
        return super()._get(offset, dtype, count, override_order)

    def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[override]
        length = int(self._get(offset, np.uint64)[0])
        if length > len(self.data) - offset - 8:
            raise _Malformed(f"truncated header: a string of {length} bytes runs past the end")
        return super()._get_str(offset)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
        raw_type = int(raw_type)
        if raw_type not in _VALUE_TYPES:
            raise _Malformed(f"unknown value type {raw_type}")
        if raw_type == GGUFValueType.ARRAY:
            item_part = self._get(orig_offs, np.uint32)
            count_part = self._get(orig_offs + 4, np.uint64)
            item_type, count = int(item_part[0]), int(count_part[0])
            if item_type not in _VALUE_TYPES:
                raise _Malformed(f"unknown array item type {item_type}")
            scalar = self.gguf_scalar_to_np.get(GGUFValueType(item_type))
            smallest = np.dtype(scalar).itemsize if scalar is not None else 8  # a length head
            if count * smallest > len(self.data) - (orig_offs + 12):
                raise _Malformed(
                    f"truncated header: an array of {count} items cannot fit in the rest "
                    "of the file"
                )
            if scalar is not None:
                # One view for the whole array; the base reader makes one per element.
                values = self._get(orig_offs + 12, scalar, count)
                types = [GGUFValueType.ARRAY, GGUFValueType(item_type)]
                return 12 + int(values.nbytes), [item_part, count_part, values], [2], types
            if count > MAX_ARRAY_ITEMS:
                raise _Malformed(f"an array of {count} strings or arrays is too large")
            if item_type == GGUFValueType.STRING:
                return self._string_array(orig_offs, item_part, count_part, count)
        return super()._get_field_parts(orig_offs, raw_type)

    def _string_array(
        self, orig_offs: int, item_part: np.ndarray, count_part: np.ndarray, count: int
    ) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        # Decoded straight into a list (walked with struct over a memoryview): vocabularies
        # have 10^5 strings, and the base reader's two views per string would cost a
        # transient ~100 MB that the allocator keeps for the life of the server.
        view = memoryview(self.data)  # type: ignore[arg-type]
        end = len(view)
        values: list[str] = []
        offs = orig_offs + 12
        unpack = _U64.unpack_from
        for _ in range(count):
            if offs + 8 > end:
                raise _Malformed("truncated header: a string runs past the end of the file")
            (length,) = unpack(view, offs)
            if length > end - offs - 8:
                raise _Malformed(f"truncated header: a string of {length} bytes runs past the end")
            values.append(str(view[offs + 8 : offs + 8 + length], "utf-8"))
            offs += 8 + length
        self._pending_strings = values  # taken by _push_field for the field being built
        types = [GGUFValueType.ARRAY, GGUFValueType.STRING]
        return offs - orig_offs, [item_part, count_part], [], types

    def _push_field(self, field: Any, skip_sum: bool = False) -> int:
        if field.name in self.fields:
            raise _Malformed(f"duplicate metadata key {field.name!r}")
        pending = getattr(self, "_pending_strings", None)
        if pending is not None:
            self.string_arrays[field.name] = pending
            self._pending_strings = None
        return int(super()._push_field(field, skip_sum))

    def _build_fields(self, offs: int, count: int) -> int:
        # Each pair takes at least 8 (key length) + 4 (type) + 1 bytes: refuse absurd counts
        # before looping over them.
        if int(count) * 13 > len(self.data) - offs:
            raise _Malformed(f"metadata count {int(count)} is impossible for this file size")
        try:
            return int(super()._build_fields(offs, count))
        except Exception as exc:
            raise _Malformed(f"metadata {self._failing_key(offs)}: {_reason(exc)}") from None

    def _failing_key(self, first: int) -> str:
        """The key of the pair after the last one read (the one that failed)."""
        offs = first
        pairs = [f for name, f in self.fields.items() if not name.startswith("GGUF.")]
        if pairs:
            offs = int(pairs[-1].offset) + sum(int(p.nbytes) for p in pairs[-1].parts)
        try:
            length = int(self._get(offs, np.uint64)[0])
            if length > 4096:
                raise _Malformed("key too long")
            return repr(bytes(self._get(offs + 8, np.uint8, length)).decode(errors="replace"))
        except _Malformed:
            return f"pair #{len(pairs)}"

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[Any]]:
        align = self.fields.get("general.alignment")
        if align is not None:
            value = align.contents()
            if align.types != [GGUFValueType.UINT32] or value <= 0 or value & (value - 1):
                raise _Malformed(f"invalid general.alignment {value!r} (a power of two, uint32)")
        # Each tensor info takes at least 8 + 4 + 4 + 8 bytes.
        if int(count) * 24 > len(self.data) - offs:
            raise _Malformed(f"tensor count {int(count)} is impossible for this file size")
        try:
            return super()._build_tensor_info(offs, count)  # type: ignore[no-any-return]
        except _Malformed:
            raise
        except Exception as exc:
            raise _Malformed(f"tensor table: {_reason(exc)}") from None

    def _get_tensor_info_field(self, orig_offs: int) -> Any:
        name_len, name_data = self._get_str(orig_offs)
        name = bytes(name_data).decode(errors="replace")
        n_dims = int(self._get(orig_offs + 8 + int(name_len[0]), np.uint32)[0])
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Malformed(f"tensor {name!r}: {n_dims} dimensions (must be 1..{MAX_DIMS})")
        return super()._get_tensor_info_field(orig_offs)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        # GGUFFile validates the table and makes the data views itself.
        self.tensor_infos = fields


_VALUE_TYPES = {int(t) for t in GGUFValueType}
_U64 = struct.Struct("<Q")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, _Malformed):
        return str(exc)
    text = str(exc) or type(exc).__name__
    return "corrupt header: " + (text if len(text) < 200 else text[:200] + "...")


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
        return _type_name(self.ggml_type)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the innermost dimension) in this tensor's encoding."""
        geometry = _geometry(self.ggml_type)
        assert geometry is not None  # a TensorInfo is only made for a known type
        _, block, size = geometry
        cols = self.shape[-1] if self.shape else 1
        return cols // block * size


class GGUFFile:
    """A GGUF file opened read-only and memory-mapped; use :meth:`open`."""

    path: Path
    version: int
    architecture: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    # the id a model served from it reports when not the file's stem (a checkpoint presented
    # as a GGUF in memory names its run and step)
    model_id: str | None = None

    def __init__(
        self,
        path: Path,
        version: int,
        metadata: dict[str, Any],
        tensors: dict[str, TensorInfo],
        alignment: int,
        data_offset: int,
    ) -> None:
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset
        self.architecture = str(metadata.get("general.architecture", ""))

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        """Map and validate ``path``; raises :class:`GGUFError` if it is not a usable GGUF."""
        p = Path(path)
        try:
            with open(p, "rb") as fh:
                head = fh.read(8)
                size = os.fstat(fh.fileno()).st_size
        except OSError as exc:
            raise GGUFError(f"{p}: cannot open: {exc.strerror or exc}") from exc
        if size == 0:
            raise GGUFError(f"{p}: file is empty, not a GGUF file")
        if len(head) < 8 or head[:4] != b"GGUF":
            raise GGUFError(f"{p}: not a GGUF file (bad magic {head[:4]!r})")
        version = int.from_bytes(head[4:8], "little")
        if version & 0xFFFF == 0:
            raise GGUFError(f"{p}: big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(
                f"{p}: unsupported GGUF version {version} (supported: {list(SUPPORTED_VERSIONS)})"
            )
        if size < 24:
            raise GGUFError(f"{p}: truncated header: the file is only {size} bytes")
        try:
            reader = _BoundedReader(p)
        except OSError as exc:
            raise GGUFError(f"{p}: cannot open: {exc.strerror or exc}") from exc
        except Exception as exc:  # the reader fails in many ways on a corrupt header
            raise GGUFError(f"{p}: {_reason(exc)}") from exc
        return cls._validate(p, version, size, reader)

    @classmethod
    def _validate(cls, path: Path, version: int, size: int, reader: _BoundedReader) -> GGUFFile:
        def fail(what: str) -> GGUFError:
            return GGUFError(f"{path}: {what}")

        metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            if key in reader.string_arrays:
                metadata[key] = reader.string_arrays[key]
                continue
            if (
                len(field.types) == 2
                and field.types[0] == GGUFValueType.ARRAY
                and field.types[1] in reader.gguf_scalar_to_np
                and len(field.parts[-1]) >= LARGE_ARRAY
            ):
                # a vocabulary's scores or token types: a read-only view of the mapped file
                # (a list of Python numbers would take 8 to 32 bytes per entry of heap)
                metadata[key] = field.parts[-1]
                continue
            try:
                metadata[key] = field.contents()
            except Exception as exc:
                raise fail(f"metadata {key!r}: {_reason(exc)}") from exc
        alignment = int(reader.alignment)
        data_offset = int(reader.data_offset)
        base = reader.data  # the file's read-only mapping, as uint8
        table: list[tuple[str, tuple[int, ...], int, int]] = []
        for field in reader.tensor_infos:
            _, name_data, _, dims, raw_type, rel = field.parts
            name = bytes(name_data).decode(errors="replace")
            table.append((name, tuple(int(d) for d in dims), int(raw_type[0]), int(rel[0])))
        # Where each tensor's bytes may run to: the next tensor's start, or the end of the
        # file (what tells Q2_0's two layouts apart).
        starts = sorted(data_offset + rel for _, _, _, rel in table)
        tensors: dict[str, TensorInfo] = {}
        for name, ne, ggml_type, rel in table:
            if name in tensors:
                raise fail(f"duplicate tensor name {name!r}")
            after = bisect.bisect_right(starts, data_offset + rel)
            span_end = starts[after] if after < len(starts) else size
            tensors[name] = _check_tensor(
                fail, size, base, name, ne, ggml_type, rel, data_offset, alignment, span_end
            )
        # Overlapping tensors mean a corrupt table: two weights would alias the same bytes.
        prev: TensorInfo | None = None
        for info in sorted(tensors.values(), key=lambda t: t.offset):
            if prev is not None and info.offset < prev.offset + prev.nbytes:
                raise fail(f"tensor {info.name!r} overlaps tensor {prev.name!r}")
            prev = info
        return cls(path, version, metadata, tensors, alignment, data_offset)

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
    geometry = _geometry(t)
    return geometry[0] if geometry is not None else str(t)


def _geometry(t: int) -> tuple[str, int, int] | None:
    """(name, elements per block, bytes per block) of GGML type ``t``, None if unknown."""
    if t in _OWN_TYPES:  # before the gguf package, which may not know them or only one
        return _OWN_TYPES[t]
    try:
        qtype = GGMLQuantizationType(t)
        block, size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        return None
    return qtype.name, block, size


def _padded(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _q2_0_layout(
    fail: Callable[[str], GGUFError],
    name: str,
    ne: tuple[int, ...],
    n_elements: int,
    span: int,
    alignment: int,
) -> int:
    """The type, Q2_0 or Q2_0_128, whose bytes fill a type-42 tensor's span of the file (at
    least the tensor's bytes, at most those padded to the alignment): exactly one must fit."""
    layouts = []  # (type, bytes) of the layouts whose blocks divide the rows
    for t in (Q2_0, Q2_0_128):
        _, block, size = _OWN_TYPES[t]
        if ne[0] % block == 0:
            layouts.append((t, n_elements // block * size))
    fits = [t for t, nbytes in layouts if nbytes <= span <= _padded(nbytes, alignment)]
    if len(fits) == 1:
        return fits[0]
    sizes = " or ".join(f"{nbytes} bytes in blocks of {_OWN_TYPES[t][1]}" for t, nbytes in layouts)
    if fits:
        raise fail(
            f"tensor {name!r}: Q2_0 (type 42) is ambiguous: its {span} bytes in the file fit "
            f"both block layouts ({sizes}, padded to {alignment} bytes)"
        )
    raise fail(
        f"tensor {name!r}: Q2_0 (type 42) data of {span} bytes (up to the next tensor or the "
        f"end of the file) fits no block layout ({sizes}, padded to {alignment} bytes); the "
        "file is truncated or corrupt"
    )


def _check_tensor(
    fail: Callable[[str], GGUFError],
    file_size: int,
    base: np.ndarray,
    name: str,
    ne: tuple[int, ...],
    ggml_type: int,
    rel: int,
    data_offset: int,
    alignment: int,
    span_end: int,
) -> TensorInfo:
    geometry = _geometry(ggml_type)
    if geometry is None:
        raise fail(f"tensor {name!r}: unknown GGML type {ggml_type}")
    n_elements = 1
    for d in ne:
        n_elements *= d
    if n_elements >= 1 << 62:
        raise fail(f"tensor {name!r}: element count overflows ({ne})")
    if ne[0] % geometry[1]:
        raise fail(
            f"tensor {name!r}: row length {ne[0]} is not a multiple of the "
            f"{geometry[0]} block size {geometry[1]}"
        )
    if rel % alignment:
        raise fail(f"tensor {name!r}: data offset {rel} is not {alignment}-byte aligned")
    start = data_offset + rel
    if ggml_type == Q2_0 and 0 <= start <= file_size:  # else refused below as it stands
        ggml_type = _q2_0_layout(fail, name, ne, n_elements, span_end - start, alignment)
        geometry = _OWN_TYPES[ggml_type]
    _, block, type_size = geometry
    nbytes = n_elements // block * type_size
    if start < 0 or start + nbytes > file_size:
        raise fail(
            f"tensor {name!r}: data [{start}, {start + nbytes}) lies beyond the end of the "
            f"file ({file_size} bytes); the file is truncated or corrupt"
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
