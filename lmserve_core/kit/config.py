"""The hyper-parameters every decoder-only family reads, under llama.cpp's key names.

A family's config is a dataclass that extends :class:`DecoderConfig` (or
:class:`ExpertsConfig`, for a family with mixture-of-experts variants) with its own fields and
builds itself from :func:`decoder_hparams` (and :func:`experts_hparams`) plus whatever keys
only it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmserve_core.gguf_file import GGUFError

from .hparams import MISSING, HParams

__all__ = ["DecoderConfig", "ExpertsConfig", "decoder_hparams", "experts_hparams"]


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Sizes of a decoder-only transformer; ``n_ff`` is the feed-forward (or one expert's)
    width."""

    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim


@dataclass(frozen=True, slots=True)
class ExpertsConfig(DecoderConfig):
    """A decoder whose feed-forward may be a mixture of experts: ``n_expert`` is 0 for a
    dense one, and ``n_ff`` is then the MLP's width (one expert's otherwise)."""

    n_expert: int = 0
    n_expert_used: int = 0  # experts per token (top-k)
    expert_weights_scale: float = 1.0  # multiplies the chosen experts' weights

    @property
    def moe(self) -> bool:
        return self.n_expert > 0


def experts_hparams(hp: HParams, *, moe: bool, moe_architecture: str) -> dict[str, Any]:
    """The :class:`ExpertsConfig` fields of a GGUF: ``expert_count`` (required when the
    architecture is a mixture of experts, refused otherwise: such a file should name
    ``moe_architecture``), ``expert_used_count`` and ``expert_weights_scale``."""
    n_expert = hp.integer("expert_count", MISSING if moe else 0, minimum=0, maximum=4096)
    if moe and n_expert < 1:
        raise GGUFError(f"{hp.key('expert_count')} must be at least 1")
    if not moe and n_expert:
        raise GGUFError(
            f"a {hp.arch} GGUF with experts: its architecture should be {moe_architecture}"
        )
    return {
        "n_expert": n_expert,
        "n_expert_used": hp.integer("expert_used_count", maximum=n_expert) if moe else 0,
        "expert_weights_scale": hp.number("expert_weights_scale", 1.0),
    }


def decoder_hparams(
    hp: HParams,
    *,
    experts: bool = False,
    n_ff_key: str = "feed_forward_length",
    n_ff_default: Any = None,
    rms_eps_default: float = 1e-5,
    n_ctx_default: int = 2048,
) -> dict[str, Any]:
    """The :class:`DecoderConfig` fields of a GGUF, checked: head counts that divide,
    ``key_length == value_length``, every size positive and bounded. With ``experts``,
    ``n_ff`` is one expert's width: ``expert_feed_forward_length``, or for older conversions
    without it the width of the first layer's expert tensors."""
    if experts:
        n_ff_key = "expert_feed_forward_length"
        for name, parts in (("ffn_gate_exps", 1), ("ffn_gate_up_exps", 2)):
            info = hp.gguf.tensors.get(f"blk.0.{name}.weight")
            if info is not None and len(info.shape) == 3:
                n_ff_default = info.shape[1] // parts
    n_embd = hp.integer("embedding_length")
    n_head = hp.integer("attention.head_count", maximum=4096)
    n_kv_head = hp.integer("attention.head_count_kv", n_head, maximum=4096)
    if n_head % n_kv_head:
        raise GGUFError(f"head_count {n_head} is not a multiple of head_count_kv {n_kv_head}")
    head_dim = hp.integer("attention.key_length", n_embd // n_head or 1, maximum=4096)
    if hp.integer("attention.value_length", head_dim, maximum=4096) != head_dim:
        raise GGUFError("attention.key_length != attention.value_length is not supported")
    return {
        "architecture": hp.arch,
        "n_layer": hp.block_count(),
        "n_embd": n_embd,
        "n_head": n_head,
        "n_kv_head": n_kv_head,
        "head_dim": head_dim,
        "n_ff": hp.integer(n_ff_key, MISSING if n_ff_default is None else n_ff_default),
        "n_vocab": hp.vocab_size(),
        "n_ctx_train": hp.integer("context_length", n_ctx_default, maximum=1 << 30),
        "rms_eps": hp.number("attention.layer_norm_rms_epsilon", rms_eps_default),
    }
