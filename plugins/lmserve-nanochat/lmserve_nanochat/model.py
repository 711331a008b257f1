"""NanochatModel: nanochat's forward pass (``lmserve_nanochat._forward``) as a ForwardModel.

The only module that touches the family's native library: it fills the C weight tables from
the view :func:`lmserve_nanochat.view.build_view` makes, every tensor checked by the kit
before a pointer reaches C.

The smear mixes each token's embedding with the previous token's, and the previous token
of a chunk's first row lies outside the chunk (a decode step, a prompt continued after a
reused prefix). Every cache of this model (:class:`NanochatCache`) therefore keeps the token
id of every position it holds: forward and forward_batch write them, copy_rows copies them
with the rows, snapshot / restore carry them after the rows' bytes (the disk tier), and a
speculative rollback (a forward at an earlier position) needs nothing: the positions before
it keep their tokens. Before each call the model hands the C side, per sequence, the token
at ``pos - 1`` (``nanochat_previous``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.kit import DecoderConfig, NativeForwardModel
from lmserve_core.kit.forward import NativeCache
from lmserve_core.kit.rope import NEOX, Rope, base_inv_freq
from lmserve_core.native import kernels

from . import _forward
from ._forward import ffi, lib
from .config import NanochatConfig
from .view import ARCHITECTURE, config_from_view

__all__ = ["NanochatCache", "NanochatModel", "NanochatModelConfig"]


@dataclass(frozen=True, slots=True)
class NanochatModelConfig(DecoderConfig):
    """The kit's decoder sizes of a nanochat view, and its NanochatConfig."""

    nanochat: NanochatConfig | None = None

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> NanochatModelConfig:
        c = config_from_view(gguf)
        return cls(
            architecture=ARCHITECTURE,
            n_layer=c.n_layer,
            n_embd=c.n_embd,
            n_head=c.n_head,
            n_kv_head=c.n_kv_head,
            head_dim=c.head_dim,
            n_ff=c.n_ff,
            n_vocab=c.vocab_size,
            n_ctx_train=c.sequence_len,
            rms_eps=c.norm_eps,
            nanochat=c,
        )


class NanochatCache(NativeCache):
    """A KV cache that also keeps the token id of every position (the smear reads the one
    before a chunk)."""

    def __init__(self, model: NativeForwardModel, n_ctx: int, kv_type: str) -> None:
        super().__init__(model, n_ctx, kv_type)
        self.tokens = np.zeros(n_ctx, np.int32)

    def snapshot(self, n: int) -> npt.NDArray[np.uint8]:
        """The rows of positions [0, n), then their token ids (int32)."""
        return np.concatenate([super().snapshot(n), self.tokens[:n].view(np.uint8)])

    def restore(self, n: int, state: npt.ArrayLike) -> None:
        """Load what :meth:`snapshot` saved."""
        raw = np.asarray(state, np.uint8).reshape(-1)
        if raw.size < 4 * n:
            raise ValueError("a nanochat cache state too short for its tokens")
        ids = np.frombuffer(raw[raw.size - 4 * n :].tobytes(), np.int32)
        if n and (int(ids.min()) < 0 or int(ids.max()) >= self.model.n_vocab):
            raise ValueError("a nanochat cache state with token ids out of range")
        super().restore(n, raw[: raw.size - 4 * n])
        self.tokens[:n] = ids


class NanochatModel(NativeForwardModel, native=_forward, config=NanochatModelConfig):
    """nanochat's GPT over a :func:`~lmserve_nanochat.view.build_view` view::

        model = NanochatModel.load(build_view(config, tensors, path=path), n_threads=2)
        cache = model.new_cache(256)
        logits = model.forward(cache, ids, 0)
    """

    config: NanochatModelConfig

    def setup(self) -> None:
        c = self.config.nanochat
        assert c is not None
        self._calls = threading.Lock()  # the previous-token table, then the forward it serves
        hd = c.head_dim
        tensors = self.keep(ffi.new("lm_decoder_tensors *"))
        # q and k: the weightless per-head norm, then times qk_scale
        self._qk_scale = self.keep(ffi.new("float[]", [c.qk_scale] * hd))
        own = self.keep(ffi.new("nanochat_layer[]", c.n_layer))
        self._own = own
        tensors.layers = self.layer_table("lm_layer_tensors", self._layer)
        self.io_tensors(tensors.io, output_norm=False)
        self.rope = Rope(mode=NEOX, n_rot=hd, inv_freq=base_inv_freq(c.rope_theta, hd))
        self.rotary(tensors.rope, self.rope)

        weights = self.keep(ffi.new("nanochat_weights *"))
        weights.layers = own
        cfg = self.keep(ffi.new("nanochat_config *"))
        self.dims(cfg.dims)
        self._windows = self.keep(ffi.new("int64_t[]", list(c.windows)))
        cfg.windows = self._windows
        cfg.logit_softcap = c.logit_softcap
        cfg.backout_layer = c.backout_layer
        cfg.ve_gate_cols = c.ve_gate_channels
        cfg.ve_gate_scale = c.ve_gate_scale
        if c.generation != "plain":
            weights.resid_lambdas = self.floats("resid_lambdas", (c.n_layer,))
            weights.x0_lambdas = self.floats("x0_lambdas", (c.n_layer,))
        if c.smear:
            info = self.gguf.require("smear_gate.weight", shape=(-1,))
            cfg.smear_cols = info.shape[0]
            weights.smear_gate = self.floats("smear_gate.weight", info.shape)
            weights.smear_lambda = self.floats("smear_lambda", (1,))
        if c.backout_layer >= 0:
            weights.backout_lambda = self.floats("backout_lambda", (1,))
        self.refuse_unknown_tensors("nanochat")
        self.build(lib.nanochat_build, cfg, tensors, weights)
        # the view's converted matrices were copied for the products: not held twice
        self.release_view_sources()

    def _layer(self, layer: Any, i: int, p: str) -> None:
        c = self.config.nanochat
        assert c is not None
        self.attention_tensors(layer.attn, p, q_dim=c.n_head * c.head_dim, kv_dim=c.kv_dim,
                               norm=None)
        layer.attn.q_norm = self._qk_scale
        layer.attn.k_norm = self._qk_scale
        self.mlp_tensors(layer.ffn, p, c.n_ff, norm=None, gated=False)
        if i in c.ve_layers:
            self.matrix(self._own[i].value_embd, p + "value_embd.weight",
                        (c.vocab_size, c.kv_dim))
            self._own[i].ve_gate = self.floats(p + "attn_ve_gate.weight",
                                               (c.n_kv_head, c.ve_gate_channels))

    # ------------------------------------------------------------------ ForwardModel

    def new_cache(self, n_ctx: int, kv_type: str | None = None) -> NanochatCache:
        """An empty cache for ``n_ctx`` positions (pages commit lazily)."""
        self._require_open()
        if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx <= 0:
            raise ValueError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        return NanochatCache(self, n_ctx, kv_type or self.kv_type)

    def forward(
        self, cache: Any, tokens: Sequence[int], pos: int, *, all_logits: bool = False
    ) -> np.ndarray:
        """Run ``tokens`` at ``pos..``; float32 logits of the last token or of all of them."""
        ids, pos = self._check_call(cache, tokens, pos)
        with self._calls:
            self._previous([(cache, pos)])
            # the checked ids, an array: the base reads any sequence of ids
            logits = super().forward(cache, cast(Sequence[int], ids), pos, all_logits=all_logits)
            cache.tokens[pos : pos + ids.size] = ids
        return logits

    def forward_batch(
        self, rows: Sequence[tuple[Any, Sequence[int], int]]
    ) -> list[np.ndarray]:
        """One weight pass over several sequences (see NativeForwardModel.forward_batch)."""
        checked = [self._check_call(cache, tokens, pos) for cache, tokens, pos in rows]
        if len(rows) > self.n_batch:  # more rows than tokens a batch takes
            raise ValueError(f"{len(rows)} sequences exceed the batch of {self.n_batch}")
        with self._calls:
            self._previous([(cache, pos) for (cache, _, _), (_, pos) in zip(rows, checked,
                                                                             strict=True)])
            out = super().forward_batch(rows)
            for (cache, _, _), (ids, pos) in zip(rows, checked, strict=True):
                cache.tokens[pos : pos + ids.size] = ids
        return out

    def copy_rows(self, src: Any, dst: Any, n: int) -> None:
        """Copy positions ``[0, n)`` of every layer, and their tokens, from ``src`` into
        ``dst``."""
        super().copy_rows(src, dst, n)
        dst.tokens[:n] = src.tokens[:n]

    def _previous(self, seqs: Sequence[tuple[NanochatCache, int]]) -> None:
        """Name, for each (cache, pos) of the coming call, the token at ``pos - 1``."""
        self._require_open()
        caches = [ffi.cast("lm_cache *", int(kernels.ffi.cast("uintptr_t", c.native.ptr)))
                  for c, _ in seqs]
        pos = ffi.new("int64_t[]", [p for _, p in seqs])
        prev = ffi.new("int32_t[]", [int(c.tokens[p - 1]) if p > 0 else -1 for c, p in seqs])
        status = lib.nanochat_previous(self._base, len(seqs), ffi.new("lm_cache *[]", caches),
                                       pos, prev)
        kernels.check(status, "nanochat_previous")
