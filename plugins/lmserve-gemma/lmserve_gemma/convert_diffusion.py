"""Convert a transformers DiffusionGemma checkpoint (``DiffusionGemmaForBlockDiffusion``) to a
``diffusion-gemma`` GGUF.

The layout is the one of the published ``diffusion-gemma`` GGUFs (unsloth's
``diffusiongemma-26B-A4B-it-GGUF``, written by the converter of llama.cpp pull request #24423;
readers in other projects agree on it): the Gemma 4 text tensors and ``diffusion-gemma.*``
keys under llama.cpp's ``gemma4`` names, plus

* ``blk.N.enc_layer_output_scale.weight`` [1]: the encoder's (causal pass's) per-layer
  output scalar; ``blk.N.layer_output_scale.weight`` is the decoder's (the denoiser's);
* ``self_cond_pre_norm.weight`` [n_embd], ``self_cond_gate.weight`` / ``self_cond_up.weight``
  [n_embd -> n_ff], ``self_cond_down.weight`` [n_ff -> n_embd]: the self-conditioning MLP;
* ``diffusion-gemma.attention.causal`` false;
* the keys without an architecture prefix ``diffusion.canvas_length`` (u32) and the
  entropy-bound sampler's ``diffusion.eb_max_steps`` (u32), ``diffusion.eb_t_min``,
  ``diffusion.eb_t_max``, ``diffusion.eb_entropy_bound`` (f32),
  ``diffusion.eb_stability_threshold`` (u32), ``diffusion.eb_confidence_threshold`` (f32).
  Published files may lack the ``eb_*`` keys (readers then take the reference defaults 48,
  0.4, 0.8, 0.1, 1, 0.005); this converter writes them, from ``generation_config.json`` where
  it sets them.

The encoder and decoder share every weight but their layer scalars; the output is tied to
the embedding. Only the text model is converted (the published files carry no vision tower).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter

from lmserve_core.testing.gguf_writer import add_arch_metadata, add_tensor, add_values
from lmserve_core.testing.synthetic import FILE_TYPES, tensor_type

from .gguf_vocab import add_vocab, gemma4_vocab, load_json

ARCH = "diffusion-gemma"
HF_ARCHITECTURES = ("DiffusionGemmaForBlockDiffusion",)
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

# The entropy-bound sampler's keys, their GGUF types and the reference defaults
# (DiffusionGemmaGenerationConfig._get_default_generation_params).
EB_DEFAULTS: dict[str, int | float] = {
    "eb_max_steps": 48,
    "eb_t_min": 0.4,
    "eb_t_max": 0.8,
    "eb_entropy_bound": 0.1,
    "eb_stability_threshold": 1,
    "eb_confidence_threshold": 0.005,
}
_EB_FROM_HF = {
    "eb_max_steps": "max_denoising_steps",
    "eb_t_min": "t_min",
    "eb_t_max": "t_max",
    "eb_stability_threshold": "stability_threshold",
    "eb_confidence_threshold": "confidence_threshold",
}

# A Gemma 4 layer's transformers names and their GGUF ones (llama.cpp's Gemma4Model).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "layer_scalar": "layer_output_scale.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
}
_TOP_MAP = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "self_conditioning.pre_norm.weight": "self_cond_pre_norm.weight",
    "self_conditioning.gate_proj.weight": "self_cond_gate.weight",
    "self_conditioning.up_proj.weight": "self_cond_up.weight",
    "self_conditioning.down_proj.weight": "self_cond_down.weight",
}
_DECODER = "model.decoder."
_ENCODER = "model.encoder.language_model."
_SKIPPED = ("model.encoder.vision_tower.", "model.encoder.embed_vision.", "lm_head.")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")

SLIDING, FULL = "sliding_attention", "full_attention"


class ConvertError(ValueError):
    """The checkpoint cannot be converted (another architecture, a missing or odd tensor)."""


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """Write the ``diffusion-gemma`` GGUF of the checkpoint in ``hf_dir`` to ``out``.

    ``outtype``: f32, f16, bf16 or q8_0 for the matrices (1-D tensors and the routers stay
    f32; rows that do not fit a q8_0 block fall back as llama.cpp's do). Raises
    :class:`ConvertError` for a checkpoint of another architecture.
    """
    hf_dir, out = Path(hf_dir), Path(out)
    if outtype not in OUTTYPES:
        raise ConvertError(f"outtype {outtype!r}: expected one of {', '.join(OUTTYPES)}")
    config = _config(hf_dir)
    text = config["text_config"]
    tensors = dict(_gguf_tensors(hf_dir, text))
    n_layer = int(text["num_hidden_layers"])
    n_expert = int(text.get("num_experts") or 0)

    writer = GGUFWriter(out, ARCH)
    writer.add_type("model")
    writer.add_name(hf_dir.name)
    add_arch_metadata(writer, ARCH, _arch_keys(config, text))
    add_values(writer, _diffusion_keys(hf_dir, config))
    writer.add_file_type(int(FILE_TYPES[outtype]))
    writer.add_quantization_version(2)  # GGML_QUANT_VERSION
    if (hf_dir / "tokenizer.json").is_file():
        add_vocab(writer, gemma4_vocab(hf_dir))
    for name, array in tensors.items():
        qtype = tensor_type(name, array.shape, outtype, n_layer=n_layer, n_expert=n_expert,
                            tied=True)
        add_tensor(writer, name, array, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConvertError(f"{hf_dir}: no config.json")
    config = load_json(path)
    archs = tuple(config.get("architectures") or ())
    if config.get("model_type") != "diffusion_gemma" or not set(archs) <= set(HF_ARCHITECTURES):
        found = ", ".join(archs) or config.get("model_type") or "unknown"
        raise ConvertError(
            f"{hf_dir}: {found} is not a DiffusionGemma checkpoint; this converter writes "
            f"{ARCH} GGUFs from {', '.join(HF_ARCHITECTURES)} only"
        )
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConvertError(f"{hf_dir}: config.json has no text_config")
    if text.get("use_bidirectional_attention") == "all":
        raise ConvertError(f"{hf_dir}: a bidirectional encoder is not a block-diffusion model")
    return config


def _layer_types(text: dict[str, Any]) -> list[str]:
    n_layer = int(text["num_hidden_layers"])
    types = text.get("layer_types") or [
        SLIDING if (il + 1) % 6 else FULL for il in range(n_layer)
    ]
    if len(types) != n_layer or set(types) - {SLIDING, FULL}:
        raise ConvertError(f"layer_types {types!r}: expected {n_layer} of {SLIDING}/{FULL}")
    return list(types)


def _per_layer(text: dict[str, Any], key: str, default: int) -> list[int]:
    """``key`` of every layer: the per_layer_config override, else ``default``."""
    overrides = text.get("per_layer_config") or {}
    n_layer = int(text["num_hidden_layers"])
    return [int((overrides.get(str(il)) or {}).get(key, default)) for il in range(n_layer)]


def _rope(text: dict[str, Any], kind: str) -> dict[str, Any]:
    params = (text.get("rope_parameters") or {}).get(kind)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ConvertError(f"rope_parameters has no {kind} entry with a rope_theta")
    return params


def _arch_keys(config: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    """The ``diffusion-gemma.*`` keys: Gemma 4's as llama.cpp writes them, not causal."""
    types = _layer_types(text)
    head_dim = _per_layer(text, "head_dim", int(text["head_dim"]))
    n_kv = _per_layer(text, "num_key_value_heads", int(text["num_key_value_heads"]))
    swa = [t == SLIDING for t in types]
    dims = {head_dim[il] for il in range(len(types)) if not swa[il]}
    dims_swa = {head_dim[il] for il in range(len(types)) if swa[il]}
    if len(dims) > 1 or len(dims_swa) > 1:
        raise ConvertError("layers of one kind must share their head width")
    hd_full = dims.pop() if dims else int(text["head_dim"])
    hd_swa = dims_swa.pop() if dims_swa else int(text["head_dim"])
    keys: dict[str, Any] = {
        "context_length": int(text.get("max_position_embeddings", 131072)),
        "embedding_length": int(text["hidden_size"]),
        "block_count": len(types),
        "feed_forward_length": int(text["intermediate_size"]),
        "attention.head_count": int(text["num_attention_heads"]),
        "attention.head_count_kv": n_kv if len(set(n_kv)) > 1 else n_kv[0],
        "rope.freq_base": float(_rope(text, FULL)["rope_theta"]),
        "rope.freq_base_swa": float(_rope(text, SLIDING)["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(text.get("rms_norm_eps", 1e-6)),
        "attention.key_length": hd_full,
        "attention.value_length": hd_full,
        "attention.key_length_swa": hd_swa,
        "attention.value_length_swa": hd_swa,
        "final_logit_softcapping": float(text.get("final_logit_softcapping") or 0.0),
        "attention.sliding_window": int(text["sliding_window"]),
        "attention.shared_kv_layers": 0,
        "embedding_length_per_layer_input": 0,
        "attention.sliding_window_pattern": swa,
        "rope.dimension_count": hd_full,
        "rope.dimension_count_swa": hd_swa,
        "attention.causal": False,
    }
    if text.get("num_experts"):
        keys["expert_count"] = int(text["num_experts"])
        keys["expert_used_count"] = int(text["top_k_experts"])
        keys["expert_feed_forward_length"] = int(text["moe_intermediate_size"])
    return keys


def _diffusion_keys(hf_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """``diffusion.canvas_length`` and the sampler's ``diffusion.eb_*``."""
    gen_path = hf_dir / "generation_config.json"
    gen = load_json(gen_path) if gen_path.is_file() else {}
    keys: dict[str, Any] = {"diffusion.canvas_length": int(config.get("canvas_length") or 256)}
    for key, default in EB_DEFAULTS.items():
        value = gen.get(_EB_FROM_HF.get(key, ""))
        if key == "eb_entropy_bound":
            value = (gen.get("sampler_config") or {}).get("entropy_bound")
        keys[f"diffusion.{key}"] = type(default)(default if value is None else value)
    return keys


def _rope_freqs(text: dict[str, Any]) -> np.ndarray:
    """Gemma 4's ``rope_freqs``: 1 for the pairs the global layers' proportional RoPE turns,
    1e30 (standing still) for the rest, over the global head."""
    hd_full = int(_arch_keys({}, text)["attention.key_length"])
    partial = float(_rope(text, FULL).get("partial_rotary_factor", 1.0))
    n_rot = int(hd_full * partial / 2)
    return np.array([1.0] * n_rot + [1e30] * (hd_full // 2 - n_rot), dtype=np.float32)


def _gguf_tensors(hf_dir: Path, text: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """Every GGUF tensor (f32), in llama.cpp's order: rope_freqs, then by checkpoint name."""
    yield "rope_freqs.weight", _rope_freqs(text)
    seen: dict[str, np.ndarray] = {}
    shared: dict[str, np.ndarray] = {}  # encoder copies of decoder weights (untied files)
    for name, array in sorted(_checkpoint(hf_dir)):
        if name.startswith(_SKIPPED):
            continue
        if name.startswith(_DECODER):
            gguf = _gguf_name(name[len(_DECODER) :], name)
        elif name.startswith(_ENCODER):
            rest = name[len(_ENCODER) :]
            m = _LAYER.match(rest)
            if m is not None and m.group(2) == "layer_scalar":
                gguf = f"blk.{m.group(1)}.enc_layer_output_scale.weight"
            else:
                shared[_gguf_name(rest, name)] = array
                continue
        else:
            raise ConvertError(f"{hf_dir}: no GGUF name for tensor {name}")
        seen[gguf] = array
    for gguf, array in shared.items():
        if gguf not in seen:
            seen[gguf] = array  # a file that keeps the encoder's copy of a tied weight
        elif not np.array_equal(seen[gguf], array):
            raise ConvertError(f"{hf_dir}: encoder and decoder differ in {gguf}")
    n_layer = int(text["num_hidden_layers"])
    for il in range(n_layer):
        for key in ("layer_output_scale.weight", "enc_layer_output_scale.weight"):
            seen.setdefault(f"blk.{il}.{key}", np.ones(1, np.float32))
    missing = [k for k in _TOP_MAP.values() if k not in seen]
    if missing:
        raise ConvertError(f"{hf_dir}: missing tensors {', '.join(missing)}")
    yield from seen.items()


def _gguf_name(rest: str, full: str) -> str:
    if rest in _TOP_MAP:
        return _TOP_MAP[rest]
    m = _LAYER.match(rest)
    if m is not None and m.group(2) in LAYER_NAMES:
        return f"blk.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    raise ConvertError(f"no GGUF name for tensor {full}")


# ------------------------------------------------------------------ safetensors

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def _checkpoint(hf_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the checkpoint's safetensors files, as float32 arrays."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(load_json(index)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for file in files:
        path = hf_dir / file
        if not path.is_file():
            raise ConvertError(f"{hf_dir}: no {file}")
        yield from _safetensors(path)


def _safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    (n,) = struct.unpack("<Q", data[:8].tobytes())
    header = json.loads(data[8 : 8 + n].tobytes())
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ConvertError(f"{path}: {name} has dtype {info['dtype']}")
        a, b = info["data_offsets"]
        raw = np.frombuffer(data[base + a : base + b], dtype=dtype)
        if dtype is np.uint16:  # bfloat16: the high half of a float32
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        shape = tuple(info["shape"])
        if raw.size != math.prod(shape):
            raise ConvertError(f"{path}: {name} holds {raw.size} values, not {shape}")
        yield name, raw.astype(np.float32).reshape(shape)


def main(argv: list[str] | None = None) -> int:
    """``python -m lmserve_gemma.convert_diffusion HF_DIR OUT.gguf [--outtype ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m lmserve_gemma.convert_diffusion",
        description="Convert a transformers DiffusionGemma checkpoint to a diffusion-gemma GGUF.",
    )
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--outtype", choices=OUTTYPES, default="f32")
    args = parser.parse_args(argv)
    try:
        print(convert(args.hf_dir, args.out, args.outtype))
    except ConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
