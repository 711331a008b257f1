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

    serves_prefix_rows = True

    config: Qwen3Config

    def setup(self) -> None:
        c = self.config
        w = self.weight_table("lm_decoder_tensors", "lm_layer_tensors", self._layer)
        self.rope = rope_from_gguf(HParams(self.gguf), head_dim=c.head_dim, mode=int(RopeMode.NEOX))
        self.rotary(w.rope, self.rope)
        self.refuse_unknown_tensors(c.architecture)

        cfg = ffi.new("qwen3_config *")
        self.dims(cfg.dims)
        self.config_fields(cfg, "n_expert", "n_expert_used", "expert_weights_scale")
        self.build(lib.qwen3_build, cfg, w, n_used_experts=c.n_expert_used)

    def _layer(self, layer: Any, i: int, p: str) -> None:
        c = self.config
        self.attention_tensors(layer.attn, p, q_dim=c.q_dim, kv_dim=c.kv_dim, head_dim=c.head_dim)
        if c.moe:
            self.moe_tensors(layer.ffn, p, n_expert=c.n_expert, n_ff=c.n_ff)
        else:
            self.mlp_tensors(layer.ffn, p, c.n_ff)
