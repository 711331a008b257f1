"""Hyper-parameters of a ``qwen3`` / ``qwen3moe`` GGUF, under the names llama.cpp reads."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.kit import ExpertsConfig, HParams, decoder_hparams, experts_hparams

ARCHITECTURES = ("qwen3", "qwen3moe")


@dataclass(frozen=True, slots=True)
class Qwen3Config(ExpertsConfig):
    """What the forward pass needs; ``n_expert`` is 0 for the dense architecture."""

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Qwen3Config:
        """Read the config from a GGUF's metadata; unknown keys are ignored."""
        hp = HParams.served(gguf, ARCHITECTURES, "qwen3")
        moe = hp.arch == "qwen3moe"
        experts = experts_hparams(hp, moe=moe, moe_architecture="qwen3moe")
        # Qwen3 sets the head width apart from n_embd / n_head (0.6B: 16 x 128 over 1024).
        common = decoder_hparams(hp, experts=moe, rms_eps_default=1e-6, n_ctx_default=40960)
        return cls(**common, **experts)
