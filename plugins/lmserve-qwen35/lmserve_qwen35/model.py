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

    def setup(self) -> None:
        c = self.config
        layers = self.keep(ffi.new("qwen35_layer[]", c.n_layer))
        for i, layer in enumerate(layers):
            self._layer(layer, i, f"blk.{i}.")
        w = self.keep(ffi.new("qwen35_weights *"))
        w.layers = layers
        self.matrix(w.token_embd, "token_embd.weight", (c.n_vocab, c.n_embd))
        w.output_norm = self.floats("output_norm.weight", (c.n_embd,))
        tied = "output.weight" not in self.gguf.tensors
        self.matrix(w.output, "token_embd.weight" if tied else "output.weight", (c.n_vocab, c.n_embd))
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
        cfg.n_expert = c.n_expert
        cfg.n_expert_used = c.n_expert_used
        cfg.expert_weights_scale = c.expert_weights_scale
        cfg.n_ff_shexp = c.n_ff_shexp
        cfg.ssm_conv_kernel = c.conv_kernel
        cfg.ssm_n_k_head = c.ssm_n_k_head
        cfg.ssm_n_v_head = c.ssm_n_v_head
        cfg.ssm_head_k = c.ssm_head_k
        cfg.ssm_head_v = c.ssm_head_v
        cfg.ssm_head_map = _GROUPED if c.architecture == "qwen3next" else _TILED
        self.build(lib.qwen35_build, cfg, w, n_used_experts=c.n_expert_used)

    def _layer(self, layer: Any, i: int, p: str) -> None:
        c = self.config
        d = c.n_embd
        layer.attn_norm = self.floats(p + "attn_norm.weight", (d,))
        layer.ffn_norm = self.floats(p + "post_attention_norm.weight", (d,))
        layer.recurrent = int(c.recurrent[i])
        if c.recurrent[i]:
            self._deltanet(layer, p)
        else:
            qd, kvd = c.q_dim, c.kv_dim
            self.matrix(layer.wq, p + "attn_q.weight", (2 * qd, d))
            self.matrix(layer.wk, p + "attn_k.weight", (kvd, d))
            self.matrix(layer.wv, p + "attn_v.weight", (kvd, d))
            self.matrix(layer.wo, p + "attn_output.weight", (d, qd))
            layer.q_norm = self.floats(p + "attn_q_norm.weight", (c.head_dim,))
            layer.k_norm = self.floats(p + "attn_k_norm.weight", (c.head_dim,))
        self._ffn(layer, p)

    def _deltanet(self, layer: Any, p: str) -> None:
        c = self.config
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

    def _ffn(self, layer: Any, p: str) -> None:
        c = self.config
        d, ff = c.n_embd, c.n_ff
        if not c.moe:
            self.matrix(layer.ffn_gate, p + "ffn_gate.weight", (ff, d))
            self.matrix(layer.ffn_up, p + "ffn_up.weight", (ff, d))
            self.matrix(layer.ffn_down, p + "ffn_down.weight", (d, ff))
            return
        e = c.n_expert
        self.matrix(layer.ffn_gate_inp, p + "ffn_gate_inp.weight", (e, d))
        if p + "ffn_gate_up_exps.weight" in self.gguf.tensors:
            self.matrix(layer.ffn_gate_up_exps, p + "ffn_gate_up_exps.weight", (e, 2 * ff, d),
                        cuts=(ff,))
        else:
            self.matrix(layer.ffn_gate_exps, p + "ffn_gate_exps.weight", (e, ff, d))
            self.matrix(layer.ffn_up_exps, p + "ffn_up_exps.weight", (e, ff, d))
        self.matrix(layer.ffn_down_exps, p + "ffn_down_exps.weight", (e, d, ff))
        if c.n_ff_shexp > 0:
            sh = c.n_ff_shexp
            gate = p + "ffn_gate_inp_shexp.weight"
            info = self.gguf.tensors.get(gate)
            # written as (n_embd,) by some converters, (1, n_embd) by others
            shape = (d,) if info is not None and len(info.shape) == 1 else (1, d)
            self.matrix(layer.ffn_gate_inp_shexp, gate, shape)
            self.matrix(layer.ffn_gate_shexp, p + "ffn_gate_shexp.weight", (sh, d))
            self.matrix(layer.ffn_up_shexp, p + "ffn_up_shexp.weight", (sh, d))
            self.matrix(layer.ffn_down_shexp, p + "ffn_down_shexp.weight", (d, sh))
