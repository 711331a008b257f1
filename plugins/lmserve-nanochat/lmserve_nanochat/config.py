"""NanochatConfig: what the forward pass needs of a nanochat checkpoint, whichever layout and
generation of ``nanochat/gpt.py`` wrote it.

A checkpoint's ``model_config`` (``meta_{step}.json``) gives the geometry; what changed
between generations of ``gpt.py`` without a config key is read from the weights the
checkpoint holds (:func:`generation_of`):

===========  ==========================================================================
generation   how it shows in the state dict, and what it implies
===========  ==========================================================================
plain        no ``resid_lambdas`` (patched to 1 / 0, as nanochat's loader does), no value
             embeddings: rotary base 10,000, short window ``sequence_len // 2``
lambdas      ``resid_lambdas`` / ``x0_lambdas``, no value embeddings: as plain
ve32         value embeddings gated by 32 channels: gate ``2 sigmoid(.)``, as plain
ve12         value embeddings gated by 12 channels: gate ``3 sigmoid(.)``, rotary base
             100,000, short window ``ceil(sequence_len / 3 / 128) * 128``
smear        ``smear_gate`` / ``backout_lambda``: as ve12, q and k scaled by 1.2 after their
             norm, short window ``ceil(sequence_len / 4 / 128) * 128`` (current ``gpt.py``)
===========  ==========================================================================

The Hugging Face port (``NanoChatForCausalLM``) holds the plain architecture with its
constants in ``config.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# torch.nn.functional.rms_norm without eps uses the input dtype's machine epsilon: nanochat's
# CPU inference runs in float32.
F32_EPS = float(np.finfo(np.float32).eps)
SOFTCAP = 15.0
VOCAB_PAD = 64


class CheckpointError(ValueError):
    """A checkpoint that cannot be served: names the file or key at fault."""


@dataclass(frozen=True, slots=True)
class NanochatConfig:
    """The hyper-parameters of one nanochat model, normalised across generations."""

    vocab_size: int          # the tokenizer's (the padded rows of wte / lm_head are sliced off)
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    n_ff: int                # 4 n_embd in nanochat; config.json's intermediate_size in the HF port
    sequence_len: int        # the training context: the long window, and n_ctx_train
    generation: str          # plain, lambdas, ve32, ve12, smear (module docstring)
    rope_theta: float
    norm_eps: float
    logit_softcap: float
    qk_scale: float          # q and k each multiplied by it after their norm (1.2 or 1.0)
    windows: tuple[int, ...]  # per layer: keys a query sees, itself included (0: all)
    ve_layers: tuple[int, ...]  # layers with a value embedding
    ve_gate_channels: int    # the gate reads x[..., :channels] (0: no value embeddings)
    ve_gate_scale: float     # gate = scale * sigmoid(ve_gate . x[:channels])
    smear: bool              # smear gate on the embeddings, and backout
    backout_layer: int       # the layer whose output is subtracted at the end (-1: none)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim


def padded_vocab(vocab_size: int) -> int:
    """Rows of ``wte`` / ``lm_head`` in a nanochat checkpoint (padded to a multiple of 64)."""
    return -(-vocab_size // VOCAB_PAD) * VOCAB_PAD


def has_ve(layer: int, n_layer: int) -> bool:
    """gpt.py's alternating value-embedding layers (the last one always has one)."""
    return layer % 2 == (n_layer - 1) % 2


def generation_of(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """The ``gpt.py`` generation that wrote a state dict, from its keys (prefix-free names)."""
    if "smear_gate.weight" in shapes:
        return "smear"
    gates = [s for k, s in shapes.items() if k.endswith(".attn.ve_gate.weight")]
    if gates:
        channels = gates[0][-1]
        if channels == 12:
            return "ve12"
        if channels == 32:
            return "ve32"
        raise CheckpointError(f"value-embedding gates of {channels} channels: unknown gpt.py")
    return "lambdas" if "resid_lambdas" in shapes else "plain"


def _windows(pattern: str, n_layer: int, sequence_len: int, generation: str) -> tuple[int, ...]:
    pattern = pattern.upper()
    if not pattern or any(c not in "SL" for c in pattern):
        raise CheckpointError(f"window_pattern {pattern!r}: only S and L are known")
    if generation == "smear":
        short = -(-sequence_len // 4 // 128) * 128
    elif generation == "ve12":
        short = -(-sequence_len // 3 // 128) * 128
    else:
        short = sequence_len // 2
    # flash-attention's window (left, 0): `left` keys before the query, and the query's own
    left = [short if pattern[i % len(pattern)] == "S" else sequence_len for i in range(n_layer)]
    left[-1] = sequence_len  # the last layer always sees the long window
    return tuple(w + 1 for w in left)


def _int(config: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where}: {key} must be a positive integer (got {value!r})")
    return value


def from_model_config(
    model_config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str
) -> NanochatConfig:
    """The config of a native checkpoint: ``meta_{step}.json``'s ``model_config`` and the
    shapes of its (prefix-free) state dict. ``where`` names the file in errors."""
    n_layer = _int(model_config, "n_layer", where)
    n_head = _int(model_config, "n_head", where)
    n_kv_head = _int(model_config, "n_kv_head", where, n_head)
    n_embd = _int(model_config, "n_embd", where)
    vocab_size = _int(model_config, "vocab_size", where)
    sequence_len = _int(model_config, "sequence_len", where)
    if n_embd % n_head or n_head % n_kv_head:
        raise CheckpointError(
            f"{where}: n_embd {n_embd}, n_head {n_head}, n_kv_head {n_kv_head} do not divide"
        )
    generation = generation_of(shapes)
    # checkpoints from before sliding windows were trained with full context
    pattern = model_config.get("window_pattern", "L")
    if not isinstance(pattern, str):
        raise CheckpointError(f"{where}: window_pattern must be a string (got {pattern!r})")
    ve_layers = tuple(i for i in range(n_layer) if f"value_embeds.{i}.weight" in shapes)
    channels = 0
    if ve_layers:
        gate = shapes.get(f"transformer.h.{ve_layers[0]}.attn.ve_gate.weight")
        if gate is None:
            raise CheckpointError(f"{where}: value embeddings without their ve_gate")
        channels = int(gate[-1])
    new_rope = generation in ("ve12", "smear")
    return NanochatConfig(
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=n_embd,
        n_ff=4 * n_embd,
        sequence_len=sequence_len,
        generation=generation,
        rope_theta=100000.0 if new_rope else 10000.0,
        norm_eps=F32_EPS,
        logit_softcap=SOFTCAP,
        qk_scale=1.2 if generation == "smear" else 1.0,
        windows=_windows(pattern, n_layer, sequence_len, generation),
        ve_layers=ve_layers,
        ve_gate_channels=channels,
        ve_gate_scale=3.0 if new_rope else 2.0,
        smear=generation == "smear",
        backout_layer=n_layer // 2 if generation == "smear" else -1,
    )


def from_hf_config(config: Mapping[str, Any], where: str) -> NanochatConfig:
    """The config of the Hugging Face port (``config.json`` of ``NanoChatForCausalLM``)."""
    n_layer = _int(config, "num_hidden_layers", where)
    n_head = _int(config, "num_attention_heads", where)
    n_kv_head = config.get("num_key_value_heads") or n_head
    n_kv_head = _int({"num_key_value_heads": n_kv_head}, "num_key_value_heads", where)
    n_embd = _int(config, "hidden_size", where)
    if n_embd % n_head or n_head % n_kv_head:
        raise CheckpointError(
            f"{where}: hidden_size {n_embd}, num_attention_heads {n_head}, "
            f"num_key_value_heads {n_kv_head} do not divide"
        )
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    act = config.get("hidden_act", "relu2")
    if act != "relu2":
        raise CheckpointError(f"{where}: hidden_act {act!r}: only relu2 is nanochat's")
    softcap = config.get("final_logit_softcapping", SOFTCAP)
    sequence_len = _int(config, "max_position_embeddings", where, 2048)
    return NanochatConfig(
        vocab_size=_int(config, "vocab_size", where),
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=n_embd,
        n_ff=_int(config, "intermediate_size", where),
        sequence_len=sequence_len,
        generation="plain",
        rope_theta=float(theta),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        logit_softcap=float(softcap) if softcap else 0.0,
        qk_scale=1.0,
        windows=(0,) * n_layer,
        ve_layers=(),
        ve_gate_channels=0,
        ve_gate_scale=0.0,
        smear=False,
        backout_layer=-1,
    )
