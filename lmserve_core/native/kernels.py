"""numpy API over the compiled shared kernels (``lmserve_core._kernels``).

This is the one module that calls into ``lib``: it checks every size before a pointer
reaches C and turns status codes into exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .binding import (
    _R16_TYPE as _R16_TYPE,
)
from .binding import (
    CACHE_TYPES as CACHE_TYPES,
)
from .binding import (
    DECODE_LAYOUTS as DECODE_LAYOUTS,
)
from .binding import (
    DECODE_MAX_ROWS as DECODE_MAX_ROWS,
)
from .binding import (
    DECODE_PRECISIONS as DECODE_PRECISIONS,
)
from .binding import (
    MATRIX_TYPES as MATRIX_TYPES,
)
from .binding import (
    PREFILL_PRECISIONS as PREFILL_PRECISIONS,
)
from .binding import (
    Activation as Activation,
)
from .binding import (
    DecodePrecision as DecodePrecision,
)
from .binding import (
    F32Array as F32Array,
)
from .binding import (
    Interleaved as Interleaved,
)
from .binding import (
    Isa as Isa,
)
from .binding import (
    KernelAbiError as KernelAbiError,
)
from .binding import (
    KernelError as KernelError,
)
from .binding import (
    KernelIsaError as KernelIsaError,
)
from .binding import (
    KernelMemoryError as KernelMemoryError,
)
from .binding import (
    KernelMismatchError as KernelMismatchError,
)
from .binding import (
    KernelTypeError as KernelTypeError,
)
from .binding import (
    KernelValueError as KernelValueError,
)
from .binding import (
    Pool as Pool,
)
from .binding import (
    PrefillPrecision as PrefillPrecision,
)
from .binding import (
    QuantType as QuantType,
)
from .binding import (
    RopeMode as RopeMode,
)

# the shared part of every call, re-exported: callers name it kernels.X
from .binding import (
    _f32 as _f32,
)
from .binding import (
    _fbuf as _fbuf,
)
from .binding import (
    _need as _need,
)
from .binding import (
    _pool_ptr as _pool_ptr,
)
from .binding import (
    _raw as _raw,
)
from .binding import (
    _type_id as _type_id,
)
from .binding import (
    _ubuf as _ubuf,
)
from .binding import (
    available_isas as available_isas,
)
from .binding import (
    block_bytes as block_bytes,
)
from .binding import (
    block_elems as block_elems,
)
from .binding import (
    check as check,
)
from .binding import (
    decode_precision as decode_precision,
)
from .binding import (
    ffi as ffi,
)
from .binding import (
    isa_active as isa_active,
)
from .binding import (
    isa_best as isa_best,
)
from .binding import (
    kernels_name as kernels_name,
)
from .binding import (
    lib as lib,
)
from .binding import (
    prefill_precision as prefill_precision,
)
from .binding import (
    row_bytes as row_bytes,
)
from .binding import (
    select_decode_precision as select_decode_precision,
)
from .binding import (
    select_isa as select_isa,
)
from .binding import (
    select_prefill_precision as select_prefill_precision,
)
from .binding import (
    use_decode_precision as use_decode_precision,
)
from .binding import (
    use_isa as use_isa,
)
from .binding import (
    use_prefill_precision as use_prefill_precision,
)

if TYPE_CHECKING:
    from .cache import Cache


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


# ------------------------------------------------------------------ KV caches: native/cache.py
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
