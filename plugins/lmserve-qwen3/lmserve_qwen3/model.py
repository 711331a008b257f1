"""Qwen3Model: the Qwen3 / Qwen3-MoE forward pass (``lmserve_qwen3._forward``).

The only module that touches the family's native library: it fills the C weight table from
the GGUF, every tensor checked by the kit for type and shape before a pointer reaches C.
"""

from __future__ import annotations

from typing import Any

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.kit import DEFAULT_BATCH, HParams, NativeForwardModel, RopeMode, rope_from_gguf

from ._forward import ffi, lib
from .config import Qwen3Config


class Qwen3Model(NativeForwardModel):
    """Qwen3 or Qwen3-MoE over a mapped GGUF (weights are never copied)."""

    def __init__(
        self,
        gguf: GGUFFile,
        config: Qwen3Config,
        *,
        n_threads: int = 0,
        n_batch: int = DEFAULT_BATCH,
        kv_type: str = "f16",
    ) -> None:
        super().__init__(
            gguf,
            ffi=ffi,
            lib=lib,
            n_vocab=config.n_vocab,
            n_ctx_train=config.n_ctx_train,
            n_threads=n_threads,
            n_batch=n_batch,
            kv_type=kv_type,
        )
        self.config = c = config
        layers = self.keep(ffi.new("qwen3_layer[]", c.n_layer))
        for i, layer in enumerate(layers):
            self._layer(layer, f"blk.{i}.", c)
        w = self.keep(ffi.new("qwen3_weights *"))
        self.matrix(w.token_embd, "token_embd.weight", (c.n_vocab, c.n_embd))
        w.layers = layers
        w.output_norm = self.floats("output_norm.weight", (c.n_embd,))
        # Qwen3-0.6B ... 4B tie the output to the embedding: no output.weight then.
        output = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        self.matrix(w.output, output, (c.n_vocab, c.n_embd))
        self.rope = rope_from_gguf(HParams(gguf), head_dim=c.head_dim, mode=int(RopeMode.NEOX))
        w.rope.mode = self.rope.mode
        w.rope.n_rot = self.rope.n_rot
        w.rope.inv_freq = self.keep(ffi.from_buffer("float[]", self.rope.inv_freq))
        w.rope.mscale = self.rope.mscale
        self.refuse_unknown_tensors(c.architecture)

        cfg = ffi.new("qwen3_config *")
        for name in ("n_layer", "n_embd", "n_head", "n_kv_head", "head_dim", "n_vocab",
                     "n_expert", "n_expert_used", "rms_eps", "expert_weights_scale"):
            setattr(cfg, name, getattr(c, name))
        self.build(
            lib.qwen3_build,
            cfg,
            w,
            cache_layers=[(c.n_kv_head, c.head_dim, c.head_dim)] * c.n_layer,
            n_used_experts=c.n_expert_used,
        )

    def _layer(self, layer: Any, p: str, c: Qwen3Config) -> None:
        d, qd, kvd, ff = c.n_embd, c.q_dim, c.kv_dim, c.n_ff
        layer.attn_norm = self.floats(p + "attn_norm.weight", (d,))
        self.matrix(layer.wq, p + "attn_q.weight", (qd, d))
        self.matrix(layer.wk, p + "attn_k.weight", (kvd, d))
        self.matrix(layer.wv, p + "attn_v.weight", (kvd, d))
        self.matrix(layer.wo, p + "attn_output.weight", (d, qd))
        layer.q_norm = self.floats(p + "attn_q_norm.weight", (c.head_dim,))
        layer.k_norm = self.floats(p + "attn_k_norm.weight", (c.head_dim,))
        layer.ffn_norm = self.floats(p + "ffn_norm.weight", (d,))
        layer.n_ff = ff
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

    @classmethod
    def load(
        cls,
        gguf: GGUFFile,
        *,
        n_threads: int = 0,
        n_batch: int = DEFAULT_BATCH,
        kv_type: str = "f16",
    ) -> Qwen3Model:
        """Build the model over an open GGUF; ``n_threads`` 0 uses every core."""
        return cls(
            gguf, Qwen3Config.from_gguf(gguf), n_threads=n_threads, n_batch=n_batch,
            kv_type=kv_type,
        )
