"""numpy API over the compiled shared kernels (``lmserve_core._kernels``).

This is the one module that calls into ``lib``: it checks every size before a pointer
reaches C and turns status codes into exceptions.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from lmserve_core._kernels import ffi, lib

F32Array = npt.NDArray[np.float32]


class QuantType(enum.IntEnum):
    """Tensor types the kernels handle; values are GGML's type ids."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


class Isa(enum.IntEnum):
    """Instruction-set paths of the kernels."""

    PORTABLE = 0
    AVX2 = 1
    AVX512 = 2


class RopeMode(enum.IntEnum):
    """Which dimensions RoPE rotates together: (2i, 2i+1) or (i, i + n_rot/2)."""

    NORMAL = 0
    NEOX = 2


class KernelError(RuntimeError):
    """A kernel returned a failure status."""

    status: int = 0


class KernelValueError(KernelError, ValueError):
    """A size, index or pointer argument was invalid (``LM_EINVAL``)."""

    status = -1


class KernelMemoryError(KernelError, MemoryError):
    """Scratch memory could not be allocated (``LM_ENOMEM``)."""

    status = -2


class KernelTypeError(KernelError, TypeError):
    """The tensor type is not supported (``LM_ETYPE``)."""

    status = -3


class KernelIsaError(KernelError):
    """The CPU lacks the requested instruction set (``LM_EISA``)."""

    status = -4


_ERRORS: dict[int, type[KernelError]] = {
    cls.status: cls
    for cls in (KernelValueError, KernelMemoryError, KernelTypeError, KernelIsaError)
}


def check(status: int, what: str = "kernel call") -> None:
    """Raise the exception that matches a status code; return on ``LM_OK``."""
    if status == 0:
        return
    cls = _ERRORS.get(status, KernelError)
    raise cls(f"{what} failed with status {status}")


# ------------------------------------------------------------------ types
def _type_id(qtype: int) -> int:
    t = int(qtype)
    if lib.lm_type_block_elems(t) <= 0:
        raise KernelTypeError(f"unsupported tensor type {t}")
    return t


def block_elems(qtype: int) -> int:
    """Elements per block of ``qtype``."""
    return int(lib.lm_type_block_elems(_type_id(qtype)))


def block_bytes(qtype: int) -> int:
    """Bytes per block of ``qtype``."""
    return int(lib.lm_type_block_bytes(_type_id(qtype)))


def row_bytes(qtype: int, n: int) -> int:
    """Bytes of an ``n``-element row of ``qtype``; ValueError if n is not whole blocks."""
    size = int(lib.lm_row_bytes(_type_id(qtype), int(n)))
    if size < 0:
        name = QuantType(int(qtype)).name
        raise KernelValueError(f"{n} elements is not a whole number of {name} blocks")
    return size


# ------------------------------------------------------------------ ISA
def isa_best() -> Isa:
    """Best instruction set the CPU supports."""
    return Isa(lib.lm_isa_best())


def isa_active() -> Isa:
    """Instruction set the kernels currently use."""
    return Isa(lib.lm_isa_active())


def select_isa(isa: int) -> None:
    """Make the kernels use ``isa`` process-wide; KernelIsaError if the CPU lacks it."""
    check(lib.lm_isa_select(int(isa)), f"select ISA {isa}")


def available_isas() -> list[Isa]:
    """Every path this CPU can run, portable first."""
    return [isa for isa in Isa if isa <= isa_best()]


@contextlib.contextmanager
def use_isa(isa: int) -> Iterator[Isa]:
    """Run a block with ``isa`` selected, then restore the previous selection."""
    previous = isa_active()
    select_isa(isa)
    try:
        yield Isa(isa)
    finally:
        select_isa(previous)


# ------------------------------------------------------------------ pool
class Pool:
    """A persistent native thread pool (the calling thread is thread 0)."""

    def __init__(self, n_threads: int = 0) -> None:
        ptr = lib.lm_pool_new(int(n_threads))
        if ptr == ffi.NULL:
            raise KernelMemoryError("could not create the thread pool")
        self._ptr: Any = ptr

    @property
    def ptr(self) -> Any:
        """The ``lm_pool *`` to pass to kernels (NULL once closed)."""
        return self._ptr

    @property
    def size(self) -> int:
        """Threads, the caller included."""
        return int(lib.lm_pool_size(self._ptr))

    def close(self) -> None:
        """Stop and join the workers; idempotent."""
        if self._ptr != ffi.NULL:
            ptr, self._ptr = self._ptr, ffi.NULL
            lib.lm_pool_free(ptr)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _pool_ptr(pool: Pool | None) -> Any:
    return ffi.NULL if pool is None else pool.ptr


# ------------------------------------------------------------------ buffers
def _f32(a: npt.ArrayLike) -> F32Array:
    return np.ascontiguousarray(a, dtype=np.float32)


def _raw(raw: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Any contiguous buffer (or array) as flat bytes; no copy when already contiguous."""
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)


def _fbuf(a: F32Array) -> Any:
    return ffi.from_buffer("float[]", a)


def _ubuf(a: npt.NDArray[np.uint8]) -> Any:
    return ffi.from_buffer("uint8_t[]", a)


def _need(raw: npt.NDArray[np.uint8], size: int, what: str) -> None:
    if raw.nbytes < size:
        raise KernelValueError(f"{what}: need {size} bytes, got {raw.nbytes}")


# ------------------------------------------------------------------ rows
def dequantize_row(qtype: int, raw: npt.ArrayLike, n: int) -> F32Array:
    """Decode the first ``n`` elements of a row of ``qtype`` blocks."""
    t = _type_id(qtype)
    data = _raw(raw)
    _need(data, row_bytes(t, n), "dequantize_row")
    out = np.empty(int(n), dtype=np.float32)
    check(lib.lm_dequantize_row(t, _ubuf(data), _fbuf(out), int(n)), "dequantize_row")
    return out


def vec_dot(qtype: int, raw: npt.ArrayLike, x: npt.ArrayLike) -> float:
    """dot(row of ``qtype``, x) over ``len(x)`` elements."""
    t = _type_id(qtype)
    xs = _f32(x).reshape(-1)
    data = _raw(raw)
    _need(data, row_bytes(t, xs.size), "vec_dot")
    out = ffi.new("float *")
    check(lib.lm_vec_dot(t, _ubuf(data), _fbuf(xs), xs.size, out), "vec_dot")
    return float(out[0])


def matmul(
    qtype: int,
    w_raw: npt.ArrayLike,
    rows: int,
    cols: int,
    x: npt.ArrayLike,
    pool: Pool | None = None,
) -> F32Array:
    """``x @ W.T`` for W (rows x cols of ``qtype``); x is (cols,) or (ntok, cols)."""
    t = _type_id(qtype)
    xs = _f32(x)
    vector = xs.ndim == 1
    if xs.ndim not in (1, 2) or xs.shape[-1] != cols:
        raise KernelValueError(f"x has shape {xs.shape}, expected (ntok, {cols})")
    xs = xs.reshape(-1, cols)
    if rows < 0:
        raise KernelValueError("rows must be >= 0")
    data = _raw(w_raw)
    _need(data, rows * row_bytes(t, cols), "matmul")
    y = np.empty((xs.shape[0], rows), dtype=np.float32)
    if y.size:
        check(
            lib.lm_matmul(
                _pool_ptr(pool), t, _ubuf(data), rows, cols, _fbuf(xs), xs.shape[0], _fbuf(y)
            ),
            "matmul",
        )
    return y[0] if vector else y


def get_rows(
    qtype: int, table: npt.ArrayLike, n_rows: int, cols: int, ids: npt.ArrayLike
) -> F32Array:
    """Decoded rows ``ids`` of an (n_rows x cols) table of ``qtype``."""
    t = _type_id(qtype)
    data = _raw(table)
    _need(data, n_rows * row_bytes(t, cols), "get_rows")
    idx = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
    out = np.empty((idx.size, cols), dtype=np.float32)
    check(
        lib.lm_get_rows(
            t,
            _ubuf(data),
            n_rows,
            cols,
            ffi.from_buffer("int32_t[]", idx),
            idx.size,
            _fbuf(out),
        ),
        "get_rows",
    )
    return out


# ------------------------------------------------------------------ leaf ops
def rmsnorm(x: npt.ArrayLike, weight: npt.ArrayLike | None, eps: float) -> F32Array:
    """Row-wise RMS norm over the last axis."""
    xs = _f32(x)
    n = xs.shape[-1]
    w = None if weight is None else _f32(weight).reshape(-1)
    if w is not None and w.size != n:
        raise KernelValueError(f"weight has {w.size} elements, expected {n}")
    out = np.empty_like(xs)
    flat_in, flat_out = xs.reshape(-1, n), out.reshape(-1, n)
    wp = ffi.NULL if w is None else _fbuf(w)
    for i in range(flat_in.shape[0]):
        lib.lm_rmsnorm(_fbuf(flat_out[i]), _fbuf(flat_in[i]), wp, n, float(eps))
    return out


def rope(
    x: npt.ArrayLike,
    n_rot: int,
    pos: int,
    freq_base: float = 10000.0,
    freq_scale: float = 1.0,
    mode: int = RopeMode.NORMAL,
) -> F32Array:
    """Rotary embedding of one token's heads, x shaped (n_heads, head_dim); returns a copy."""
    out = _f32(x).copy()
    if out.ndim != 2:
        raise KernelValueError("x must be (n_heads, head_dim)")
    n_heads, head_dim = out.shape
    if not 0 <= n_rot <= head_dim or n_rot % 2:
        raise KernelValueError(f"n_rot {n_rot} must be even and <= head_dim {head_dim}")
    lib.lm_rope(
        _fbuf(out),
        n_heads,
        head_dim,
        n_rot,
        int(pos),
        float(freq_base),
        float(freq_scale),
        int(mode),
    )
    return out


def softmax(x: npt.ArrayLike) -> F32Array:
    """Softmax of a vector."""
    out = _f32(x).reshape(-1).copy()
    lib.lm_softmax(_fbuf(out), out.size)
    return out


def _binary(fn: Any, a: npt.ArrayLike, b: npt.ArrayLike) -> F32Array:
    av, bv = _f32(a), _f32(b)
    if av.shape != bv.shape:
        raise KernelValueError(f"shapes differ: {av.shape} vs {bv.shape}")
    out = np.empty_like(av)
    fn(_fbuf(out), _fbuf(av), _fbuf(bv), av.size)
    return out


def silu_mul(gate: npt.ArrayLike, up: npt.ArrayLike) -> F32Array:
    """silu(gate) * up."""
    return _binary(lib.lm_silu_mul, gate, up)


def gelu_mul(gate: npt.ArrayLike, up: npt.ArrayLike) -> F32Array:
    """gelu_tanh(gate) * up."""
    return _binary(lib.lm_gelu_mul, gate, up)


def add(a: npt.ArrayLike, b: npt.ArrayLike) -> F32Array:
    """a + b."""
    return _binary(lib.lm_add, a, b)


def scale(x: npt.ArrayLike, s: float) -> F32Array:
    """x * s."""
    out = _f32(x).copy()
    lib.lm_scale(_fbuf(out), float(s), out.size)
    return out


def attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    pos0: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    pool: Pool | None = None,
) -> F32Array:
    """Causal GQA of q (ntok, n_head, head_dim) over caches k, v (n_ctx, n_kv_head, head_dim).

    Query token t sits at position pos0 + t and sees cache rows up to and including it.
    """
    qs, ks, vs = _f32(q), _f32(k), _f32(v)
    if qs.ndim != 3 or ks.ndim != 3 or ks.shape != vs.shape:
        raise KernelValueError("q must be (ntok, n_head, head_dim); k, v (n_ctx, n_kv, head_dim)")
    ntok, n_head, head_dim = qs.shape
    n_ctx, n_kv, kv_dim = ks.shape
    if kv_dim != head_dim or n_kv == 0 or n_head % n_kv:
        raise KernelValueError(f"incompatible heads: q {qs.shape}, k {ks.shape}")
    if pos0 < 0 or pos0 + ntok > n_ctx:
        raise KernelValueError(f"positions {pos0}..{pos0 + ntok} exceed the cache ({n_ctx})")
    out = np.empty_like(qs)
    check(
        lib.lm_attention(
            _pool_ptr(pool),
            _fbuf(qs),
            _fbuf(ks),
            _fbuf(vs),
            _fbuf(out),
            ntok,
            int(pos0),
            n_head,
            n_kv,
            head_dim,
            float(scale),
            int(window),
            float(softcap),
        ),
        "attention",
    )
    return out
