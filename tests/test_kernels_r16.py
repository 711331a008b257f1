"""Interleaved layouts (16 rows block column by block column): the repacking, the products
on every ISA (the same bits for any token count, thread count and ISA's kernels), the paths
that read rows (embedding lookup, prefill GEMM, f32 decode) and cutting a matrix."""

from __future__ import annotations

import numpy as np
import pytest
from test_kernels import assert_matmul_close, make_rows, reference

from lmserve_core.native import kernels as K

pytestmark = pytest.mark.usefixtures("restore_isa")

QT = K.QuantType
R16_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q6_K]
ISAS = K.available_isas()


def r16(qtype: QT) -> int:
    return int(K.Interleaved[qtype.name + "_R16"])


@pytest.fixture(params=R16_TYPES, ids=lambda t: t.name)
def matrix(request, rng) -> tuple[QT, np.ndarray, np.ndarray, int, int]:
    """(type, GGML bytes, interleaved bytes, rows, cols)."""
    qtype, rows = request.param, 48
    cols = 512 if K.block_elems(qtype) == 256 else 320
    raw = make_rows(qtype, rows, cols, rng)
    return qtype, raw, K.repack_r16(qtype, raw, rows, cols), rows, cols


def test_repacking_keeps_every_byte_and_every_row(matrix) -> None:
    qtype, raw, packed, rows, cols = matrix
    assert packed.nbytes == raw.nbytes and packed.tobytes() != raw.tobytes()
    want = reference(qtype, raw, cols)
    for isa in ISAS:
        with K.use_isa(isa):
            got = K.get_rows(r16(qtype), packed, rows, cols, np.arange(rows)[::-1])
        np.testing.assert_array_equal(got, want[::-1], err_msg=isa.name)


def test_repacking_refuses_what_it_cannot_lay_out(rng) -> None:
    raw = make_rows(QT.Q8_0, 20, 64, rng)
    with pytest.raises(ValueError):
        K.repack_r16(QT.Q8_0, raw, 20, 64)  # not whole groups of 16 rows
    with pytest.raises(TypeError):
        K.repack_r16(QT.Q5_1, make_rows(QT.Q5_1, 16, 64, rng), 16, 64)
    from lmserve_core._kernels import ffi, lib

    buf = ffi.new("uint8_t[]", 16 * 34 * 2)
    assert lib.lm_repack_r16(QT.Q8_0, buf, r16(QT.Q4_0), buf, 16, 64) == lib.LM_ETYPE
    # rows of an interleaved matrix are not contiguous: the row-level entry points refuse it
    assert lib.lm_dequantize_row(r16(QT.Q8_0), buf, ffi.new("float[64]"), 64) == lib.LM_ETYPE
    with pytest.raises(ValueError):
        K.get_rows(r16(QT.Q8_0), np.zeros(20 * 68, np.uint8), 20, 64, [0])


def test_a_layout_is_chosen_only_where_the_products_gain() -> None:
    for isa in ISAS:
        for prefill in K.PrefillPrecision:
            with K.use_isa(isa):
                K.select_prefill_precision(prefill)
                chosen = {t for t in QT if K.interleaved_for(t)}
                assert all(K.interleaved_for(t) == r16(t) for t in chosen)
            if isa == K.Isa.PORTABLE:  # its products read it no faster
                assert not chosen
            else:  # every SIMD table multiplies and decodes every interleaved type
                assert chosen == set(R16_TYPES), (isa.name, prefill.name)


def test_prefill_multiplies_integers_where_the_table_says_so() -> None:
    K.select_decode_precision(K.DecodePrecision.I16)
    for isa in ISAS:
        with K.use_isa(isa):
            for qtype in R16_TYPES:
                assert K.int_products(r16(qtype), 1)  # decode multiplies integers everywhere
                K.select_prefill_precision(K.PrefillPrecision.F32)
                assert not K.int_products(r16(qtype), K.DECODE_MAX_ROWS + 64)
                K.select_prefill_precision(K.PrefillPrecision.I16)
            # every SIMD path reads a prompt's tokens with decode's products
            assert K.int_products(r16(QT.Q4_K), 512) == (isa != K.Isa.PORTABLE), isa.name


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
def test_products_equal_the_ggml_layouts_within_the_int16_bound(matrix, isa, rng) -> None:
    qtype, raw, packed, rows, cols = matrix
    K.select_isa(isa)
    K.select_decode_precision(K.DecodePrecision.I16)
    ref = reference(qtype, raw, cols).astype(np.float64)
    for ntok in (1, 3, 8, 9, 15):
        x = rng.standard_normal((ntok, cols), dtype=np.float32)
        got = K.matmul(r16(qtype), packed, rows, cols, x)
        want = K.matmul(qtype, raw, rows, cols, x)
        exact = x.astype(np.float64) @ ref.T
        scale = np.abs(x).astype(np.float64) @ np.abs(ref).T
        assert_matmul_close(got, exact, scale, K.DecodePrecision.I16, ref, x)
        # both layouts multiply the same integers: they differ by float rounding alone
        np.testing.assert_allclose(got, want, rtol=0, atol=float(1e-5 * scale.max()) + 1e-6)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
def test_a_tokens_outputs_do_not_depend_on_the_batch_or_the_threads(matrix, isa, rng) -> None:
    """What makes speculative verification and batched decoding give the bits of one
    token at a time."""
    qtype, _, packed, rows, cols = matrix
    K.select_isa(isa)
    K.select_decode_precision(K.DecodePrecision.I16)
    K.select_prefill_precision(K.PrefillPrecision.I16)
    # where the layout is chosen, int16 prefill runs the same products on many tokens
    most = 70 if K.int_products(r16(qtype), 70) else K.DECODE_MAX_ROWS
    x = rng.standard_normal((most, cols), dtype=np.float32)
    alone = np.stack([K.matmul(r16(qtype), packed, rows, cols, x[t : t + 1])[0] for t in range(most)])
    for threads in (1, 2, 3):
        with K.Pool(threads) as pool:
            for ntok in [n for n in (2, 7, 8, 9, K.DECODE_MAX_ROWS, 32, 45, 70) if n <= most]:
                got = K.matmul(r16(qtype), packed, rows, cols, x[:ntok], pool=pool)
                np.testing.assert_array_equal(got, alone[:ntok], err_msg=f"{threads} {ntok}")


def test_every_isa_applies_the_factors_as_the_portable_products_do(rng) -> None:
    """Q4_0 and Q8_0 read only the activations' integers and steps, which every ISA
    quantizes to the same bits: so their outputs are bit for bit the portable ones, whether
    a kernel multiplies the few tokens' bytes or the more tokens' words."""
    K.select_decode_precision(K.DecodePrecision.I16)
    for qtype in (QT.Q4_0, QT.Q8_0):
        rows, cols = 32, 1024
        raw = make_rows(qtype, rows, cols, rng)
        if qtype == QT.Q8_0:  # the bytes' extremes, against x's (each group's +-32767)
            blocks = raw.reshape(-1, 34).copy()
            blocks[::2, 2:] = np.array([-128, 127], np.int8).view(np.uint8)[rng.integers(0, 2, 32)]
            raw = blocks.reshape(rows, -1)
        packed = K.repack_r16(qtype, raw, rows, cols)
        x = rng.standard_normal((8, cols), dtype=np.float32)
        x[:, ::64] = np.float32(-40.0)  # a low byte of 1 under a high byte of -128
        for ntok in (1, 2, 3, 4, 5, 8):
            with K.use_isa(K.Isa.PORTABLE):
                want = K.matmul(r16(qtype), packed, rows, cols, x[:ntok])
            for isa in ISAS:
                with K.use_isa(isa):
                    got = K.matmul(r16(qtype), packed, rows, cols, x[:ntok])
                np.testing.assert_array_equal(got, want, err_msg=f"{qtype.name} {isa.name} {ntok}")


def test_products_propagate_nan(rng) -> None:
    K.select_decode_precision(K.DecodePrecision.I16)
    packed = K.repack_r16(QT.Q4_1, make_rows(QT.Q4_1, 16, 64, rng), 16, 64)
    x = np.ones((2, 64), np.float32)
    x[1, 40] = np.nan
    for isa in ISAS:
        with K.use_isa(isa):
            y = K.matmul(r16(QT.Q4_1), packed, 16, 64, x)
        assert np.isfinite(y[0]).all() and np.isnan(y[1]).all(), isa.name


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
def test_many_tokens_and_f32_decode_read_the_same_values(matrix, isa, rng) -> None:
    """The prefill GEMM (f32 prefill) decodes an interleaved matrix's rows into exactly the
    values of the GGML layout; f32 decode multiplies them as floats."""
    qtype, raw, packed, rows, cols = matrix
    K.select_isa(isa)
    K.select_prefill_precision(K.PrefillPrecision.F32)
    x = rng.standard_normal((40, cols), dtype=np.float32)
    np.testing.assert_array_equal(
        K.matmul(r16(qtype), packed, rows, cols, x), K.matmul(qtype, raw, rows, cols, x)
    )
    K.select_decode_precision(K.DecodePrecision.F32)
    ref = reference(qtype, raw, cols).astype(np.float64)
    x = x[:3]
    scale = np.abs(x).astype(np.float64) @ np.abs(ref).T
    got = K.matmul(r16(qtype), packed, rows, cols, x)
    assert_matmul_close(got, x @ ref.T, scale, K.DecodePrecision.F32, ref, x)


def test_a_matrix_is_cut_only_at_whole_groups(rng) -> None:
    """lm_matrix_rows: a cut inside a group of 16 rows gives no data, which every product
    refuses, instead of rows that are not the ones asked for."""
    from lmserve_core._kernels import ffi, lib

    rows, cols = 48, 64
    packed = K.repack_r16(QT.Q8_0, make_rows(QT.Q8_0, rows, cols, rng), rows, cols)
    buf = ffi.from_buffer(packed)
    m = ffi.new("lm_matrix *", {"data": ffi.cast("void *", buf), "type": r16(QT.Q8_0)})[0]
    cut = lib.lm_matrix_rows(m, 16, cols)
    assert int(ffi.cast("uintptr_t", cut.data)) == int(ffi.cast("uintptr_t", buf)) + 16 * 68
    assert lib.lm_matrix_rows(m, 8, cols).data == ffi.NULL
    x = np.ones((1, cols), np.float32)
    y = np.empty((1, rows), np.float32)
    assert lib.lm_matmul(ffi.NULL, r16(QT.Q8_0), ffi.NULL, 32, cols, ffi.from_buffer("float[]", x),
                         1, ffi.from_buffer("float[]", y)) == lib.LM_EINVAL
    # a matrix of the interleaved type needs whole groups
    assert lib.lm_matmul(ffi.NULL, r16(QT.Q8_0), buf, 40, cols, ffi.from_buffer("float[]", x),
                         1, ffi.from_buffer("float[]", y)) == lib.LM_EINVAL
    # a GGML type is cut anywhere
    g = ffi.new("lm_matrix *", {"data": ffi.cast("void *", buf), "type": int(QT.Q8_0)})[0]
    assert int(ffi.cast("uintptr_t", lib.lm_matrix_rows(g, 8, cols).data)) == (
        int(ffi.cast("uintptr_t", buf)) + 8 * 68
    )


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_super_blocks_apply_their_factors_as_the_portable_products_do(qtype, rng) -> None:
    """Q4_K's mins multiply each group's float sum, whose rounding is each ISA's own: with
    inputs whose group sums are exact in any order, every ISA's outputs are the portable
    ones bit for bit (Q6_K's are for any input), for every token count up to 15, passes of
    several kernel calls (up to 31 tokens) and any thread count."""
    K.select_decode_precision(K.DecodePrecision.I16)
    rows, cols = 48, 1024
    raw = make_rows(qtype, rows, cols, rng)
    if qtype == QT.Q4_K:
        raw.reshape(-1, 144)[::3, 4:16] = 0xFF  # the largest scales and mins
    else:  # the extreme scales and 6-bit values
        blocks = raw.reshape(-1, 210)
        blocks[::3, 192:208] = np.array([-128, 127], np.int8).view(np.uint8)[rng.integers(0, 2, 16)]
        blocks[1::3, :192] = rng.choice(np.array([0x00, 0xFF], np.uint8), (blocks[1::3].shape[0], 192))
    packed = K.repack_r16(qtype, raw, rows, cols)
    x = (rng.integers(-64, 65, (31, cols)) * 0.25).astype(np.float32)
    x[:, ::64] = np.float32(-40.0)
    for ntok in [*range(1, 16), 16, 24, 31]:
        with K.use_isa(K.Isa.PORTABLE):
            want = K.matmul(r16(qtype), packed, rows, cols, x[:ntok])
        for isa in ISAS:
            with K.use_isa(isa):
                for threads in (1, 2, 3):
                    with K.Pool(threads) as pool:
                        got = K.matmul(r16(qtype), packed, rows, cols, x[:ntok], pool=pool)
                    np.testing.assert_array_equal(got, want, err_msg=f"{isa.name} {ntok} {threads}")


def test_super_block_layouts_keep_each_rows_bytes(rng) -> None:
    """Q4_K and Q6_K per 16 rows and super-block: the rows' f16 factors in turn, their
    scales, then their integers; the same bytes as the 16 GGUF blocks."""
    for qtype in (QT.Q4_K, QT.Q6_K):
        raw = make_rows(qtype, 16, 256, rng)
        packed = K.repack_r16(qtype, raw, 16, 256)
        assert packed.nbytes == raw.nbytes
        d = raw[:, 0:2] if qtype == QT.Q4_K else raw[:, 208:210]
        assert packed[:32].tobytes() == np.ascontiguousarray(d).tobytes()
        if qtype == QT.Q4_K:  # dmin, then the packed scales as 3 words of the 16 rows
            assert packed[32:64].tobytes() == np.ascontiguousarray(raw[:, 2:4]).tobytes()
            words = raw[:, 4:16].reshape(16, 3, 4).transpose(1, 0, 2)
            assert packed[64:256].tobytes() == np.ascontiguousarray(words).tobytes()
        else:  # the int8 scales, scale i of the 16 rows together
            assert packed[32:288].tobytes() == np.ascontiguousarray(raw[:, 192:208].T).tobytes()
