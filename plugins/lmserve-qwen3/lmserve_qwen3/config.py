"""Hyper-parameters of a ``qwen3`` / ``qwen3moe`` GGUF, under the names llama.cpp reads."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.kit import MISSING, HParams

ARCHITECTURES = ("qwen3", "qwen3moe")


@dataclass(frozen=True, slots=True)
class Qwen3Config:
    """What the forward pass needs; ``n_expert`` is 0 for the dense architecture."""

    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int  # dense: the MLP's width; MoE: one expert's
    n_vocab: int
    n_ctx_train: int
    rms_eps: float = 1e-6
    n_expert: int = 0
    n_expert_used: int = 0
    expert_weights_scale: float = 1.0

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    @property
    def moe(self) -> bool:
        return self.n_expert > 0

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Qwen3Config:
        """Read the config from a GGUF's metadata; unknown keys are ignored."""
        arch = gguf.architecture
        if arch not in ARCHITECTURES:
            raise GGUFError(f"architecture {arch!r} is not served by the qwen3 family")
        hp = HParams(gguf)
        n_embd = hp.integer("embedding_length")
        n_head = hp.integer("attention.head_count", maximum=4096)
        n_kv_head = hp.integer("attention.head_count_kv", n_head, maximum=4096)
        if n_head % n_kv_head:
            raise GGUFError(f"head_count {n_head} is not a multiple of head_count_kv {n_kv_head}")
        # Qwen3 sets the head width apart from n_embd / n_head (0.6B: 16 x 128 over 1024).
        head_dim = hp.integer("attention.key_length", n_embd // n_head or 1, maximum=4096)
        if hp.integer("attention.value_length", head_dim, maximum=4096) != head_dim:
            raise GGUFError("attention.key_length != attention.value_length is not a Qwen3 layout")
        moe = arch == "qwen3moe"
        n_expert = hp.integer("expert_count", MISSING if moe else 0, minimum=0, maximum=4096)
        if not moe and n_expert:
            raise GGUFError("a qwen3 GGUF with experts: its architecture should be qwen3moe")
        n_used = 0
        if moe:
            if n_expert < 1:
                raise GGUFError("qwen3moe.expert_count must be at least 1")
            n_used = hp.integer("expert_used_count", maximum=n_expert)
        n_ff = (
            hp.integer("expert_feed_forward_length", _expert_width(gguf))
            if moe
            else hp.integer("feed_forward_length")
        )
        return cls(
            architecture=arch,
            n_layer=hp.block_count(),
            n_embd=n_embd,
            n_head=n_head,
            n_kv_head=n_kv_head,
            head_dim=head_dim,
            n_ff=n_ff,
            n_vocab=hp.vocab_size(),
            n_ctx_train=hp.integer("context_length", 40960, maximum=1 << 30),
            rms_eps=hp.number("attention.layer_norm_rms_epsilon", 1e-6),
            n_expert=n_expert,
            n_expert_used=n_used,
            expert_weights_scale=hp.number("expert_weights_scale", 1.0),
        )


def _expert_width(gguf: GGUFFile) -> object:
    # Older conversions left out expert_feed_forward_length: the expert tensors tell it.
    info = gguf.tensors.get("blk.0.ffn_gate_exps.weight")
    return info.shape[1] if info is not None and len(info.shape) == 3 else MISSING
