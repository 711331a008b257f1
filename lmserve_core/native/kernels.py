"""numpy API over the compiled shared kernels (``lmserve_core._kernels``).

This is the one module that calls into ``lib``: it checks every size before a pointer
reaches C and turns status codes into exceptions.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lmserve_core._kernels import ffi, lib

F32Array = npt.NDArray[np.float32]


def _c_enum(name: str, c_enum: str, prefix: str) -> Any:
    # The C header is the one list of these values; Python reads it from the compiled module.
    members = {k.removeprefix(prefix): v for k, v in ffi.typeof(c_enum).relements.items()}
    return enum.IntEnum(name, sorted(members.items(), key=lambda kv: kv[1]))


QuantType = _c_enum("QuantType", "enum lm_type", "LM_")
QuantType.__doc__ = (
    "Tensor types the kernels handle; values are GGML's type ids (lm_type), but for Q2_0_128: "
    "lmserve's id of the 128-element layout of GGML type 42 (Q2_0 is its 64-element one)."
)
Interleaved = _c_enum("Interleaved", "enum lm_r16_type", "LM_")
Interleaved.__doc__ = (
    "Layouts the kit rewrites Q4_0, Q4_1, Q8_0, Q4_K and Q6_K matrices into (lm_r16_type): "
    "the same bytes, "
    "16 rows interleaved block column by block column; never a GGUF's type."
)
# The interleaved layout of each type that has one, whether or not this CPU gains from it.
_R16_TYPE: dict[int, int] = {int(QuantType[i.name.removesuffix("_R16")]): int(i) for i in Interleaved}
Isa = _c_enum("Isa", "enum lm_isa", "LM_ISA_")
Isa.__doc__ = "Instruction-set paths of the kernels (lm_isa)."
RopeMode = _c_enum("RopeMode", "enum lm_rope_mode", "LM_ROPE_")
RopeMode.__doc__ = "Which dimensions RoPE rotates together: (2i, 2i+1) or (i, i + n_rot/2)."
Activation = _c_enum("Activation", "enum lm_act", "LM_ACT_")
Activation.__doc__ = "Gate activation of a gated feed-forward (lm_act)."
DecodePrecision = _c_enum("DecodePrecision", "enum lm_decode_precision", "LM_DECODE_")
DecodePrecision.__doc__ = (
    "Activations of the few-token products (decode, short chunks): F32, or I16 (int16 per "
    "group of 32 with integer products; lm_decode_precision)."
)
#: ``--decode-precision`` names of the precisions.
DECODE_PRECISIONS: dict[str, int] = {"int16": 1, "f32": 0}
PrefillPrecision = _c_enum("PrefillPrecision", "enum lm_prefill_precision", "LM_PREFILL_")
PrefillPrecision.__doc__ = (
    "Activations of the many-token products (prefill): F32, or I16 (decode's int16 products "
    "on the interleaved matrices, the f32 GEMM elsewhere; lm_prefill_precision)."
)
#: ``--prefill-precision`` names of the precisions.
PREFILL_PRECISIONS: dict[str, int] = {"int16": 1, "f32": 0}
#: Query rows a forward pass of one sequence may have and still run decode's kernels, which
#: give each row the bits it gets in a pass of its own (``LM_DECODE_MAX_ROWS``; the C side
#: checks its thresholds against it): speculative verification stays within it.
DECODE_MAX_ROWS: int = int(lib.LM_DECODE_MAX_ROWS)

#: Every type id a weight matrix may have (GGML's, and Q2_0_128 for the type-42 tensors that
#: ``gguf_file`` finds in that layout): what families accept for their matrices.
MATRIX_TYPES: tuple[int, ...] = tuple(int(t) for t in QuantType)
#: Matrices the kit keeps in another layout holding exactly the same values, because decode's
#: products read it faster: Q5_0's 5-bit integers widened to Q8_0's bytes (about half the
#: unpack work per weight for 1.5x the bytes; see ``NativeForwardModel.matrix``).
DECODE_LAYOUTS: dict[int, int] = {int(QuantType.Q5_0): int(QuantType.Q8_0)}
#: Storage types of a KV cache, by the name ``--kv-type`` takes.
CACHE_TYPES: dict[str, int] = {"f16": int(QuantType.F16), "f32": int(QuantType.F32)}


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


class KernelAbiError(KernelError):
    """A family module was built against another kit ABI than this core (``LM_EABI``)."""

    status = -5


class KernelMismatchError(KernelError, ValueError):
    """A cache of another geometry or type than the model's (``LM_EMISMATCH``)."""

    status = -6


_ERRORS: dict[int, type[KernelError]] = {
    cls.status: cls
    for cls in (
        KernelValueError,
        KernelMemoryError,
        KernelTypeError,
        KernelIsaError,
        KernelAbiError,
        KernelMismatchError,
    )
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
def isa_best() -> enum.IntEnum:
    """Best instruction set the CPU supports."""
    return Isa(lib.lm_isa_best())


def isa_active() -> enum.IntEnum:
    """Instruction set the kernels currently use."""
    return Isa(lib.lm_isa_active())


def select_isa(isa: int) -> None:
    """Make the kernels use ``isa`` process-wide; KernelIsaError if the CPU lacks it."""
    check(lib.lm_isa_select(int(isa)), f"select ISA {isa}")


def kernels_name() -> str:
    """The kernels' active path as the banner and ``/v1/models`` show it: ``avx2``,
    ``avx512``, ``neon_dotprod``, ``neon_i8mm`` or ``portable``."""
    return Isa(lib.lm_isa_active()).name.lower()


def available_isas() -> list[enum.IntEnum]:
    """Every path this CPU can run, portable first."""
    return [isa for isa in Isa if lib.lm_isa_available(int(isa))]


@contextlib.contextmanager
def _selected(
    active: Callable[[], enum.IntEnum], select: Callable[[int], None], value: int
) -> Iterator[enum.IntEnum]:
    """Run a block with ``value`` selected, then restore the previous selection."""
    previous = active()
    select(value)
    try:
        yield active()
    finally:
        select(previous)


def use_isa(isa: int) -> contextlib.AbstractContextManager[enum.IntEnum]:
    """Run a block with ``isa`` selected, then restore the previous selection."""
    return _selected(isa_active, select_isa, isa)


# ------------------------------------------------------------------ precisions
def decode_precision() -> enum.IntEnum:
    """Activation precision of the few-token products, process-wide."""
    return DecodePrecision(lib.lm_decode_precision_active())


def select_decode_precision(precision: int) -> None:
    """Make the few-token products use ``precision`` (a DecodePrecision) process-wide."""
    check(lib.lm_decode_precision_select(int(precision)), f"select decode precision {precision}")


def use_decode_precision(precision: int) -> contextlib.AbstractContextManager[enum.IntEnum]:
    """Run a block with ``precision`` selected, then restore the previous selection."""
    return _selected(decode_precision, select_decode_precision, precision)


def prefill_precision() -> enum.IntEnum:
    """Activation precision of the many-token products, process-wide."""
    return PrefillPrecision(lib.lm_prefill_precision_active())


def select_prefill_precision(precision: int) -> None:
    """Make the many-token products use ``precision`` (a PrefillPrecision) process-wide."""
    check(lib.lm_prefill_precision_select(int(precision)), f"select prefill precision {precision}")


def use_prefill_precision(precision: int) -> contextlib.AbstractContextManager[enum.IntEnum]:
    """Run a block with ``precision`` selected for prefill, then restore the previous one."""
    return _selected(prefill_precision, select_prefill_precision, precision)


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


def convert_row(
    qtype: int, raw: npt.ArrayLike, to: int, n: int, out: npt.NDArray[np.uint8] | None = None
) -> npt.NDArray[np.uint8]:
    """The first ``n`` elements of a row of ``qtype`` blocks rewritten exactly as ``to``
    (the pairs of :data:`DECODE_LAYOUTS`), into ``out`` when given (contiguous uint8 of
    exactly ``row_bytes(to, n)``)."""
    t, u = _type_id(qtype), _type_id(to)
    data = _raw(raw)
    _need(data, row_bytes(t, n), "convert_row")
    if out is None:
        out = np.empty(row_bytes(u, n), dtype=np.uint8)
    elif (
        out.dtype != np.uint8
        or out.size != row_bytes(u, n)
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError(f"convert_row: out must be {row_bytes(u, n)} writable contiguous bytes")
    check(lib.lm_convert_row(t, _ubuf(data), u, _ubuf(out), int(n)), "convert_row")
    return out


def interleaved_for(qtype: int) -> int | None:
    """The :data:`Interleaved` layout of ``qtype`` that the active ISA's products read faster,
    or None (the type has none, or this ISA gains nothing from it)."""
    return int(lib.lm_r16_for(int(qtype))) or None


def int_products(qtype: int, ntok: int) -> bool:
    """Whether a product of ``ntok`` tokens with ``qtype`` weights multiplies int16
    activations under the active ISA and precisions (each token's outputs then have the bits
    it gets alone)."""
    return bool(lib.lm_int_products_active(int(qtype), int(ntok)))


def repack_r16(
    qtype: int, raw: npt.ArrayLike, rows: int, cols: int, out: npt.NDArray[np.uint8] | None = None
) -> npt.NDArray[np.uint8]:
    """A (rows x cols) matrix of ``qtype`` (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; rows a multiple of
    16) rewritten in its :data:`Interleaved` layout, into ``out`` when given (contiguous uint8
    of the same size): the same bytes in another order."""
    t = _type_id(qtype)
    to = _R16_TYPE.get(t)
    if to is None:
        raise KernelTypeError(f"type {t} has no interleaved layout")
    if rows < 0 or rows % 16:
        raise KernelValueError(f"{rows} rows is not a multiple of 16")
    size = rows * row_bytes(t, cols)
    data = _raw(raw)
    _need(data, size, "repack_r16")
    if out is None:
        out = np.empty(size, dtype=np.uint8)
    elif (
        out.dtype != np.uint8
        or out.size != size
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError(f"repack_r16: out must be {size} writable contiguous bytes")
    check(lib.lm_repack_r16(t, _ubuf(data), to, _ubuf(out), int(rows), int(cols)), "repack_r16")
    return out



def _row_dot(fn: Any, what: str, qtype: int, raw: npt.ArrayLike, x: npt.ArrayLike) -> float:
    t = _type_id(qtype)
    xs = _f32(x).reshape(-1)
    data = _raw(raw)
    _need(data, row_bytes(t, xs.size), what)
    out = ffi.new("float *")
    check(fn(t, _ubuf(data), _fbuf(xs), xs.size, out), what)
    return float(out[0])


def vec_dot(qtype: int, raw: npt.ArrayLike, x: npt.ArrayLike) -> float:
    """dot(row of ``qtype``, x) over ``len(x)`` elements."""
    return _row_dot(lib.lm_vec_dot, "vec_dot", qtype, raw, x)


def vec_dot_i16(qtype: int, raw: npt.ArrayLike, x: npt.ArrayLike) -> float:
    """dot(row of ``qtype``, x) through int16 activations (the integer path)."""
    return _row_dot(lib.lm_vec_dot_i16, "vec_dot_i16", qtype, raw, x)


def quantize_x16(x: npt.ArrayLike) -> tuple[npt.NDArray[np.int16], F32Array]:
    """``x`` (a multiple of 32 values) as the integer path's activations: int16 values and,
    per group of 32, its step and its f32 sum (``ds[:, 0]``, ``ds[:, 1]``)."""
    xs = _f32(x).reshape(-1)
    if xs.size % 32:
        raise KernelValueError(f"{xs.size} values is not a whole number of groups of 32")
    q = np.empty(xs.size, np.int16)
    ds = np.empty((xs.size // 32, 2), np.float32)
    check(
        lib.lm_quantize_x16(
            _fbuf(xs), xs.size, ffi.from_buffer("int16_t[]", q), _fbuf(ds.reshape(-1))
        ),
        "quantize_x16",
    )
    return q, ds


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


# ------------------------------------------------------------------ threaded row ops
def rmsnorm_rows(
    x: npt.ArrayLike, weight: npt.ArrayLike | None, eps: float, pool: Pool | None = None
) -> F32Array:
    """RMS norm of every row of x over its last axis (per-head norms: rows of head_dim)."""
    xs = _f32(x)
    n = xs.shape[-1]
    w = None if weight is None else _f32(weight).reshape(-1)
    if n == 0 or (w is not None and w.size != n):
        raise KernelValueError(f"weight must have {n} elements")
    out = np.empty_like(xs)
    rows = xs.size // n
    wp = ffi.NULL if w is None else _fbuf(w)
    check(
        lib.lm_rmsnorm_rows(_pool_ptr(pool), _fbuf(out), _fbuf(xs), wp, rows, n, float(eps)),
        "rmsnorm_rows",
    )
    return out


def rope_rows(
    x: npt.ArrayLike,
    pos0: int,
    inv_freq: npt.ArrayLike,
    mode: int = 0,
    mscale: float = 1.0,
    pool: Pool | None = None,
) -> F32Array:
    """RoPE of x (ntok, n_heads, head_dim), token t at position pos0 + t; returns a copy.

    Pair i of the first ``2 * len(inv_freq)`` dims of each head turns by pos * inv_freq[i].
    """
    out = _f32(x).copy()
    if out.ndim != 3:
        raise KernelValueError("x must be (ntok, n_heads, head_dim)")
    freqs = _f32(inv_freq).reshape(-1)
    spec = ffi.new("lm_rotary *")
    spec.mode = int(mode)
    spec.n_rot = 2 * freqs.size
    spec.inv_freq = _fbuf(freqs) if freqs.size else ffi.NULL
    spec.mscale = float(mscale)
    ntok, n_heads, head_dim = out.shape
    check(
        lib.lm_rope_rows(_pool_ptr(pool), _fbuf(out), ntok, n_heads, head_dim, int(pos0), spec),
        "rope_rows",
    )
    return out


def glu_rows(
    gate: npt.ArrayLike, up: npt.ArrayLike, act: int = 0, pool: Pool | None = None
) -> F32Array:
    """act(gate) * up, spread over the pool."""
    g, u = _f32(gate), _f32(up)
    if g.shape != u.shape:
        raise KernelValueError(f"shapes differ: {g.shape} vs {u.shape}")
    out = np.empty_like(g)
    check(
        lib.lm_glu_rows(_pool_ptr(pool), _fbuf(out), _fbuf(g), _fbuf(u), g.size, int(act)),
        "glu_rows",
    )
    return out


def matmuls(
    products: list[tuple[int, npt.ArrayLike, int, int, npt.ArrayLike]],
    pool: Pool | None = None,
) -> list[F32Array]:
    """Several ``x @ W.T`` in one call; each product is (qtype, raw W, rows, cols, x).

    Every x has the same number of tokens (rows of x).
    """
    keep: list[Any] = []
    mms = ffi.new("lm_mm[]", max(len(products), 1))
    outs: list[F32Array] = []
    ntok = None
    for i, (qtype, raw, rows, cols, x) in enumerate(products):
        t = _type_id(qtype)
        xs = _f32(x).reshape(-1, cols)
        if ntok is None:
            ntok = xs.shape[0]
        if xs.shape[0] != ntok:
            raise KernelValueError("every product needs the same number of tokens")
        data = _raw(raw)
        _need(data, rows * row_bytes(t, cols), "matmuls")
        y = np.empty((ntok, rows), dtype=np.float32)
        wbuf, xbuf, ybuf = _ubuf(data), _fbuf(xs), _fbuf(y)
        keep += [data, xs, wbuf, xbuf, ybuf]
        mms[i].w.data = wbuf
        mms[i].w.type = t
        mms[i].rows = rows
        mms[i].cols = cols
        mms[i].x = xbuf
        mms[i].y = ybuf
        outs.append(y)
    check(lib.lm_matmuls(_pool_ptr(pool), mms, len(products), ntok or 0), "matmuls")
    return outs


def f32_to_f16(x: npt.ArrayLike) -> npt.NDArray[np.float16]:
    """x rounded to half precision by the active ISA's conversion (what f16 caches store)."""
    xs = _f32(x).reshape(-1)
    if xs.size == 0:
        return np.zeros(np.shape(x), np.float16)
    width = 1024
    rows = -(-xs.size // width)
    padded = np.zeros(rows * width, np.float32)
    padded[: xs.size] = xs
    with Cache([(1, width, width)], rows, "f16") as cache:
        cache.write(0, 0, padded.reshape(rows, width), padded.reshape(rows, width))
        k = cache.state(rows)[: 2 * rows * width]  # the layer's K rows come first
        return k.view(np.float16)[: xs.size].reshape(np.shape(x)).copy()


# ------------------------------------------------------------------ KV caches
CacheGeometry = tuple[int, int, int]  # (n_kv_head, head_dim_k, head_dim_v) of one layer


def _layers(layers: Any) -> Any:
    """An ``lm_cache_layer[]`` from cdata or (n_kv_head, head_dim_k, head_dim_v[, ring[,
    state]]) tuples (ring 0 or absent: a row per position; state: f32 values of a recurrent
    state, 0 or absent: none)."""
    if isinstance(layers, ffi.CData):
        return layers
    out = ffi.new("lm_cache_layer[]", max(len(layers), 1))
    for i, layer in enumerate(layers):
        if isinstance(layer, ffi.CData):
            out[i] = layer
        else:
            values = [int(v) for v in layer]
            out[i].n_kv_head, out[i].head_dim_k, out[i].head_dim_v = values[:3]
            out[i].ring = values[3] if len(values) > 3 else 0
            out[i].state = values[4] if len(values) > 4 else 0
    return out


def cache_bytes(layers: Any, n_ctx: int, kv_type: str = "f16", n_layer: int | None = None) -> int:
    """Bytes of a whole cache of ``n_ctx`` positions (rings of sliding-window layers
    included) once every row is written."""
    arr = _layers(layers)
    n = len(layers) if n_layer is None else n_layer
    size = int(lib.lm_cache_bytes(n, arr, int(n_ctx), _cache_type(kv_type)))
    check(min(size, 0), "cache_bytes")
    return size


def cache_bytes_per_pos(layers: Any, n_layer: int | None = None, kv_type: str = "f16") -> int:
    """Bytes one position takes in a cache of this geometry (K and V of every layer with a
    row per position; ring layers take a fixed size, see :func:`cache_bytes`)."""
    arr = _layers(layers)
    n = len(layers) if n_layer is None else n_layer
    size = int(lib.lm_cache_bytes_per_pos(n, arr, _cache_type(kv_type)))
    check(min(size, 0), "cache_bytes_per_pos")
    return size


def _cache_type(kv_type: str) -> int:
    try:
        return CACHE_TYPES[kv_type]
    except KeyError:
        raise KernelValueError(
            f"KV cache type {kv_type!r}: expected one of {', '.join(CACHE_TYPES)}"
        ) from None


class Cache:
    """A native KV cache of ``n_ctx`` positions (pages commit lazily).

    ``layers`` is the geometry of every layer: ``lm_cache_layer`` cdata or
    (n_kv_head, head_dim_k, head_dim_v[, ring]) tuples. ``kv_type`` is "f16" or "f32". A
    layer with a ring smaller than ``n_ctx`` keeps only the last ``ring`` positions written
    (``rings``; 0 for a row per position).
    """

    def __init__(
        self, layers: Any, n_ctx: int, kv_type: str = "f16", *, n_layer: int | None = None
    ) -> None:
        if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx <= 0:
            raise KernelValueError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        arr = _layers(layers)
        n = len(layers) if n_layer is None else n_layer
        out = ffi.new("lm_cache **")
        check(lib.lm_cache_new(n, arr, n_ctx, _cache_type(kv_type), out), "cache_new")
        self.bytes_per_pos = cache_bytes_per_pos(arr, n, kv_type)
        self.bytes = cache_bytes(arr, n_ctx, kv_type, n)
        self._ptr: Any = ffi.gc(out[0], lib.lm_cache_free, size=self.bytes)
        self.n_ctx = n_ctx
        self.n_layer = n
        self.kv_type = kv_type
        self.layers: list[CacheGeometry] = [
            (int(arr[i].n_kv_head), int(arr[i].head_dim_k), int(arr[i].head_dim_v))
            for i in range(n)
        ]
        self.rings: list[int] = [
            int(arr[i].ring) if 0 < int(arr[i].ring) < n_ctx else 0 for i in range(n)
        ]
        # f32 values of each layer's recurrent state (0: a layer of K/V rows only)
        self.states: list[int] = [int(arr[i].state) for i in range(n)]
        self._snapshots: tuple[Any, Any] | None = None  # plan_snapshots' arrays

    @property
    def ptr(self) -> Any:
        """The ``lm_cache *``; KernelValueError once closed."""
        if self._ptr is None:
            raise KernelValueError("the cache is closed")
        return self._ptr

    def write(self, layer: int, pos0: int, k: npt.ArrayLike, v: npt.ArrayLike) -> None:
        """Rows pos0.. of one layer from f32 k (ntok, kv_dim_k) and v (ntok, kv_dim_v)."""
        ks, vs = _f32(k), _f32(v)
        ntok = ks.shape[0] if ks.ndim else 0
        geo = self._geometry(layer)
        if ks.size != ntok * geo[0] * geo[1] or vs.size != ntok * geo[0] * geo[2]:
            raise KernelValueError(f"k/v shapes {ks.shape}/{vs.shape} do not fit layer {layer}")
        check(lib.lm_cache_write(self.ptr, layer, pos0, ntok, _fbuf(ks), _fbuf(vs)), "cache_write")

    def read(self, layer: int, pos0: int, ntok: int) -> tuple[F32Array, F32Array]:
        """Rows pos0.. of one layer as f32 (ntok, kv_dim_k) and (ntok, kv_dim_v)."""
        geo = self._geometry(layer)
        k = np.empty((ntok, geo[0] * geo[1]), np.float32)
        v = np.empty((ntok, geo[0] * geo[2]), np.float32)
        check(lib.lm_cache_read(self.ptr, layer, pos0, ntok, _fbuf(k), _fbuf(v)), "cache_read")
        return k, v

    def _geometry(self, layer: int) -> CacheGeometry:
        if not 0 <= layer < self.n_layer:
            raise KernelValueError(f"layer {layer} outside [0, {self.n_layer})")
        return self.layers[layer]

    def copy_to(self, dst: Cache, n: int) -> None:
        """Positions [0, n) of every layer into ``dst`` (same geometry and type)."""
        check(lib.lm_cache_copy(self.ptr, dst.ptr, int(n)), "cache_copy")

    def state(self, n: int) -> npt.NDArray[np.uint8]:
        """The state of positions [0, n) as bytes (what :meth:`load` takes back)."""
        size = int(lib.lm_cache_state_bytes(self.ptr, int(n)))
        check(min(size, 0), "cache_state_bytes")
        buf = np.empty(size, np.uint8)
        check(lib.lm_cache_save(self.ptr, int(n), _ubuf(buf), size), "cache_save")
        return buf

    def load(self, n: int, state: npt.ArrayLike) -> None:
        """Restore positions [0, n) from :meth:`state`'s bytes."""
        data = _raw(state)
        check(lib.lm_cache_load(self.ptr, int(n), _ubuf(data), data.nbytes), "cache_load")

    @property
    def recurrent_bytes(self) -> int:
        """Bytes of every layer's recurrent state (0 for a cache of K/V rows only)."""
        size = int(lib.lm_cache_recurrent_bytes(self.ptr))
        check(min(size, 0), "cache_recurrent_bytes")
        return size

    def recurrent_state(self) -> npt.NDArray[np.uint8]:
        """Every layer's recurrent state as bytes: what it carries past the last position
        written (:meth:`load_recurrent` takes it back)."""
        buf = np.empty(self.recurrent_bytes, np.uint8)
        check(lib.lm_cache_recurrent_save(self.ptr, _ubuf(buf), buf.nbytes), "cache_recurrent_save")
        return buf

    def plan_snapshots(self, positions: Sequence[int]) -> npt.NDArray[np.uint8]:
        """Keep the recurrent state as a prompt of each of ``positions`` leaves it while the
        next chunk is read (one pass instead of a stop at each); row ``i`` of the returned
        ``(len(positions), recurrent_bytes)`` array gets :meth:`recurrent_state`'s bytes for
        ``positions[i]``. Empty ``positions`` ends the plan; end it before the array goes."""
        buf = np.zeros((len(positions), self.recurrent_bytes), np.uint8)
        pos = np.ascontiguousarray(positions, np.int64)
        if not len(positions):
            check(lib.lm_cache_plan_snapshots(self.ptr, ffi.NULL, 0, ffi.NULL, 0),
                  "cache_plan_snapshots")
            self._snapshots = None
            return buf
        check(lib.lm_cache_plan_snapshots(
            self.ptr, ffi.cast("int64_t *", pos.ctypes.data), len(positions),
            ffi.from_buffer("uint8_t[]", buf), buf.nbytes,
        ), "cache_plan_snapshots")
        self._snapshots = (pos, buf)  # alive while the C side points at them
        return buf

    def load_recurrent(self, state: npt.ArrayLike) -> None:
        """Set every layer's recurrent state from :meth:`recurrent_state`'s bytes."""
        data = _raw(state)
        check(lib.lm_cache_recurrent_load(self.ptr, _ubuf(data), data.nbytes), "cache_recurrent_load")

    def copy_recurrent_to(self, dst: Cache) -> None:
        """Every layer's recurrent state into ``dst`` (same geometry and type)."""
        check(lib.lm_cache_recurrent_copy(self.ptr, dst.ptr), "cache_recurrent_copy")

    def layer_state(self, layer: int) -> F32Array:
        """A copy of one layer's recurrent state (f32)."""
        size = self.states[self._geometry_index(layer)]
        ptr = lib.lm_cache_layer_state(self.ptr, layer)
        if size == 0 or ptr == ffi.NULL:
            raise KernelValueError(f"layer {layer} has no recurrent state")
        return np.frombuffer(ffi.buffer(ptr, 4 * size), np.float32).copy()

    def _geometry_index(self, layer: int) -> int:
        if not 0 <= layer < self.n_layer:
            raise KernelValueError(f"layer {layer} outside [0, {self.n_layer})")
        return layer

    def attention(
        self, layer: int, q: npt.ArrayLike, pos0: int, scale: float, window: int = 0,
        softcap: float = 0.0, pool: Pool | None = None, bias: npt.ArrayLike | None = None,
        *, bidirectional: bool = False,
    ) -> F32Array:
        """Attention of q (ntok, n_head, head_dim) over this layer's rows [0, pos0 + ntok):
        causal, or with ``bidirectional`` every query over the rows of the whole chunk and the
        window before pos0.

        ``bias`` (ntok, n_head, extent): bias[t, h, d] is added to the scaled score of query
        (t, h) and the key d positions before it, for d < extent (causal only).
        """
        qs = _f32(q)
        if qs.ndim != 3:
            raise KernelValueError("q must be (ntok, n_head, head_dim)")
        bs = None if bias is None else _f32(bias)
        if bs is not None and (bs.ndim != 3 or bs.shape[:2] != qs.shape[:2] or not bs.shape[2]):
            raise KernelValueError("bias must be (ntok, n_head, extent)")
        if bs is not None and bidirectional:
            raise KernelValueError("a distance bias is causal: not with bidirectional")
        out = np.empty_like(qs)
        check(
            lib.lm_attention_cached_bias(
                _pool_ptr(pool), _fbuf(qs), self.ptr, layer, _fbuf(out), qs.shape[0], int(pos0),
                qs.shape[1], float(scale), int(window), float(softcap),
                ffi.NULL if bs is None else _fbuf(bs), 0 if bs is None else bs.shape[2],
            )
            if not bidirectional
            else lib.lm_attention_cached_span(
                _pool_ptr(pool), _fbuf(qs), self.ptr, layer, _fbuf(out), qs.shape[0], int(pos0),
                qs.shape[1], float(scale), int(window), float(softcap), 1,
            ),
            "attention_cached",
        )
        return out

    def close(self) -> None:
        """Release the memory now instead of at garbage collection."""
        if self._ptr is not None:
            ffi.release(self._ptr)
            self._ptr = None

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ family models
def kit_table() -> int:
    """Address of the kit's function table, for a family module's ``lm_kit_bind``."""
    return int(ffi.cast("uintptr_t", lib.lm_kit_table()))


def as_base(address: int) -> Any:
    """An ``lm_base *`` of this module's ffi for a family model's address."""
    return ffi.cast("lm_base *", address)


def model_free(base: Any) -> None:
    """Free a family model (its ``free_model`` callback releases its own memory)."""
    lib.lm_model_free(base)


def model_threads(base: Any) -> int:
    """Threads of a family model's pool."""
    return int(lib.lm_base_threads(base))


def forward(
    base: Any, cache: Cache, tokens: npt.NDArray[np.int32], pos: int, logits: F32Array,
    all_logits: bool, *, bidirectional: bool = False,
) -> None:
    """Run a family model's forward pass (the chunk driver); the caller checks every size.
    ``bidirectional``: one chunk whose rows see each other both ways
    (``lm_forward_bidirectional``), logits of every row."""
    args = (
        base,
        cache.ptr,
        ffi.cast("int32_t *", ffi.from_buffer(tokens)),
        tokens.size,
        int(pos),
        ffi.cast("float *", ffi.from_buffer(logits, require_writable=True)),
    )
    if bidirectional:
        check(lib.lm_forward_bidirectional(*args), "forward_bidirectional")
    else:
        check(lib.lm_forward(*args, 1 if all_logits else 0), "forward")


def forward_batch(
    base: Any, caches: Sequence[Cache], tokens: npt.NDArray[np.int32],
    ntoks: npt.NDArray[np.int64], pos: npt.NDArray[np.int64], logits: F32Array | None,
) -> None:
    """One weight pass over several sequences (``lm_forward_batch``): sequence i runs
    ``ntoks[i]`` of ``tokens`` at ``pos[i]..`` of ``caches[i]``; logits of every row (None:
    none, only the base's ``hidden`` rows)."""
    ptrs = ffi.new("lm_cache *[]", [c.ptr for c in caches])
    check(
        lib.lm_forward_batch(
            base,
            len(caches),
            ptrs,
            ffi.cast("int32_t *", ffi.from_buffer(tokens)),
            ffi.cast("int64_t *", ffi.from_buffer(ntoks)),
            ffi.cast("int64_t *", ffi.from_buffer(pos)),
            ffi.NULL
            if logits is None
            else ffi.cast("float *", ffi.from_buffer(logits, require_writable=True)),
        ),
        "forward_batch",
    )
