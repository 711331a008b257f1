"""Hyper-parameters of a llama-architecture GGUF, read from its ``<arch>.*`` metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmserve_core.gguf_file import GGUFError, GGUFFile

# GGUF architectures that share this implementation (mlx-lm style alias table): the key
# is ``general.architecture``, the value the family whose forward pass serves it.
ARCHITECTURE_ALIASES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
}

_MISSING = object()


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
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float = 1e-5
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0

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

        def get(suffix: str, default: Any = _MISSING) -> Any:
            value = gguf.arch_get(suffix, default)
            if value is _MISSING:
                raise GGUFError(f"missing metadata key {arch}.{suffix}")
            return value

        n_embd = _positive_int(get("embedding_length"), "embedding_length")
        n_head = _positive_int(get("attention.head_count"), "attention.head_count")
        n_kv_head = _positive_int(get("attention.head_count_kv", n_head), "head_count_kv")
        if n_head % n_kv_head:
            raise GGUFError(f"head_count {n_head} is not a multiple of head_count_kv {n_kv_head}")
        head_dim = _positive_int(get("attention.key_length", n_embd // n_head), "key_length")
        value_dim = _positive_int(get("attention.value_length", head_dim), "value_length")
        if value_dim != head_dim:
            raise GGUFError("key_length != value_length is not a llama layout")
        n_rot = _positive_int(get("rope.dimension_count", head_dim), "rope.dimension_count")
        if n_rot > head_dim or n_rot % 2:
            raise GGUFError(f"rope.dimension_count {n_rot} does not fit head_dim {head_dim}")
        if int(get("expert_count", 0) or 0) > 0:
            raise GGUFError("mixture-of-experts llama GGUFs are not supported")

        n_vocab = get("vocab_size", None)
        if n_vocab is None:
            tokens = gguf.metadata.get("tokenizer.ggml.tokens")
            if tokens is not None:
                n_vocab = len(tokens)
            elif "token_embd.weight" in gguf.tensors:
                n_vocab = gguf.tensors["token_embd.weight"].shape[0]
            else:
                raise GGUFError("cannot tell the vocabulary size")

        return cls(
            architecture=arch,
            n_layer=_positive_int(get("block_count"), "block_count"),
            n_embd=n_embd,
            n_ff=_positive_int(get("feed_forward_length"), "feed_forward_length"),
            n_head=n_head,
            n_kv_head=n_kv_head,
            head_dim=head_dim,
            n_rot=n_rot,
            n_vocab=_positive_int(n_vocab, "vocab_size"),
            n_ctx_train=_positive_int(get("context_length", 2048), "context_length"),
            rms_eps=_positive_float(get("attention.layer_norm_rms_epsilon", 1e-5), "rms eps"),
            rope_freq_base=_positive_float(get("rope.freq_base", 10000.0), "rope.freq_base"),
            rope_freq_scale=_rope_freq_scale(get),
        )


def _rope_freq_scale(get: Any) -> float:
    kind = str(get("rope.scaling.type", "none") or "none")
    factor = get("rope.scaling.factor", None)
    if factor is None:
        factor = get("rope.scale_linear", None)  # the older spelling of a linear factor
        if factor is not None:
            kind = "linear"
    if kind == "none" or factor is None or float(factor) in (0.0, 1.0):
        return 1.0
    if kind != "linear":
        raise GGUFError(f"rope scaling {kind!r} is not supported (only linear)")
    return 1.0 / _positive_float(factor, "rope.scaling.factor")


def _positive_int(value: Any, what: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise GGUFError(f"{what}: expected an integer, got {value!r}") from None
    if number <= 0 or number != value:
        raise GGUFError(f"{what}: expected a positive integer, got {value!r}")
    return number


def _positive_float(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise GGUFError(f"{what}: expected a number, got {value!r}") from None
    if not number > 0.0 or number == float("inf"):
        raise GGUFError(f"{what}: expected a positive number, got {value!r}")
    return number
