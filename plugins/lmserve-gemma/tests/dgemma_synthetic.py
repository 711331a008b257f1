"""A synthetic DiffusionGemma model for tests: a tiny random ``DiffusionGemmaForBlockDiffusion``
(eager attention, float32), converted by ``lmserve_gemma.convert_diffusion``, and what
transformers computes with it.

Geometry: 4 layers (sliding, global, sliding, global), n_embd 64, 4 query heads; sliding
layers head width 32 with 2 KV heads, global ones 64 with 1 (keys as values, proportional
RoPE on a quarter), sliding window 8, a dense MLP of 128 beside 4 experts of 64 (top 2),
soft-capping 30, canvas 16, Gemma 4's tokenizer (262144 ids, so the Gemma 4 one is used as
is). Every parameter and buffer is noise, seeded per name, the 1-D ones included: norms and
scalars (both passes' layer scalars, the router's scales) from [0.5, 1.5], the final norm
from [4, 12] (a wide logit spread), matrices N(0, 0.25), the embedding N(0, 0.03).

Recorded with transformers (``reference.npz``): a prompt of 20 ids (past the window),
the causal pass's logits over it (the encoder's hidden states through the tied head and the
soft-cap); the denoiser's logits over a fixed random canvas without self-conditioning, then
over a second canvas self-conditioned on the first logits at a temperature; the causal pass
over the first canvas as a committed block, and the denoiser over a third canvas after it.

Cached under ``$LMSERVE_TEST_CACHE`` like the other synthetic models, keyed by
:data:`VERSION` and the geometry.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmserve_core.testing.assets import cache_dir
from lmserve_core.testing.gguf_writer import atomic_output

VERSION = "1"
N_VOCAB = 262_144
PROMPT_LEN = 20
CANVAS = 16
TEMPERATURE = 0.6  # of the self-conditioning logits of the second canvas
SLIDING, FULL = "sliding_attention", "full_attention"

TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": N_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "global_head_dim": 64,
    "num_global_key_value_heads": 1,
    "max_position_embeddings": 512,
    "sliding_window": 8,
    "layer_types": [SLIDING, FULL, SLIDING, FULL],
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 64,
    "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "pad_token_id": 0,
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    },
}
VISION_CONFIG: dict[str, Any] = {
    "model_type": "gemma4_vision",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


@dataclass(frozen=True)
class DiffusionModel:
    gguf: Path
    hf_dir: Path
    reference: Path

    def load_hf(self) -> Any:
        import torch
        import transformers

        model = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(
            self.hf_dir, attn_implementation="eager", dtype=torch.float32
        )
        return model.eval()

    def recorded(self) -> dict[str, np.ndarray]:
        with np.load(self.reference) as data:
            return {k: data[k] for k in data.files}


def _key() -> str:
    spec = {"version": VERSION, "text": TEXT_CONFIG, "vision": VISION_CONFIG, "canvas": CANVAS}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def build_hf_model(seed: int = 0) -> Any:
    import torch
    import transformers

    config = transformers.DiffusionGemmaConfig(
        text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG), canvas_length=CANVAS
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DiffusionGemmaForBlockDiffusion(config).to(torch.float32).eval()
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    with torch.no_grad():
        for name, t in tensors.items():
            if "vision" in name or not t.is_floating_point() or "inv_freq" in name:
                continue
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            if name.endswith("decoder.norm.weight") or name.endswith("language_model.norm.weight"):
                values = rng.uniform(4.0, 12.0, size=t.shape)
            elif t.ndim == 1 or name.endswith("layer_scalar"):
                values = rng.uniform(0.5, 1.5, size=t.shape)
            elif name.endswith("embed_tokens.weight"):
                values = rng.normal(0.0, 0.03, size=t.shape)
            else:
                values = rng.normal(0.0, 0.25, size=t.shape)
            t.copy_(torch.from_numpy(values.astype(np.float32)))
    model.tie_weights()
    return model


def causal_logits(model: Any, ids: list[int], cache: Any) -> np.ndarray:
    """The encoder over ``ids`` after ``cache``'s prefix (which it extends): every row's
    logits through the tied head and the soft-cap."""
    import torch

    with torch.no_grad():
        out = model.model.encoder(input_ids=torch.tensor([ids]), cache=cache)
        logits = model.lm_head(out.last_hidden_state).float()
        cap = model.final_logit_softcapping
        return (torch.tanh(logits / cap) * cap)[0].numpy()


def denoiser_logits(
    model: Any, canvas: list[int], cache: Any, self_conditioning: np.ndarray | None
) -> np.ndarray:
    import torch

    sc = None if self_conditioning is None else torch.from_numpy(self_conditioning)[None]
    with torch.no_grad():
        out = model(decoder_input_ids=torch.tensor([canvas]), cache=cache,
                    self_conditioning_logits=sc)
    return out.logits[0].float().numpy()


def record(model: Any, seed: int = 0) -> dict[str, np.ndarray]:
    from transformers import DynamicCache

    rng = np.random.default_rng([seed, 7])
    prompt = [2, *rng.integers(3, N_VOCAB, size=PROMPT_LEN - 1).tolist()]
    canvases = [rng.integers(0, N_VOCAB, size=CANVAS).tolist() for _ in range(3)]
    cache = DynamicCache(config=model.config.text_config)
    causal = causal_logits(model, prompt, cache)
    first = denoiser_logits(model, canvases[0], cache, None)
    second = denoiser_logits(model, canvases[1], cache, first / TEMPERATURE)
    committed = causal_logits(model, canvases[0], cache)
    third = denoiser_logits(model, canvases[2], cache, None)
    return {
        "prompt": np.array(prompt, np.int32),
        "canvases": np.array(canvases, np.int32),
        "causal": causal,
        "denoise_first": first,
        "denoise_second": second,
        "causal_committed": committed,
        "denoise_third": third,
    }


def write(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> None:
    from lmserve_gemma.convert_diffusion import convert

    model = build_hf_model(seed)
    hf_dir = out_dir / "hf"
    model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    convert(hf_dir, out_dir / "model.gguf", "f32")
    loaded = DiffusionModel(out_dir / "model.gguf", hf_dir, out_dir / "reference.npz").load_hf()
    np.savez(out_dir / "reference.npz", **record(loaded, seed))


def diffusion_model(tokenizer_dir: Path, seed: int = 0) -> DiffusionModel:
    """The cached model (written on first use)."""
    folder = cache_dir() / "diffusion-gemma" / f"tiny-s{seed}-{_key()}"
    if not (folder / "reference.npz").is_file():
        with atomic_output(folder) as tmp:
            tmp.mkdir(parents=True)
            write(tmp, tokenizer_dir, seed)
    return DiffusionModel(folder / "model.gguf", folder / "hf", folder / "reference.npz")
