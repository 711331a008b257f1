"""Q2_0 in numpy, for tests: both block layouts of GGML type 42, and GGUFs holding them.

A block is an f16 scale ``d`` and 2-bit codes, element ``j`` at bits ``2 (j % 4)`` of byte
``j // 4``, worth ``(code - 1) * d``: llama.cpp's Q2_0 has 64 elements (18 bytes), the layout
of PrismML's Ternary-Bonsai files 128 (34 bytes; lmserve's type Q2_0_128). The ``gguf``
package does not know type 42, so :func:`write_gguf` writes the tensor table itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from lmserve_core.gguf_file import Q2_0, Q2_0_128
from lmserve_core.testing.gguf_writer import add_arch_metadata

__all__ = ["Q2_0", "Q2_0_128", "block", "decode", "encode", "random_blocks", "write_gguf"]

# (elements, bytes) of a block, written out here rather than read from the code under test
_BLOCKS = {Q2_0: (64, 18), Q2_0_128: (128, 34)}


def block(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of a block of ``qtype`` (Q2_0 or Q2_0_128)."""
    if qtype not in _BLOCKS:
        raise ValueError(f"type {qtype} is not a Q2_0 layout")
    return _BLOCKS[qtype]


def decode(raw: np.ndarray, qtype: int) -> np.ndarray:
    """The values of whole blocks of ``qtype`` (any shape of bytes whose last axis is whole
    blocks): float32 of shape (..., elements), each exactly ``(code - 1) * d``."""
    elems, nbytes = block(qtype)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, nbytes)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # (nblocks, 1)
    codes = (blocks[:, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # (nb, elems/4, 4)
    values = (codes.reshape(-1, elems).astype(np.float32) - 1) * d
    return values.reshape(*lead, -1)


def encode(w: np.ndarray, qtype: int) -> np.ndarray:
    """``w`` (rows of whole blocks) as ``qtype`` bytes, by llama.cpp's quantize_row_q2_0_ref:
    d = max |w| of the block, code = clamp(round(w / d) + 1, 0, 3) (halves away from 0)."""
    elems, nbytes = block(qtype)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.shape[-1] % elems:
        raise ValueError(f"rows of {w.shape[-1]} are not whole blocks of {elems}")
    blocks = w.reshape(-1, elems)
    amax = np.abs(blocks).max(axis=1)
    inv = np.divide(np.float32(1), amax, out=np.zeros_like(amax), where=amax > 0, dtype=np.float32)
    scaled = blocks * inv[:, None]
    rounded = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))
    codes = np.clip(rounded + 1, 0, 3).astype(np.uint8).reshape(len(blocks), -1, 4)
    qs = codes[..., 0] | codes[..., 1] << 2 | codes[..., 2] << 4 | codes[..., 3] << 6
    out = np.empty((len(blocks), nbytes), np.uint8)
    out[:, :2] = amax.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = qs
    return out.reshape(*w.shape[:-1], -1)


def random_blocks(
    rng: np.random.Generator, qtype: int, rows: int, cols: int, scale: float = 0.05
) -> np.ndarray:
    """(rows, row bytes) of random codes (all four, +2 included) and f16 scales in
    [-scale, scale]."""
    elems, nbytes = block(qtype)
    if cols % elems:
        raise ValueError(f"rows of {cols} are not whole blocks of {elems}")
    raw = rng.integers(0, 256, (rows * cols // elems, nbytes), dtype=np.uint8)
    d = rng.uniform(-scale, scale, len(raw)).astype(np.float16)
    raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path,
    arch: str,
    keys: Mapping[str, Any],
    tensors: Sequence[tuple[str, int, tuple[int, ...], np.ndarray]],
) -> None:
    """A GGUF of ``arch`` with ``{arch}.{key}`` metadata and the given tensors, each (name,
    GGML type id, numpy shape, raw bytes or the f32 values of an F32 tensor), in order."""
    writer = GGUFWriter(str(path), arch)
    add_arch_metadata(writer, arch, keys)
    data = []
    for name, qtype, shape, raw in tensors:
        payload = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        # a non-uint8 dtype keeps the shape as elements; the id is written as it is
        raw_dtype: Any = GGMLQuantizationType.F32 if qtype == 0 else qtype
        writer.add_tensor_info(name, shape, np.dtype(np.float32), payload.nbytes, raw_dtype)
        data.append(payload)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for payload in data:
        writer.write_tensor_data(payload)
    writer.close()
