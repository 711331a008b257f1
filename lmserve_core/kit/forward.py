"""NativeForwardModel: the Python half of a family whose forward pass is C over the kit.

A family subclasses it with its cffi module (``ffi``, ``lib``) and config class, and writes
:meth:`~NativeForwardModel.setup`: fill the C weight table from the GGUF with :meth:`matrix`
and :meth:`floats` (each tensor checked for type and shape before a pointer reaches C), or
for the tensors most decoders name alike with :meth:`weight_table`, :meth:`attention_tensors`,
:meth:`mlp_tensors` and :meth:`moe_tensors`, then hand config and table to the C build
function with :meth:`build`. Everything else a
``ForwardModel`` does — caches, the forward pass, prefix copies, routing traces, status codes
turned into exceptions — happens here, over the core's compiled kernels.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import structlog

from lmserve_core import memory
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.native import cache as native_cache
from lmserve_core.native import kernels
from lmserve_core.progress import Report, tracker

from .caches import (
    CHECKPOINT_EVERY,
    CHECKPOINTS_BEFORE_END,
    MAX_CHECKPOINTS,
    RECURRENT,
    SLIDING,
    NativeCache,
    RecurrentCache,
)
from .weights import POOLING_HEAD_TENSORS, WeightTable

# the caches and the weight table live in their own modules; their names stay importable here
__all__ = [
    "CHECKPOINTS_BEFORE_END",
    "CHECKPOINT_EVERY",
    "DEFAULT_BATCH",
    "MAX_CHECKPOINTS",
    "POOLING_HEAD_TENSORS",
    "RECURRENT",
    "SLIDING",
    "NativeCache",
    "NativeForwardModel",
    "RecurrentCache",
    "Routing",
    "WeightTable",
]

# Most tokens per weight pass: large enough that prefill is compute-bound, small enough that
# the scratch (a few n_batch x n_ff float buffers) stays a few MB.
DEFAULT_BATCH = 256

log = structlog.get_logger("lmserve.kit")

_bound: set[int] = set()  # family libs already handed the kit table
_bind_lock = threading.Lock()


class Routing:
    """Experts chosen by every MoE layer for every token of a traced forward pass."""

    def __init__(self, ids: npt.NDArray[np.int32], weights: npt.NDArray[np.float32]) -> None:
        self.ids = ids  # (n_layer, ntok, n_used)
        self.weights = weights  # (n_layer, ntok, n_used)


class NativeForwardModel(WeightTable):
    """Base of a family's forward pass written in C over the kit (``lmserve/kit.h``).

    Subclasses set ``ffi`` and ``lib`` (their cffi module, built by
    ``lmserve_core.native.family_ffibuilder``) and ``config_type`` (a class with
    ``from_gguf(gguf)``, ``n_vocab`` and ``n_ctx_train``), and implement :meth:`setup`; see
    ``docs/plugins.md``.
    """

    ffi: ClassVar[Any]
    lib: ClassVar[Any]
    config_type: ClassVar[Any]
    # True when every layer's cache rows are plain attention keys and values, the rows a
    # prompt's tokens would leave: then a KV prefix (a cartridge) can stand for them
    serves_prefix_rows: ClassVar[bool] = False
    # True when every recurrent layer keeps the states a pass is asked for
    # (``lm_cache_plan_snapshots``: the kit's DeltaNet mixer does): a prompt's checkpoints
    # are then taken in the pass that reads past them, not by stopping there
    checkpoints_in_pass: ClassVar[bool] = False

    def __init_subclass__(cls, *, native: Any = None, config: Any = None, **kwargs: Any) -> None:
        # class Qwen3Model(NativeForwardModel, native=_forward, config=Qwen3Config)
        super().__init_subclass__(**kwargs)
        if native is not None:
            cls.ffi, cls.lib = native.ffi, native.lib
        if config is not None:
            cls.config_type = config

    def __init__(
        self,
        gguf: GGUFFile,
        config: Any,
        *,
        n_threads: int = 0,
        n_batch: int = DEFAULT_BATCH,
        kv_type: str = "f16",
        progress: Report | None = None,
    ) -> None:
        """``progress(done, total)`` is called with the bytes of the file's tensors read so
        far as each is placed (default: :func:`lmserve_core.progress.tracker`'s)."""
        if not isinstance(n_batch, int) or n_batch <= 0:
            raise ValueError(f"n_batch must be a positive integer, got {n_batch!r}")
        if kv_type not in kernels.CACHE_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(kernels.CACHE_TYPES)}")
        _bind(self.ffi, self.lib)
        self.gguf = gguf  # owns the mapping every weight pointer points into
        self.config = config
        self.n_vocab = int(config.n_vocab)
        self.n_ctx_train = int(config.n_ctx_train)
        self.n_threads = n_threads
        self.n_batch = n_batch
        self.kv_type = kv_type
        self.n_layer = 0
        self.cache_layers: Any = None
        self.n_used_experts = 0  # > 0 for MoE models: routing can be traced
        self._keep: list[Any] = []  # buffers whose pointers C holds
        self._arena = memory.WeightArena()  # the matrices copied into process memory
        self._resident: dict[str, tuple[Any, int]] = {}  # name: (the bytes read, their type)
        self._relay_budget: int | None = None  # extra bytes relaid copies may still take
        self._copy_budget: int | None = None  # bytes plain copies may still take
        self.relaid_bytes = 0  # matrices rewritten into their decode layout
        self.interleaved_bytes = 0  # copies in an interleaved layout (kernels.Interleaved)
        self.copied_bytes = 0  # matrices copied as they are
        self.mapped_bytes = 0  # matrices read from the mapped file
        self._used: set[str] = set()
        self._base: Any = None
        self._lock = threading.Lock()  # the model's scratch serves one call at a time
        self._progress = progress or tracker("weights", "loading weights")
        self._total_bytes = sum(int(info.nbytes) for info in gguf.tensors.values())
        self._read_bytes = 0
        self.setup()
        self._progress(self._total_bytes, self._total_bytes)
        if self._base is None:
            raise RuntimeError(f"{type(self).__name__}.setup did not build the native model")
        log.info(
            "weights",
            mode=memory.weights_mode(),
            copied_bytes=self.copied_bytes,
            relaid_bytes=self.relaid_bytes,
            interleaved_bytes=self.interleaved_bytes,
            mapped_bytes=self.mapped_bytes,
        )

    @classmethod
    def load(
        cls,
        gguf: GGUFFile,
        *,
        n_threads: int = 0,
        n_batch: int = DEFAULT_BATCH,
        kv_type: str = "f16",
        progress: Report | None = None,
    ) -> Any:
        """Read the config from the GGUF and build the model; ``n_threads`` 0: every core;
        ``progress``: see :class:`NativeForwardModel`."""
        return cls(
            gguf,
            cls.config_type.from_gguf(gguf),
            n_threads=n_threads,
            n_batch=n_batch,
            kv_type=kv_type,
            progress=progress,
        )

    def setup(self) -> None:
        """Fill the weight table from ``self.gguf`` and call :meth:`build` (the family's)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ weight table

    def build(self, build_fn: Callable[..., int], *args: Any, n_used_experts: int = 0) -> None:
        """Call the family's C ``build(*args, n_threads, n_batch, lm_base **out)``.

        The caches this model makes take the geometry the C model declares in its lm_base.
        ``n_used_experts`` (top-k of a mixture of experts) sizes routing traces.
        """
        out = self.ffi.new("lm_base **")
        status = build_fn(*args, self.n_threads, self.n_batch, out)
        kernels.check(status, f"{type(self).__name__} build")
        address = int(self.ffi.cast("uintptr_t", out[0]))
        self._base = self.ffi.gc(out[0], lambda _p: kernels.model_free(kernels.as_base(address)))
        self._core = kernels.as_base(address)
        self.n_layer = int(self._core.n_layer)
        layers = self._core.cache_layers
        self.cache_layers = [
            (
                int(layers[i].n_kv_head),
                int(layers[i].head_dim_k),
                int(layers[i].head_dim_v),
                int(layers[i].ring),
                int(layers[i].state),
            )
            for i in range(self.n_layer)
        ]
        self.n_used_experts = n_used_experts
        self.n_threads = kernels.model_threads(self._core)

    # ------------------------------------------------------------------ ForwardModel

    @property
    def kv_bytes_per_pos(self) -> int:
        """Bytes one position of a cache takes (K and V of every layer with a row per
        position; sliding-window rings take a fixed size, see :meth:`kv_bytes`)."""
        return native_cache.cache_bytes_per_pos(self.cache_layers, self.n_layer, self.kv_type)

    def kv_bytes(self, n_ctx: int) -> int:
        """Bytes of a cache of ``n_ctx`` positions once every row is written, with its
        recurrent states and the most checkpoints of them it keeps."""
        states = 4 * sum(layer[4] for layer in self.cache_layers)
        return native_cache.cache_bytes(
            self.cache_layers, n_ctx, self.kv_type, self.n_layer
        ) + MAX_CHECKPOINTS * states

    @property
    def recurrent(self) -> bool:
        """True when some layer keeps a recurrent state (its caches are RecurrentCache)."""
        return any(layer[4] for layer in self.cache_layers or ())

    def new_cache(self, n_ctx: int, kv_type: str | None = None) -> NativeCache:
        """An empty cache for ``n_ctx`` positions (pages commit lazily)."""
        self._require_open()
        if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx <= 0:
            raise ValueError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        kind = RecurrentCache if self.recurrent else NativeCache
        return kind(self, n_ctx, kv_type or self.kv_type)

    def forward(
        self, cache: Any, tokens: Sequence[int], pos: int, *, all_logits: bool = False
    ) -> np.ndarray:
        """Run ``tokens`` at ``pos..``; float32 logits of the last token or of all of them."""
        ids, pos = self._check_call(cache, tokens, pos)
        logits = np.empty(
            (ids.size, self.n_vocab) if all_logits else (self.n_vocab,), np.float32
        )
        self._run(cache, ids, pos, logits, all_logits)
        return logits

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """The hidden state of the last of ``tokens`` after the final norm, run from position
        0 on a scratch cache: float32 ``(n_embd,)``, the sequence's embedding as the model
        itself reads it (a fleet's retrieval vectors)."""
        self._require_open()
        n = len(tokens)
        if n == 0:
            raise ValueError("nothing to embed")
        cache = self.new_cache(n)
        try:
            ids, _ = self._check_call(cache, tokens, 0)
            hidden = np.empty(int(self._core.n_embd), np.float32)
            self._run(cache, ids, 0, np.empty(self.n_vocab, np.float32), False, hidden)
        finally:
            cache.close()
        return hidden

    def _run(
        self, cache: Any, ids: np.ndarray, pos: int, logits: np.ndarray, all_logits: bool,
        hidden: np.ndarray | None = None,
    ) -> None:
        """The forward pass behind :meth:`forward`; ``hidden`` (``n_embd`` floats) gets the
        final-normed state of the last row."""
        recurrent = isinstance(cache, RecurrentCache)
        if pos == 0 and recurrent:
            cache.truncate(0)  # a new sequence: its checkpoints are of another
        # a recurrent cache: the checkpoints planned inside the call, kept in the same pass
        # (a pass keeps at most LM_MAX_SNAPSHOTS; past them it ends at the next one), or,
        # for a model whose layers do not keep them, the pass stops at each
        stops = cache.stops(pos, ids.size) if recurrent else []
        most = int(kernels.lib.LM_MAX_SNAPSHOTS) if self.checkpoints_in_pass else 0
        end = pos + ids.size
        out = None if hidden is None else kernels.ffi.from_buffer(hidden, require_writable=True)
        with self._lock:
            self._require_open()
            if out is not None:
                self._core.hidden = kernels.ffi.cast("float *", out)
            try:
                a = pos
                while a < end:
                    inside, stops = stops[:most], stops[most:]
                    b = stops.pop(0) if stops else end
                    piece = logits[a - pos : b - pos] if all_logits else logits
                    kept = cache.native.plan_snapshots(inside) if inside else None
                    try:
                        kernels.forward(self._core, cache.native, ids[a - pos : b - pos], a,
                                        piece, all_logits)
                    finally:
                        if kept is not None:
                            cache.native.plan_snapshots(())
                    if recurrent:
                        for p, state in zip(inside, kept if kept is not None else (), strict=True):
                            cache.wrote(p, state)
                        cache.wrote(b)
                    a = b
            finally:
                if out is not None:
                    self._core.hidden = kernels.ffi.NULL

    def forward_bidirectional(self, cache: Any, tokens: Sequence[int], pos: int) -> np.ndarray:
        """Run ``tokens`` at ``pos..`` as one chunk whose rows see each other both ways (and
        the cache before ``pos``, within each layer's window): a block-diffusion canvas.
        Writes their cache rows, which a later causal pass over ``pos..`` overwrites. At most
        ``n_batch`` tokens; float32 logits ``(len(tokens), n_vocab)``."""
        ids, pos = self._check_call(cache, tokens, pos)
        if ids.size > self.n_batch:
            raise ValueError(f"{ids.size} tokens exceed the batch of {self.n_batch}")
        if isinstance(cache, RecurrentCache):
            raise ValueError("a model with recurrent layers has no bidirectional pass")
        logits = np.empty((ids.size, self.n_vocab), np.float32)
        with self._lock:
            self._require_open()
            kernels.forward(self._core, cache.native, ids, pos, logits, True, bidirectional=True)
        return logits

    def forward_batch(
        self, rows: Sequence[tuple[Any, Sequence[int], int]]
    ) -> list[np.ndarray]:
        """One weight pass over several sequences: ``rows`` of (cache, tokens, pos), each
        cache distinct, at most ``n_batch`` tokens in all. Returns each row's logits,
        ``(len(tokens), n_vocab)`` float32, for every token."""
        if not rows:
            return []
        logits = self._batch(rows, None, want_logits=True)
        assert logits is not None
        return np.split(logits, np.cumsum([len(tokens) for _, tokens, _ in rows])[:-1])

    def _batch(
        self,
        rows: Sequence[tuple[Any, Sequence[int], int]],
        hidden: np.ndarray | None,
        *,
        want_logits: bool,
    ) -> np.ndarray | None:
        """The pass behind :meth:`forward_batch` and :meth:`hidden_batch`: the logits of
        every row (or None), ``hidden`` filled with the final-normed rows when given."""
        checked = [self._check_call(cache, tokens, pos) for cache, tokens, pos in rows]
        ntoks = np.array([ids.size for ids, _ in checked], np.int64)
        total = int(ntoks.sum())
        if total > self.n_batch:
            raise ValueError(f"{total} tokens exceed the batch of {self.n_batch}")
        if len({id(cache) for cache, _, _ in rows}) != len(rows):
            raise ValueError("each sequence of a batch needs its own cache")
        ids = np.concatenate([ids for ids, _ in checked])
        pos = np.array([p for _, p in checked], np.int64)
        for (cache, _, _), p in zip(rows, pos.tolist(), strict=True):
            if p == 0 and isinstance(cache, RecurrentCache):
                cache.truncate(0)
        logits = np.empty((total, self.n_vocab), np.float32) if want_logits else None
        out = None
        if hidden is not None:
            if hidden.dtype != np.float32 or hidden.size < total * int(self._core.n_embd):
                raise ValueError(f"hidden must hold {total} float32 rows of n_embd")
            out = kernels.ffi.from_buffer(hidden, require_writable=True)
        with self._lock:
            self._require_open()
            if out is not None:
                self._core.hidden = kernels.ffi.cast("float *", out)
            try:
                kernels.forward_batch(
                    self._core, [cache.native for cache, _, _ in rows], ids, ntoks, pos, logits
                )
            finally:
                if out is not None:
                    self._core.hidden = kernels.ffi.NULL
        for (cache, _, _), p, n in zip(rows, pos.tolist(), ntoks.tolist(), strict=True):
            if isinstance(cache, RecurrentCache):
                cache.wrote(p + n)
        return logits

    def hidden_batch(self, rows: Sequence[tuple[Any, Sequence[int], int]]) -> list[np.ndarray]:
        """:meth:`forward_batch` for the hidden states: each row's final-normed states,
        ``(len(tokens), n_embd)`` float32, for every token (what embeddings pool). A decoder
        the kit runs whole skips the output head; another family computes its logits too."""
        if not rows:
            return []
        self._require_open()
        total = sum(len(tokens) for _, tokens, _ in rows)
        hidden = np.full((total, int(self._core.n_embd)), np.nan, np.float32)
        try:
            self._batch(rows, hidden, want_logits=False)
        except kernels.KernelValueError:  # a family pass of its own: it writes logits too
            self._batch(rows, hidden, want_logits=True)
        if np.isnan(hidden[-1, 0]):  # a family whose pass does not end in the kit's lm_logits
            raise RuntimeError(f"{type(self).__name__} does not report its hidden states")
        return np.split(hidden, np.cumsum([len(tokens) for _, tokens, _ in rows])[:-1])

    def forward_traced(
        self, cache: Any, tokens: Sequence[int], pos: int
    ) -> tuple[np.ndarray, Routing]:
        """:meth:`forward` with every token's logits and the experts every MoE layer chose."""
        if self.n_used_experts <= 0:
            raise ValueError("this model has no experts to trace")
        ids, pos = self._check_call(cache, tokens, pos)
        n, k = ids.size, self.n_used_experts
        chosen = np.full((self.n_layer, n, k), -1, np.int32)
        weights = np.zeros((self.n_layer, n, k), np.float32)
        trace = kernels.ffi.new("lm_trace *")
        trace.ids = kernels.ffi.cast("int32_t *", kernels.ffi.from_buffer(chosen))
        trace.weights = kernels.ffi.cast("float *", kernels.ffi.from_buffer(weights))
        trace.cap = n
        trace.n_used = k
        logits = np.empty((n, self.n_vocab), np.float32)
        with self._lock:
            self._require_open()
            self._core.trace = trace
            try:
                kernels.forward(self._core, cache.native, ids, pos, logits, True)
            finally:
                self._core.trace = kernels.ffi.NULL
        return logits, Routing(chosen, weights)

    def copy_rows(self, src: Any, dst: Any, n: int) -> None:
        """Copy positions ``[0, n)`` of every layer from cache ``src`` into ``dst``."""
        self._check_cache(src)
        self._check_cache(dst)
        with self._lock:
            src.native.copy_to(dst.native, n)
            if isinstance(dst, RecurrentCache):
                dst.adopt_from(src, n)

    def close(self) -> None:
        """Free the native model (pool, scratch) and the weights' copies; caches stay valid
        to free."""
        with self._lock:
            if self._base is not None:
                self.ffi.release(self._base)
                self._base = None
                self._core = None
                # nothing reads the weights any more: the copies may go
                self._keep.clear()
                self._resident.clear()
                self._arena = memory.WeightArena()

    # ------------------------------------------------------------------ helpers

    def _require_open(self) -> None:
        if self._base is None:
            raise RuntimeError("the model is closed (or was never built)")

    def _check_cache(self, cache: Any) -> None:
        if not isinstance(cache, NativeCache) or cache.model is not self:
            raise ValueError("the cache was not made by this model")

    def _check_call(
        self, cache: Any, tokens: Sequence[int], pos: int
    ) -> tuple[npt.NDArray[np.int32], int]:
        self._check_cache(cache)
        pos = operator.index(pos)
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = int(ids.size)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if pos < 0 or pos + n > cache.n_ctx:
            raise ValueError(f"positions {pos}..{pos + n - 1} do not fit a cache of {cache.n_ctx}")
        if isinstance(cache, RecurrentCache) and pos not in (0, cache.pos):
            raise ValueError(
                f"a recurrent cache continues at position {cache.pos} (or 0), not {pos}"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= self.n_vocab:
            raise ValueError(f"token id outside [0, {self.n_vocab})")
        return np.ascontiguousarray(ids, dtype=np.int32), pos


def _bind(ffi: Any, lib: Any) -> None:
    """Hand the core's kernel table to a family module once."""
    with _bind_lock:
        if id(lib) in _bound:
            return
        status = lib.lm_kit_bind(ffi.cast("const void *", kernels.kit_table()))
        if status != 0:
            kernels.check(status, "binding the family module to the core's kernels")
        _bound.add(id(lib))
