"""Convert a transformers ``InklingForCausalLM`` checkpoint to an ``inkling`` GGUF.

The layout is that of the open llama.cpp conversion work (its ``InklingModel`` converter and
``llama_model_inkling`` loader), as the published ``inkling`` GGUFs carry it:

* keys: the standard ``inkling.*`` ones (``block_count``, ``embedding_length``,
  ``feed_forward_length`` = the dense layers' width, ``attention.head_count``,
  ``attention.head_count_kv`` as a per-layer array, ``attention.key_length`` /
  ``value_length``, ``attention.layer_norm_rms_epsilon``, ``attention.sliding_window`` and
  ``attention.sliding_window_pattern`` (true = sliding layer), ``expert_count``,
  ``expert_used_count``, ``expert_shared_count``, ``expert_feed_forward_length``,
  ``expert_weights_scale`` (the router's ``route_scale``), ``expert_gating_func`` = sigmoid,
  ``vocab_size``) and the family's own ``inkling.d_rel``, ``rel_extent``, ``rel_extent_swa``
  (= the sliding window), ``shortconv_kernel``, ``dense_block_count``,
  ``logit_scale_denom`` (``logits_mup_width_multiplier``), ``log_scaling_n_floor`` (0: off),
  ``log_scaling_alpha``, ``unpadded_vocab_size``;
* tensors: ``token_embd``, ``token_embd_norm``, ``output_norm``, ``output``; per block
  ``attn_norm``, ``attn_q``, ``attn_k``, ``attn_v``, ``attn_r``, ``attn_output``,
  ``attn_q_norm``, ``attn_k_norm``, ``attn_rel_proj`` (``[d_rel, extent]``, F32),
  ``shortconv_{k,v,attn,mlp}`` (``[channels, kernel]``, F32), ``ffn_norm``, ``ffn_gscale``
  (``[1]``: the dense MLP's ``global_scale`` or the router's), dense blocks ``ffn_gate``,
  ``ffn_up``, ``ffn_down``; MoE blocks ``ffn_gate_inp`` (routed then shared rows, F32),
  ``exp_probs_b.bias``, ``ffn_{gate,up,down}_exps`` and the shared experts stacked as
  ``ffn_{gate,up,down}_shexp`` (``[n_shared, ...]``).

The tokenizer is written as llama.cpp writes byte-level BPE vocabularies, with pre-tokenizer
``inkling``; EOS is ``<|content_model_end_sampling|>`` when the vocabulary has it (else the
config's ``eos_token_id``), BOS is set to EOS and never added.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter

from lmserve_core.testing.gguf_writer import (
    TYPE_NAMES,
    add_arch_metadata,
    add_bpe_tokenizer,
    add_tensor,
    atomic_output,
    load_bpe_vocab,
)

ARCH = "inkling"
ARCHITECTURES = ("InklingForCausalLM",)
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
EOS_TOKEN = "<|content_model_end_sampling|>"

T = GGMLQuantizationType


class ConvertError(ValueError):
    """The checkpoint is not one this converter handles."""


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    archs = config.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise ConvertError(
            f"not an Inkling text checkpoint: architectures {archs!r} "
            f"(this converter handles {', '.join(ARCHITECTURES)})"
        )
    return config


def _resolve(hp: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters the layout needs, with transformers' defaults filled in."""
    try:
        from transformers import InklingTextConfig
    except ImportError as exc:
        raise ImportError(
            "converting an Inkling checkpoint needs transformers with Inkling (its "
            "InklingTextConfig fills in the defaults): pip install 'lmserve-inkling[convert]'",
            name="transformers",
        ) from exc

    cfg = InklingTextConfig(**{k: v for k, v in hp.items() if k != "architectures"})
    n = cfg.num_hidden_layers
    if cfg.layer_types is None or cfg.mlp_layer_types is None:  # transformers fills both
        raise ConvertError("the configuration names no layer_types or mlp_layer_types")
    local = [t == "hybrid_sliding" for t in cfg.layer_types]
    mlp = list(cfg.mlp_layer_types)
    dense = next((i for i, t in enumerate(mlp) if t != "dense"), n)
    if any(t != "sparse" for t in mlp[dense:]):
        raise ConvertError(f"dense layers must lead: mlp_layer_types {mlp!r}")
    if cfg.swa_head_dim != cfg.head_dim or cfg.swa_num_attention_heads != cfg.num_attention_heads:
        raise ConvertError("sliding layers with other query heads or head width than the "
                           "global ones have no GGUF layout")
    return {
        "cfg": cfg,
        "local": local,
        "dense": dense,
        "kv_heads": [cfg.swa_num_key_value_heads if s else cfg.num_key_value_heads for s in local],
        "unpadded": cfg.unpadded_vocab_size or cfg.vocab_size,
    }  # multi-token-prediction layers (model.mtp.*) are left out: the text forward only


def _tensors(hf_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the checkpoint's safetensors files as f32."""
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{hf_dir}: no .safetensors files")
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, np.asarray(st.get_tensor(name), dtype=np.float32)
        except TypeError:  # bf16: numpy has no such dtype
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118
                    yield name, st.get_tensor(name).float().numpy()


def _matrix_type(outtype: str, array: np.ndarray) -> T:
    qtype = TYPE_NAMES[outtype]
    if qtype == T.Q8_0 and array.shape[-1] % 32:
        return T.F16  # rows Q8_0 blocks do not fit (llama.cpp's converter falls back alike)
    return qtype


def _keys(r: dict[str, Any]) -> dict[str, Any]:
    c = r["cfg"]
    return {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": r["kv_heads"],
        "attention.key_length": c.head_dim,
        "attention.value_length": c.head_dim,
        "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        "attention.sliding_window": c.sliding_window_size,
        "attention.sliding_window_pattern": r["local"],
        "expert_count": c.n_routed_experts,
        "expert_used_count": c.num_experts_per_tok,
        "expert_shared_count": c.n_shared_experts,
        "expert_feed_forward_length": c.moe_intermediate_size,
        "expert_weights_scale": float(c.route_scale),
        "expert_gating_func": int(ExpertGatingFuncType.SIGMOID),
        "vocab_size": c.vocab_size,
        "d_rel": c.d_rel,
        "rel_extent": c.rel_extent,
        "rel_extent_swa": c.sliding_window_size,
        "shortconv_kernel": c.conv_kernel_size,
        "dense_block_count": r["dense"],
        "logit_scale_denom": float(c.logits_mup_width_multiplier),
        "log_scaling_n_floor": int(c.log_scaling_n_floor or 0),
        "log_scaling_alpha": float(c.log_scaling_alpha),
        "unpadded_vocab_size": r["unpadded"],
    }


# checkpoint name (after "model.layers.N.") -> GGUF name (after "blk.N.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.r_proj.weight": "attn_r.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.rel_logits_proj.proj": "attn_rel_proj.weight",
    "self_attn.k_sconv.conv1d.weight": "shortconv_k.weight",
    "self_attn.v_sconv.conv1d.weight": "shortconv_v.weight",
    "attn_sconv.conv1d.weight": "shortconv_attn.weight",
    "mlp_sconv.conv1d.weight": "shortconv_mlp.weight",
    "mlp.global_scale": "ffn_gscale.weight",
    "mlp.gate.global_scale": "ffn_gscale.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj": "ffn_down_shexp.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.embed_tokens.embed_norm.weight": "token_embd_norm.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# stored f32 whatever the outtype (llama.cpp's converter forces these)
_F32 = ("attn_rel_proj.weight", "ffn_gate_inp.weight")


def _gguf_tensors(name: str, a: np.ndarray) -> list[tuple[str, np.ndarray]]:
    if name in _TOP_NAMES:
        return [(_TOP_NAMES[name], a)]
    if name.startswith("model.mtp."):
        return []
    parts = name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        raise ConvertError(f"unexpected tensor {name!r}")
    bid, rest = parts[2], parts[3]
    p = f"blk.{bid}."
    if rest == "mlp.experts.gate_up_proj":  # (E, 2 I, D): each expert's gate rows, then up
        n_ff = a.shape[1] // 2
        return [(p + "ffn_gate_exps.weight", a[:, :n_ff]), (p + "ffn_up_exps.weight", a[:, n_ff:])]
    if rest not in _LAYER_NAMES:
        raise ConvertError(f"unexpected tensor {name!r}")
    if rest.endswith("sconv.conv1d.weight"):  # (C, 1, K) -> (C, K)
        a = a.reshape(a.shape[0], a.shape[-1])
    return [(p + _LAYER_NAMES[rest], a)]


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """Write ``out`` (an ``inkling`` GGUF) from the transformers checkpoint in ``hf_dir``:
    matrices as ``outtype`` (f32, f16, bf16 or q8_0), vectors, convolutions, relative
    position banks and routers f32. Raises :class:`ConvertError` for anything else."""
    hf_dir, out = Path(hf_dir), Path(out)
    if outtype not in OUTTYPES:
        raise ConvertError(f"outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ConvertError(f"{hf_dir}: no config.json")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    r = _resolve(_text_config(config))
    cfg = r["cfg"]

    vocab = load_bpe_vocab(hf_dir, cfg.vocab_size, {})
    eos = vocab.tokens.index(EOS_TOKEN) if EOS_TOKEN in vocab.tokens else cfg.eos_token_id
    vocab.special_ids = {k: v for k, v in vocab.special_ids.items() if k not in ("bos", "eos")}
    vocab.special_ids |= {"bos": eos, "eos": eos}
    vocab.add_special = {"bos": False, "eos": False}

    with atomic_output(out) as tmp:
        writer = GGUFWriter(str(tmp), ARCH)
        writer.add_name(hf_dir.name)
        add_arch_metadata(writer, ARCH, _keys(r))
        add_bpe_tokenizer(writer, vocab, "inkling")
        seen: set[str] = set()
        for name, array in _tensors(hf_dir):
            for gname, a in _gguf_tensors(name, array):
                if gname in seen:
                    raise ConvertError(f"two checkpoint tensors map to {gname}")
                seen.add(gname)
                a = np.ascontiguousarray(a, dtype=np.float32)
                keep = a.ndim < 2 or gname.endswith(_F32) or ".shortconv_" in gname
                qtype = T.F32 if keep else _matrix_type(outtype, a)
                add_tensor(writer, gname, a, qtype)
        if "output.weight" not in seen:
            raise ConvertError(f"{hf_dir}: no lm_head.weight (Inkling's head is never tied)")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out
