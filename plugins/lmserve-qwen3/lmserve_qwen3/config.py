"""Hyper-parameters of a ``qwen3`` / ``qwen3moe`` GGUF, under the names llama.cpp reads."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.kit import MISSING, DecoderConfig, HParams, decoder_hparams

ARCHITECTURES = ("qwen3", "qwen3moe")


@dataclass(frozen=True, slots=True)
class Qwen3Config(DecoderConfig):
    """What the forward pass needs; ``n_expert`` is 0 for the dense architecture, and
    ``n_ff`` is then the MLP's width (one expert's otherwise)."""

    n_expert: int = 0
    n_expert_used: int = 0
    expert_weights_scale: float = 1.0

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
        moe = arch == "qwen3moe"
        n_expert = hp.integer("expert_count", MISSING if moe else 0, minimum=0, maximum=4096)
        if not moe and n_expert:
            raise GGUFError("a qwen3 GGUF with experts: its architecture should be qwen3moe")
        if moe and n_expert < 1:
            raise GGUFError("qwen3moe.expert_count must be at least 1")
        # Qwen3 sets the head width apart from n_embd / n_head (0.6B: 16 x 128 over 1024).
        common = decoder_hparams(
            hp,
            n_ff_key="expert_feed_forward_length" if moe else "feed_forward_length",
            n_ff_default=_expert_width(gguf) if moe else None,
            rms_eps_default=1e-6,
            n_ctx_default=40960,
        )
        return cls(
            **common,
            n_expert=n_expert,
            n_expert_used=hp.integer("expert_used_count", maximum=n_expert) if moe else 0,
            expert_weights_scale=hp.number("expert_weights_scale", 1.0),
        )


def _expert_width(gguf: GGUFFile) -> int | None:
    # Older conversions left out expert_feed_forward_length: the expert tensors tell it.
    info = gguf.tensors.get("blk.0.ffn_gate_exps.weight")
    return info.shape[1] if info is not None and len(info.shape) == 3 else None
