"""Gemma4Model: the Gemma 4 forward pass (``lmserve_gemma._forward``, gemma4_forward.c).

Fills the C weight table from the GGUF under llama.cpp's tensor names, every tensor checked by
the kit for type and shape before a pointer reaches C; a file with tensors the table does not
read is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmserve_core.gguf_file import GGUFError
from lmserve_core.kit import (
    HParams,
    NativeForwardModel,
    QuantType,
    Rope,
    RopeMode,
    base_inv_freq,
    rope_from_gguf,
)

from . import _forward
from ._forward import ffi, lib
from .gemma4_config import Gemma4Config


class Gemma4Model(NativeForwardModel, native=_forward, config=Gemma4Config):
    """Gemma 4 over a mapped GGUF (its weights, Q5_0 aside, used in place)."""

    config: Gemma4Config

    def setup(self) -> None:
        c = self.config
        layers = self.keep(ffi.new("gemma4_layer[]", c.n_layer))
        for i, layer in enumerate(layers):
            self._layer(layer, i)
        w = self.keep(ffi.new("gemma4_weights *"))
        w.layers = layers
        d = c.n_embd
        self.matrix(w.token_embd, "token_embd.weight", (c.n_vocab, d))
        w.output_norm = self.floats("output_norm.weight", (d,))
        tied = "output.weight" not in self.gguf.tensors
        self.matrix(w.output, "token_embd.weight" if tied else "output.weight", (c.n_vocab, d))
        if c.n_embd_per_layer:
            lp = c.n_layer * c.n_embd_per_layer
            self.matrix(w.ple_token_embd, "per_layer_token_embd.weight", (c.n_vocab, lp))
            self.matrix(w.ple_model_proj, "per_layer_model_proj.weight", (lp, d))
            w.ple_proj_norm = self.floats("per_layer_proj_norm.weight", (c.n_embd_per_layer,))
        self._rope(w)
        self.refuse_unknown_tensors(c.architecture)

        cfg = ffi.new("gemma4_config *")
        cfg.n_layer = c.n_layer
        cfg.n_embd = c.n_embd
        cfg.n_vocab = c.n_vocab
        cfg.n_embd_per_layer = c.n_embd_per_layer
        cfg.n_expert = c.n_expert
        cfg.n_expert_used = c.n_expert_used
        cfg.n_swa = c.n_swa
        cfg.rms_eps = c.rms_eps
        cfg.logit_softcap = c.logit_softcap
        moe = any(layer.ffn_gate_inp.data != ffi.NULL for layer in layers)
        self.build(lib.gemma4_build, cfg, w, n_used_experts=c.n_expert_used if moe else 0)

    def _rope(self, w: Any) -> None:
        """Global layers: rope.freq_base (and its scaling) over rope.dimension_count, divided
        by the ``rope_freqs`` factors: the converter writes 1 for the rotated pairs of
        Gemma 4's proportional RoPE and 1e30 for the rest, which then stand still. Local
        layers: rope.freq_base_swa over rope.dimension_count_swa, unscaled."""
        c = self.config
        neox = int(RopeMode.NEOX)
        factors = None
        if "rope_freqs.weight" in self.gguf.tensors:
            info = self.gguf.require("rope_freqs.weight", ggml_types=(int(QuantType.F32),))
            factors = info.data.view(np.float32)  # rope_from_gguf checks the count
            self.use("rope_freqs.weight")
        self.rope = rope_from_gguf(HParams(self.gguf), head_dim=c.head_dim, mode=neox,
                                   freq_factors=factors)
        self.rotary(w.rope, self.rope)
        self.rope_swa = Rope(mode=neox, n_rot=c.n_rot_swa,
                             inv_freq=base_inv_freq(c.rope_base_swa, c.n_rot_swa))
        self.rotary(w.rope_swa, self.rope_swa)

    def _layer(self, layer: Any, il: int) -> None:
        c = self.config
        p = f"blk.{il}."
        has = self.gguf.tensors.__contains__
        d, hd, src = c.n_embd, c.layer_head_dim(il), c.kv_source[il]
        n_head, n_kv = c.n_head[il], c.n_kv_head[src]
        qd, kvd, ff = n_head * hd, n_kv * hd, c.n_ff[il]
        own = c.has_kv(il)
        layer.swa = int(c.swa_layers[il])
        layer.kv_source = src
        layer.n_head = n_head
        layer.n_kv_head = n_kv
        layer.head_dim = hd
        layer.n_ff = ff
        layer.n_ff_exp = c.n_ff_exp[il]

        layer.attn_norm = self.floats(p + "attn_norm.weight", (d,))
        if has(p + "attn_qkv.weight"):
            self.matrix(layer.wqkv, p + "attn_qkv.weight", (qd + 2 * kvd, d), cuts=(qd, qd + kvd))
        else:
            self.matrix(layer.wq, p + "attn_q.weight", (qd, d))
            if own:
                self.matrix(layer.wk, p + "attn_k.weight", (kvd, d))
                if has(p + "attn_v.weight"):  # absent: values are the key projection
                    self.matrix(layer.wv, p + "attn_v.weight", (kvd, d))
        self.matrix(layer.wo, p + "attn_output.weight", (d, qd))
        layer.q_norm = self.floats(p + "attn_q_norm.weight", (hd,))
        if own:
            layer.k_norm = self.floats(p + "attn_k_norm.weight", (hd,))
        else:
            # a layer sharing an earlier cache reads none of its own K/V weights (llama.cpp
            # loads and ignores them when a file has them)
            for name in ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight"):
                if has(p + name):
                    self.use(p + name)
        layer.post_attn_norm = self.floats(p + "post_attention_norm.weight", (d,))

        layer.ffn_norm = self.floats(p + "ffn_norm.weight", (d,))
        self.matrix(layer.ffn_gate, p + "ffn_gate.weight", (ff, d))
        self.matrix(layer.ffn_up, p + "ffn_up.weight", (ff, d))
        self.matrix(layer.ffn_down, p + "ffn_down.weight", (d, ff))
        layer.post_ffn_norm = self.floats(p + "post_ffw_norm.weight", (d,))
        if has(p + "ffn_gate_inp.weight"):
            self._experts(layer, p, il)

        if c.n_embd_per_layer:
            pd = c.n_embd_per_layer
            self.matrix(layer.inp_gate, p + "inp_gate.weight", (pd, d))
            self.matrix(layer.proj, p + "proj.weight", (d, pd))
            layer.ple_post_norm = self.floats(p + "post_norm.weight", (d,))
        layer.out_scale = self.optional_floats(p + "layer_output_scale.weight", (1,))

    def _experts(self, layer: Any, p: str, il: int) -> None:
        c = self.config
        if c.n_expert == 0:
            raise GGUFError(f"{self.gguf.path}: layer {il} has a router but "
                            f"{c.architecture}.expert_count is missing")
        d, e, ff = c.n_embd, c.n_expert, c.n_ff_exp[il]
        self.matrix(layer.ffn_gate_inp, p + "ffn_gate_inp.weight", (e, d))
        layer.ffn_gate_inp_scale = self.floats(p + "ffn_gate_inp.scale", (d,))
        layer.pre_ffn_norm_2 = self.floats(p + "pre_ffw_norm_2.weight", (d,))
        layer.post_ffn_norm_1 = self.floats(p + "post_ffw_norm_1.weight", (d,))
        layer.post_ffn_norm_2 = self.floats(p + "post_ffw_norm_2.weight", (d,))
        if p + "ffn_gate_up_exps.weight" in self.gguf.tensors:
            self.matrix(layer.ffn_gate_up_exps, p + "ffn_gate_up_exps.weight", (e, 2 * ff, d),
                        cuts=(ff,))
        else:
            self.matrix(layer.ffn_gate_exps, p + "ffn_gate_exps.weight", (e, ff, d))
            self.matrix(layer.ffn_up_exps, p + "ffn_up_exps.weight", (e, ff, d))
        self.matrix(layer.ffn_down_exps, p + "ffn_down_exps.weight", (e, d, ff))
        layer.ffn_down_exps_scale = self.optional_floats(p + "ffn_down_exps.scale", (e,))
