"""Rotary position embedding: frequencies and scaling schemes, as the native kernels take them.

The kernels rotate pair i of a head by ``pos * inv_freq[i]`` and multiply cos and sin by
``mscale``; every scheme a GGUF can carry is folded into those two here, computed in float32
the way the transformers reference computes them:

- none: ``inv_freq[i] = 1 / base^(2i / n_rot)``
- linear (``rope.scaling.type = linear`` or the older ``rope.scale_linear``): divided by the
  factor (positions are interpolated)
- llama3: per-pair factors, either from the GGUF's ``rope_freqs.weight`` tensor (what
  llama.cpp's converter writes) or computed from the llama3 parameters
- YaRN (``rope.scaling.type = yarn``): a ramp between interpolated and extrapolated
  frequencies, and the attention factor ``0.1 ln(factor) + 1`` as ``mscale``
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lmserve_core.gguf_file import GGUFError

from .hparams import HParams

__all__ = ["Rope", "rope_from_gguf", "base_inv_freq", "llama3_inv_freq", "yarn_inv_freq"]

F32 = npt.NDArray[np.float32]

NORMAL = 0  # lm_rope_mode: pairs (2i, 2i + 1)
NEOX = 2  # pairs (i, i + n_rot / 2)


@dataclass(frozen=True)
class Rope:
    """What the kernels need: the pair layout, rotated dims, frequencies and cos/sin scale."""

    mode: int
    n_rot: int
    inv_freq: F32  # (n_rot // 2,)
    mscale: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in (NORMAL, NEOX):
            raise ValueError(f"rope mode {self.mode} is neither NORMAL (0) nor NEOX (2)")
        if self.n_rot < 0 or self.n_rot % 2 or self.inv_freq.shape != (self.n_rot // 2,):
            raise ValueError(f"{self.inv_freq.shape} frequencies for {self.n_rot} rotated dims")
        if not np.isfinite(self.inv_freq).all() or not math.isfinite(self.mscale):
            raise ValueError("rope frequencies must be finite")


def base_inv_freq(base: float, n_rot: int) -> F32:
    """``1 / base^(2i / n_rot)`` in float32 for i < n_rot / 2."""
    exponents = np.arange(0, n_rot, 2, dtype=np.float32) / np.float32(n_rot)
    return (np.float32(1.0) / np.power(np.float32(base), exponents)).astype(np.float32)


def llama3_inv_freq(
    base: float,
    n_rot: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> F32:
    """Llama 3.1's frequency scaling: long wavelengths divided by ``factor``, short ones
    kept, a smooth blend between."""
    inv = base_inv_freq(base, n_rot)
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def yarn_inv_freq(
    base: float,
    n_rot: int,
    factor: float,
    original_context: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attn_factor: float | None = None,
) -> tuple[F32, float]:
    """YaRN: frequencies and the cos/sin scale (the attention factor)."""

    def correction_dim(rotations: float) -> float:
        return (n_rot * math.log(original_context / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low = float(max(math.floor(correction_dim(beta_fast)), 0))
    high = float(min(math.ceil(correction_dim(beta_slow)), n_rot - 1))
    if low == high:
        high += 0.001  # no division by zero in the ramp
    pos_freqs = np.power(
        np.float32(base), np.arange(0, n_rot, 2, dtype=np.float32) / np.float32(n_rot)
    )
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(n_rot // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = np.float32(1.0) - ramp.astype(np.float32)  # 1: extrapolate (high frequencies)
    inv = interpolation * (1 - keep) + extrapolation * keep
    mscale = attn_factor if attn_factor is not None else 0.1 * math.log(factor) + 1.0
    return inv.astype(np.float32), float(mscale)


def rope_from_gguf(
    hp: HParams,
    *,
    head_dim: int,
    mode: int,
    freq_factors: npt.ArrayLike | None = None,
    default_base: float = 10000.0,
) -> Rope:
    """The RoPE a GGUF asks for: ``rope.freq_base``, ``rope.dimension_count`` and
    ``rope.scaling.*``; ``freq_factors`` are the per-pair divisors of a ``rope_freqs``
    tensor when the file has one."""
    base = hp.number("rope.freq_base", default_base)
    n_rot = hp.integer("rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise GGUFError(
            f"{hp.gguf.path}: rope.dimension_count {n_rot} does not fit head_dim {head_dim}"
        )
    kind = hp.text("rope.scaling.type", "none") or "none"
    factor: float | None = None
    if hp.has("rope.scaling.factor"):
        factor = hp.number("rope.scaling.factor", minimum=0.0, inclusive=True)
    elif hp.has("rope.scale_linear"):  # the older spelling of a linear factor
        factor = hp.number("rope.scale_linear")
        kind = "linear"
    if factor is not None and factor in (0.0, 1.0):
        factor = None

    inv = base_inv_freq(base, n_rot)
    mscale = 1.0
    if kind == "none" or factor is None:
        pass
    elif kind == "linear":
        inv = (inv / np.float32(factor)).astype(np.float32)
    elif kind == "yarn":
        attn = hp.number("rope.scaling.attn_factor") if hp.has("rope.scaling.attn_factor") else None
        inv, mscale = yarn_inv_freq(
            base,
            n_rot,
            factor,
            hp.integer("rope.scaling.original_context_length"),
            beta_fast=hp.number("rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=hp.number("rope.scaling.yarn_beta_slow", 1.0),
            attn_factor=attn,
        )
    else:
        raise GGUFError(
            f"{hp.gguf.path}: rope scaling {kind!r} is not supported (none, linear, yarn)"
        )
    if freq_factors is not None:
        factors = np.asarray(freq_factors, dtype=np.float32).reshape(-1)
        if factors.shape != inv.shape or not (np.isfinite(factors).all() and (factors > 0).all()):
            raise GGUFError(
                f"{hp.gguf.path}: rope_freqs has {factors.size} factors for {inv.size} pairs, "
                "or a factor that is not a positive number"
            )
        inv = (inv / factors).astype(np.float32)
    return Rope(mode=mode, n_rot=n_rot, inv_freq=inv, mscale=mscale)
