"""Hyper-parameters of a llama-architecture GGUF, read from its ``<arch>.*`` metadata."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.kit import HParams

# GGUF architectures that share this implementation (mlx-lm style alias table): the key
# is ``general.architecture``, the value the family whose forward pass serves it.
ARCHITECTURE_ALIASES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The llama hyper-parameters the forward pass needs."""

    architecture: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float = 1e-5

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> LlamaConfig:
        """Read the config from a GGUF's metadata; unknown keys are ignored."""
        arch = gguf.architecture
        if ARCHITECTURE_ALIASES.get(arch) != "llama":
            raise GGUFError(f"architecture {arch!r} is not served by the llama family")
        hp = HParams(gguf)
        n_embd = hp.integer("embedding_length")
        n_head = hp.integer("attention.head_count", maximum=4096)
        n_kv_head = hp.integer("attention.head_count_kv", n_head, maximum=4096)
        if n_head % n_kv_head:
            raise GGUFError(f"head_count {n_head} is not a multiple of head_count_kv {n_kv_head}")
        head_dim = hp.integer("attention.key_length", n_embd // n_head or 1)
        if hp.integer("attention.value_length", head_dim) != head_dim:
            raise GGUFError("key_length != value_length is not a llama layout")
        if hp.integer("expert_count", 0, minimum=0) > 0:
            raise GGUFError("mixture-of-experts llama GGUFs are not supported")
        return cls(
            architecture=arch,
            n_layer=hp.block_count(),
            n_embd=n_embd,
            n_ff=hp.integer("feed_forward_length"),
            n_head=n_head,
            n_kv_head=n_kv_head,
            head_dim=head_dim,
            n_vocab=hp.vocab_size(),
            n_ctx_train=hp.integer("context_length", 2048, maximum=1 << 30),
            rms_eps=hp.number("attention.layer_norm_rms_epsilon", 1e-5),
        )
