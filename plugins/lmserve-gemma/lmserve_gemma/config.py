"""Hyper-parameters of a ``gemma3`` GGUF, under the names llama.cpp reads."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.kit import DecoderConfig, HParams, decoder_hparams

# Gemma 3's default: five local (sliding-window) layers, then one global.
SWA_PATTERN = 6
# Gemma 3 27B scales queries by n_embd / n_head rather than the head width.
LAYERS_27B = 62


@dataclass(frozen=True, slots=True)
class Gemma3Config(DecoderConfig):
    """What the Gemma 3 forward pass needs besides the decoder's sizes."""

    n_swa: int = 0  # sliding window of the local layers; 0: every layer is global
    swa_layers: tuple[bool, ...] = ()  # per layer: local (True) or global
    rope_base_swa: float = 10000.0  # RoPE base of the local layers
    attn_scale: float = 1.0  # multiplies the queries
    logit_softcap: float = 0.0  # final_logit_softcapping; 0: none

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Gemma3Config:
        """Read the config from a GGUF's metadata; unknown keys are ignored."""
        if gguf.architecture != "gemma3":
            raise GGUFError(f"architecture {gguf.architecture!r} is not Gemma 3")
        hp = HParams(gguf)
        common = decoder_hparams(hp, rms_eps_default=1e-6, n_ctx_default=131072)
        n_layer = common["n_layer"]
        n_swa = hp.integer("attention.sliding_window", 0, minimum=0, maximum=1 << 30)
        swa_layers = swa_pattern(hp, n_layer) if n_swa > 0 else (False,) * n_layer
        if n_layer == LAYERS_27B:
            attn_scale = 1.0 / math.sqrt(common["n_embd"] // common["n_head"])
        else:
            attn_scale = 1.0 / math.sqrt(common["head_dim"])
        return cls(
            **common,
            n_swa=n_swa,
            swa_layers=swa_layers,
            rope_base_swa=hp.number("rope.freq_base_swa", 10000.0),
            attn_scale=attn_scale,
            logit_softcap=hp.number("final_logit_softcapping", 0.0, inclusive=True),
        )


def swa_pattern(hp: HParams, n_layer: int, default: int = SWA_PATTERN) -> tuple[bool, ...]:
    """Which layers slide: ``attention.sliding_window_pattern`` as a bool per layer, or a
    period n (layer il is local unless il % n == n - 1; 0: every layer is local)."""
    value = hp.raw("attention.sliding_window_pattern", default)
    if isinstance(value, Sequence | np.ndarray) and not isinstance(value, str):
        flags = list(value)
        if len(flags) != n_layer or not all(f in (0, 1) for f in flags):
            raise GGUFError(
                f"{hp.key('attention.sliding_window_pattern')}: expected {n_layer} booleans"
            )
        return tuple(bool(f) for f in flags)
    period = hp.integer("attention.sliding_window_pattern", default, minimum=0)
    return tuple(period == 0 or il % period < period - 1 for il in range(n_layer))
