"""Tiny random nanochat models and their float32 references.

Three kinds, each with a noise on every parameter (nanochat's init leaves the projections
and the lambdas at values that would hide a wrong formula):

- ``smear``: the current ``gpt.py`` (vendored under reference/nanochat), value embeddings
  gated by 12 channels, smear and backout, q/k scaled by 1.2;
- ``ve32``: the ``gpt.py`` of March 4, 2026 (value embeddings gated by 32 channels, rotary
  base 10,000, half-context short windows, logits capped at 20); its tiny ``sequence_len``
  makes the windows shorter than the test prompts;
- ``hf``: transformers' ``NanoChatForCausalLM`` (the plain architecture, eager attention),
  its weights renamed to nanochat's as the checkpoint reader does.

The state dicts are cached as ``.npz`` under ``cache_dir() / "nanochat-synthetic"`` (keyed by
this module's version and the spec) and loaded back into the reference module, so every run
compares with the same weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lmserve_nanochat.config import NanochatConfig, from_hf_config, from_model_config

from lmserve_core.testing.assets import cache_dir

SCRIPT_VERSION = "1"
REFERENCE = Path(__file__).with_name("reference")


@dataclass(frozen=True)
class Spec:
    kind: str  # smear, ve32, hf
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64
    vocab_size: int = 300  # padded to 320 in the native checkpoints
    sequence_len: int = 64
    window_pattern: str = "SL"
    seed: int = 0


SPECS = {
    "smear": Spec("smear"),
    "ve32": Spec("ve32", n_layer=3, sequence_len=32, seed=1),
    "hf": Spec("hf", n_layer=2, vocab_size=256, seed=2),
}

# transformers' NanoChatForCausalLM names -> nanochat's (what the checkpoint reader maps)
HF_NAMES = {
    "model.embed_tokens.weight": "transformer.wte.weight",
    "lm_head.weight": "lm_head.weight",
    "self_attn.q_proj.weight": "attn.c_q.weight",
    "self_attn.k_proj.weight": "attn.c_k.weight",
    "self_attn.v_proj.weight": "attn.c_v.weight",
    "self_attn.o_proj.weight": "attn.c_proj.weight",
    "mlp.fc1.weight": "mlp.c_fc.weight",
    "mlp.fc2.weight": "mlp.c_proj.weight",
}


def _torch() -> Any:
    import torch

    torch.set_num_threads(1)  # a busy 2-core machine: OpenMP barriers stall otherwise
    return torch


def _gpt_module(kind: str) -> Any:
    if str(REFERENCE) not in sys.path:
        sys.path.insert(0, str(REFERENCE))
    if kind == "smear":
        from nanochat import gpt
    else:
        from nanochat import gpt_ve32 as gpt
    return gpt


def native_config(spec: Spec) -> dict[str, Any]:
    """gpt.py's GPTConfig of ``spec``: the ``model_config`` of a checkpoint's meta json."""
    return {
        "sequence_len": spec.sequence_len,
        "vocab_size": spec.vocab_size,
        "n_layer": spec.n_layer,
        "n_head": spec.n_head,
        "n_kv_head": spec.n_kv_head,
        "n_embd": spec.n_embd,
        "window_pattern": spec.window_pattern,
    }


def _hf_config(spec: Spec) -> Any:
    from transformers import NanoChatConfig

    return NanoChatConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.n_embd,
        intermediate_size=4 * spec.n_embd,
        num_hidden_layers=spec.n_layer,
        num_attention_heads=spec.n_head,
        num_key_value_heads=spec.n_kv_head,
        max_position_embeddings=spec.sequence_len,
        rms_norm_eps=1e-6,
        final_logit_softcapping=15.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def _empty_module(spec: Spec) -> Any:
    torch = _torch()
    if spec.kind == "hf":
        from transformers import NanoChatForCausalLM

        return NanoChatForCausalLM(_hf_config(spec)).eval()
    gpt = _gpt_module(spec.kind)
    with torch.device("meta"):
        model = gpt.GPT(gpt.GPTConfig(**native_config(spec)))
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


def _random_state(spec: Spec, module: Any) -> dict[str, np.ndarray]:
    """Every parameter drawn afresh: matrices ~ N(0, 1 / fan_in), embeddings ~ N(0, 1),
    lambdas around their trained ranges."""
    rng = np.random.default_rng(spec.seed)
    out = {}
    for name, p in module.state_dict().items():
        shape = tuple(p.shape)
        if name.endswith("resid_lambdas"):
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("x0_lambdas"):
            v = 0.2 + 0.1 * rng.standard_normal(shape)
        elif name in ("smear_lambda", "backout_lambda"):
            v = 0.4 + 0.1 * rng.standard_normal(shape)
        elif "wte" in name or "embed" in name:
            v = rng.standard_normal(shape)
        elif "ve_gate" in name or "smear_gate" in name:
            v = 0.5 * rng.standard_normal(shape)
        elif name.endswith("lm_head.weight"):
            v = 2.0 * rng.standard_normal(shape) / np.sqrt(shape[-1])
        else:
            v = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = v.astype(np.float32)
    return out


def _cached_state(spec: Spec) -> tuple[Path, dict[str, np.ndarray]]:
    key = hashlib.sha256(json.dumps([SCRIPT_VERSION, asdict(spec)]).encode()).hexdigest()[:16]
    path = cache_dir() / "nanochat-synthetic" / f"{spec.kind}-{key}.npz"
    if not path.exists():
        state = _random_state(spec, _empty_module(spec))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **state)
        os.replace(tmp, path)  # concurrent runs: the first rename wins, both are the same
    with np.load(path) as z:
        return path, {k: z[k] for k in z.files}


@dataclass
class TinyModel:
    spec: Spec
    path: Path  # the cached state dict: the "checkpoint file"
    config: NanochatConfig
    tensors: dict[str, np.ndarray]  # nanochat's names, float32
    reference: Any  # the torch module, float32, eval mode

    def logits(self, ids: list[int]) -> np.ndarray:
        """The reference's float32 logits of every position of ``ids``."""
        torch = _torch()
        with torch.no_grad():
            x = torch.tensor([ids])
            out = self.reference(x) if self.spec.kind != "hf" else self.reference(x).logits
        return out[0, :, : self.config.vocab_size].float().numpy()

    def greedy(self, ids: list[int], n_new: int) -> list[int]:
        """The reference's greedy continuation, recomputing the whole sequence each step."""
        out = list(ids)
        for _ in range(n_new):
            out.append(int(np.argmax(self.logits(out)[-1])))
        return out[len(ids) :]


def tiny_model(kind: str, spec: Spec | None = None) -> TinyModel:
    """The tiny model of ``kind`` (``SPECS``), or of ``spec`` (a variant of that kind)."""
    torch = _torch()
    spec = spec or SPECS[kind]
    assert spec.kind == kind
    path, state = _cached_state(spec)
    module = _empty_module(spec)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    if kind == "hf":
        tensors = {}
        for name, value in state.items():
            if name.startswith("model.layers."):
                i, rest = name[len("model.layers.") :].split(".", 1)
                tensors[f"transformer.h.{i}.{HF_NAMES[rest]}"] = value
            else:
                tensors[HF_NAMES[name]] = value
        config = from_hf_config(module.config.to_dict(), str(path))
    else:
        tensors = dict(state)
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        config = from_model_config(native_config(spec), shapes, str(path))
        if kind == "ve32":
            # gpt.py caps the logits at 20 from aba30cb to 1076f97 (March 3-9, 2026), at 15
            # before and after: nothing in a state dict tells which
            config = dataclasses.replace(config, logit_softcap=20.0)
    return TinyModel(spec, path, config, tensors, module)
