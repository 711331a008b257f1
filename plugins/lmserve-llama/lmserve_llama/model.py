"""LlamaModel: the llama forward pass (``lmserve_llama._forward``) as a ForwardModel.

The only module that touches the family's native library: it fills the C weight table
from the GGUF, every tensor checked by the kit before a pointer reaches C.
"""

from __future__ import annotations

from typing import Any

from lmserve_core.kit import HParams, NativeForwardModel, RopeMode, rope_from_gguf

from . import _forward
from ._forward import ffi, lib
from .config import LlamaConfig


class LlamaModel(NativeForwardModel, native=_forward, config=LlamaConfig):
    """The llama forward pass over a mapped GGUF (its weights, Q5_0 aside, used in place)."""

    serves_prefix_rows = True

    config: LlamaConfig

    def setup(self) -> None:
        c = self.config
        w = self.weight_table("lm_decoder_tensors", "lm_layer_tensors", self._layer)
        # the converter permuted q and k for NORMAL (adjacent-pair) rotation; llama 3.1 has
        # per-pair frequency factors
        self.rope = rope_from_gguf(HParams(self.gguf), head_dim=c.head_dim,
                                   mode=int(RopeMode.NORMAL), freq_factors=self.rope_factors())
        self.rotary(w.rope, self.rope)
        # Extra tensors mean a variant this forward pass would silently get wrong (biases,
        # experts): the file is refused instead.
        self.refuse_unknown_tensors("llama")

        dims = ffi.new("lm_dims *")
        self.dims(dims)
        self.build(lib.llama_build, dims, w)

    def _layer(self, layer: Any, i: int, p: str) -> None:
        c = self.config
        self.attention_tensors(layer.attn, p, q_dim=c.q_dim, kv_dim=c.kv_dim)
        self.mlp_tensors(layer.ffn, p, c.n_ff)
