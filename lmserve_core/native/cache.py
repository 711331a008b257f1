"""KV caches over the compiled kernels: :class:`Cache` (``lm_cache``: per layer, rows of keys
and values, a ring of them for a sliding window, or a recurrent state) and what a cache of a
geometry costs (:func:`cache_bytes`). Every size is checked before a pointer reaches C."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .binding import (
    CACHE_TYPES,
    F32Array,
    KernelValueError,
    Pool,
    _f32,
    _fbuf,
    _pool_ptr,
    _raw,
    _ubuf,
    check,
    ffi,
    lib,
)

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
