"""A tiny random llama GGUF writer and a float64 numpy reference of its forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from lmserve_core.testing.gguf_writer import add_arch_metadata


@dataclass
class TinySpec:
    """Geometry and options of a tiny llama GGUF."""

    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 96
    n_head: int = 4
    n_kv_head: int = 2
    n_rot: int = 16  # of head_dim 16: every dim rotates
    n_vocab: int = 128
    rope_base: float = 10000.0
    rope_scaling: tuple[str, float] | None = None
    tied: bool = True
    matrix_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0
    metadata: dict[str, Any] = field(default_factory=dict)  # extra or overriding keys
    drop_metadata: tuple[str, ...] = ()  # keys (without the arch prefix) to leave out
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # extra or overriding f32
    drop_tensors: tuple[str, ...] = ()
    seed: int = 0


def _weights(spec: TinySpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    hd = spec.n_embd // spec.n_head
    q, kv, d, ff = spec.n_head * hd, spec.n_kv_head * hd, spec.n_embd, spec.n_ff

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((spec.n_vocab, d)).astype(np.float32)}
    for i in range(spec.n_layer):
        w |= {
            f"blk.{i}.attn_norm.weight": norm(),
            f"blk.{i}.attn_q.weight": mat(q, d),
            f"blk.{i}.attn_k.weight": mat(kv, d),
            f"blk.{i}.attn_v.weight": mat(kv, d),
            f"blk.{i}.attn_output.weight": mat(d, q),
            f"blk.{i}.ffn_norm.weight": norm(),
            f"blk.{i}.ffn_gate.weight": mat(ff, d),
            f"blk.{i}.ffn_up.weight": mat(ff, d),
            f"blk.{i}.ffn_down.weight": mat(d, ff),
        }
    w["output_norm.weight"] = norm()
    if not spec.tied:
        w["output.weight"] = mat(spec.n_vocab, d)
    return w


def write_tiny_llama(path: Path, spec: TinySpec | None = None) -> dict[str, np.ndarray]:
    """Write the GGUF; returns the weights exactly as stored (dequantized, f32)."""
    spec = spec or TinySpec()
    arch = spec.arch
    keys: dict[str, Any] = {
        "block_count": spec.n_layer,
        "context_length": 256,
        "embedding_length": spec.n_embd,
        "feed_forward_length": spec.n_ff,
        "attention.head_count": spec.n_head,
        "attention.head_count_kv": spec.n_kv_head,
        "rope.freq_base": spec.rope_base,
        "rope.dimension_count": spec.n_rot,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "vocab_size": spec.n_vocab,
    }
    if spec.rope_scaling is not None:
        keys["rope.scaling.type"], keys["rope.scaling.factor"] = spec.rope_scaling
    for key in spec.drop_metadata:
        keys.pop(key, None)

    writer = GGUFWriter(str(path), arch)
    add_arch_metadata(writer, arch, {**keys, **spec.metadata})

    stored: dict[str, np.ndarray] = {}
    weights = _weights(spec) | spec.tensors
    for name, array in weights.items():
        if name in spec.drop_tensors:
            continue
        if array.ndim == 2 and name not in spec.tensors:
            qtype = spec.matrix_type
            data = quantize(array, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
            stored[name] = dequantize(data, qtype).reshape(array.shape)
        else:
            writer.add_tensor(name, array)
            stored[name] = array.astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


# ---------------------------------------------------------------------------- reference


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, n_rot: int, inv_freq: np.ndarray) -> np.ndarray:
    """GGML's NORMAL rope: adjacent pairs (2i, 2i+1) of the first n_rot dims rotate."""
    out = x.copy()
    theta = pos[:, None] * inv_freq[None, :]  # (T, n_rot/2)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    out[..., 0:n_rot:2] = a * cos - b * sin
    out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def reference_forward(
    w: dict[str, np.ndarray],
    spec: TinySpec,
    ids: list[int],
    freq_scale: float = 1.0,
    freq_factors: np.ndarray | None = None,
) -> np.ndarray:
    """float64 logits (len(ids), n_vocab) of the tiny model from position 0."""
    w = {k: v.astype(np.float64) for k, v in w.items() if k != "rope_freqs.weight"}
    inv_freq = freq_scale * spec.rope_base ** (-2.0 * np.arange(spec.n_rot // 2) / spec.n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    hd = spec.n_embd // spec.n_head
    group = spec.n_head // spec.n_kv_head
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = w["token_embd.weight"][ids]
    mask = np.triu(np.full((n, n), -np.inf), k=1)
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        h = _rmsnorm(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T).reshape(n, spec.n_head, hd)
        k = (h @ w[p + "attn_k.weight"].T).reshape(n, spec.n_kv_head, hd)
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, spec.n_kv_head, hd)
        q = _rope(q, pos, spec.n_rot, inv_freq)
        k = _rope(k, pos, spec.n_rot, inv_freq)
        att = np.empty_like(q)
        for head in range(spec.n_head):
            kh, vh = k[:, head // group], v[:, head // group]
            s = q[:, head] @ kh.T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            att[:, head] = (s / s.sum(axis=1, keepdims=True)) @ vh
        x = x + att.reshape(n, -1) @ w[p + "attn_output.weight"].T
        h = _rmsnorm(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    out = w.get("output.weight", w["token_embd.weight"])
    return _rmsnorm(x, w["output_norm.weight"]) @ out.T
