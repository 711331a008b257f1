"""Hyper-parameters of a ``qwen35`` / ``qwen35moe`` / ``qwen3next`` GGUF, under the names
llama.cpp's converter writes."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.kit import ExpertsConfig, HParams, decoder_hparams, experts_hparams

ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")
MOE = ("qwen35moe", "qwen3next")


@dataclass(frozen=True, slots=True)
class Qwen35Config(ExpertsConfig):
    """What the forward pass needs. ``n_layer`` counts the decoder's layers only: a file's
    multi-token-prediction layers (``nextn_predict_layers``, after them) are not run.
    ``recurrent[i]`` says whether layer i is a DeltaNet layer; ``n_ff`` is the MLP's width,
    or one expert's."""

    recurrent: tuple[bool, ...] = ()
    n_nextn: int = 0
    conv_kernel: int = 4
    ssm_n_k_head: int = 0
    ssm_n_v_head: int = 0
    ssm_head_k: int = 0
    ssm_head_v: int = 0
    n_ff_shexp: int = 0
    rope_sections: tuple[int, ...] = ()

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_n_k_head * self.ssm_head_k + self.ssm_n_v_head * self.ssm_head_v

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Qwen35Config:
        """Read the config from a GGUF's metadata; unknown keys are ignored."""
        hp = HParams.served(gguf, ARCHITECTURES, "qwen35")
        moe = hp.arch in MOE
        common = decoder_hparams(hp, experts=moe, rms_eps_default=1e-6, n_ctx_default=262144)
        n_all = common["n_layer"]
        n_nextn = hp.integer("nextn_predict_layers", 0, minimum=0, maximum=n_all - 1)
        n_layer = n_all - n_nextn
        common["n_layer"] = n_layer
        experts = experts_hparams(hp, moe=moe, moe_architecture="qwen35moe")
        n_v = hp.integer("ssm.time_step_rank", maximum=4096)
        n_k = hp.integer("ssm.group_count", maximum=4096)
        if n_v % n_k:
            raise GGUFError(f"ssm.time_step_rank {n_v} is not a multiple of ssm.group_count {n_k}")
        inner = hp.integer("ssm.inner_size")
        if inner % n_v:
            raise GGUFError(f"ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {n_v}")
        return cls(
            **common,
            recurrent=_recurrent_layers(hp, n_all, n_layer),
            n_nextn=n_nextn,
            conv_kernel=hp.integer("ssm.conv_kernel", maximum=64),
            ssm_n_k_head=n_k,
            ssm_n_v_head=n_v,
            ssm_head_k=hp.integer("ssm.state_size", maximum=1024),
            ssm_head_v=inner // n_v,
            **experts,
            n_ff_shexp=hp.integer("expert_shared_feed_forward_length", 0, minimum=0) if moe else 0,
            rope_sections=_rope_sections(hp),
        )


def _recurrent_layers(hp: HParams, n_all: int, n_layer: int) -> tuple[bool, ...]:
    """Which of the decoder's layers are DeltaNet layers: ``attention.recurrent_layers``
    when the file lists them, else every layer but each ``full_attention_interval``-th."""
    if hp.has("attention.recurrent_layers"):
        flags = _as_list(hp.raw("attention.recurrent_layers"))
        if not isinstance(flags, list | tuple) or len(flags) not in (n_all, n_layer):
            raise GGUFError(f"{hp.key('attention.recurrent_layers')} must list {n_all} layers")
        return tuple(bool(f) for f in flags[:n_layer])
    interval = hp.integer("full_attention_interval", 4, minimum=1, maximum=n_layer)
    return tuple((i + 1) % interval != 0 for i in range(n_layer))


def _rope_sections(hp: HParams) -> tuple[int, ...]:
    """``rope.dimension_sections`` (multi-axis RoPE); text has one position per token, so
    every section turns by it and the rotation is the plain one over ``n_rot`` dims."""
    if not hp.has("rope.dimension_sections"):
        return ()
    raw = _as_list(hp.raw("rope.dimension_sections"))
    if not isinstance(raw, list | tuple) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in raw):
        raise GGUFError(f"{hp.key('rope.dimension_sections')} must be a list of sizes")
    return tuple(int(v) for v in raw)


def _as_list(value: object) -> object:
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value

