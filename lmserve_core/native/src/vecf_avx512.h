/*
 * The float vector layer on AVX-512 (F, BW, VL): what simd_x86_body.h is written over.
 *
 * A vector is 16 floats (__m512), so a 32-element group is two of them. The layer's
 * primitives are the intrinsics (or short sequences) the kernels run; the ISA choices the
 * body leaves to it are its constants: tails run under lane masks (X_MASKED_TAILS 1), a dot
 * product folds each group's scale and offset into its decoder's FMA (X_GROUP_FACTOR 0, see
 * the body), and the GEMM tile is 32 rows x 12 tokens. Attention's score vectors hold two keys'
 * eight-lane sums, reduced as the AVX2 kernels reduce them, so that every score and value
 * has the AVX2 bits. vecf_end.h undefines the names.
 */
#include <immintrin.h>

#define XN(name) z_##name
#define XT __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define XF XT static inline
#define XFN XT static
#define VECF __m512
#define VECI __m512i     /* 32 int16 (or 16 int32) */
#define XHALF __m256     /* half a vector */
#define XMASK __mmask16  /* the lanes a tail loads and stores */
#define XLIVE __mmask16  /* lanes a comparison kept */
#define LANES 16
#define X_MASKED_TAILS 1
#define X_GROUP_FACTOR 0
#define X_GEMM_NR 12
/* queries whose scores one pass over four keys computes (six: 12 accumulators) */
#define X_QK_QUERIES 6
/* values: 64 dimensions a pass before the passes of 16 */
#define X_PV_WIDE 1
/* exp's clamp: scalef takes any n */
#define X_EXP_MAX 88.7f

XF __m512 z_set1(float a) {
    return _mm512_set1_ps(a);
}
XF __m512 z_zero(void) {
    return _mm512_setzero_ps();
}
XF __m512 z_loadu(const float *p) {
    return _mm512_loadu_ps(p);
}
XF __m512 z_load(const float *p) { /* aligned */
    return _mm512_load_ps(p);
}
XF void z_storeu(float *p, __m512 v) {
    _mm512_storeu_ps(p, v);
}
XF __m512 z_bcast(const float *p) {
    return _mm512_set1_ps(*p);
}
XF __m512 z_add(__m512 a, __m512 b) {
    return _mm512_add_ps(a, b);
}
XF __m512 z_sub(__m512 a, __m512 b) {
    return _mm512_sub_ps(a, b);
}
XF __m512 z_mul(__m512 a, __m512 b) {
    return _mm512_mul_ps(a, b);
}
XF __m512 z_div(__m512 a, __m512 b) {
    return _mm512_div_ps(a, b);
}
XF __m512 z_max(__m512 a, __m512 b) {
    return _mm512_max_ps(a, b);
}
XF __m512 z_min(__m512 a, __m512 b) {
    return _mm512_min_ps(a, b);
}
XF __m512 z_fmadd(__m512 a, __m512 b, __m512 c) { /* a * b + c */
    return _mm512_fmadd_ps(a, b, c);
}
XF __m512 z_fmsub(__m512 a, __m512 b, __m512 c) { /* a * b - c */
    return _mm512_fmsub_ps(a, b, c);
}
XF __m512 z_fnmadd(__m512 a, __m512 b, __m512 c) { /* c - a * b */
    return _mm512_fnmadd_ps(a, b, c);
}

XF float z_hsum(__m512 v) {
    return _mm512_reduce_add_ps(v);
}

XF float z_hmax(__m512 v) {
    return _mm512_reduce_max_ps(v);
}

/* ------------------------------------------------------------------ masks */
/* the first n (< 16) lanes */
XF __mmask16 z_mask_tail(int64_t n) {
    return (__mmask16)((1u << n) - 1);
}
/* the first min(n, 16) lanes */
XF __mmask16 z_mask_first(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}
XF __m512 z_maskz_load(__mmask16 m, const float *p) {
    return _mm512_maskz_loadu_ps(m, p);
}
XF void z_mask_store(float *p, __mmask16 m, __m512 v) {
    _mm512_mask_storeu_ps(p, m, v);
}
XF __m512 z_mask_keep(__mmask16 m, __m512 v) { /* 0 outside m */
    return _mm512_maskz_mov_ps(m, v);
}
XF __m512 z_mask_max(__m512 a, __mmask16 m, __m512 v) { /* max(v, a) in m, a elsewhere */
    return _mm512_mask_max_ps(a, m, v, a);
}

/* ------------------------------------------------------------------ exp's steps */
XF __mmask16 z_ge(__m512 a, __m512 b) {
    return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ);
}
XF __m512 z_round(__m512 v) { /* to nearest even */
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* p * 2^n where live, else 0 */
XF __m512 z_ldexp_live(__m512 p, __m512 n, __mmask16 live) {
    return _mm512_maskz_scalef_ps(live, p, n);
}

/* ------------------------------------------------------------------ conversions */
XF __m512 z_u8_ps(__m128i v) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}
XF __m512 z_i8_ps(__m128i v) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}
/* 16 unsigned / signed bytes -> one float vector */
XF void z_u8x16(__m128i v, __m512 *out) {
    out[0] = z_u8_ps(v);
}
XF void z_i8x16(__m128i v, __m512 *out) {
    out[0] = z_i8_ps(v);
}
/* 16 signed bytes at p */
XF __m512 z_i8_load(const int8_t *p) {
    return z_i8_ps(_mm_loadu_si128((const __m128i *)p));
}
XF __m128i z_lo128(__m256i v) {
    return _mm256_castsi256_si128(v);
}
XF __m128i z_hi128(__m256i v) {
    return _mm256_extracti128_si256(v, 1);
}
XF __m512 z_load_f16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
XF __m512 z_load_bf16(const uint8_t *p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
XF __m512 z_load_f32(const uint8_t *p) {
    return _mm512_loadu_ps((const float *)p);
}
XF float z_half_at(const uint8_t *p) { /* one f16, for the tails */
    return _cvtsh_ss(lm_load_half(p));
}

/* ------------------------------------------------------------------ int16 products */
XF __m512i z_loadu_i(const int16_t *p) {
    return _mm512_loadu_si512(p);
}
XF __m512i z_madd(__m512i a, __m512i b) { /* int16 pairs multiplied, summed into int32 */
    return _mm512_madd_epi16(a, b);
}
XF __m512i z_add_i32(__m512i a, __m512i b) {
    return _mm512_add_epi32(a, b);
}
XF __m512 z_cvt_i32(__m512i v) {
    return _mm512_cvtepi32_ps(v);
}
/* 32 signed bytes (lo: 0..15, hi: 16..31) as int16, one vector */
XF void z_i8x32_i16(__m128i lo, __m128i hi, __m512i w[1]) {
    w[0] = _mm512_cvtepi8_epi16(_mm256_set_m128i(hi, lo));
}

XF __m256 z_half_zero(void) {
    return _mm256_setzero_ps();
}
/* the sum of the odd lanes of off (the products of the mins when pair) */
XF float z_odd_sum(__m256 off, int pair) {
    if (!pair) return 0.0f;
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(off), _mm256_extractf128_ps(off, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_movehdup_ps(v));
}

/* ------------------------------------------------------------------ kernel pieces */
/* Q5: the 16 bytes widened once to 32-bit lanes; nibbles then split with one op each. */
XF void z_nib_ints(const uint8_t *qs, __m512i out[2]) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    out[0] = _mm512_and_si512(v, _mm512_set1_epi32(0x0F));
    out[1] = _mm512_srli_epi32(v, 4);
}

/* A Q5_0/Q5_1 block's 32 values minus off (0 or 16) as floats: bit i of qh is the 5th bit
 * of element i, or-ed in under a lane mask. */
XF void z_q5_ps(const uint8_t *qs, const uint8_t *qhp, int off, __m512 w[2]) {
    uint32_t qh;
    memcpy(&qh, qhp, sizeof qh);
    const __m512i b16 = _mm512_set1_epi32(16);
    __m512i q[2];
    z_nib_ints(qs, q);
    q[0] = _mm512_mask_or_epi32(q[0], (__mmask16)(qh & 0xFFFFu), q[0], b16);
    q[1] = _mm512_mask_or_epi32(q[1], (__mmask16)(qh >> 16), q[1], b16);
    if (off) {
        const __m512i o = _mm512_set1_epi32(off);
        q[0] = _mm512_sub_epi32(q[0], o);
        q[1] = _mm512_sub_epi32(q[1], o);
    }
    w[0] = _mm512_cvtepi32_ps(q[0]);
    w[1] = _mm512_cvtepi32_ps(q[1]);
}

/* K-quant scales: the sixteen unpacked (lm_kq_unpack) times d (eight) and dmin (eight). */
XF void z_scales_kq(const uint8_t u[16], float d, float dmin, float *s) {
    const __m512 f = z_u8_ps(_mm_loadu_si128((const __m128i *)u));
    const __m512 dm = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castps_pd(_mm512_set1_ps(d)), _mm256_castps_pd(_mm256_set1_ps(dmin)), 1));
    _mm512_storeu_ps(s, _mm512_mul_ps(f, dm));
}

/* ------------------------------------------------------------------ attention */
XF __m256 z_hi256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
/* The four keys' sums of a[0..1] (two keys each) as y_sum4 reduces them. */
XF __m128 z_sum4(const __m512 a[2]) {
    const __m256 h[4] = {_mm512_castps512_ps256(a[0]), z_hi256(a[0]),
                         _mm512_castps512_ps256(a[1]), z_hi256(a[1])};
    return y_sum4(h);
}
/* the 16 elements from element i of a K or V cache (f16 rows widened exactly) */
XF __m512 z_ld_kv(const void *base, int64_t i, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)))
                : _mm512_loadu_ps((const float *)base + i);
}
/* elements d .. d + 7 of the keys at elements i and i + ks of a K cache (f16 when half), as
 * the two halves of one vector */
#define X_KEYS 2
XF __m512 z_ld_keys(const void *k, int64_t i, int64_t ks, int half) {
    if (half) {
        const uint16_t *h = k;
        const __m256i both = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(h + i))),
            _mm_loadu_si128((const __m128i *)(h + i + ks)), 1);
        return _mm512_cvtph_ps(both);
    }
    const float *f = k;
    return _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(f + i))),
        _mm256_castps_pd(_mm256_loadu_ps(f + i + ks)), 1));
}
/* a query's elements d .. d + 7, in both halves */
XF __m512 z_ld_q8(const float *q) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q))));
}
