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

import dataclasses
import operator
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import structlog

from lmserve_core import memory
from lmserve_core.gguf_file import GGUFError, GGUFFile, TensorInfo
from lmserve_core.model import ATTENTION, AttentionCache, CacheKind
from lmserve_core.native import kernels
from lmserve_core.progress import Report, tracker

from .rope import Rope

__all__ = ["DEFAULT_BATCH", "NativeCache", "NativeForwardModel", "RecurrentCache", "Routing"]

# Most tokens per weight pass: large enough that prefill is compute-bound, small enough that
# the scratch (a few n_batch x n_ff float buffers) stays a few MB.
DEFAULT_BATCH = 256
# A ranking model's classifier head (llama.cpp's cls_out): read by lmserve_core.embeddings,
# not by the forward pass
POOLING_HEAD_TENSORS = frozenset({"cls.output.weight", "cls.output.bias"})

log = structlog.get_logger("lmserve.kit")

_bound: set[int] = set()  # family libs already handed the kit table
_bind_lock = threading.Lock()


SLIDING = CacheKind(name="sliding")
# A cache with recurrent layers: their state stands for every position written and cannot be
# cut back, so the cache resumes only from its end or from a checkpoint it kept.
RECURRENT = CacheKind(name="recurrent", truncate=False)

# Checkpoints of the recurrent state a cache keeps at most (each is the states' bytes: the
# RAM guard prices them, ``kv_bytes``), and the spacing of the evenly spaced ones in a long
# prompt.
MAX_CHECKPOINTS = 8
CHECKPOINT_EVERY = 1024
# Checkpoints this many positions before the end of a prompt: a chat's next turn renders
# the previous turn's opener again, but not always what followed it (a think block the
# template drops from history), so the next prompt usually leaves the old one a few tokens
# before its end; the same prompt again (another choice, a retry) reuses all of it but the
# token whose logits it needs.
CHECKPOINTS_BEFORE_END = (4, 1)


class NativeCache(AttentionCache):
    """A KV cache of one model: attention rows, f16 or f32, committed lazily.

    Sliding-window layers may keep a ring of rows (the geometry's ``ring``): the cache is then
    of kind ``sliding``, and a prefix can be continued from only while the ring still holds
    the keys its next chunk sees (see :meth:`reusable_prefix`).
    """

    def __init__(self, model: NativeForwardModel, n_ctx: int, kv_type: str) -> None:
        self.model = model  # the cache's geometry belongs to this model
        self.native = kernels.Cache(model.cache_layers, n_ctx, kv_type, n_layer=model.n_layer)
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        rings = [r for r in self.native.rings if r > 0]
        # A ring of R rows serves a window of at most R - n_batch (the chunk is written
        # before it is attended): the smallest ring bounds what the cache can reuse.
        self._ring = min(rings, default=0)
        self._batch = model.n_batch

    @property
    def kind(self) -> CacheKind:  # type: ignore[override]
        return SLIDING if self._ring else ATTENTION

    def reusable_prefix(self, held: int, wanted: int) -> int:
        """Any prefix of a cache without rings; with rings, ``wanted`` while every ring
        still holds the window before it (the positions since ``held - ring`` are
        resident), else nothing."""
        n = min(held, wanted)
        ring = self._ring
        if ring == 0 or held <= ring:
            return n
        # query n needs keys from n - window + 1 >= n - (ring - n_batch) + 1
        return n if n - (ring - self._batch) + 1 >= held - ring else 0

    def snapshot(self, n: int) -> npt.NDArray[np.uint8]:
        """The state of positions [0, n) as bytes."""
        return self.native.state(n)

    def restore(self, n: int, state: npt.ArrayLike) -> None:
        """Load positions [0, n) from :meth:`snapshot`'s bytes."""
        self.native.load(n, state)

    def close(self) -> None:
        """Release the memory now instead of at garbage collection."""
        self.native.close()


class RecurrentCache(NativeCache):
    """A cache with recurrent layers (and maybe attention layers): kind ``recurrent``.

    ``pos`` is the number of positions written: the recurrent state stands for all of them,
    so the next forward continues at ``pos``. A state cannot be cut back, so the cache keeps
    checkpoints (the states' bytes at chosen positions: :meth:`plan` marks them before a
    prompt is read, and the forward pass stops there to take them) and can continue from
    ``pos`` or from any checkpoint; attention rows keep any prefix. Checkpoints where other
    prompts may share the prefix (``plan``'s ``shared``: a system prompt's end) are the last
    to give way when there are too many.
    """

    def __init__(self, model: NativeForwardModel, n_ctx: int, kv_type: str) -> None:
        super().__init__(model, n_ctx, kv_type)
        self.pos = 0
        self.checkpoints: dict[int, npt.NDArray[np.uint8]] = {}  # position: states' bytes
        self.planned: set[int] = set()  # positions to take a checkpoint at when reached
        self.shared: set[int] = set()  # positions other prompts may share the prefix up to
        self._mark: tuple[int, npt.NDArray[np.uint8]] | None = None

    @property
    def kind(self) -> CacheKind:  # type: ignore[override]
        return RECURRENT

    def reusable_prefix(self, held: int, wanted: int) -> int:
        """``held`` (its end) when ``wanted`` reaches it, else the latest checkpoint at or
        before ``wanted``; 0 when there is none."""
        if held != self.pos:
            return 0
        if wanted >= held:
            return held
        return max((p for p in self.checkpoints if p <= wanted), default=0)

    def truncate(self, n: int) -> None:
        """Go back to position ``n``: 0, the end, or a checkpoint (loaded)."""
        if n == self.pos:
            return
        if n == 0:
            self.pos = 0  # the forward pass at position 0 starts from a zero state
            self.checkpoints.clear()
            self.shared.clear()
            return
        state = self.checkpoints.get(n)
        if state is None:
            raise ValueError(f"a recurrent cache cannot go back to position {n}: no checkpoint")
        self.native.load_recurrent(state)
        self.pos = n
        self.checkpoints = {p: s for p, s in self.checkpoints.items() if p <= n}

    def plan(self, end: int, shared: Iterable[int] = ()) -> None:
        """Mark the checkpoints to take while a prompt of ``end`` positions is read from
        ``pos``: 4 and 1 positions before its end, every ``CHECKPOINT_EVERY`` positions of a
        long one, and at ``shared``, where other prompts may leave this one (the end of its
        system prompt, of its earlier messages). (Its end needs none: the state is there
        when the reply starts.)"""
        shared = {p for p in shared if self.pos < p < end}
        marks = set(range(CHECKPOINT_EVERY, end, CHECKPOINT_EVERY))
        marks |= {end - k for k in CHECKPOINTS_BEFORE_END}
        self.planned = {p for p in marks | shared if self.pos < p <= end}
        self.shared = {p for p in self.shared if p <= self.pos} | shared

    def stops(self, pos: int, n: int) -> list[int]:
        """Where a forward of ``n`` tokens from ``pos`` must stop for a checkpoint."""
        return sorted(p for p in self.planned if pos < p < pos + n)

    def wrote(self, end: int, state: Any = None) -> None:
        """Positions up to ``end`` are written; take its checkpoint when one is planned
        (``state``: the state at ``end`` kept during a pass that went further)."""
        self.pos = end
        if end in self.planned:
            self.planned.discard(end)
            self.checkpoints[end] = self.native.recurrent_state() if state is None else state
            while len(self.checkpoints) > MAX_CHECKPOINTS:
                del self.checkpoints[min(self.checkpoints, key=self._keep_rank)]

    def _keep_rank(self, p: int) -> tuple[int, int]:
        """What losing checkpoint ``p`` costs, least first: the earliest ordinary ones, then
        shared prefixes, and last the earliest of those (the prefix most prompts share)."""
        shared = p in self.shared
        first = shared and p == min(self.shared & self.checkpoints.keys())
        return int(shared) + int(first), p

    def mark(self) -> None:
        """Remember the present state (:meth:`rewind` returns to it): before a verify pass
        whose rows may not all be kept."""
        self._mark = (self.pos, self.native.recurrent_state())

    def rewind(self) -> int:
        """Return to the state :meth:`mark` remembered; its position."""
        assert self._mark is not None
        self.pos, state = self._mark
        self.native.load_recurrent(state)
        self._mark = None
        self.checkpoints = {p: s for p, s in self.checkpoints.items() if p <= self.pos}
        return self.pos

    def adopt_from(self, src: RecurrentCache, n: int) -> None:
        """After the rows [0, n) were copied from ``src``: its state at ``n`` too."""
        if n == src.pos:
            src.native.copy_recurrent_to(self.native)
        else:
            self.native.load_recurrent(src.checkpoints[n])
        self.pos = n
        self.checkpoints = {p: s for p, s in src.checkpoints.items() if p <= n}
        self.shared = {p for p in src.shared if p <= n}

    def snapshot(self, n: int) -> npt.NDArray[np.uint8]:
        """The state of positions [0, n) (n == ``pos``) and the checkpoints before it, as
        bytes: the rows and states, then each checkpoint's states, then their positions and
        how many there are (int64)."""
        if n != self.pos:
            raise ValueError(f"a recurrent cache at {self.pos} has no state for {n}")
        marks = sorted(p for p in self.checkpoints if p < n)
        tail = np.array([*marks, len(marks)], np.int64).view(np.uint8)
        return np.concatenate([self.native.state(n), *(self.checkpoints[p] for p in marks), tail])

    def restore(self, n: int, state: npt.ArrayLike) -> None:
        """Load what :meth:`snapshot` saved."""
        raw = np.frombuffer(np.asarray(state, np.uint8).tobytes(), np.uint8)
        size = self.native.recurrent_bytes
        if raw.size < 8:
            raise ValueError("a recurrent cache state too short")
        k = int(raw[-8:].view(np.int64)[0])
        body = raw.size - 8 * (k + 1) - k * size
        if k < 0 or k > MAX_CHECKPOINTS or body < 0:
            raise ValueError("a recurrent cache state of another layout")
        marks = raw[body + k * size : raw.size - 8].view(np.int64).tolist()
        if any(not 0 < p < n for p in marks):
            raise ValueError("a recurrent cache state with checkpoints out of place")
        self.native.load(n, raw[:body])
        self.pos = n
        self.checkpoints = {
            p: raw[body + i * size : body + (i + 1) * size].copy() for i, p in enumerate(marks)
        }
        self.planned = set()
        self.shared = set()


class Routing:
    """Experts chosen by every MoE layer for every token of a traced forward pass."""

    def __init__(self, ids: npt.NDArray[np.int32], weights: npt.NDArray[np.float32]) -> None:
        self.ids = ids  # (n_layer, ntok, n_used)
        self.weights = weights  # (n_layer, ntok, n_used)


class NativeForwardModel:
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

    def matrix(
        self, field: Any, name: str, shape: tuple[int, ...], *, cuts: Sequence[int] = ()
    ) -> TensorInfo:
        """Point an ``lm_matrix`` field at tensor ``name``, checked for type and shape.

        Where the products read it from, and in which layout, is :meth:`_place`'s choice; a
        tensor named twice (tied embeddings) is placed once. ``cuts``: the rows (of each
        expert's matrix) at which the family's C code cuts the tensor into parts with
        ``lm_matrix_rows`` (a fused q/k/v or gate/up tensor); the interleaved layout is
        kept for tensors cut only at multiples of 16 rows."""
        info = self.gguf.require(name, ggml_types=kernels.MATRIX_TYPES, shape=shape)
        if name not in self._resident:
            self._count(info)
        data, ggml_type = self._place(info, cuts)
        buf = self.ffi.from_buffer(data)
        self._keep.append(buf)
        field.data = self.ffi.cast("const void *", buf)
        field.type = ggml_type
        self._used.add(name)
        return info

    def _count(self, info: TensorInfo) -> None:
        """One more tensor read: report the progress."""
        self._read_bytes += int(info.nbytes)
        self._progress(self._read_bytes, self._total_bytes)

    def _place(self, info: TensorInfo, cuts: Sequence[int] = ()) -> tuple[Any, int]:
        """The bytes and type the products read for ``info``, the same values either way.

        - A type of ``kernels.DECODE_LAYOUTS`` is rewritten once into its faster layout
          while those copies' extra bytes stay within an eighth of the memory available at
          load.
        - Any other matrix is copied into the process's memory (:class:`memory.WeightArena`:
          huge pages, fewer TLB misses than the file's mapping on every decode step) as
          ``memory.weights_mode()`` allows: "copy" always, "auto" while the copies stay
          within a quarter of the memory available at load, "map" never. The copy takes
          the interleaved layout (``kernels.interleaved_for``) where the CPU's products read
          it faster and the rows allow it (see :meth:`matrix`).
        - Otherwise the mapped file is read in place."""
        done = self._resident.get(info.name)
        if done is not None:
            return done
        to = kernels.DECODE_LAYOUTS.get(info.ggml_type)
        if to is not None:
            size = kernels.row_bytes(to, info.n_elements)
            if self._relay_budget is None:
                self._relay_budget = self._memory_share(8)
            if size - info.nbytes <= self._relay_budget:
                self._relay_budget -= size - info.nbytes
                r16 = self._interleave(info, to, cuts)
                out = kernels.convert_row(
                    info.ggml_type, info.data, to, info.n_elements,
                    out=None if r16 is not None else self._arena.alloc(size),
                )
                memory.release_pages(info.data)
                self.relaid_bytes += size
                done = self._resident[info.name] = self._laid(info, out, to, r16)
                return done
        mode = memory.weights_mode()
        if mode != "map":
            if self._copy_budget is None:
                self._copy_budget = self._memory_share(4)
            if mode == "copy" or info.nbytes <= self._copy_budget:
                self._copy_budget -= info.nbytes
                self.copied_bytes += info.nbytes
                r16 = self._interleave(info, info.ggml_type, cuts)
                done = self._resident[info.name] = self._laid(info, info.data, info.ggml_type, r16)
                memory.release_pages(info.data)  # not counted twice in the resident set
                return done
        self.mapped_bytes += info.nbytes
        done = self._resident[info.name] = (info.data, info.ggml_type)
        return done

    def _laid(
        self, info: TensorInfo, data: Any, ggml_type: int, r16: int | None
    ) -> tuple[Any, int]:
        """``data`` (``info``'s values as ``ggml_type``) in the arena: interleaved as ``r16``
        when given, else as it is (a copy unless it is there already)."""
        if r16 is not None:
            out = self._arena.alloc(data.nbytes)
            kernels.repack_r16(ggml_type, data, info.n_elements // info.shape[-1],
                               info.shape[-1], out=out)
            self.interleaved_bytes += data.nbytes
            return out, r16
        if data is info.data:
            return self._arena.copy(data), ggml_type
        return data, ggml_type

    @staticmethod
    def _interleave(info: TensorInfo, ggml_type: int, cuts: Sequence[int]) -> int | None:
        """The interleaved type a copy of ``info`` (held as ``ggml_type``) takes, or None:
        where the active ISA reads it faster, under int16 decode or prefill, with whole groups of 16
        rows in every matrix and between the family's cuts."""
        to = kernels.interleaved_for(ggml_type)
        ints = (
            kernels.decode_precision() == kernels.DecodePrecision.I16
            or kernels.prefill_precision() == kernels.PrefillPrecision.I16
        )
        if to is None or not ints:
            return None
        if len(info.shape) < 2 or info.shape[-2] % 16 or any(int(c) % 16 for c in cuts):
            return None
        return to

    @staticmethod
    def _memory_share(parts: int) -> int:
        """A ``parts``-th of the memory available now (of 2 GiB where the system does not
        say)."""
        avail = memory.available()
        return (avail if avail is not None else 2 << 30) // parts

    def floats(self, name: str, shape: tuple[int, ...]) -> Any:
        """A ``const float *`` to tensor ``name`` (norms, biases): used in place when stored
        as f32, decoded once into a float32 copy otherwise."""
        info = self.gguf.require(name, ggml_types=kernels.MATRIX_TYPES, shape=shape)
        self._count(info)
        if info.ggml_type == int(kernels.QuantType.F32):
            data: Any = info.data
        else:
            data = kernels.dequantize_row(info.ggml_type, info.data, info.n_elements)
        buf = self.ffi.from_buffer(data)
        self._keep.append((data, buf))
        self._used.add(name)
        return self.ffi.cast("const float *", buf)

    def optional_floats(self, name: str, shape: tuple[int, ...]) -> Any:
        """:meth:`floats`, or NULL when the file has no such tensor."""
        return self.floats(name, shape) if name in self.gguf.tensors else self.ffi.NULL

    def rotary(self, field: Any, rope: Rope) -> None:
        """Fill an ``lm_rotary`` field from :class:`~lmserve_core.kit.rope.Rope`."""
        field.mode = rope.mode
        field.n_rot = rope.n_rot
        field.inv_freq = self.keep(self.ffi.from_buffer("float[]", rope.inv_freq))
        field.mscale = rope.mscale

    def dims(self, field: Any) -> None:
        """Fill an ``lm_dims`` field from the config (a :class:`DecoderConfig`)."""
        self.config_fields(field, "n_layer", "n_embd", "n_head", "n_kv_head", "head_dim", "n_ff",
                           "n_vocab", "rms_eps")

    def config_fields(self, struct: Any, *names: str) -> Any:
        """Set each named field of a C struct to the config's attribute of that name;
        returns the struct."""
        for name in names:
            setattr(struct, name, getattr(self.config, name))
        return struct

    def weight_table(
        self, ctype: str, layer_ctype: str, fill: Callable[[Any, int, str], None]
    ) -> Any:
        """A ``ctype`` weight table (kept with the model): its ``layers`` (:meth:`layer_table`
        of ``layer_ctype``) and its ``io``, the decoder's input and output tensors
        (:meth:`io_tensors`). The standard tables are ``lm_decoder_tensors`` of
        ``lm_layer_tensors`` (lmserve/types.h); a family's own has the same two fields."""
        w = self.keep(self.ffi.new(f"{ctype} *"))
        w.layers = self.layer_table(layer_ctype, fill)
        self.io_tensors(w.io)
        return w

    def layer_table(self, ctype: str, fill: Callable[[Any, int, str], None]) -> Any:
        """A table of ``n_layer`` ``ctype`` structs (kept with the model), each filled by
        ``fill(layer, i, "blk.{i}.")``."""
        layers = self.keep(self.ffi.new(f"{ctype}[]", self.config.n_layer))
        for i, layer in enumerate(layers):
            fill(layer, i, f"blk.{i}.")
        return layers

    def keep(self, obj: Any) -> Any:
        """Keep ``obj`` (a cffi buffer or array whose pointer C holds) alive with the model."""
        self._keep.append(obj)
        return obj

    def use(self, name: str) -> None:
        """Mark a tensor as read by the family without a pointer to it (e.g. rope_freqs)."""
        self._used.add(name)

    def refuse_unknown_tensors(self, what: str) -> None:
        """Raise when the file holds tensors the weight table does not read: a variant
        (biases, extra norms, experts) this forward pass would silently get wrong."""
        extra = sorted(set(self.gguf.tensors) - self._used - POOLING_HEAD_TENSORS)
        if extra:
            more = f" (+{len(extra) - 3} more)" if len(extra) > 3 else ""
            raise GGUFError(
                f"{self.gguf.path}: unsupported {what} variant: unexpected tensors "
                f"{extra[:3]}{more}"
            )

    # ------------------------------------------------------------------ standard tensors
    # The tensors most decoders name alike (llama.cpp's names), each into the field of the
    # family's struct the docstring names; ``fields`` maps such a name to the struct's own
    # where they differ. ``p`` is the block's prefix ("blk.{i}.").

    def io_tensors(
        self, w: Any, *, output_norm: bool = True, fields: Mapping[str, str] | None = None
    ) -> None:
        """``token_embd`` (n_vocab, n_embd), ``output_norm`` (n_embd; ``output_norm=False``:
        none, the field left NULL: a norm without weight) and ``output`` (n_vocab, n_embd):
        output.weight, or token_embd.weight when the file ties the output to the embedding
        (no output.weight)."""
        d, v = self.config.n_embd, self.n_vocab
        self.matrix(_field(w, "token_embd", fields), "token_embd.weight", (v, d))
        if output_norm:
            _set(w, "output_norm", fields, self.floats("output_norm.weight", (d,)))
        tied = "output.weight" not in self.gguf.tensors
        output = "token_embd.weight" if tied else "output.weight"
        self.matrix(_field(w, "output", fields), output, (v, d))

    def attention_tensors(
        self,
        layer: Any,
        p: str,
        *,
        q_dim: int,
        kv_dim: int,
        head_dim: int = 0,
        gated: bool = False,
        biases: bool = False,
        fused: bool = False,
        kv: bool = True,
        v_optional: bool = False,
        norm: str | None = "attn_norm",
        post_norm: str | None = None,
        fields: Mapping[str, str] | None = None,
    ) -> None:
        """The attention tensors of a block into ``layer`` (an ``lm_attn_tensors``, or a
        struct with its field names; ``fields`` renames them): ``attn_norm`` (n_embd); ``wq`` from attn_q
        (q_dim, n_embd; with ``gated`` 2 q_dim, each head's query rows then its gate rows),
        ``wk`` and ``wv`` from attn_k and attn_v (kv_dim, n_embd), ``wo`` from attn_output
        (n_embd, q_dim).

        - ``head_dim``: the per-head norms ``q_norm`` and ``k_norm`` (attn_q_norm,
          attn_k_norm: head_dim).
        - ``biases``: ``bq``, ``bk``, ``bv`` from attn_q/k/v.bias where the file has them.
        - ``fused``: a file with attn_qkv (q_dim + 2 kv_dim, n_embd) gives ``wqkv`` instead
          of wq, wk and wv (the C code cuts it after q and after k).
        - ``kv=False``: a layer attending to another layer's cache reads no keys or values
          of its own (attn_k, attn_v, attn_k_norm, when the file has them, are marked read).
        - ``v_optional``: without attn_v, ``wv`` is left without data (the values are the
          keys' projection).
        - ``norm``: the name of the input norm (None: a norm without weight, ``attn_norm``
          left NULL).
        - ``post_norm``: the name of a norm of the attention output, into ``post_attn_norm``.
        """
        d = self.config.n_embd
        has = self.gguf.tensors.__contains__
        if norm is not None:
            _set(layer, "attn_norm", fields, self.floats(p + norm + ".weight", (d,)))
        if fused and has(p + "attn_qkv.weight"):
            self.matrix(_field(layer, "wqkv", fields), p + "attn_qkv.weight",
                        (q_dim + 2 * kv_dim, d), cuts=(q_dim, q_dim + kv_dim))
        else:
            self.matrix(_field(layer, "wq", fields), p + "attn_q.weight",
                        (2 * q_dim if gated else q_dim, d))
            if kv:
                self.matrix(_field(layer, "wk", fields), p + "attn_k.weight", (kv_dim, d))
                if not v_optional or has(p + "attn_v.weight"):
                    self.matrix(_field(layer, "wv", fields), p + "attn_v.weight", (kv_dim, d))
        self.matrix(_field(layer, "wo", fields), p + "attn_output.weight", (d, q_dim))
        if head_dim:
            _set(layer, "q_norm", fields, self.floats(p + "attn_q_norm.weight", (head_dim,)))
            if kv:
                _set(layer, "k_norm", fields, self.floats(p + "attn_k_norm.weight", (head_dim,)))
        if biases:
            for name, n in (("bq", q_dim), ("bk", kv_dim), ("bv", kv_dim)):
                if kv or name == "bq":
                    tensor = f"{p}attn_{name[1]}.bias"
                    _set(layer, name, fields, self.optional_floats(tensor, (n,)))
        if not kv:
            for name in ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight"):
                if has(p + name):
                    self.use(p + name)
        if post_norm is not None:
            _set(layer, "post_attn_norm", fields, self.floats(p + post_norm + ".weight", (d,)))

    def mlp_tensors(
        self,
        layer: Any,
        p: str,
        n_ff: int,
        *,
        norm: str | None = "ffn_norm",
        post_norm: str | None = None,
        gated: bool = True,
        fields: Mapping[str, str] | None = None,
    ) -> None:
        """A block's MLP into ``layer`` (an ``lm_ffn_tensors``, or a struct with its
        field names; ``fields`` renames them): ``ffn_norm`` from the tensor named ``norm`` (n_embd; None:
        none), ``ffn_gate`` (unless ``gated`` is false: left without data, an ungated MLP)
        and ``ffn_up`` (n_ff, n_embd), ``ffn_down`` (n_embd, n_ff); ``post_norm``: the name
        of a norm of the output, into ``post_ffn_norm``."""
        d = self.config.n_embd
        if norm is not None:
            _set(layer, "ffn_norm", fields, self.floats(p + norm + ".weight", (d,)))
        if gated:
            self.matrix(_field(layer, "ffn_gate", fields), p + "ffn_gate.weight", (n_ff, d))
        self.matrix(_field(layer, "ffn_up", fields), p + "ffn_up.weight", (n_ff, d))
        self.matrix(_field(layer, "ffn_down", fields), p + "ffn_down.weight", (d, n_ff))
        if post_norm is not None:
            _set(layer, "post_ffn_norm", fields, self.floats(p + post_norm + ".weight", (d,)))

    def moe_tensors(
        self,
        layer: Any,
        p: str,
        *,
        n_expert: int,
        n_ff: int,
        n_ff_shexp: int = 0,
        norm: str | None = "ffn_norm",
        fields: Mapping[str, str] | None = None,
    ) -> None:
        """A block's mixture of experts into ``layer`` (as :meth:`mlp_tensors`): ``ffn_norm``
        as :meth:`mlp_tensors`; the router
        ``ffn_gate_inp`` (n_expert, n_embd); the experts' ``ffn_gate_up_exps`` (n_expert,
        2 n_ff, n_embd: each expert's gate rows then its up rows) when the file fuses them,
        else ``ffn_gate_exps`` and ``ffn_up_exps`` (n_expert, n_ff, n_embd); and
        ``ffn_down_exps`` (n_expert, n_embd, n_ff). With ``n_ff_shexp``: a shared expert,
        ``ffn_gate_shexp``, ``ffn_up_shexp`` (n_ff_shexp, n_embd), ``ffn_down_shexp``
        (n_embd, n_ff_shexp) and its gate ``ffn_gate_inp_shexp`` ((n_embd,) or
        (1, n_embd))."""
        d, e = self.config.n_embd, n_expert

        def put(name: str, shape: tuple[int, ...], cuts: Sequence[int] = ()) -> None:
            self.matrix(_field(layer, name, fields), f"{p}{name}.weight", shape, cuts=cuts)

        if norm is not None:
            _set(layer, "ffn_norm", fields, self.floats(p + norm + ".weight", (d,)))
        put("ffn_gate_inp", (e, d))
        if p + "ffn_gate_up_exps.weight" in self.gguf.tensors:
            put("ffn_gate_up_exps", (e, 2 * n_ff, d), cuts=(n_ff,))
        else:
            put("ffn_gate_exps", (e, n_ff, d))
            put("ffn_up_exps", (e, n_ff, d))
        put("ffn_down_exps", (e, d, n_ff))
        if n_ff_shexp > 0:
            info = self.gguf.tensors.get(p + "ffn_gate_inp_shexp.weight")
            # written as (n_embd,) by some converters, (1, n_embd) by others
            put("ffn_gate_inp_shexp", (d,) if info is not None and len(info.shape) == 1 else (1, d))
            put("ffn_gate_shexp", (n_ff_shexp, d))
            put("ffn_up_shexp", (n_ff_shexp, d))
            put("ffn_down_shexp", (d, n_ff_shexp))

    def release_view_sources(self) -> int:
        """For a model over a GGUF built in memory (a converted checkpoint): let go of the
        view's own bytes of every matrix the products read from a copy, which would
        otherwise stay resident beside it; the bytes released. Call it after :meth:`build`.
        Tensors read in place (and vectors, which the C side points into) are kept."""
        released = 0
        for name, (data, _) in self._resident.items():
            info = self.gguf.tensors.get(name)
            if info is None or data is info.data or not info.data.flags.writeable:
                continue
            self.gguf.tensors[name] = dataclasses.replace(info, data=np.empty(0, np.uint8))
            released += int(info.data.nbytes)
        return released

    def rope_factors(self) -> npt.NDArray[np.float32] | None:
        """The file's ``rope_freqs`` per-pair factors (F32, marked read), or None."""
        if "rope_freqs.weight" not in self.gguf.tensors:
            return None
        info = self.gguf.require("rope_freqs.weight", ggml_types=(int(kernels.QuantType.F32),))
        self.use("rope_freqs.weight")
        return info.data.view(np.float32)  # rope_from_gguf checks the count

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
        return kernels.cache_bytes_per_pos(self.cache_layers, self.n_layer, self.kv_type)

    def kv_bytes(self, n_ctx: int) -> int:
        """Bytes of a cache of ``n_ctx`` positions once every row is written, with its
        recurrent states and the most checkpoints of them it keeps."""
        states = 4 * sum(layer[4] for layer in self.cache_layers)
        return kernels.cache_bytes(
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
        # (a pass keeps at most LM_MAX_SNAPSHOTS; past them it ends at the next one)
        stops = cache.stops(pos, ids.size) if recurrent else []
        most = int(kernels.lib.LM_MAX_SNAPSHOTS)
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


def _field(struct: Any, name: str, fields: Mapping[str, str] | None) -> Any:
    """Field ``name`` of a cffi struct, under the struct's own name in ``fields``."""
    return getattr(struct, fields.get(name, name) if fields else name)


def _set(struct: Any, name: str, fields: Mapping[str, str] | None, value: Any) -> None:
    setattr(struct, fields.get(name, name) if fields else name, value)
