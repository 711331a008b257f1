"""Qwen35Model: the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next forward pass (``lmserve_qwen35._forward``).

The only module that touches the family's native library: it fills the C weight table from
the GGUF, every tensor checked by the kit for type and shape before a pointer reaches C.
"""

from __future__ import annotations

from typing import Any

from lmserve_core.gguf_file import GGUFError
from lmserve_core.kit import HParams, NativeForwardModel, RopeMode, rope_from_gguf

from . import _forward
from ._forward import ffi, lib
from .config import Qwen35Config

# How the converter orders a DeltaNet layer's value heads: Qwen3.5's tiles them over the key
# heads (value head j reads key head j % n_k), Qwen3-Next's keeps them grouped (j // r).
_TILED, _GROUPED = 0, 1


class Qwen35Model(NativeForwardModel, native=_forward, config=Qwen35Config):
    """A hybrid DeltaNet / attention Qwen over a mapped GGUF."""

    config: Qwen35Config
    checkpoints_in_pass = True  # its recurrent layers are the kit's DeltaNet mixer

    def setup(self) -> None:
        c = self.config
        w = self.weight_table("lm_decoder_tensors", "lm_layer_tensors", self._layer)
        delta = self.layer_table("qwen35_deltanet", self._deltanet)
        self.rope = rope_from_gguf(HParams(self.gguf), head_dim=c.head_dim, mode=int(RopeMode.NEOX))
        if c.rope_sections and 2 * sum(c.rope_sections) > self.rope.n_rot:
            raise GGUFError(
                f"{self.gguf.path}: rope.dimension_sections {list(c.rope_sections)} exceed "
                f"the {self.rope.n_rot} rotated dims"
            )
        self.rotary(w.rope, self.rope)
        # multi-token-prediction layers follow the decoder's: loaded, not run
        for name in self.gguf.tensors:
            if name.startswith("blk.") and int(name.split(".")[1]) >= c.n_layer:
                self.use(name)
        self.refuse_unknown_tensors(c.architecture)

        cfg = ffi.new("qwen35_config *")
        self.dims(cfg.dims)
        self.config_fields(cfg, "n_expert", "n_expert_used", "expert_weights_scale", "n_ff_shexp",
                           "ssm_n_k_head", "ssm_n_v_head", "ssm_head_k", "ssm_head_v")
        cfg.ssm_conv_kernel = c.conv_kernel
        cfg.ssm_head_map = _GROUPED if c.architecture == "qwen3next" else _TILED
        self.build(lib.qwen35_build, cfg, w, delta, n_used_experts=c.n_expert_used)

    def _layer(self, layer: Any, i: int, p: str) -> None:
        c = self.config
        if c.recurrent[i]:
            layer.attn.attn_norm = self.floats(p + "attn_norm.weight", (c.n_embd,))
        else:
            self.attention_tensors(layer.attn, p, q_dim=c.q_dim, kv_dim=c.kv_dim,
                                   head_dim=c.head_dim, gated=True)
        # the norm before the feed-forward is post_attention_norm
        if c.moe:
            self.moe_tensors(layer.ffn, p, n_expert=c.n_expert, n_ff=c.n_ff,
                             n_ff_shexp=c.n_ff_shexp, norm="post_attention_norm")
        else:
            self.mlp_tensors(layer.ffn, p, c.n_ff, norm="post_attention_norm")

    def _deltanet(self, layer: Any, i: int, p: str) -> None:
        c = self.config
        layer.recurrent = int(c.recurrent[i])
        if not c.recurrent[i]:
            return
        d, nv = c.n_embd, c.ssm_n_v_head
        vd = nv * c.ssm_head_v
        if p + "ssm_in.weight" in self.gguf.tensors:
            raise GGUFError(
                f"{self.gguf.path}: {p}ssm_in (a fused q/k/v/z projection of older Qwen3-Next "
                "conversions) is not supported: convert the model again"
            )
        self.matrix(layer.wqkv, p + "attn_qkv.weight", (c.conv_dim, d))
        self.matrix(layer.wgate, p + "attn_gate.weight", (vd, d))
        if p + "ssm_ba.weight" in self.gguf.tensors:
            self.matrix(layer.wba, p + "ssm_ba.weight", (2 * nv, d))
        else:
            self.matrix(layer.wbeta, p + "ssm_beta.weight", (nv, d))
            self.matrix(layer.walpha, p + "ssm_alpha.weight", (nv, d))
        self.matrix(layer.ssm_out, p + "ssm_out.weight", (d, vd))
        layer.ssm_conv = self.floats(p + "ssm_conv1d.weight", (c.conv_dim, c.conv_kernel))
        layer.ssm_a = self.floats(p + "ssm_a", (nv,))
        layer.ssm_dt = self.floats(p + "ssm_dt.bias", (nv,))
        layer.ssm_norm = self.floats(p + "ssm_norm.weight", (c.ssm_head_v,))
