"""LlamaModel: the llama forward pass (``lmserve_llama._forward``) as a ForwardModel.

This is the only module that touches the family's native library: it fills the C weight
table from the GGUF (every tensor checked by the kit before a pointer reaches C).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.kit import (
    DEFAULT_BATCH,
    HParams,
    NativeForwardModel,
    QuantType,
    RopeMode,
    rope_from_gguf,
)

from ._forward import ffi, lib
from .config import LlamaConfig


class LlamaModel(NativeForwardModel):
    """The llama forward pass over a mapped GGUF (weights are never copied)."""

    def __init__(
        self,
        gguf: GGUFFile,
        config: LlamaConfig,
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
        self.config = config
        d, ff, qd, kvd = config.n_embd, config.n_ff, config.q_dim, config.kv_dim
        layers = self.keep(ffi.new("llama_layer[]", config.n_layer))
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
        self.matrix(w.token_embd, "token_embd.weight", (config.n_vocab, d))
        w.layers = layers
        w.output_norm = self.floats("output_norm.weight", (d,))
        output = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        self.matrix(w.output, output, (config.n_vocab, d))
        self._rope(w.rope, config)
        # Extra tensors mean a variant this forward pass would silently get wrong (biases,
        # experts): refuse the file instead.
        self.refuse_unknown_tensors("llama")

        cfg = ffi.new("llama_config *")
        for name in ("n_layer", "n_embd", "n_ff", "n_head", "n_kv_head", "head_dim", "n_vocab"):
            setattr(cfg, name, getattr(config, name))
        cfg.rms_eps = config.rms_eps
        geometry = [(config.n_kv_head, config.head_dim, config.head_dim)] * config.n_layer
        self.build(lib.llama_build, cfg, w, cache_layers=geometry)

    def _rope(self, field: Any, config: LlamaConfig) -> None:
        factors = None
        if "rope_freqs.weight" in self.gguf.tensors:  # llama 3.1 frequency factors
            info = self.gguf.require("rope_freqs.weight", ggml_types=(int(QuantType.F32),))
            factors = info.data.view(np.float32)  # rope_from_gguf checks the count
            self.use("rope_freqs.weight")
        rope = rope_from_gguf(
            HParams(self.gguf), head_dim=config.head_dim, mode=int(RopeMode.NORMAL),
            freq_factors=factors,
        )
        self.rope = rope
        field.mode = rope.mode
        field.n_rot = rope.n_rot
        field.inv_freq = self.keep(ffi.from_buffer("float[]", rope.inv_freq))
        field.mscale = rope.mscale

    @classmethod
    def load(
        cls,
        gguf: GGUFFile,
        *,
        n_threads: int = 0,
        n_batch: int = DEFAULT_BATCH,
        kv_type: str = "f16",
    ) -> LlamaModel:
        """Build the model over an open GGUF; ``n_threads`` 0 uses every core."""
        return cls(
            gguf, LlamaConfig.from_gguf(gguf), n_threads=n_threads, n_batch=n_batch,
            kv_type=kv_type,
        )
