"""Gemma3Model: the Gemma 3 forward pass (``lmserve_gemma._forward``).

The only module that touches the family's native library for Gemma 3: it fills the C weight
table from the GGUF, every tensor checked by the kit for type and shape before a pointer
reaches C.
"""

from __future__ import annotations

from typing import Any

from lmserve_core.gguf_file import GGUFError
from lmserve_core.kit import (
    HParams,
    NativeForwardModel,
    Rope,
    RopeMode,
    base_inv_freq,
    rope_from_gguf,
)

from . import _forward
from ._forward import ffi, lib
from .config import Gemma3Config


class Gemma3Model(NativeForwardModel, native=_forward, config=Gemma3Config):
    """Gemma 3 over a mapped GGUF (its weights, Q5_0 aside, used in place)."""

    serves_prefix_rows = True

    config: Gemma3Config

    def setup(self) -> None:
        c = self.config
        if any(name.startswith("dense_") for name in self.gguf.tensors):
            # EmbeddingGemma's projection heads: an encoder, not a chat model
            raise GGUFError("a Gemma 3 GGUF with dense_2/dense_3 projections (an embedding "
                            "model) is not served")
        w = self.weight_table("lm_decoder_tensors", "lm_layer_tensors", self._layer)
        neox = int(RopeMode.NEOX)
        self.rope = rope_from_gguf(HParams(self.gguf), head_dim=c.head_dim, mode=neox)
        self.rotary(w.rope, self.rope)
        # local layers: their own base, no scaling, every dimension rotated
        self.rope_swa = Rope(mode=neox, n_rot=c.head_dim,
                             inv_freq=base_inv_freq(c.rope_base_swa, c.head_dim))
        self.rotary(w.rope_swa, self.rope_swa)
        self.refuse_unknown_tensors(c.architecture)

        cfg = ffi.new("gemma3_config *")
        self.dims(cfg.dims)
        self.config_fields(cfg, "n_swa", "attn_scale", "logit_softcap")
        self.build(lib.gemma3_build, cfg, w)

    def _layer(self, layer: Any, i: int, p: str) -> None:
        c = self.config
        layer.swa = int(c.swa_layers[i])
        self.attention_tensors(layer.attn, p, q_dim=c.q_dim, kv_dim=c.kv_dim,
                               head_dim=c.head_dim, post_norm="post_attention_norm")
        self.mlp_tensors(layer.ffn, p, c.n_ff, post_norm="post_ffw_norm")
