"""build_view: a nanochat checkpoint's weights as an in-memory GGUFFile the kit reads.

A nanochat checkpoint is no GGUF: its reader hands float32 arrays under nanochat's own
state-dict names (``transformer.wte.weight``, ``transformer.h.{i}.attn.c_q.weight``, ...).
:func:`build_view` lays them out as a GGUF view the kit's weight-table helpers read:

===============================  ==============================  ===========================
view tensor                      from                            stored as
===============================  ==============================  ===========================
token_embd.weight                transformer.wte.weight          ``weights`` (rows sliced)
output.weight                    lm_head.weight                  ``weights`` (rows sliced)
blk.{i}.attn_q / attn_k.weight   attn.c_q / attn.c_k             ``weights``, rope-negated
blk.{i}.attn_v.weight            attn.c_v                        ``weights``
blk.{i}.attn_output.weight       attn.c_proj                     ``weights``
blk.{i}.ffn_up / ffn_down        mlp.c_fc / mlp.c_proj           ``weights``
blk.{i}.value_embd.weight        value_embeds.{i}.weight         ``weights`` (rows sliced)
blk.{i}.attn_ve_gate.weight      attn.ve_gate.weight             f32
resid_lambdas, x0_lambdas        the same                        f32
smear_gate.weight, smear_lambda  the same (gate flattened)       f32
backout_lambda                   the same                        f32
===============================  ==============================  ===========================

- The padded rows of ``wte``, ``lm_head`` and the value embeddings (nanochat pads the vocabulary
  to a multiple of 64) are cut to ``vocab_size``.
- nanochat turns q and k by ``-theta`` (``y1 = x1 cos + x2 sin``, ``y2 = -x1 sin + x2 cos``
  over the two halves of a head). The rows of the second half of every q and k head are
  negated here, so the kernels' NEOX rotation by ``+theta`` gives q and k with that half
  negated, the same on both sides: their dot product, and so the attention, are nanochat's.
  The per-head RMS norm commutes with the rotation and with the sign.
- ``weights``: "f32", "f16", "bf16" or "q8_0" (gguf-py's ``gguf.quants.quantize``) for the
  matrices and embedding tables; a q8_0 matrix whose rows are not whole blocks of 32 stays
  f16. Vectors, scalars and the small value-embedding gates stay f32.
- The NanochatConfig travels in the metadata (``nanochat.config.<field>``, read back by
  :func:`config_from_view`), beside llama.cpp-style keys for generic readers.

The arrays the view holds are its own (copies), writable: the kit's loader only releases
the pages of read-only views (file mappings), so its copies never zero these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from lmserve_core.gguf_file import GGUFFile, TensorInfo

from .config import CheckpointError, NanochatConfig

__all__ = ["ARCHITECTURE", "WEIGHT_TYPES", "build_view", "config_from_view"]

ARCHITECTURE = "nanochat"
WEIGHT_TYPES: dict[str, GGMLQuantizationType] = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
}
CONFIG_PREFIX = f"{ARCHITECTURE}.config."
ALIGNMENT = 32


def _rope_negated(w: np.ndarray, n_heads: int) -> np.ndarray:
    """``w`` (n_heads * head_dim, cols) with the rows of each head's second half negated."""
    out = w.reshape(n_heads, -1, w.shape[-1]).copy()
    out[:, out.shape[1] // 2 :] *= -1.0
    return out.reshape(w.shape)


class _Builder:
    def __init__(self, path: Path, weights: str) -> None:
        if weights not in WEIGHT_TYPES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_TYPES)} (got {weights!r})")
        self.path = path
        self.qtype = WEIGHT_TYPES[weights]
        self.tensors: dict[str, TensorInfo] = {}
        self.offset = 0

    def add(self, name: str, values: np.ndarray, qtype: GGMLQuantizationType) -> None:
        values = np.ascontiguousarray(values, dtype=np.float32)
        block = GGML_QUANT_SIZES[qtype][0]
        if values.shape[-1] % block:
            qtype = GGMLQuantizationType.F16  # q8_0 needs whole blocks of 32 per row
        if qtype == GGMLQuantizationType.F32:
            raw = values.copy()
        elif qtype == GGMLQuantizationType.F16:
            raw = values.astype(np.float16)
        else:
            raw = quantize(values, qtype)
        data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        self.tensors[name] = TensorInfo(
            name=name,
            ggml_type=int(qtype),
            shape=tuple(int(s) for s in values.shape),
            n_elements=int(values.size),
            nbytes=int(data.nbytes),
            offset=self.offset,
            data=data,
        )
        self.offset += -(-data.nbytes // ALIGNMENT) * ALIGNMENT

    def matrix(self, name: str, values: np.ndarray) -> None:
        self.add(name, values, self.qtype)

    def vector(self, name: str, values: np.ndarray) -> None:
        self.add(name, values, GGMLQuantizationType.F32)


def _get(tensors: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``name`` of the checkpoint, checked against ``shape`` (-1: any size)."""
    value = tensors.get(name)
    if value is None:
        raise CheckpointError(f"the checkpoint has no {name}")
    arr = np.asarray(value)
    if arr.ndim != len(shape) or any(w not in (-1, g) for w, g in zip(shape, arr.shape, strict=True)):
        raise CheckpointError(f"{name} has shape {arr.shape}, expected {shape}")
    return arr


def _rows(tensors: Mapping[str, np.ndarray], name: str, vocab: int, cols: int) -> np.ndarray:
    """An embedding-like table cut to its first ``vocab`` rows (the rest is padding)."""
    arr = _get(tensors, name, (-1, cols))
    if arr.shape[0] < vocab:
        raise CheckpointError(f"{name} has {arr.shape[0]} rows for a vocabulary of {vocab}")
    return arr[:vocab]


def _metadata(config: NanochatConfig) -> dict[str, Any]:
    """The config's fields and the llama.cpp-style keys of a nanochat view."""
    a = ARCHITECTURE
    meta: dict[str, Any] = {
        "general.architecture": a,
        f"{a}.vocab_size": config.vocab_size,
        f"{a}.block_count": config.n_layer,
        f"{a}.context_length": config.sequence_len,
        f"{a}.embedding_length": config.n_embd,
        f"{a}.feed_forward_length": config.n_ff,
        f"{a}.attention.head_count": config.n_head,
        f"{a}.attention.head_count_kv": config.n_kv_head,
        f"{a}.attention.layer_norm_rms_epsilon": config.norm_eps,
        f"{a}.rope.freq_base": config.rope_theta,
        f"{a}.final_logit_softcapping": config.logit_softcap,
    }
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        meta[CONFIG_PREFIX + field.name] = list(value) if isinstance(value, tuple) else value
    return meta


def config_from_view(gguf: GGUFFile) -> NanochatConfig:
    """The NanochatConfig a view carries (:func:`build_view`'s metadata)."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(NanochatConfig):
        key = CONFIG_PREFIX + field.name
        if key not in gguf.metadata:
            raise CheckpointError(f"{gguf.path}: the view lacks {key}")
        value = gguf.metadata[key]
        values[field.name] = tuple(int(v) for v in value) if isinstance(value, list | tuple) else value
    return NanochatConfig(**values)


def build_view(
    config: NanochatConfig,
    tensors: Mapping[str, np.ndarray],
    *,
    path: Path,
    weights: str = "f32",
    metadata: Mapping[str, Any] | None = None,
) -> GGUFFile:
    """The in-memory GGUF view of a nanochat checkpoint (see the module docstring).

    ``tensors``: float32 arrays under nanochat's state-dict names (no ``_orig_mod.`` prefix);
    ``path``: the checkpoint file (the model's id, and what the KV disk tier fingerprints);
    ``weights``: the type of the matrices and embedding tables; ``metadata``: merged in (the
    tokenizer's keys)."""
    c = config
    d, v, q_dim, kv_dim = c.n_embd, c.vocab_size, c.n_embd, c.kv_dim
    b = _Builder(Path(path), weights)
    b.matrix("token_embd.weight", _rows(tensors, "transformer.wte.weight", v, d))
    b.matrix("output.weight", _rows(tensors, "lm_head.weight", v, d))
    for i in range(c.n_layer):
        p, blk = f"transformer.h.{i}.", f"blk.{i}."
        wq = _get(tensors, p + "attn.c_q.weight", (q_dim, d))
        wk = _get(tensors, p + "attn.c_k.weight", (kv_dim, d))
        b.matrix(blk + "attn_q.weight", _rope_negated(wq, c.n_head))
        b.matrix(blk + "attn_k.weight", _rope_negated(wk, c.n_kv_head))
        b.matrix(blk + "attn_v.weight", _get(tensors, p + "attn.c_v.weight", (kv_dim, d)))
        b.matrix(blk + "attn_output.weight", _get(tensors, p + "attn.c_proj.weight", (d, q_dim)))
        b.matrix(blk + "ffn_up.weight", _get(tensors, p + "mlp.c_fc.weight", (c.n_ff, d)))
        b.matrix(blk + "ffn_down.weight", _get(tensors, p + "mlp.c_proj.weight", (d, c.n_ff)))
        if i in c.ve_layers:
            b.matrix(blk + "value_embd.weight", _rows(tensors, f"value_embeds.{i}.weight", v, kv_dim))
            gate = (c.n_kv_head, c.ve_gate_channels)
            b.vector(blk + "attn_ve_gate.weight", _get(tensors, p + "attn.ve_gate.weight", gate))
    if c.generation != "plain":
        for name in ("resid_lambdas", "x0_lambdas"):
            b.vector(name, _get(tensors, name, (c.n_layer,)))
    if c.smear:
        b.vector("smear_gate.weight", _get(tensors, "smear_gate.weight", (1, -1)).reshape(-1))
        b.vector("smear_lambda", _get(tensors, "smear_lambda", (1,)))
    if c.backout_layer >= 0:
        b.vector("backout_lambda", _get(tensors, "backout_lambda", (1,)))
    meta = _metadata(c)
    meta.update(metadata or {})
    meta["general.architecture"] = ARCHITECTURE
    return GGUFFile(Path(path), 3, meta, b.tensors, ALIGNMENT, 0)
