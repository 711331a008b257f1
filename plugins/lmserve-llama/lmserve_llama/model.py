"""LlamaModel: the llama forward pass (``lmserve_llama._forward``) as a ForwardModel.

The only module that touches the family's native library: it fills the C weight table
from the GGUF, every tensor checked by the kit before a pointer reaches C.
"""

from __future__ import annotations

import numpy as np

from lmserve_core.kit import HParams, NativeForwardModel, QuantType, RopeMode, rope_from_gguf

from . import _forward
from ._forward import ffi, lib
from .config import LlamaConfig


class LlamaModel(NativeForwardModel, native=_forward, config=LlamaConfig):
    """The llama forward pass over a mapped GGUF (its weights, Q5_0 aside, used in place)."""

    config: LlamaConfig

    def setup(self) -> None:
        c, gguf = self.config, self.gguf
        d, ff, qd, kvd = c.n_embd, c.n_ff, c.q_dim, c.kv_dim
        layers = self.keep(ffi.new("llama_layer[]", c.n_layer))
        for i, layer in enumerate(layers):
            p = f"blk.{i}."
            layer.attn_norm = self.floats(p + "attn_norm.weight", (d,))
            self.matrix(layer.wq, p + "attn_q.weight", (qd, d))
            self.matrix(layer.wk, p + "attn_k.weight", (kvd, d))
            self.matrix(layer.wv, p + "attn_v.weight", (kvd, d))
            self.matrix(layer.wo, p + "attn_output.weight", (d, qd))
            layer.ffn_norm = self.floats(p + "ffn_norm.weight", (d,))
            self.matrix(layer.w_gate, p + "ffn_gate.weight", (ff, d))
            self.matrix(layer.w_up, p + "ffn_up.weight", (ff, d))
            self.matrix(layer.w_down, p + "ffn_down.weight", (d, ff))
        w = self.keep(ffi.new("llama_weights *"))
        self.matrix(w.token_embd, "token_embd.weight", (c.n_vocab, d))
        w.layers = layers
        w.output_norm = self.floats("output_norm.weight", (d,))
        output = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        self.matrix(w.output, output, (c.n_vocab, d))
        factors = None
        if "rope_freqs.weight" in gguf.tensors:  # llama 3.1 frequency factors
            info = gguf.require("rope_freqs.weight", ggml_types=(int(QuantType.F32),))
            factors = info.data.view(np.float32)  # rope_from_gguf checks the count
            self.use("rope_freqs.weight")
        # the converter permuted q and k for NORMAL (adjacent-pair) rotation
        self.rope = rope_from_gguf(
            HParams(gguf), head_dim=c.head_dim, mode=int(RopeMode.NORMAL), freq_factors=factors
        )
        self.rotary(w.rope, self.rope)
        # Extra tensors mean a variant this forward pass would silently get wrong (biases,
        # experts): the file is refused instead.
        self.refuse_unknown_tensors("llama")

        dims = ffi.new("lm_dims *")
        self.dims(dims)
        self.build(lib.llama_build, dims, w)
