"""Hyper-parameters of a llama-architecture GGUF, read from its ``<arch>.*`` metadata."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.kit import DecoderConfig, HParams, decoder_hparams

# GGUF architectures that share this implementation (mlx-lm style alias table): the key
# is ``general.architecture``, the value the family whose forward pass serves it.
ARCHITECTURE_ALIASES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
}


@dataclass(frozen=True, slots=True)
class LlamaConfig(DecoderConfig):
    """The llama hyper-parameters the forward pass needs."""

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> LlamaConfig:
        """Read the config from a GGUF's metadata; unknown keys are ignored."""
        hp = HParams.served(gguf, tuple(ARCHITECTURE_ALIASES), "llama")
        if hp.integer("expert_count", 0, minimum=0) > 0:
            raise GGUFError("mixture-of-experts llama GGUFs are not supported")
        return cls(**decoder_hparams(hp))
