"""Gemma4Model: the Gemma 4 forward pass (``lmserve_gemma._forward``, gemma4_forward.c).

Fills the C weight table from the GGUF under llama.cpp's tensor names, every tensor checked by
the kit for type and shape before a pointer reaches C; a file with tensors the table does not
read is refused.
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
from .gemma4_config import Gemma4Config


class Gemma4Model(NativeForwardModel, native=_forward, config=Gemma4Config):
    """Gemma 4 over a mapped GGUF (its weights, Q5_0 aside, used in place)."""

    serves_prefix_rows = True

    config: Gemma4Config

    def setup(self) -> None:
        c = self.config
        t = self.weight_table("lm_decoder_tensors", "lm_layer_tensors", self._layer)
        w = self.keep(ffi.new("gemma4_weights *"))
        w.layers = self.layer_table("gemma4_layer", self._own)
        if c.n_embd_per_layer:
            lp = c.n_layer * c.n_embd_per_layer
            self.matrix(w.ple_token_embd, "per_layer_token_embd.weight", (c.n_vocab, lp))
            self.matrix(w.ple_model_proj, "per_layer_model_proj.weight", (lp, c.n_embd))
            w.ple_proj_norm = self.floats("per_layer_proj_norm.weight", (c.n_embd_per_layer,))
        self.diffusion_weights(w)
        self._rope(t)
        self.refuse_unknown_tensors(c.architecture)

        cfg = self.config_fields(ffi.new("gemma4_config *"), "n_layer", "n_embd", "n_vocab",
                                 "n_embd_per_layer", "n_expert", "n_expert_used", "n_swa",
                                 "rms_eps", "logit_softcap")
        moe = any(t.layers[i].ffn.ffn_gate_inp.data != ffi.NULL for i in range(c.n_layer))
        self.build(lib.gemma4_build, cfg, t, w, n_used_experts=c.n_expert_used if moe else 0)

    def _rope(self, w: Any) -> None:
        """Global layers: rope.freq_base (and its scaling) over rope.dimension_count, divided
        by the ``rope_freqs`` factors: the converter writes 1 for the rotated pairs of
        Gemma 4's proportional RoPE and 1e30 for the rest, which then stand still. Local
        layers: rope.freq_base_swa over rope.dimension_count_swa, unscaled."""
        c = self.config
        neox = int(RopeMode.NEOX)
        self.rope = rope_from_gguf(HParams(self.gguf), head_dim=c.head_dim, mode=neox,
                                   freq_factors=self.rope_factors())
        self.rotary(w.rope, self.rope)
        self.rope_swa = Rope(mode=neox, n_rot=c.n_rot_swa,
                             inv_freq=base_inv_freq(c.rope_base_swa, c.n_rot_swa))
        self.rotary(w.rope_swa, self.rope_swa)

    def _layer(self, layer: Any, il: int, p: str) -> None:
        """The kit's tensors of layer ``il``."""
        c = self.config
        hd, src = c.layer_head_dim(il), c.kv_source[il]
        n_head, n_kv = c.n_head[il], c.n_kv_head[src]
        layer.swa = int(c.swa_layers[il])
        # a layer sharing an earlier cache reads none of its own K/V weights (llama.cpp loads
        # and ignores them when a file has them); without attn_v, values are the keys
        self.attention_tensors(layer.attn, p, q_dim=n_head * hd, kv_dim=n_kv * hd, head_dim=hd,
                               fused=True, kv=c.has_kv(il), v_optional=True,
                               post_norm="post_attention_norm")
        self.mlp_tensors(layer.ffn, p, c.n_ff[il], post_norm="post_ffw_norm")
        if p + "ffn_gate_inp.weight" in self.gguf.tensors:
            if c.n_expert == 0:
                raise GGUFError(f"{self.gguf.path}: layer {il} has a router but "
                                f"{c.architecture}.expert_count is missing")
            self.moe_tensors(layer.ffn, p, n_expert=c.n_expert, n_ff=c.n_ff_exp[il], norm=None)

    def _own(self, layer: Any, il: int, p: str) -> None:
        """What is Gemma 4's own of layer ``il``: its geometry, the norms and scales around its
        experts, its per-layer input and output scale."""
        c = self.config
        d = c.n_embd
        layer.kv_source = c.kv_source[il]
        layer.n_head = c.n_head[il]
        layer.n_kv_head = c.n_kv_head[c.kv_source[il]]
        layer.head_dim = c.layer_head_dim(il)
        layer.n_ff = c.n_ff[il]
        layer.n_ff_exp = c.n_ff_exp[il]
        if p + "ffn_gate_inp.weight" in self.gguf.tensors:
            layer.ffn_gate_inp_scale = self.floats(p + "ffn_gate_inp.scale", (d,))
            layer.ffn_down_exps_scale = self.optional_floats(
                p + "ffn_down_exps.scale", (c.n_expert,)
            )
            layer.pre_ffn_norm_2 = self.floats(p + "pre_ffw_norm_2.weight", (d,))
            layer.post_ffn_norm_1 = self.floats(p + "post_ffw_norm_1.weight", (d,))
            layer.post_ffn_norm_2 = self.floats(p + "post_ffw_norm_2.weight", (d,))
        if c.n_embd_per_layer:
            pd = c.n_embd_per_layer
            self.matrix(layer.inp_gate, p + "inp_gate.weight", (pd, d))
            self.matrix(layer.proj, p + "proj.weight", (d, pd))
            layer.ple_post_norm = self.floats(p + "post_norm.weight", (d,))
        self.own_scales(layer, p)

    def diffusion_weights(self, w: Any) -> None:
        """DiffusionGemma's self-conditioning MLP (none in Gemma 4)."""

    def own_scales(self, layer: Any, p: str) -> None:
        """The layer's output scale."""
        layer.out_scale = self.optional_floats(p + "layer_output_scale.weight", (1,))
