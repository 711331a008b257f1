"""The compiled kernels' module (``lmserve_core._kernels``: ``ffi``, ``lib``) and what every
call into it shares: the C enums as Python enums, status codes as exceptions
(:func:`check`), the instruction set and precisions in use, the thread pool, and the buffer
conversions that check a size before a pointer reaches C."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
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
