"""LlamaModel: the llama forward pass (``lmserve_llama._forward``) as a ForwardModel.

This is the only module that touches the native library: it validates every tensor and
size in Python before a pointer reaches C, and turns C status codes into exceptions.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.model import KVCache

from ._forward import ffi, lib
from .config import LlamaConfig

# GGML type ids the shared kernels decode (lmserve/kernels.h, enum lm_type).
MATRIX_TYPES: tuple[int, ...] = (0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30)
NORM_TYPES: tuple[int, ...] = (0,)  # f32: the norms are read as plain float arrays

# Most tokens per weight pass: large enough that prefill is compute-bound, small enough
# that the scratch (a few n_batch x n_ff float buffers) stays a few MB.
DEFAULT_BATCH = 256

_LAYER_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)


class LlamaError(RuntimeError):
    """The native forward pass returned a failure status."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what} failed with status {status}")
        self.status = status


def _check(status: int, what: str) -> None:
    if status == lib.LLAMA_OK:
        return
    if status == lib.LLAMA_ENOMEM:
        raise MemoryError(f"{what}: out of memory")
    if status == lib.LLAMA_EINVAL:
        raise ValueError(f"{what}: invalid argument")
    raise LlamaError(what, status)


class LlamaCache:
    """A KV cache for ``n_ctx`` positions (f32 K and V per layer, committed lazily)."""

    __slots__ = ("_ptr", "model", "n_ctx")

    def __init__(self, model: LlamaModel, n_ctx: int) -> None:
        if not isinstance(n_ctx, int) or n_ctx <= 0:
            raise ValueError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        if model._ptr is None:
            raise RuntimeError("the model is closed")
        out = ffi.new("llama_cache **")
        _check(lib.llama_cache_build(model._ptr, n_ctx, out), "llama_cache_build")
        cfg = model.config
        size = 2 * 4 * cfg.n_layer * n_ctx * cfg.kv_dim
        self._ptr = ffi.gc(out[0], lib.llama_cache_free, size=size)
        self.model = model  # the cache's geometry belongs to this model
        self.n_ctx = n_ctx

    def close(self) -> None:
        """Release the cache's memory now instead of at garbage collection."""
        if self._ptr is not None:
            ffi.release(self._ptr)
            self._ptr = None


class LlamaModel:
    """The llama forward pass over a mapped GGUF (weights are never copied)."""

    def __init__(
        self,
        gguf: GGUFFile,
        config: LlamaConfig,
        *,
        n_threads: int = 0,
        n_batch: int = DEFAULT_BATCH,
    ) -> None:
        if n_batch <= 0:
            raise ValueError(f"n_batch must be positive, got {n_batch}")
        self.gguf = gguf  # owns the mapping every weight pointer points into
        self.config = config
        self.n_vocab = config.n_vocab
        self.n_ctx_train = config.n_ctx_train
        self._lock = threading.Lock()  # the scratch buffers serve one call at a time
        self._keep: list[Any] = []  # cffi buffers whose pointers C holds

        tensors = _validated_tensors(gguf, config)
        layers = ffi.new("llama_layer[]", config.n_layer)
        for i, layer in enumerate(layers):
            t = tensors[i]
            layer.attn_norm = self._floats(t["attn_norm"])
            self._matrix(layer.wq, t["attn_q"])
            self._matrix(layer.wk, t["attn_k"])
            self._matrix(layer.wv, t["attn_v"])
            self._matrix(layer.wo, t["attn_output"])
            layer.ffn_norm = self._floats(t["ffn_norm"])
            self._matrix(layer.w_gate, t["ffn_gate"])
            self._matrix(layer.w_up, t["ffn_up"])
            self._matrix(layer.w_down, t["ffn_down"])
        weights = ffi.new("llama_weights *")
        self._matrix(weights.token_embd, gguf.tensors["token_embd.weight"])
        weights.layers = layers
        weights.output_norm = self._floats(gguf.tensors["output_norm.weight"])
        output = gguf.tensors.get("output.weight", gguf.tensors["token_embd.weight"])
        self._matrix(weights.output, output)
        self._keep.extend((layers, weights))

        cfg = ffi.new("llama_config *")
        cfg.n_layer = config.n_layer
        cfg.n_embd = config.n_embd
        cfg.n_ff = config.n_ff
        cfg.n_head = config.n_head
        cfg.n_kv_head = config.n_kv_head
        cfg.head_dim = config.head_dim
        cfg.n_rot = config.n_rot
        cfg.n_vocab = config.n_vocab
        cfg.n_batch = n_batch
        cfg.rms_eps = config.rms_eps
        cfg.rope_freq_base = config.rope_freq_base
        cfg.rope_freq_scale = config.rope_freq_scale

        out = ffi.new("llama_model **")
        _check(lib.llama_model_build(cfg, weights, n_threads, out), "llama_model_build")
        self._ptr = ffi.gc(out[0], lib.llama_model_free)
        self.n_threads = int(lib.llama_model_threads(self._ptr))

    @classmethod
    def load(
        cls, gguf: GGUFFile, *, n_threads: int = 0, n_batch: int = DEFAULT_BATCH
    ) -> LlamaModel:
        """Build the model over an open GGUF; ``n_threads`` 0 uses every core."""
        return cls(gguf, LlamaConfig.from_gguf(gguf), n_threads=n_threads, n_batch=n_batch)

    # ------------------------------------------------------------------ ForwardModel

    def new_cache(self, n_ctx: int) -> LlamaCache:
        """Allocate an empty cache for ``n_ctx`` positions (pages commit lazily)."""
        return LlamaCache(self, n_ctx)

    def forward(
        self, cache: KVCache, tokens: Sequence[int], pos: int, *, all_logits: bool = False
    ) -> np.ndarray:
        """Run ``tokens`` at ``pos..``; float32 logits of the last token or of all of them."""
        ptr = self._cache_ptr(cache)
        pos = operator.index(pos)
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = int(ids.size)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if pos < 0 or pos + n > cache.n_ctx:
            raise ValueError(f"positions {pos}..{pos + n - 1} do not fit a cache of {cache.n_ctx}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.n_vocab:
            raise ValueError(f"token id outside [0, {self.n_vocab})")
        ids32 = np.ascontiguousarray(ids, dtype=np.int32)
        logits = np.empty((n, self.n_vocab) if all_logits else (self.n_vocab,), np.float32)
        with self._lock:
            status = lib.llama_forward(
                self._ptr,
                ptr,
                ffi.cast("int32_t *", ffi.from_buffer(ids32)),
                n,
                pos,
                ffi.cast("float *", ffi.from_buffer(logits, require_writable=True)),
                1 if all_logits else 0,
            )
        _check(status, "llama_forward")
        return logits

    def copy_rows(self, src: KVCache, dst: KVCache, n: int) -> None:
        """Copy cache rows ``[0, n)`` of every layer from ``src`` into ``dst``."""
        src_ptr, dst_ptr = self._cache_ptr(src), self._cache_ptr(dst)
        if n < 0 or n > src.n_ctx or n > dst.n_ctx:
            raise ValueError(f"cannot copy {n} rows between caches of {src.n_ctx}/{dst.n_ctx}")
        with self._lock:
            status = lib.llama_cache_copy_rows(src_ptr, dst_ptr, n)
        _check(status, "llama_cache_copy_rows")

    def close(self) -> None:
        """Free the native model (thread pool, scratch); caches stay valid to free."""
        with self._lock:
            if self._ptr is not None:
                ffi.release(self._ptr)
                self._ptr = None

    # ------------------------------------------------------------------ helpers

    def _cache_ptr(self, cache: KVCache) -> Any:
        if self._ptr is None:
            raise RuntimeError("the model is closed")
        if not isinstance(cache, LlamaCache) or cache.model is not self:
            raise ValueError("the cache was not made by this model")
        if cache._ptr is None:
            raise ValueError("the cache is closed")
        return cache._ptr

    def _floats(self, tensor: Any) -> Any:
        buf = ffi.from_buffer(tensor.data)
        self._keep.append(buf)
        return ffi.cast("const float *", buf)

    def _matrix(self, field: Any, tensor: Any) -> None:
        buf = ffi.from_buffer(tensor.data)
        self._keep.append(buf)
        field.data = ffi.cast("const void *", buf)
        field.type = int(tensor.ggml_type)


def _validated_tensors(gguf: GGUFFile, cfg: LlamaConfig) -> list[dict[str, Any]]:
    """Every block tensor, checked for type and shape against the config."""
    d, ff = cfg.n_embd, cfg.n_ff
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    gguf.require("token_embd.weight", ggml_types=MATRIX_TYPES, shape=(cfg.n_vocab, d))
    gguf.require("output_norm.weight", ggml_types=NORM_TYPES, shape=(d,))
    if "output.weight" in gguf.tensors:
        gguf.require("output.weight", ggml_types=MATRIX_TYPES, shape=(cfg.n_vocab, d))
    shapes = {
        "attn_norm": (d,),
        "attn_q": (cfg.q_dim, d),
        "attn_k": (cfg.kv_dim, d),
        "attn_v": (cfg.kv_dim, d),
        "attn_output": (d, cfg.q_dim),
        "ffn_norm": (d,),
        "ffn_gate": (ff, d),
        "ffn_up": (ff, d),
        "ffn_down": (d, ff),
    }
    layers = []
    for i in range(cfg.n_layer):
        layer = {}
        for short in _LAYER_TENSORS:
            name = f"blk.{i}.{short}.weight"
            types = NORM_TYPES if short.endswith("_norm") else MATRIX_TYPES
            layer[short] = gguf.require(name, ggml_types=types, shape=shapes[short])
            expected.add(name)
        layers.append(layer)
    # Extra tensors mean a variant this forward pass would silently get wrong (biases,
    # llama-3 rope frequency factors, experts): refuse the file instead.
    extra = sorted(set(gguf.tensors) - expected)
    if extra:
        more = f" (+{len(extra) - 3} more)" if len(extra) > 3 else ""
        raise GGUFError(f"unsupported llama variant: unexpected tensors {extra[:3]}{more}")
    return layers
