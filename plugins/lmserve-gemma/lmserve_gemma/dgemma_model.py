"""DiffusionGemmaModel: DiffusionGemma's two passes over the Gemma 4 forward (gemma4_forward.c).

The causal pass (the encoder: prompt and committed blocks, writing the KV prefix) is
Gemma 4's with the ``enc_layer_output_scale`` scalars; the denoiser's pass over a canvas
(:meth:`DiffusionGemmaModel.denoise`) attends both ways over the canvas and to the prefix,
embeds the canvas through the self-conditioning MLP and scales by ``layer_output_scale``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lmserve_core.native import kernels

from ._forward import ffi, lib
from .dgemma_config import DiffusionGemmaConfig
from .gemma4_model import Gemma4Model

# The self-conditioning input reads the whole embedding: kept decoded up to this size.
EMBEDDING_KEPT = 256 << 20
EMBEDDING_SLICE = 16384  # rows decoded at a time past it


class DiffusionGemmaModel(Gemma4Model, config=DiffusionGemmaConfig):
    """A ``diffusion-gemma`` GGUF: the causal pass is :meth:`forward`, the canvas pass
    :meth:`denoise`."""

    serves_prefix_rows = False  # its canvas passes are not a prefix-and-tokens sequence

    config: DiffusionGemmaConfig

    def diffusion_weights(self, w: Any) -> None:
        """The self-conditioning MLP into the weight struct."""
        d, f = self.config.n_embd, self.config.n_ff[0]
        w.sc_pre_norm = self.floats("self_cond_pre_norm.weight", (d,))
        self.matrix(w.sc_gate, "self_cond_gate.weight", (f, d))
        self.matrix(w.sc_up, "self_cond_up.weight", (f, d))
        self.matrix(w.sc_down, "self_cond_down.weight", (d, f))
        w.sc_n_ff = f

    def own_scales(self, layer: Any, p: str) -> None:
        """The canvas pass's and the causal pass's output scales."""
        layer.out_scale = self.optional_floats(p + "layer_output_scale.weight", (1,))
        layer.enc_out_scale = self.optional_floats(p + "enc_layer_output_scale.weight", (1,))

    def new_cache(self, n_ctx: int, kv_type: str | None = None) -> Any:
        """A cache whose sliding-window rings are reused with a canvas's margin: a canvas
        writes up to ``canvas_length`` rows past the committed ones, which take the place
        of older rows in the rings."""
        cache = super().new_cache(n_ctx, kv_type)
        cache._batch = max(0, cache._batch - self.config.canvas_length)
        return cache

    def _embedding_rows(self, first: int, n: int) -> np.ndarray:
        """Rows ``[first, first + n)`` of the token embedding as float32."""
        info = self.gguf.tensors["token_embd.weight"]
        raw = np.asarray(info.data).reshape(-1, info.row_bytes)[first : first + n]
        return kernels.dequantize_row(info.ggml_type, raw, n * self.config.n_embd).reshape(
            n, self.config.n_embd
        )

    def soft_embeddings(self, logits: np.ndarray) -> np.ndarray:
        """softmax(logits) . embedding * sqrt(n_embd) of every canvas row: the denoiser's
        self-conditioning input (transformers' ``soft_embeddings``), over the whole
        vocabulary. An embedding of at most EMBEDDING_KEPT bytes as float32 is decoded once
        and kept; a larger one is decoded a slice of rows at a time on every call."""
        z = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=-1, keepdims=True)
        n_vocab, d = self.config.n_vocab, self.config.n_embd
        if n_vocab * d * 4 <= EMBEDDING_KEPT:
            if getattr(self, "_embedding", None) is None:
                self._embedding = self._embedding_rows(0, n_vocab)
            out = p @ self._embedding
        else:
            out = np.zeros((len(p), d), np.float32)
            for v0 in range(0, n_vocab, EMBEDDING_SLICE):
                n = min(EMBEDDING_SLICE, n_vocab - v0)
                out += p[:, v0 : v0 + n] @ self._embedding_rows(v0, n)
        return out * np.float32(np.sqrt(d))

    def denoise(
        self, cache: Any, canvas: Sequence[int], pos: int, self_conditioning: np.ndarray | None
    ) -> np.ndarray:
        """The denoiser over ``canvas`` at ``pos..`` after the cache's prefix ``[0, pos)``:
        raw logits (canvas, n_vocab). ``self_conditioning``: the previous step's logits (as
        the sampler processed them), or None on the first step. Writes the canvas's cache
        rows, which the causal pass over the committed block overwrites."""
        ids, pos = self._check_call(cache, canvas, pos)
        if ids.size > self.n_batch:
            raise ValueError(f"a canvas of {ids.size} exceeds the batch of {self.n_batch}")
        soft = None
        if self_conditioning is not None:
            if self_conditioning.shape != (ids.size, self.n_vocab):
                raise ValueError(f"self-conditioning logits of shape {self_conditioning.shape}"
                                 f", expected {(ids.size, self.n_vocab)}")
            soft = np.ascontiguousarray(self.soft_embeddings(self_conditioning))
        logits = np.empty((ids.size, self.n_vocab), np.float32)
        with self._lock:
            self._require_open()
            ptr = ffi.NULL if soft is None else ffi.cast("float *", ffi.from_buffer(soft))
            kernels.check(lib.gemma4_self_condition(self._base, ptr, 0 if soft is None
                                                    else len(soft)), "self_condition")
            try:
                kernels.forward(self._core, cache.native, ids, pos, logits, True,
                                bidirectional=True)
            finally:
                lib.gemma4_self_condition(self._base, ffi.NULL, 0)
        return logits
