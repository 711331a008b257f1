"""Hyper-parameters of a ``gemma4`` GGUF, under the names llama.cpp reads.

Gemma 4 sets most sizes per layer: sliding-window (local) and global layers have their own
head width (``attention.key_length_swa`` / ``attention.key_length``), rotary dimensions
(``rope.dimension_count_swa`` / ``rope.dimension_count``) and RoPE base
(``rope.freq_base_swa`` / ``rope.freq_base``); head counts and feed-forward widths may be
arrays with a value per layer. The last ``attention.shared_kv_layers`` layers have no keys and
values of their own: each attends to the cache of the last earlier layer of its kind that has
them (transformers' ``kv_sharing_modes``; llama.cpp's ``n_layer_kv_from_start - 2`` for local
and ``- 1`` for global layers name the same layers in every published model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.kit import MISSING, HParams

# Most experts per token a file may ask for.
MAX_EXPERTS_USED = 64
# Widest head a file may declare.
MAX_HEAD_DIM = 1024


@dataclass(frozen=True, slots=True)
class Gemma4Config:
    """What the Gemma 4 forward pass needs; per-layer tuples have ``n_layer`` entries."""

    ARCHITECTURE: ClassVar[str] = "gemma4"
    NAME: ClassVar[str] = "Gemma 4"

    architecture: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    n_head: tuple[int, ...]  # query heads per layer
    n_kv_head: tuple[int, ...]  # key/value heads per layer
    head_dim: int  # of the global layers (attention.key_length)
    head_dim_swa: int  # of the local layers (attention.key_length_swa)
    n_ff: tuple[int, ...]  # dense feed-forward width per layer
    swa_layers: tuple[bool, ...]  # per layer: local (True) or global
    n_swa: int  # sliding window of the local layers
    n_kv_shared: int  # trailing layers without keys and values of their own
    kv_source: tuple[int, ...]  # per layer: the layer whose cache it attends to
    n_embd_per_layer: int  # width of the per-layer inputs (PLE); 0: none
    n_expert: int  # experts of the MoE layers; 0: none
    n_expert_used: int  # experts per token
    n_ff_exp: tuple[int, ...]  # one expert's width per layer (0 without experts)
    n_rot: int  # rotated dimensions of the global layers
    n_rot_swa: int  # rotated dimensions of the local layers
    rope_base_swa: float  # RoPE base of the local layers
    logit_softcap: float  # final_logit_softcapping; 0: none

    def layer_head_dim(self, il: int) -> int:
        """The head width of layer ``il``."""
        return self.head_dim_swa if self.swa_layers[il] else self.head_dim

    def has_kv(self, il: int) -> bool:
        """Whether layer ``il`` computes (and caches) keys and values of its own."""
        return self.kv_source[il] == il

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Gemma4Config:
        """Read the config from a GGUF's metadata; unknown keys are ignored."""
        if gguf.architecture != cls.ARCHITECTURE:
            raise GGUFError(f"architecture {gguf.architecture!r} is not {cls.NAME}")
        hp = HParams(gguf)
        n_layer = hp.block_count()
        n_embd = hp.integer("embedding_length")

        n_head = hp.per_layer("attention.head_count", n_layer, maximum=4096)
        n_kv_head = (
            hp.per_layer("attention.head_count_kv", n_layer, maximum=4096)
            if hp.has("attention.head_count_kv")
            else list(n_head)
        )
        for il, (h, kv) in enumerate(zip(n_head, n_kv_head, strict=True)):
            if h % kv:
                raise GGUFError(
                    f"{gguf.path}: layer {il}: head_count {h} is not a multiple of "
                    f"head_count_kv {kv}"
                )

        head_dim = hp.integer("attention.key_length", n_embd // n_head[0] or 1,
                              maximum=MAX_HEAD_DIM)
        head_dim_swa = hp.integer("attention.key_length_swa", maximum=MAX_HEAD_DIM)
        for key, want in (("attention.value_length", head_dim),
                          ("attention.value_length_swa", head_dim_swa)):
            if hp.integer(key, want, maximum=MAX_HEAD_DIM) != want:
                raise GGUFError(
                    f"{gguf.path}: {hp.key(key)} differs from the key length {want}: Gemma 4 "
                    "keys and values have one width"
                )

        swa_layers = _swa_layers(hp, n_layer)
        n_swa = hp.integer("attention.sliding_window", minimum=1 if any(swa_layers) else 0,
                           maximum=1 << 30)

        n_rot = hp.integer("rope.dimension_count", head_dim, minimum=0, maximum=MAX_HEAD_DIM)
        n_rot_swa = hp.integer("rope.dimension_count_swa", n_rot, minimum=0,
                               maximum=MAX_HEAD_DIM)
        for key, rot, width, used in (
            ("rope.dimension_count", n_rot, head_dim, not all(swa_layers)),
            ("rope.dimension_count_swa", n_rot_swa, head_dim_swa, any(swa_layers)),
        ):
            if used and (rot > width or rot % 2):
                raise GGUFError(
                    f"{gguf.path}: {hp.key(key)} {rot} does not fit the head width {width}"
                )

        n_kv_shared = hp.integer("attention.shared_kv_layers", 0, minimum=0,
                                 maximum=n_layer - 1)
        kv_source = _kv_sources(gguf, swa_layers, n_kv_shared)
        for il, src in enumerate(kv_source):
            if n_kv_head[il] != n_kv_head[src]:
                raise GGUFError(
                    f"{gguf.path}: layer {il} attends to the cache of layer {src}, which has "
                    f"{n_kv_head[src]} kv heads, not {n_kv_head[il]}"
                )
            if n_head[il] % n_kv_head[src]:
                raise GGUFError(f"{gguf.path}: layer {il}: head counts do not group")

        n_expert = hp.integer("expert_count", 0, minimum=0, maximum=4096)
        n_expert_used = 0
        n_ff_exp = [0] * n_layer
        if n_expert:
            n_expert_used = hp.integer("expert_used_count",
                                       maximum=min(n_expert, MAX_EXPERTS_USED))
            n_ff_exp = hp.per_layer("expert_feed_forward_length", n_layer)

        return cls(
            architecture=hp.arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_vocab=hp.vocab_size(),
            n_ctx_train=hp.integer("context_length", 131072, maximum=1 << 30),
            rms_eps=hp.number("attention.layer_norm_rms_epsilon", 1e-6),
            n_head=tuple(n_head),
            n_kv_head=tuple(n_kv_head),
            head_dim=head_dim,
            head_dim_swa=head_dim_swa,
            n_ff=tuple(hp.per_layer("feed_forward_length", n_layer)),
            swa_layers=swa_layers,
            n_swa=n_swa,
            n_kv_shared=n_kv_shared,
            kv_source=kv_source,
            n_embd_per_layer=hp.integer("embedding_length_per_layer_input", 0, minimum=0,
                                        maximum=(1 << 20) // n_layer),
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            n_ff_exp=tuple(n_ff_exp),
            n_rot=n_rot,
            n_rot_swa=n_rot_swa,
            rope_base_swa=hp.number("rope.freq_base_swa", 10000.0),
            logit_softcap=hp.number("final_logit_softcapping", 0.0, inclusive=True),
        )


def _swa_layers(hp: HParams, n_layer: int) -> tuple[bool, ...]:
    """``attention.sliding_window_pattern``: a boolean per layer (local: True)."""
    value = hp.raw("attention.sliding_window_pattern", MISSING)
    if not isinstance(value, Sequence | np.ndarray) or isinstance(value, str):
        raise GGUFError(
            f"{hp.gguf.path}: {hp.key('attention.sliding_window_pattern')} must be an array "
            f"of {n_layer} booleans, got {value!r}"
        )
    flags = list(value)
    if len(flags) != n_layer or not all(isinstance(f, bool | np.bool_) or f in (0, 1)
                                        for f in flags):
        raise GGUFError(
            f"{hp.gguf.path}: {hp.key('attention.sliding_window_pattern')}: expected "
            f"{n_layer} booleans"
        )
    return tuple(bool(f) for f in flags)


def _kv_sources(
    gguf: GGUFFile, swa_layers: tuple[bool, ...], n_kv_shared: int
) -> tuple[int, ...]:
    """Per layer, the layer whose cache it attends to: itself, or for the last
    ``n_kv_shared`` layers the last layer of the same kind before them."""
    n_layer = len(swa_layers)
    first_shared = n_layer - n_kv_shared
    sources = list(range(n_layer))
    for il in range(first_shared, n_layer):
        same = [j for j in range(first_shared) if swa_layers[j] == swa_layers[il]]
        if not same:
            kind = "sliding-window" if swa_layers[il] else "global"
            raise GGUFError(
                f"{gguf.path}: layer {il} shares keys and values, but no earlier {kind} "
                "layer has them"
            )
        sources[il] = same[-1]
    return tuple(sources)
