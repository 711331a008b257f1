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

    config: Gemma3Config

    def setup(self) -> None:
        c = self.config
        if any(name.startswith("dense_") for name in self.gguf.tensors):
            # EmbeddingGemma's projection heads: an encoder, not a chat model
            raise GGUFError("a Gemma 3 GGUF with dense_2/dense_3 projections (an embedding "
                            "model) is not served")
        layers = self.keep(ffi.new("gemma3_layer[]", c.n_layer))
        for i, layer in enumerate(layers):
            self._layer(layer, f"blk.{i}.")
            layer.swa = int(c.swa_layers[i])
        w = self.keep(ffi.new("gemma3_weights *"))
        w.layers = layers
        self.matrix(w.token_embd, "token_embd.weight", (c.n_vocab, c.n_embd))
        w.output_norm = self.floats("output_norm.weight", (c.n_embd,))
        tied = "output.weight" not in self.gguf.tensors
        self.matrix(w.output, "token_embd.weight" if tied else "output.weight", (c.n_vocab, c.n_embd))
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
        cfg.n_swa = c.n_swa
        cfg.attn_scale = c.attn_scale
        cfg.logit_softcap = c.logit_softcap
        self.build(lib.gemma3_build, cfg, w)

    def _layer(self, layer: Any, p: str) -> None:
        c = self.config
        d, qd, kvd, ff = c.n_embd, c.q_dim, c.kv_dim, c.n_ff
        layer.attn_norm = self.floats(p + "attn_norm.weight", (d,))
        self.matrix(layer.wq, p + "attn_q.weight", (qd, d))
        self.matrix(layer.wk, p + "attn_k.weight", (kvd, d))
        self.matrix(layer.wv, p + "attn_v.weight", (kvd, d))
        self.matrix(layer.wo, p + "attn_output.weight", (d, qd))
        layer.q_norm = self.floats(p + "attn_q_norm.weight", (c.head_dim,))
        layer.k_norm = self.floats(p + "attn_k_norm.weight", (c.head_dim,))
        layer.post_attn_norm = self.floats(p + "post_attention_norm.weight", (d,))
        layer.ffn_norm = self.floats(p + "ffn_norm.weight", (d,))
        self.matrix(layer.ffn_gate, p + "ffn_gate.weight", (ff, d))
        self.matrix(layer.ffn_up, p + "ffn_up.weight", (ff, d))
        self.matrix(layer.ffn_down, p + "ffn_down.weight", (d, ff))
        layer.post_ffn_norm = self.floats(p + "post_ffw_norm.weight", (d,))
