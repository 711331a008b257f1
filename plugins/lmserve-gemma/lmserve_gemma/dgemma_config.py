"""Hyper-parameters of a ``diffusion-gemma`` GGUF: Gemma 4's (``diffusion-gemma.*``, the same
keys as ``gemma4.*``) and the block-diffusion ones, keys without an architecture prefix:
``diffusion.canvas_length`` and the entropy-bound sampler's ``diffusion.eb_*`` (absent keys
take the reference defaults, as llama.cpp's reader does). See ``convert_diffusion`` for the
layout's sources.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from lmserve_core.gguf_file import GGUFError, GGUFFile

from .gemma4_config import Gemma4Config

# Longest canvas a file may ask for.
MAX_CANVAS = 4096


@dataclass(frozen=True, slots=True)
class EntropyBound:
    """The sampler's parameters (transformers' DiffusionGemmaGenerationConfig names)."""

    max_denoising_steps: int = 48
    t_min: float = 0.4  # temperature of the last step
    t_max: float = 0.8  # temperature of the first step
    entropy_bound: float = 0.1
    stability_threshold: int = 1
    confidence_threshold: float = 0.005

    def __post_init__(self) -> None:
        if not isinstance(self.max_denoising_steps, int) or self.max_denoising_steps < 1:
            raise ValueError(f"max_denoising_steps {self.max_denoising_steps!r}: expected >= 1")
        if not isinstance(self.stability_threshold, int) or self.stability_threshold < 0:
            raise ValueError(f"stability_threshold {self.stability_threshold!r}: expected >= 0")
        for name in ("t_min", "t_max", "entropy_bound", "confidence_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} {value!r}: expected a finite number >= 0")
        if self.entropy_bound <= 0 or min(self.t_min, self.t_max) <= 0:
            raise ValueError("entropy_bound, t_min and t_max must be > 0")

    def replace(self, **changes: Any) -> EntropyBound:
        """These parameters with ``changes`` (a request's overrides)."""
        return dataclasses.replace(self, **changes)


# GGUF key suffix (``diffusion.eb_*``) of each field.
EB_KEYS = {
    "max_denoising_steps": "eb_max_steps",
    "t_min": "eb_t_min",
    "t_max": "eb_t_max",
    "entropy_bound": "eb_entropy_bound",
    "stability_threshold": "eb_stability_threshold",
    "confidence_threshold": "eb_confidence_threshold",
}


@dataclass(frozen=True, slots=True)
class DiffusionGemmaConfig(Gemma4Config):
    """Gemma 4's geometry, the canvas length and the sampler's defaults."""

    ARCHITECTURE: ClassVar[str] = "diffusion-gemma"
    NAME: ClassVar[str] = "DiffusionGemma"

    canvas_length: int = 256
    sampler: EntropyBound = EntropyBound()

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> DiffusionGemmaConfig:
        base = Gemma4Config.from_gguf.__func__(cls, gguf)  # type: ignore[attr-defined]
        if base.n_kv_shared:
            raise GGUFError(f"{gguf.path}: DiffusionGemma has no shared KV")
        canvas = gguf.get("diffusion.canvas_length")
        if not isinstance(canvas, int) or not 1 <= canvas <= MAX_CANVAS:
            raise GGUFError(f"{gguf.path}: diffusion.canvas_length {canvas!r}: expected an "
                            f"integer in [1, {MAX_CANVAS}]")
        defaults = EntropyBound()
        values: dict[str, Any] = {}
        for field, suffix in EB_KEYS.items():
            value = gguf.get(f"diffusion.{suffix}")
            if value is None:
                continue
            want = type(getattr(defaults, field))
            if isinstance(value, bool) or not isinstance(value, int | float) or (
                want is int and value != int(value)
            ):
                raise GGUFError(f"{gguf.path}: diffusion.{suffix} {value!r} is not a number")
            # an f32 key as the decimal it was written from (0.4, not 0.4000000059604645)
            values[field] = int(value) if want is int else float(str(np.float32(value)))
        try:
            sampler = EntropyBound(**values)
        except ValueError as exc:
            raise GGUFError(f"{gguf.path}: diffusion.eb_*: {exc}") from None
        return dataclasses.replace(base, canvas_length=canvas, sampler=sampler)
