"""Hyper-parameters of an ``inkling`` GGUF, read from its ``inkling.*`` metadata (the layout of
lmserve_inkling.convert)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.kit import DecoderConfig, HParams

ARCHITECTURES = ("inkling",)


def _decoder_fields(hp: HParams, n_layer: int, n_kv_head: int) -> dict[str, Any]:
    """The :class:`DecoderConfig` fields (``head_count_kv`` is per layer here, which the
    kit's ``decoder_hparams`` does not read), and ``n_dense``."""
    n_head = hp.integer("attention.head_count", maximum=4096)
    head_dim = hp.integer("attention.key_length", maximum=4096)
    if hp.integer("attention.value_length", head_dim, maximum=4096) != head_dim:
        raise GGUFError("attention.key_length != attention.value_length is not supported")
    n_dense = hp.integer("dense_block_count", 0, minimum=0, maximum=n_layer)
    return {
        "architecture": hp.arch,
        "n_layer": n_layer,
        "n_embd": hp.integer("embedding_length"),
        "n_head": n_head,
        "n_kv_head": n_kv_head,
        "head_dim": head_dim,
        "n_ff": hp.integer("feed_forward_length") if n_dense else 0,
        "n_vocab": hp.vocab_size(),
        "n_ctx_train": hp.integer("context_length", 4096, maximum=1 << 30),
        "rms_eps": hp.number("attention.layer_norm_rms_epsilon", 1e-6),
        "n_dense": n_dense,
    }


@dataclass(frozen=True, slots=True)
class InklingConfig(DecoderConfig):
    """What the forward pass needs beyond a decoder's sizes (``n_kv_head``: the global
    layers'; ``n_ff``: the dense layers' width)."""

    kv_heads: tuple[int, ...] = ()  # per layer
    swa: tuple[bool, ...] = ()  # per layer: a sliding-window layer
    window: int = 0
    rel_extent: int = 0
    rel_extent_swa: int = 0
    d_rel: int = 0
    conv_kernel: int = 0
    n_dense: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_shared: int = 0
    n_ff_exp: int = 0
    route_scale: float = 1.0
    logit_scale_denom: float = 1.0
    n_vocab_unpadded: int = 0
    log_n_floor: int = 0
    log_alpha: float = 0.0

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> InklingConfig:
        hp = HParams.served(gguf, ARCHITECTURES, "inkling")
        n_layer = hp.block_count()
        kv_heads = hp.per_layer("attention.head_count_kv", n_layer, maximum=4096)
        base = _decoder_fields(hp, n_layer, max(kv_heads))
        pattern = hp.raw("attention.sliding_window_pattern")
        if not isinstance(pattern, list | tuple) or len(pattern) != n_layer:
            raise GGUFError(f"{hp.key('attention.sliding_window_pattern')}: one flag per layer")
        n_dense = base.pop("n_dense")
        moe = n_dense < n_layer
        if gguf.metadata.get(hp.key("expert_gating_func"), 2) != 2:
            raise GGUFError(f"{hp.key('expert_gating_func')}: only sigmoid (2) is supported")
        denom = hp.number("logit_scale_denom")
        if denom == 0:
            raise GGUFError(f"{hp.key('logit_scale_denom')} is 0")
        n_vocab = base["n_vocab"]
        for i in range(n_layer):
            if base["n_head"] % kv_heads[i]:
                raise GGUFError(f"layer {i}: head_count_kv {kv_heads[i]} does not divide heads")
        return cls(
            **base,
            kv_heads=tuple(kv_heads),
            swa=tuple(bool(p) for p in pattern),
            window=hp.integer("attention.sliding_window"),
            rel_extent=hp.integer("rel_extent"),
            rel_extent_swa=hp.integer("rel_extent_swa"),
            d_rel=hp.integer("d_rel", maximum=4096),
            conv_kernel=hp.integer("shortconv_kernel", minimum=2, maximum=64),
            n_dense=n_dense,
            n_expert=hp.integer("expert_count", maximum=4096) if moe else 0,
            n_expert_used=hp.integer("expert_used_count", maximum=64) if moe else 0,
            n_shared=hp.integer("expert_shared_count", maximum=64) if moe else 0,
            n_ff_exp=hp.integer("expert_feed_forward_length") if moe else 0,
            route_scale=hp.number("expert_weights_scale", 1.0),
            logit_scale_denom=denom,
            n_vocab_unpadded=hp.integer("unpadded_vocab_size", n_vocab, maximum=n_vocab),
            log_n_floor=hp.integer("log_scaling_n_floor", 0, minimum=0),
            log_alpha=hp.number("log_scaling_alpha", 0.0),
        )
