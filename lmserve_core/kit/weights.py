"""The weight table of a family's native forward pass: :class:`WeightTable`, the half of
:class:`~lmserve_core.kit.forward.NativeForwardModel` that places the GGUF's tensors where C
reads them. Each tensor is checked for type and shape before a pointer reaches C; a matrix
is read from the mapped file, copied into process memory, or rewritten into its decode
layout (``--weights``); the decoders' common tensors have one-call tables."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import structlog

from lmserve_core import memory
from lmserve_core.gguf_file import GGUFError, GGUFFile, TensorInfo
from lmserve_core.native import kernels
from lmserve_core.progress import Report

from .rope import Rope

log = structlog.get_logger("lmserve.kit")

# A ranking model's classifier head (llama.cpp's cls_out): read by lmserve_core.embeddings,
# not by the forward pass
POOLING_HEAD_TENSORS = frozenset({"cls.output.weight", "cls.output.bias"})


class WeightTable:
    """Placing a family's tensors: what :meth:`NativeForwardModel.setup` calls. The state it
    keeps (the file, the buffers C points into, the byte counts) is set up by
    ``NativeForwardModel.__init__``."""

    ffi: ClassVar[Any]
    lib: ClassVar[Any]
    gguf: GGUFFile
    config: Any
    n_vocab: int
    n_layer: int
    _keep: list[Any]
    _arena: memory.WeightArena
    _resident: dict[str, tuple[Any, int]]
    _relay_budget: int | None
    _copy_budget: int | None
    relaid_bytes: int
    interleaved_bytes: int
    copied_bytes: int
    mapped_bytes: int
    _used: set[str]
    _progress: Report
    _total_bytes: int
    _read_bytes: int

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


def _field(struct: Any, name: str, fields: Mapping[str, str] | None) -> Any:
    """Field ``name`` of a cffi struct, under the struct's own name in ``fields``."""
    return getattr(struct, fields.get(name, name) if fields else name)


def _set(struct: Any, name: str, fields: Mapping[str, str] | None, value: Any) -> None:
    setattr(struct, fields.get(name, name) if fields else name, value)
