"""InklingModel: the Inkling forward pass (``lmserve_inkling._forward``) as a ForwardModel.

The only module that touches the family's native library: it fills the C weight table from
the GGUF, every tensor checked by the kit before a pointer reaches C.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmserve_core.kit import NativeForwardModel
from lmserve_core.native import kernels

from . import _forward
from ._forward import ffi, lib
from .config import InklingConfig


class InklingModel(NativeForwardModel, native=_forward, config=InklingConfig):
    """The Inkling forward pass over a mapped GGUF."""

    config: InklingConfig
    checkpoints_in_pass = True  # its convolutions keep the planned snapshots as they pass

    def setup(self) -> None:
        c = self.config
        w = self.keep(ffi.new("inkling_weights *"))
        self.io_tensors(w.io)
        w.token_embd_norm = self.floats("token_embd_norm.weight", (c.n_embd,))
        w.layers = self.layer_table("inkling_layer", self._layer)
        self.refuse_unknown_tensors("inkling")

        cfg = ffi.new("inkling_config *")
        self.dims(cfg.dims)
        self.config_fields(cfg, "n_dense", "window", "rel_extent", "rel_extent_swa", "d_rel",
                           "conv_kernel", "n_expert", "n_expert_used", "n_shared", "n_ff_exp",
                           "route_scale", "n_vocab_unpadded", "log_n_floor", "log_alpha")
        cfg.logit_scale = 1.0 / c.logit_scale_denom
        self.build(lib.inkling_build, cfg, w, n_used_experts=c.n_expert_used)
        # the logits cover the unpadded vocabulary (the tables' padding rows are never read)
        self.n_vocab = c.n_vocab_unpadded

    def _f32(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        info = self.gguf.require(name, ggml_types=kernels.MATRIX_TYPES, shape=shape)
        self.use(name)
        return np.asarray(
            kernels.dequantize_row(info.ggml_type, info.data, info.n_elements), np.float32
        ).reshape(shape)

    def _layer(self, L: Any, i: int, p: str) -> None:
        c = self.config
        D, H, HD, R, K = c.n_embd, c.n_head, c.head_dim, c.d_rel, c.conv_kernel
        kvd = c.kv_heads[i] * HD
        extent = c.rel_extent_swa if c.swa[i] else c.rel_extent
        L.swa = int(c.swa[i])
        L.n_kv_head = c.kv_heads[i]
        L.attn_norm = self.floats(p + "attn_norm.weight", (D,))
        self.matrix(L.wq, p + "attn_q.weight", (H * HD, D))
        self.matrix(L.wk, p + "attn_k.weight", (kvd, D))
        self.matrix(L.wv, p + "attn_v.weight", (kvd, D))
        self.matrix(L.wr, p + "attn_r.weight", (H * R, D))
        self.matrix(L.wo, p + "attn_output.weight", (D, H * HD))
        L.q_norm = self.floats(p + "attn_q_norm.weight", (HD,))
        L.k_norm = self.floats(p + "attn_k_norm.weight", (HD,))
        # the bank's shape says which kind of layer it is: a pattern read the wrong way round
        # is a load error
        rel = np.ascontiguousarray(self._f32(p + "attn_rel_proj.weight", (R, extent)).T)
        L.rel_proj_t = self.keep(ffi.from_buffer("float[]", rel))
        self.keep(rel)
        L.conv_k = self.floats(p + "shortconv_k.weight", (kvd, K))
        L.conv_v = self.floats(p + "shortconv_v.weight", (kvd, K))
        L.conv_attn = self.floats(p + "shortconv_attn.weight", (D, K))
        L.conv_mlp = self.floats(p + "shortconv_mlp.weight", (D, K))
        L.ffn_norm = self.floats(p + "ffn_norm.weight", (D,))
        L.gscale = self.floats(p + "ffn_gscale.weight", (1,))
        if i < c.n_dense:
            self.mlp_tensors(L, p, c.n_ff, norm=None)
            return
        E, S, F = c.n_expert, c.n_shared, c.n_ff_exp
        self.matrix(L.router, p + "ffn_gate_inp.weight", (E + S, D))
        L.router_bias = self.floats(p + "exp_probs_b.bias", (E,))
        self.matrix(L.gate_exps, p + "ffn_gate_exps.weight", (E, F, D))
        self.matrix(L.up_exps, p + "ffn_up_exps.weight", (E, F, D))
        self.matrix(L.down_exps, p + "ffn_down_exps.weight", (E, D, F))
        self.matrix(L.gate_shexp, p + "ffn_gate_shexp.weight", (S, F, D))
        self.matrix(L.up_shexp, p + "ffn_up_shexp.weight", (S, F, D))
        self.matrix(L.down_shexp, p + "ffn_down_shexp.weight", (S, D, F))
