"""The family kit: what a model family builds on instead of copying.

- :class:`NativeForwardModel` — the Python half of a forward pass written in C over the
  kit header ``lmserve/kit.h`` (weight table checks, caches, the forward call, status codes).
- :class:`HParams` — ``{arch}.*`` metadata with clear errors for missing or absurd values.
- :func:`rope_from_gguf` and friends — RoPE frequencies for every scaling scheme.
- ``lmserve_core.native.family_ffibuilder_for`` (build time) — the cffi build of a family module.

A family is then its ``forward_chunk`` and weight table in C, plus its conventions
(``lmserve_core.model.FamilyConventions``); ``docs/plugins.md`` walks through one.
"""

from lmserve_core.native.kernels import MATRIX_TYPES, Activation, QuantType, RopeMode

from .config import DecoderConfig, ExpertsConfig, decoder_hparams, experts_hparams
from .forward import DEFAULT_BATCH, NativeCache, NativeForwardModel, Routing
from .hparams import MISSING, HParams
from .rope import Rope, base_inv_freq, llama3_inv_freq, rope_from_gguf, yarn_inv_freq

__all__ = [
    "DEFAULT_BATCH",
    "MATRIX_TYPES",
    "MISSING",
    "Activation",
    "DecoderConfig",
    "ExpertsConfig",
    "HParams",
    "NativeCache",
    "NativeForwardModel",
    "QuantType",
    "Rope",
    "RopeMode",
    "Routing",
    "base_inv_freq",
    "decoder_hparams",
    "experts_hparams",
    "llama3_inv_freq",
    "rope_from_gguf",
    "yarn_inv_freq",
]
