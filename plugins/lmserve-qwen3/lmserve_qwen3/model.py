"""Qwen3Model: the Qwen3 / Qwen3-MoE forward pass (``lmserve_qwen3._forward``).

The only module that touches the family's native library: it fills the C weight table from
the GGUF, every tensor checked by the kit for type and shape before a pointer reaches C.
"""

from __future__ import annotations

from typing import Any

from lmserve_core.kit import HParams, NativeForwardModel, RopeMode, rope_from_gguf

from . import _forward
from ._forward import ffi, lib
from .config import Qwen3Config


class Qwen3Model(NativeForwardModel, native=_forward, config=Qwen3Config):
    """Qwen3 or Qwen3-MoE over a mapped GGUF (its weights, Q5_0 aside, used in place)."""

    config: Qwen3Config

    def setup(self) -> None:
        c = self.config
        layers = self.keep(ffi.new("qwen3_layer[]", c.n_layer))
        for i, layer in enumerate(layers):
            self._layer(layer, f"blk.{i}.")
        w = self.keep(ffi.new("qwen3_weights *"))
        w.layers = layers
        self.matrix(w.token_embd, "token_embd.weight", (c.n_vocab, c.n_embd))
        w.output_norm = self.floats("output_norm.weight", (c.n_embd,))
        # Qwen3-0.6B ... 4B tie the output to the embedding: no output.weight then.
        tied = "output.weight" not in self.gguf.tensors
        self.matrix(w.output, "token_embd.weight" if tied else "output.weight", (c.n_vocab, c.n_embd))
        self.rope = rope_from_gguf(HParams(self.gguf), head_dim=c.head_dim, mode=int(RopeMode.NEOX))
        self.rotary(w.rope, self.rope)
        self.refuse_unknown_tensors(c.architecture)

        cfg = ffi.new("qwen3_config *")
        self.dims(cfg.dims)
        cfg.n_expert = c.n_expert
        cfg.n_expert_used = c.n_expert_used
        cfg.expert_weights_scale = c.expert_weights_scale
        self.build(lib.qwen3_build, cfg, w, n_used_experts=c.n_expert_used)

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
        layer.ffn_norm = self.floats(p + "ffn_norm.weight", (d,))
        if c.moe:
            e = c.n_expert
            self.matrix(layer.ffn_gate_inp, p + "ffn_gate_inp.weight", (e, d))
            self.matrix(layer.ffn_gate_exps, p + "ffn_gate_exps.weight", (e, ff, d))
            self.matrix(layer.ffn_up_exps, p + "ffn_up_exps.weight", (e, ff, d))
            self.matrix(layer.ffn_down_exps, p + "ffn_down_exps.weight", (e, d, ff))
        else:
            self.matrix(layer.ffn_gate, p + "ffn_gate.weight", (ff, d))
            self.matrix(layer.ffn_up, p + "ffn_up.weight", (ff, d))
            self.matrix(layer.ffn_down, p + "ffn_down.weight", (d, ff))
