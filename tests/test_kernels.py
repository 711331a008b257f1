"""Shared native kernels: block formats, every ISA path, matmul, leaf ops, attention, pool."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from lmserve_core import native
from lmserve_core.native import kernels as K
from lmserve_core.testing import q2_0

pytestmark = pytest.mark.usefixtures("restore_isa")

QT = K.QuantType
ALL_TYPES = list(QT)
K_TYPES = {QT.Q4_K, QT.Q5_K, QT.Q6_K}
# byte offsets of the f16 scale fields of the K-quant blocks built from random bytes
K_SCALE_FIELDS = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
# the two layouts of GGML type 42, which the gguf package does not know (tests/test_q2_0.py)
Q2_TYPES = {QT.Q2_0, QT.Q2_0_128}


# ------------------------------------------------------------------ helpers
def make_rows(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights of ``qtype``: (rows, row_bytes) uint8."""
    if qtype == QT.F32:
        return rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint8)
    if qtype in Q2_TYPES:
        return q2_0.random_blocks(rng, int(qtype), rows, cols)
    if qtype in K_TYPES:
        # gguf-py cannot quantize K-types: random bytes give random quants, scales and mins;
        # only the f16 super-block scales must be sane numbers.
        nblocks = rows * cols // K.block_elems(qtype)
        raw = rng.integers(0, 256, (nblocks, K.block_bytes(qtype)), dtype=np.uint8)
        for off in K_SCALE_FIELDS[qtype]:
            scale = rng.uniform(-0.05, 0.05, nblocks).astype(np.float16)
            raw[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
        return raw.reshape(rows, -1)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    return quantize(w, gguf.GGMLQuantizationType(int(qtype)))


def reference(qtype: QT, raw: np.ndarray, cols: int) -> np.ndarray:
    """gguf-py's numpy dequantization as (rows, cols) float32."""
    if qtype == QT.F32:
        return raw.view(np.float32).reshape(-1, cols)
    if qtype in Q2_TYPES:
        return q2_0.decode(raw, int(qtype)).reshape(-1, cols)
    out = dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))
    return np.asarray(out, dtype=np.float32).reshape(-1, cols)


def assert_dot_close(got: np.ndarray, want: np.ndarray, scale: np.ndarray, rel: float) -> None:
    """|got - want| <= rel * scale elementwise, scale being sum |w| |x| (the rounding bound)."""
    got, want, scale = (np.asarray(a, dtype=np.float64) for a in (got, want, scale))
    err = np.abs(got - want)
    bound = rel * scale + 1e-30
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


PRECISIONS = list(K.DecodePrecision)


def i16_bound(ref: np.ndarray, x: np.ndarray) -> np.ndarray:
    """What int16 activations may add to y = x . ref^T: per group of 32, its step / 2 times
    the sum of |w| over the group (ntok, rows)."""
    x = np.asarray(x, dtype=np.float64)
    groups = x.reshape(x.shape[0], -1, 32)
    half_step = np.abs(groups).max(axis=2) / 32767 / 2  # (ntok, groups)
    wsum = np.abs(ref).reshape(ref.shape[0], -1, 32).sum(axis=2)  # (rows, groups)
    return half_step @ wsum.T


def assert_matmul_close(got, want, scale, precision, ref, x) -> None:
    """Within f32 rounding, plus the activations' rounding on the integer path."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    extra = i16_bound(ref, x) if precision == K.DecodePrecision.I16 else 0.0
    err = np.abs(got - want)
    bound = 1e-5 * scale + extra * 1.001 + 1e-30
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


SIMD_ISAS = [isa for isa in K.Isa if isa != K.Isa.PORTABLE]


def require(isa: K.Isa) -> None:
    if isa not in K.available_isas():
        pytest.skip(f"CPU lacks {isa.name}")


# ------------------------------------------------------------------ geometry
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_block_geometry_matches_ggml(qtype: QT) -> None:
    if qtype in Q2_TYPES:
        elems, nbytes = q2_0.block(int(qtype))
    else:
        elems, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(qtype))]
    assert K.block_elems(qtype) == elems
    assert K.block_bytes(qtype) == nbytes
    assert K.row_bytes(qtype, 4 * elems) == 4 * nbytes


def test_row_bytes_rejects_partial_blocks_and_unknown_types() -> None:
    with pytest.raises(ValueError):
        K.row_bytes(QT.Q4_0, 33)
    with pytest.raises(ValueError):
        K.row_bytes(QT.Q6_K, 128)
    with pytest.raises(TypeError):
        K.row_bytes(5, 32)  # a GGML id we do not support
    from lmserve_core._kernels import lib

    assert lib.lm_row_bytes(QT.Q8_0, -32) < 0
    assert lib.lm_type_block_elems(5) <= 0


# ------------------------------------------------------------------ dequantize
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_portable_dequantize_equals_gguf(qtype: QT, rng: np.random.Generator) -> None:
    cols = 512
    raw = make_rows(qtype, 6, cols, rng)
    ref = reference(qtype, raw, cols)
    K.select_isa(K.Isa.PORTABLE)
    for r in range(raw.shape[0]):
        np.testing.assert_array_equal(K.dequantize_row(qtype, raw[r], cols), ref[r])


@pytest.mark.parametrize("isa", SIMD_ISAS, ids=lambda i: i.name)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_simd_dequantize_is_bit_identical(qtype: QT, isa: K.Isa, rng) -> None:
    require(isa)
    cols = 512 + (0 if K.block_elems(qtype) > 1 else 13)  # odd tails for element types
    raw = make_rows(qtype, 3, cols, rng) if qtype not in (QT.F16, QT.BF16, QT.F32) else None
    if raw is None:
        base = make_rows(qtype, 3, 512, rng)
        raw = np.concatenate([base, base[:, : 13 * base.shape[1] // 512]], axis=1)
    with K.use_isa(K.Isa.PORTABLE):
        want = [K.dequantize_row(qtype, row, cols) for row in raw]
    with K.use_isa(isa):
        got = [K.dequantize_row(qtype, row, cols) for row in raw]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_half_conversion_handles_special_values() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    for isa in K.available_isas():
        with K.use_isa(isa):
            got = K.dequantize_row(QT.F16, bits.view(np.uint8), bits.size)
        np.testing.assert_array_equal(got, want)  # NaNs compare equal positionally


def test_bf16_is_the_upper_half_of_f32(rng) -> None:
    f = rng.standard_normal(64, dtype=np.float32)
    bf = (f.view(np.uint32) >> 16).astype(np.uint16)
    want = (bf.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(K.dequantize_row(QT.BF16, bf.view(np.uint8), 64), want)


# ------------------------------------------------------------------ dot products
@pytest.mark.parametrize("isa", [K.Isa.PORTABLE, *SIMD_ISAS], ids=lambda i: i.name)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_vec_dot_matches_reference(qtype: QT, isa: K.Isa, rng) -> None:
    require(isa)
    cols = 1024
    raw = make_rows(qtype, 8, cols, rng)
    ref = reference(qtype, raw, cols).astype(np.float64)
    x = rng.standard_normal(cols, dtype=np.float32)
    with K.use_isa(isa):
        got = np.array([K.vec_dot(qtype, row, x) for row in raw])
    with K.use_isa(K.Isa.PORTABLE):
        portable = np.array([K.vec_dot(qtype, row, x) for row in raw])
    scale = np.abs(ref) @ np.abs(x.astype(np.float64))
    assert_dot_close(got, ref @ x, scale, 1e-5)
    assert_dot_close(got, portable, scale, 1e-5)


# ------------------------------------------------------------------ matmul
@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.name)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_numpy(qtype: QT, precision: K.DecodePrecision, rng) -> None:
    K.select_decode_precision(precision)
    cols = 512
    rows = 45  # not a multiple of any row tile
    raw = make_rows(qtype, rows, cols, rng)
    ref = reference(qtype, raw, cols).astype(np.float64)
    x = rng.standard_normal((64, cols), dtype=np.float32)
    pools = {"inline": None, "1": K.Pool(1), "2": K.Pool(2), "3": K.Pool(3)}
    try:
        for isa in K.available_isas():
            with K.use_isa(isa):
                for ntok in (1, 3, 17, 64):
                    xs = x[:ntok]
                    want = xs.astype(np.float64) @ ref.T
                    scale = np.abs(xs.astype(np.float64)) @ np.abs(ref).T
                    for name, pool in pools.items():
                        got = K.matmul(qtype, raw, rows, cols, xs, pool=pool)
                        assert got.shape == (ntok, rows), (isa, ntok, name)
                        # only the few-token products (the dot path) take int16 activations
                        p = precision if ntok < 32 else K.DecodePrecision.F32
                        assert_matmul_close(got, want, scale, p, ref, xs)
    finally:
        for pool in pools.values():
            if pool is not None:
                pool.close()


@pytest.mark.parametrize("isa", SIMD_ISAS, ids=lambda i: i.name)
@pytest.mark.parametrize(
    "qtype", [QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.F16], ids=lambda t: t.name
)
@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.name)
def test_matmul_simd_matches_portable(
    qtype: QT, isa: K.Isa, precision: K.DecodePrecision, rng
) -> None:
    require(isa)
    K.select_decode_precision(precision)
    cols, rows = 768, 70
    raw = make_rows(qtype, rows, cols, rng)
    ref = reference(qtype, raw, cols).astype(np.float64)
    with K.Pool(2) as pool:
        for ntok in (1, 2, 5, 13, 40):
            x = rng.standard_normal((ntok, cols), dtype=np.float32)
            scale = np.abs(x.astype(np.float64)) @ np.abs(ref).T
            with K.use_isa(K.Isa.PORTABLE):
                want = K.matmul(qtype, raw, rows, cols, x, pool=pool)
            with K.use_isa(isa):
                got = K.matmul(qtype, raw, rows, cols, x, pool=pool)
            # the same int16 activations on both paths: only f32 rounding differs
            assert_dot_close(got, want, scale, 1e-5)


def test_matmul_is_deterministic_per_isa_and_thread_count(rng) -> None:
    cols, rows = 576, 100
    raw = make_rows(QT.Q4_1, rows, cols, rng)
    x = rng.standard_normal((33, cols), dtype=np.float32)
    with K.Pool(2) as pool:
        first = K.matmul(QT.Q4_1, raw, rows, cols, x, pool=pool)
        for _ in range(3):
            np.testing.assert_array_equal(K.matmul(QT.Q4_1, raw, rows, cols, x, pool=pool), first)


def test_matmul_vector_input_and_empty_shapes(rng) -> None:
    K.select_decode_precision(K.DecodePrecision.F32)
    raw = make_rows(QT.Q8_0, 7, 64, rng)
    x = rng.standard_normal(64, dtype=np.float32)
    y = K.matmul(QT.Q8_0, raw, 7, 64, x)
    assert y.shape == (7,)
    np.testing.assert_allclose(y, reference(QT.Q8_0, raw, 64) @ x, rtol=1e-5, atol=1e-5)
    assert K.matmul(QT.Q8_0, raw, 7, 64, np.zeros((0, 64), np.float32)).shape == (0, 7)


def test_get_rows(rng) -> None:
    raw = make_rows(QT.Q6_K, 10, 256, rng)
    ref = reference(QT.Q6_K, raw, 256)
    ids = np.array([3, 0, 9, 3], dtype=np.int32)
    np.testing.assert_array_equal(K.get_rows(QT.Q6_K, raw, 10, 256, ids), ref[ids])
    with pytest.raises(ValueError):
        K.get_rows(QT.Q6_K, raw, 10, 256, [10])
    with pytest.raises(ValueError):
        K.get_rows(QT.Q6_K, raw, 10, 256, [-1])


# ------------------------------------------------------------------ int16 activations
def test_decode_precision_is_int16_by_default_and_selectable() -> None:
    from lmserve_core._kernels import lib

    assert K.decode_precision() == K.DecodePrecision.I16
    with K.use_decode_precision(K.DecodePrecision.F32) as chosen:
        assert chosen == K.DecodePrecision.F32 == K.decode_precision()
    assert K.decode_precision() == K.DecodePrecision.I16
    with pytest.raises(ValueError):
        K.select_decode_precision(5)
    assert lib.lm_decode_precision_select(-1) == lib.LM_EINVAL
    assert K.DECODE_PRECISIONS == {"int16": K.DecodePrecision.I16, "f32": K.DecodePrecision.F32}


def test_quantize_x16_rounds_to_nearest_and_is_identical_on_every_isa(rng) -> None:
    x = rng.standard_normal(32 * 40).astype(np.float32) * np.repeat(
        np.logspace(-30, 30, 40, dtype=np.float32), 32
    )
    x[32 * 3 : 32 * 4] = 0.0  # a group of zeros
    x[32 * 5 + 7] = 1.0  # a group whose maximum is exactly one value
    got = {}
    for isa in K.available_isas():
        with K.use_isa(isa):
            got[isa] = K.quantize_x16(x)
    q, ds = got[K.Isa.PORTABLE]
    for isa, (qi, dsi) in got.items():
        np.testing.assert_array_equal(qi, q, err_msg=isa.name)
        np.testing.assert_array_equal(dsi[:, 0], ds[:, 0], err_msg=isa.name)
        np.testing.assert_allclose(dsi[:, 1], ds[:, 1], rtol=1e-5, atol=0, err_msg=isa.name)
    groups = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(groups).max(axis=1)
    np.testing.assert_array_equal(ds[:, 0], amax.astype(np.float32) / np.float32(32767))
    np.testing.assert_allclose(ds[:, 1], groups.sum(axis=1), rtol=1e-5)
    inv = np.where(amax > 0, np.float32(32767) / amax.astype(np.float32), 0).astype(np.float32)
    want = np.rint(groups.astype(np.float32) * inv[:, None]).astype(np.int16)  # ties to even
    np.testing.assert_array_equal(q.reshape(-1, 32), want)
    assert np.abs(q).max() == 32767
    assert not q[32 * 3 : 32 * 4].any()


def test_quantize_x16_marks_non_finite_groups() -> None:
    x = np.ones(96, np.float32)
    x[40] = np.nan
    x[70] = np.inf
    for isa in K.available_isas():
        with K.use_isa(isa):
            q, ds = K.quantize_x16(x)
        assert np.isfinite(ds[0]).all() and np.isnan(ds[1:]).all(), isa.name
        assert not q[32:].any()
    with pytest.raises(ValueError):
        K.quantize_x16(np.ones(48, np.float32))


BLOCK_TYPES = [t for t in ALL_TYPES if K.block_elems(t) > 1]


def wide_cols(qtype: QT) -> int:
    """A row of more than 64 groups of 32 whose count is not a multiple of 8 where the block
    allows it: the SIMD products prepare group factors 64 groups at a time, 8 per vector."""
    return {256: 2304, 128: 2432, 64: 2368}.get(K.block_elems(qtype), 2336)


@pytest.mark.parametrize("wide", [False, True], ids=["1024", "wide"])
@pytest.mark.parametrize("isa", [K.Isa.PORTABLE, *SIMD_ISAS], ids=lambda i: i.name)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_vec_dot_i16_within_the_activations_rounding(
    qtype: QT, isa: K.Isa, wide: bool, rng
) -> None:
    require(isa)
    cols = wide_cols(qtype) if wide else 1024
    raw = make_rows(qtype, 8, cols, rng)
    ref = reference(qtype, raw, cols).astype(np.float64)
    # groups of very different sizes: each has its own step
    x = (rng.standard_normal(cols) * np.repeat(rng.uniform(0.01, 10, cols // 32), 32)).astype(
        np.float32
    )
    with K.use_isa(isa):
        got = np.array([K.vec_dot_i16(qtype, row, x) for row in raw])
    with K.use_isa(K.Isa.PORTABLE):
        portable = np.array([K.vec_dot_i16(qtype, row, x) for row in raw])
    scale = np.abs(ref) @ np.abs(x.astype(np.float64))
    bound = i16_bound(ref, x[None])[0]
    assert np.all(np.abs(got - ref @ x) <= 1e-5 * scale + bound)
    # the same integers on every path; the float sums may round differently
    assert_dot_close(got, portable, scale, 1e-5)
    # and the rounding is that of int16, far below the bound of int8 activations
    assert np.abs(got - ref @ x).max() < bound.max() / 4


@pytest.mark.parametrize("isa", SIMD_ISAS, ids=lambda i: i.name)
@pytest.mark.parametrize("qtype", [t for t in BLOCK_TYPES if K.block_elems(t) == 32], ids=str)
def test_i16_products_of_every_group_count(qtype: QT, isa: K.Isa, rng) -> None:
    """Rows of 1 to 7 groups and with 1, 2 or 3 groups past a multiple of four (kernels that
    take four groups at a time finish a row with a partial quad), alone and batched."""
    require(isa)
    K.select_decode_precision(K.DecodePrecision.I16)
    for groups in (1, 2, 3, 4, 5, 6, 7, 17, 18, 19):
        cols, rows = 32 * groups, 9
        raw = make_rows(qtype, rows, cols, rng)
        x = rng.standard_normal((5, cols), dtype=np.float32)
        with K.use_isa(K.Isa.PORTABLE):
            want = K.matmul(qtype, raw, rows, cols, x)
        with K.use_isa(isa):
            got = K.matmul(qtype, raw, rows, cols, x)
            alone = np.stack([K.matmul(qtype, raw, rows, cols, x[t : t + 1])[0] for t in range(5)])
        scale = np.abs(x.astype(np.float64)) @ np.abs(reference(qtype, raw, cols)).T
        assert_dot_close(got, want, scale, 1e-5)
        np.testing.assert_array_equal(got, alone, err_msg=f"{groups} groups")


def test_vec_dot_i16_refuses_element_types() -> None:
    with pytest.raises(TypeError):
        K.vec_dot_i16(QT.F16, np.zeros(64, np.uint8), np.ones(32, np.float32))


@pytest.mark.parametrize("wide", [False, True], ids=["512", "wide"])
@pytest.mark.parametrize(
    "qtype",
    [QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q4_K, QT.Q6_K, QT.Q2_0, QT.Q2_0_128],
    ids=lambda t: t.name,
)
def test_i16_rows_do_not_depend_on_the_batch_or_the_threads(qtype: QT, wide: bool, rng) -> None:
    """A token's products are the same alone, in a batch of any size or at any thread count
    (what lets a batched decode give the outputs of sequential ones)."""
    K.select_decode_precision(K.DecodePrecision.I16)
    cols, rows = (wide_cols(qtype) if wide else 512), 83
    raw = make_rows(qtype, rows, cols, rng)
    most = K.DECODE_MAX_ROWS
    x = rng.standard_normal((most, cols), dtype=np.float32)
    alone = np.stack([K.matmul(qtype, raw, rows, cols, x[t : t + 1])[0] for t in range(most)])
    for threads in (1, 2, 3):
        with K.Pool(threads) as pool:
            for ntok in (2, 5, 13, most):
                got = K.matmul(qtype, raw, rows, cols, x[:ntok], pool=pool)
                np.testing.assert_array_equal(got, alone[:ntok], err_msg=f"{threads} {ntok}")


def test_i16_products_propagate_nan(rng) -> None:
    K.select_decode_precision(K.DecodePrecision.I16)
    raw = make_rows(QT.Q4_1, 4, 64, rng)
    x = np.ones((2, 64), np.float32)
    x[1, 40] = np.nan
    y = K.matmul(QT.Q4_1, raw, 4, 64, x)
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()


# ------------------------------------------------------------------ bad arguments
def test_bad_arguments_raise_instead_of_crashing(rng) -> None:
    raw = make_rows(QT.Q4_0, 4, 64, rng)
    x = np.ones(64, np.float32)
    with pytest.raises(ValueError):
        K.vec_dot(QT.Q4_0, raw[0], np.ones(48, np.float32))  # not whole blocks
    with pytest.raises(ValueError):
        K.vec_dot(QT.Q4_0, raw[0], np.ones(128, np.float32))  # row too short
    with pytest.raises(TypeError):
        K.vec_dot(4, raw[0], x)
    with pytest.raises(TypeError):
        K.dequantize_row(99, raw[0], 32)
    with pytest.raises(ValueError):
        K.matmul(QT.Q4_0, raw, 5, 64, x)  # more rows than bytes
    with pytest.raises(ValueError):
        K.matmul(QT.Q4_0, raw, 4, 64, np.ones((2, 32), np.float32))
    with pytest.raises(ValueError):
        K.select_isa(7)
    with pytest.raises(ValueError):
        K.attention(np.ones((1, 3, 8)), np.ones((1, 2, 8)), np.ones((1, 2, 8)), 0, 1.0)
    with pytest.raises(ValueError):
        K.attention(np.ones((2, 2, 8)), np.ones((2, 2, 8)), np.ones((2, 2, 8)), 1, 1.0)


def test_c_entry_points_return_status_codes() -> None:
    from lmserve_core._kernels import ffi, lib

    null = ffi.NULL
    out = ffi.new("float[4]")
    assert lib.lm_vec_dot(QT.Q4_0, null, out, 32, out) == lib.LM_EINVAL
    assert lib.lm_vec_dot(5, null, out, 32, out) == lib.LM_ETYPE
    assert lib.lm_dequantize_row(QT.Q8_0, ffi.new("uint8_t[34]"), out, 31) == lib.LM_EINVAL
    assert lib.lm_matmul(null, QT.F32, null, 1, 4, out, 1, out) == lib.LM_EINVAL
    assert lib.lm_matmul(null, 31, out, 1, 4, out, 1, out) == lib.LM_ETYPE
    assert lib.lm_matmul(null, QT.F32, out, -1, 4, out, 1, out) == lib.LM_EINVAL
    assert lib.lm_attention(null, out, out, out, out, 1, 0, 3, 2, 4, 1.0, 0, 0.0) == lib.LM_EINVAL
    assert lib.lm_attention(null, null, out, out, out, 1, 0, 2, 2, 4, 1.0, 0, 0.0) == lib.LM_EINVAL
    assert lib.lm_isa_select(-1) == lib.LM_EINVAL


def test_isa_selection() -> None:
    assert K.isa_active() in K.available_isas()
    assert K.available_isas()[0] == K.Isa.PORTABLE
    with K.use_isa(K.Isa.PORTABLE):
        assert K.isa_active() == K.Isa.PORTABLE
    assert K.isa_best() == K.available_isas()[-1]
    for isa in K.Isa:
        if isa not in K.available_isas():
            with pytest.raises(K.KernelIsaError):
                K.select_isa(isa)


# ------------------------------------------------------------------ leaf ops
def test_rmsnorm(rng) -> None:
    x = rng.standard_normal((3, 576), dtype=np.float32) * 3
    w = rng.standard_normal(576, dtype=np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(K.rmsnorm(x, w, 1e-5), want * w, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(K.rmsnorm(x, None, 1e-5), want, rtol=2e-6, atol=2e-6)


def rope_reference(x, n_rot, pos, base, scale, neox):
    out = x.astype(np.float64).copy()
    half = n_rot // 2
    theta = pos * scale * base ** (-2.0 * np.arange(half) / n_rot)
    cos, sin = np.cos(theta), np.sin(theta)
    if neox:
        a, b = np.arange(half), np.arange(half) + half
    else:
        a, b = 2 * np.arange(half), 2 * np.arange(half) + 1
    x0, x1 = out[:, a].copy(), out[:, b].copy()
    out[:, a] = x0 * cos - x1 * sin
    out[:, b] = x0 * sin + x1 * cos
    return out


@pytest.mark.parametrize("mode", [K.RopeMode.NORMAL, K.RopeMode.NEOX], ids=str)
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope(mode, n_rot, rng) -> None:
    x = rng.standard_normal((5, 64), dtype=np.float32)
    for pos, base, scale in ((0, 10000.0, 1.0), (7, 10000.0, 1.0), (93, 1e6, 0.25)):
        got = K.rope(x, n_rot, pos, base, scale, mode)
        want = rope_reference(x, n_rot, pos, base, scale, mode == K.RopeMode.NEOX)
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-5)
        # dims past n_rot are untouched
        np.testing.assert_array_equal(got[:, n_rot:], x[:, n_rot:])


@pytest.mark.parametrize("isa", list(K.Isa), ids=lambda i: i.name)
def test_softmax_is_stable(isa, rng) -> None:
    require(isa)
    x = rng.standard_normal(1001).astype(np.float32) * 30 + 500
    x[::7] = -np.inf  # masked logits
    e = np.exp(x.astype(np.float64) - x.max())
    with K.use_isa(isa):
        got = K.softmax(x)
    np.testing.assert_allclose(got, e / e.sum(), rtol=2e-6, atol=1e-12)
    assert np.all(got[::7] == 0.0)
    assert np.isfinite(got).all() and abs(got.sum() - 1) < 1e-5


@pytest.mark.parametrize("isa", list(K.Isa), ids=lambda i: i.name)
def test_activations_and_elementwise(isa, rng) -> None:
    g = rng.standard_normal(301).astype(np.float32) * 4  # odd length: SIMD tails
    g[:4] = [-200.0, 200.0, 0.0, -1e-8]
    u = rng.standard_normal(301).astype(np.float32)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    silu = g64 / (1 + np.exp(-g64)) * u64
    gelu = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64**3))) * u64
    # float32 evaluation of the gate argument limits accuracy far in the negative tail,
    # where the result is tiny next to |g * u|
    bound_scale = 1e-6 * np.abs(g64 * u64)
    require(isa)
    with K.use_isa(isa):
        for got, want in ((K.silu_mul(g, u), silu), (K.gelu_mul(g, u), gelu)):
            assert np.all(np.abs(got - want) <= 2e-6 * np.abs(want) + bound_scale)
        np.testing.assert_array_equal(K.add(g, u), g + u)
        np.testing.assert_array_equal(K.scale(g, 0.5), g * np.float32(0.5))


# ------------------------------------------------------------------ attention
def attention_reference(q, k, v, pos0, scale, window=0, softcap=0.0):
    ntok, n_head, hd = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    out = np.zeros((ntok, n_head, hd))
    for t in range(ntok):
        pos = pos0 + t
        lo = max(0, pos - window + 1) if window > 0 else 0
        for h in range(n_head):
            kk = k[lo : pos + 1, h // group].astype(np.float64)
            vv = v[lo : pos + 1, h // group].astype(np.float64)
            s = kk @ q[t, h].astype(np.float64) * scale
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vv
    return out


@pytest.mark.parametrize(
    ("n_head", "n_kv", "window", "softcap"),
    [(4, 4, 0, 0.0), (6, 2, 0, 0.0), (4, 1, 5, 0.0), (4, 2, 0, 50.0), (4, 2, 3, 20.0)],
)
@pytest.mark.parametrize(("ntok", "hd"), [(1, 64), (3, 40), (17, 64), (12, 80), (2, 80)])
def test_attention_matches_reference(n_head, n_kv, window, softcap, ntok, hd, rng) -> None:
    # few tokens take the per-(token, head) path, many the tiled one; odd head sizes
    # exercise the vector tails
    pos0 = 23
    n_ctx = pos0 + ntok + 3  # rows past the last query position must be ignored
    q = rng.standard_normal((ntok, n_head, hd), dtype=np.float32)
    k = rng.standard_normal((n_ctx, n_kv, hd), dtype=np.float32)
    v = rng.standard_normal((n_ctx, n_kv, hd), dtype=np.float32)
    scale = hd**-0.5
    want = attention_reference(q, k, v, pos0, scale, window, softcap)
    with K.Pool(2) as pool:
        for isa in K.available_isas():
            with K.use_isa(isa):
                for p in (None, pool):
                    got = K.attention(q, k, v, pos0, scale, window, softcap, pool=p)
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("ntok", [1, 12, 40])
def test_attention_window_far_from_the_start(ntok, rng) -> None:
    # the window's first key lies past whole key tiles, which the tiled path skips
    pos0, window, hd = 150, 9, 32
    q = rng.standard_normal((ntok, 4, hd), dtype=np.float32)
    k = rng.standard_normal((pos0 + ntok, 2, hd), dtype=np.float32)
    v = rng.standard_normal((pos0 + ntok, 2, hd), dtype=np.float32)
    k[: pos0 - window + 1] = np.nan  # before every query's window: must not leak in
    v[: pos0 - window + 1] = np.nan
    want = attention_reference(q, k, v, pos0, 0.2, window)
    for isa in K.available_isas():
        with K.use_isa(isa):
            got = K.attention(q, k, v, pos0, 0.2, window)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("ntok", [1, 3])
def test_attention_long_context_decode(ntok, window, rng) -> None:
    # many key chunks, merged; with ntok=3 the first token has one chunk fewer than the last
    pos0, hd = 670, 64
    q = rng.standard_normal((ntok, 4, hd), dtype=np.float32)
    k = rng.standard_normal((pos0 + ntok, 2, hd), dtype=np.float32)
    v = rng.standard_normal((pos0 + ntok, 2, hd), dtype=np.float32)
    want = attention_reference(q, k, v, pos0, hd**-0.5, window)
    with K.Pool(2) as pool:
        for isa in K.available_isas():
            with K.use_isa(isa):
                for p in (None, pool):
                    got = K.attention(q, k, v, pos0, hd**-0.5, window, pool=p)
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_attention_ignores_future_cache_rows(rng) -> None:
    q = rng.standard_normal((1, 2, 16), dtype=np.float32)
    k = rng.standard_normal((10, 2, 16), dtype=np.float32)
    v = rng.standard_normal((10, 2, 16), dtype=np.float32)
    first = K.attention(q, k, v, 4, 0.25)
    k[5:], v[5:] = 1e6, np.nan
    np.testing.assert_array_equal(K.attention(q, k, v, 4, 0.25), first)


# ------------------------------------------------------------------ pool
def test_pool_lifecycle_and_size() -> None:
    for n in (1, 2, 4):
        with K.Pool(n) as pool:
            assert pool.size == n
    pool = K.Pool(0)
    assert pool.size >= 1
    pool.close()
    pool.close()  # idempotent


def test_pool_wakes_sleeping_workers(rng) -> None:
    raw = make_rows(QT.Q8_0, 64, 256, rng)
    x = rng.standard_normal((8, 256), dtype=np.float32)
    want = K.matmul(QT.Q8_0, raw, 64, 256, x)
    with K.Pool(3) as pool:
        for _ in range(3):
            time.sleep(0.01)  # longer than the spin phase: workers are asleep
            np.testing.assert_array_equal(K.matmul(QT.Q8_0, raw, 64, 256, x, pool=pool), want)


def test_pool_shared_by_concurrent_callers(rng) -> None:
    raw = make_rows(QT.Q4_K, 96, 512, rng)
    x = rng.standard_normal((20, 512), dtype=np.float32)
    want = K.matmul(QT.Q4_K, raw, 96, 512, x)
    errors: list[BaseException] = []

    with K.Pool(2) as pool:

        def work() -> None:
            try:
                for _ in range(20):
                    got = K.matmul(QT.Q4_K, raw, 96, 512, x, pool=pool)
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]


# ------------------------------------------------------------------ build helpers
def test_compile_args_switches() -> None:
    default = native.compile_args({})
    assert "-O3" in default and "-O0" not in default and "-DLM_NO_SIMD" not in default
    assert "-ffp-contract=off" in default
    debug = native.compile_args({"LMSERVE_NATIVE_DEBUG": "1"})
    assert "-O0" in debug and "-g" in debug and "-O3" not in debug
    assert native.compile_args({"LMSERVE_NATIVE_DEBUG": "0"}) == default
    assert "-DLM_NO_SIMD" in native.compile_args({"LMSERVE_NATIVE_PORTABLE": "yes"})


def test_sources_headers_and_cdef_agree() -> None:
    include = Path(native.get_include())
    header = (include / "lmserve" / "kernels.h").read_text()
    sources = [Path(p) for p in native.get_sources()]
    assert all(p.is_absolute() and p.exists() for p in sources)
    assert {p.name for p in sources} >= {"types.c", "matmul.c", "pool.c", "attention.c", "kit.c"}
    impl = (include / "lmserve" / "kernels_impl.h").read_text()
    assert {p.name for p in sources} == set(re.findall(r'#include "\.\./\.\./src/(\w+\.c)"', impl))
    assert "kernels_impl.h" in native.kernels_source()
    # the cdef is cut from the header, so every declared function must sit inside the region
    declared = set(re.findall(r"\b(lm_\w+)\s*\(", header))
    cdef = native.get_cdef()
    assert declared == set(re.findall(r"\b(lm_\w+)\s*\(", cdef))
    from lmserve_core._kernels import lib

    assert all(hasattr(lib, name) for name in declared)
    # every function of the kit table is a core function with the same name
    api = (include / "lmserve" / "api.h").read_text()
    table = set(re.findall(r"X\((?:[\w *]+,[\s\\]*)?(lm_\w+),[\s\\]*\(", api))
    assert {"lm_matmul", "lm_self_attention", "lm_moe_ffn", "lm_base_free"} <= table
    assert table <= declared


@pytest.mark.parametrize("pair", list(K.DECODE_LAYOUTS.items()), ids=lambda p: f"{QT(p[0]).name}")
def test_decode_layouts_hold_the_same_values(pair: tuple[int, int], rng) -> None:
    """A matrix relaid for decode decodes to the same floats and gives the same products,
    bit for bit, at either precision."""
    src, dst = pair
    rows, cols = 37, 640
    raw = make_rows(QT(src), rows, cols, rng)
    relaid = K.convert_row(src, raw, dst, rows * cols)
    assert relaid.nbytes == K.row_bytes(dst, rows * cols)
    np.testing.assert_array_equal(
        K.dequantize_row(src, raw, rows * cols), K.dequantize_row(dst, relaid, rows * cols)
    )
    x = rng.standard_normal((5, cols), dtype=np.float32)
    for precision in K.DecodePrecision:
        with K.use_decode_precision(precision):
            np.testing.assert_array_equal(
                K.matmul(src, raw, rows, cols, x), K.matmul(dst, relaid, rows, cols, x)
            )
    with pytest.raises(K.KernelError):
        K.convert_row(dst, relaid, src, rows * cols)  # only the listed direction
