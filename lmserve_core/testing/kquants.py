"""numpy quantizers for GGML's Q4_K, Q5_K and Q6_K blocks, and a Q4_K_M-like type policy.

The ``gguf`` package decodes K-quants but cannot encode them. These encoders produce valid
blocks (the layouts of ggml's ``block_q4_K``, ``block_q5_K`` and ``block_q6_K``) with a
vectorised version of llama.cpp's scale search; the rounding is not bit-identical to
llama.cpp's quantizer, which is not needed: readers only care that blocks decode to what
the writer says they hold (see :func:`lmserve_core.testing.gguf_writer.encode_tensor`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256
BLOCK_BYTES = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}

# Blocks handled per numpy pass: bounds the temporaries to ~100 MB for any tensor size.
_CHUNK_BLOCKS = 1 << 14


def _chunked(
    encode: Callable[[np.ndarray, bool], np.ndarray], qtype: T
) -> Callable[..., np.ndarray]:
    def quantize(data: np.ndarray, search: bool = True) -> np.ndarray:
        """``data`` (..., n) f32, n a multiple of 256 -> uint8 blocks (..., n / 256 * size).

        ``search=False`` skips the scale search (min-max scales): several times faster, for
        random benchmark weights whose accuracy does not matter.
        """
        data = np.asarray(data, dtype=np.float32)
        if data.ndim == 0 or data.shape[-1] % QK_K:
            raise ValueError(
                f"{qtype.name} needs rows that are a multiple of {QK_K}, got shape {data.shape}"
            )
        blocks = data.reshape(-1, QK_K)
        out = np.empty((blocks.shape[0], BLOCK_BYTES[qtype]), dtype=np.uint8)
        for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            stop = start + _CHUNK_BLOCKS
            out[start:stop] = encode(blocks[start:stop], search)
        return out.reshape(*data.shape[:-1], data.shape[-1] // QK_K * BLOCK_BYTES[qtype])

    quantize.__name__ = f"quantize_{qtype.name.lower()}"
    return quantize


def _f16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fp16 bytes of ``values`` (n,) as (n, 2) and the float32 they decode to."""
    with np.errstate(over="ignore"):
        half = values.astype(np.float16)
    return half.reshape(-1, 1).view(np.uint8), half.astype(np.float32)


# ------------------------------------------------------------------ Q4_K / Q5_K (affine)


def _fit_affine(
    x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block ``x ~ scale * L + offset`` with L in [0, nmax] and offset <= 0.

    llama.cpp's make_qkx2_quants, vectorised: try ``nstep`` grid spacings around the
    min-max one, refit scale and offset by weighted least squares for each, keep the best.
    """
    weights = np.sqrt((x * x).mean(axis=-1, keepdims=True)) + np.abs(x)
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    span = hi - lo
    safe = np.where(span > 0, span, 1.0)
    shifted = x - lo[..., None]
    sum_w = weights.sum(axis=-1)
    sum_x = (weights * x).sum(axis=-1)

    def error(scale: np.ndarray, offset: np.ndarray, levels: np.ndarray) -> np.ndarray:
        diff = scale[..., None] * levels + offset[..., None] - x
        return (weights * diff * diff).sum(axis=-1)

    best_scale = np.where(span > 0, span / nmax, 0.0)
    best_offset = lo.copy()
    levels = np.clip(np.rint(shifted / safe[..., None] * nmax), 0, nmax)
    best_err = error(best_scale, best_offset, levels)
    for step in range(nstep):
        inv = (rmin + rdelta * step + nmax) / safe
        levels = np.clip(np.rint(shifted * inv[..., None]), 0, nmax)
        wl = weights * levels
        sum_l = wl.sum(axis=-1)
        sum_l2 = (wl * levels).sum(axis=-1)
        sum_xl = (wl * x).sum(axis=-1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = (det > 0) & (span > 0)
        det = np.where(ok, det, 1.0)
        scale = (sum_w * sum_xl - sum_x * sum_l) / det
        offset = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = offset > 0  # the offset must stay <= 0: refit the scale alone
        scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, 1.0), scale)
        offset = np.where(positive, 0.0, offset)
        err = error(scale, offset, levels)
        better = ok & (err < best_err)
        best_scale = np.where(better, scale, best_scale)
        best_offset = np.where(better, offset, best_offset)
        best_err = np.where(better, err, best_err)
    return best_scale, best_offset


def _affine_blocks(
    blocks: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shared Q4_K/Q5_K step: (d bytes, dmin bytes, packed 12-byte scales, levels (n, 8, 32))."""
    n = blocks.shape[0]
    x = blocks.reshape(n, 8, 32)
    scale, offset = _fit_affine(x, nmax, rmin, rdelta, nstep)
    mins = np.maximum(-offset, 0.0)
    d_bytes, d = _f16(scale.max(axis=-1) / 63)
    dmin_bytes, dmin = _f16(mins.max(axis=-1) / 63)
    d_safe = np.where(d > 0, d, 1.0)[:, None]
    dmin_safe = np.where(dmin > 0, dmin, 1.0)[:, None]
    sc = np.where(d[:, None] > 0, np.clip(np.rint(scale / d_safe), 0, 63), 0).astype(np.uint8)
    m = np.where(dmin[:, None] > 0, np.clip(np.rint(mins / dmin_safe), 0, 63), 0).astype(np.uint8)
    # Levels against the scales actually stored.
    step = (d[:, None] * sc)[..., None]
    low = (dmin[:, None] * m)[..., None]
    levels = np.where(step > 0, np.rint((x + low) / np.where(step > 0, step, 1.0)), 0)
    levels = np.clip(levels, 0, nmax).astype(np.uint8)
    # 6-bit scale/min pairs packed as get_scale_min_k4 unpacks them.
    packed = np.empty((n, 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return d_bytes, dmin_bytes, packed, levels


def _encode_q4_k(blocks: np.ndarray, search: bool) -> np.ndarray:
    d, dmin, scales, q = _affine_blocks(blocks, 15, -1.0, 0.1, 20 if search else 0)
    # 32-byte groups: low nibbles hold sub-block 2j, high nibbles sub-block 2j+1.
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)
    return np.concatenate([d, dmin, scales, qs], axis=1)


def _encode_q5_k(blocks: np.ndarray, search: bool) -> np.ndarray:
    d, dmin, scales, q = _affine_blocks(blocks, 31, -0.5, 0.1, 15 if search else 0)
    low = q & 0x0F
    qs = (low[:, 0::2, :] | (low[:, 1::2, :] << 4)).reshape(-1, 128)
    # Bit j of qh[l] is the fifth bit of element l of sub-block j.
    high = (q >> 4).astype(np.uint8)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j, :] << j
    return np.concatenate([d, dmin, scales, qh, qs], axis=1)


# ------------------------------------------------------------------ Q6_K (symmetric)


def _fit_symmetric(x: np.ndarray, nmin: int, nmax: int, nstep: int) -> np.ndarray:
    """Per sub-block ``x ~ scale * L`` with L in [nmin, nmax]: llama.cpp's make_qx_quants.

    The largest-magnitude value maps to ``nmin`` (the side with one more level); nearby
    grid scales are tried and each refit by least squares weighted with x^2.
    """
    idx = np.abs(x).argmax(axis=-1)[..., None]
    peak = np.take_along_axis(x, idx, axis=-1)[..., 0]
    nonzero = peak != 0
    safe_peak = np.where(nonzero, peak, 1.0)
    weights = x * x
    best_scale = np.where(nonzero, peak / nmin, 0.0)
    levels = np.clip(np.rint(x / np.where(nonzero, best_scale, 1.0)[..., None]), nmin, nmax)
    diff = best_scale[..., None] * levels - x
    best_err = (weights * diff * diff).sum(axis=-1)
    for step in range(-nstep, nstep + 1):
        if step == 0:
            continue
        inv = (nmin + 0.1 * step) / safe_peak
        levels = np.clip(np.rint(x * inv[..., None]), nmin, nmax)
        wl = weights * levels
        sum_l2 = (wl * levels).sum(axis=-1)
        scale = (wl * x).sum(axis=-1) / np.where(sum_l2 > 0, sum_l2, 1.0)
        diff = scale[..., None] * levels - x
        err = (weights * diff * diff).sum(axis=-1)
        better = nonzero & (sum_l2 > 0) & (err < best_err)
        best_scale = np.where(better, scale, best_scale)
        best_err = np.where(better, err, best_err)
    return best_scale


def _encode_q6_k(blocks: np.ndarray, search: bool) -> np.ndarray:
    n = blocks.shape[0]
    x = blocks.reshape(n, 16, 16)
    scale = _fit_symmetric(x, -32, 31, 9 if search else 0)
    d_bytes, d = _f16(np.abs(scale).max(axis=-1) / 127)
    d_safe = np.where(d > 0, d, 1.0)[:, None]
    sc = np.where(d[:, None] > 0, np.clip(np.rint(scale / d_safe), -127, 127), 0).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    levels = np.where(step != 0, np.rint(x / np.where(step != 0, step, 1.0)), 0)
    q = (np.clip(levels, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    # Each 128-element half: ql[l] holds elements l (low nibble) and l + 64 (high nibble);
    # qh[l] holds the top two bits of elements l, l + 32, l + 64, l + 96.
    low = q & 0x0F
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d_bytes], axis=1)


quantize_q4_k = _chunked(_encode_q4_k, T.Q4_K)
quantize_q5_k = _chunked(_encode_q5_k, T.Q5_K)
quantize_q6_k = _chunked(_encode_q6_k, T.Q6_K)

K_QUANTIZERS: dict[T, Callable[..., np.ndarray]] = {
    T.Q4_K: quantize_q4_k,
    T.Q5_K: quantize_q5_k,
    T.Q6_K: quantize_q6_k,
}


# ------------------------------------------------------------------ type policy

# A 256-block type that a row length rules out falls back to a 32-block one, as llama.cpp's
# tensor_type_fallback does; F16 when even that does not fit.
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

_LAYER = re.compile(r"^blk\.(\d+)\.")


def _more_bits(i_layer: int, n_layer: int) -> bool:
    # llama.cpp's use_more_bits: the first and last eighth, and every third layer between.
    return (
        i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2
    )


def fit_row_length(qtype: T, row_length: int) -> T:
    """``qtype``, or what llama.cpp falls back to when ``row_length`` does not fit its block."""
    from gguf.constants import GGML_QUANT_SIZES

    if row_length % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if row_length % GGML_QUANT_SIZES[qtype][0] == 0 else T.F16


def q4_k_m_type(
    name: str, shape: tuple[int, ...], n_layer: int, n_expert: int = 0, tied: bool = True
) -> T:
    """The type llama-quantize's Q4_K_M would give tensor ``name`` (numpy ``shape``).

    Follows llama.cpp's llama_tensor_get_type for the tensors of llama-like models: 1-D
    tensors and ``ffn_gate_inp`` stay F32; the output (the token embedding when tied) is
    Q6_K; ``attn_v`` and ``ffn_down`` are Q6_K on the layers ``use_more_bits`` picks; with
    exactly 8 experts ``attn_k``/``attn_v`` are Q8_0 and ``attn_output`` Q5_K; else Q4_K.
    Rows that do not fit a 256-element block fall back like llama.cpp's (Q8_0 for an output).
    """
    if len(shape) < 2 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name:
        return T.F32
    row = shape[-1]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return T.Q6_K if row % QK_K == 0 else T.Q8_0
    match = _LAYER.match(name)
    layer = int(match.group(1)) if match else 0
    qtype = T.Q4_K
    if ".attn_v." in name:
        if _more_bits(layer, n_layer):
            qtype = T.Q6_K
        if n_expert == 8:
            qtype = T.Q8_0
    elif ".attn_k." in name:
        if n_expert == 8:
            qtype = T.Q8_0
    elif ".attn_output." in name:
        if n_expert == 8:
            qtype = T.Q5_K
    elif ".ffn_down" in name and _more_bits(layer, n_layer):
        qtype = T.Q6_K
    return fit_row_length(qtype, row)
