/*
 * The float vector layer on AVX2 (+ FMA, F16C): what simd_x86_body.h is written over.
 *
 * A vector is 8 floats (__m256), so a 32-element group is four of them. The layer's
 * primitives are the intrinsics (or short sequences) the kernels run; the ISA choices the
 * body leaves to it are its constants: the f32 helpers' tails run in scalar code
 * (X_MASKED_TAILS 0), a dot product multiplies a group by its factor once (X_GROUP_FACTOR 1,
 * see the body), and the GEMM tile is 16 rows x 6 tokens. vecf_end.h undefines the names.
 */
#include <immintrin.h>

#define XN(name) y_##name
#define XT __attribute__((target("avx2,fma,f16c")))
#define XF XT static inline
#define XFN XT static
#define VECF __m256
#define VECI __m256i     /* 16 int16 (or 8 int32) */
#define XHALF __m128     /* half a vector */
#define XMASK __m256i    /* the lanes a tail loads and stores: all bits set */
#define XLIVE __m256     /* lanes a comparison kept: all bits set */
#define LANES 8
#define X_MASKED_TAILS 0
#define X_GROUP_FACTOR 1
#define X_GEMM_NR 6
/* queries whose scores one pass over four keys computes (three: 12 accumulators) */
#define X_QK_QUERIES 3
/* values: 64 dimensions a pass before the passes of 16 (0: 16 only) */
#define X_PV_WIDE 0
/* exp's clamp: exponent bits for 2^n, n <= 127 */
#define X_EXP_MAX 88.3f

XF __m256 y_set1(float a) {
    return _mm256_set1_ps(a);
}
XF __m256 y_zero(void) {
    return _mm256_setzero_ps();
}
XF __m256 y_loadu(const float *p) {
    return _mm256_loadu_ps(p);
}
XF __m256 y_load(const float *p) { /* aligned */
    return _mm256_load_ps(p);
}
XF void y_storeu(float *p, __m256 v) {
    _mm256_storeu_ps(p, v);
}
XF __m256 y_bcast(const float *p) {
    return _mm256_broadcast_ss(p);
}
XF __m256 y_add(__m256 a, __m256 b) {
    return _mm256_add_ps(a, b);
}
XF __m256 y_sub(__m256 a, __m256 b) {
    return _mm256_sub_ps(a, b);
}
XF __m256 y_mul(__m256 a, __m256 b) {
    return _mm256_mul_ps(a, b);
}
XF __m256 y_div(__m256 a, __m256 b) {
    return _mm256_div_ps(a, b);
}
XF __m256 y_max(__m256 a, __m256 b) {
    return _mm256_max_ps(a, b);
}
XF __m256 y_min(__m256 a, __m256 b) {
    return _mm256_min_ps(a, b);
}
XF __m256 y_fmadd(__m256 a, __m256 b, __m256 c) { /* a * b + c */
    return _mm256_fmadd_ps(a, b, c);
}
XF __m256 y_fmsub(__m256 a, __m256 b, __m256 c) { /* a * b - c */
    return _mm256_fmsub_ps(a, b, c);
}
XF __m256 y_fnmadd(__m256 a, __m256 b, __m256 c) { /* c - a * b */
    return _mm256_fnmadd_ps(a, b, c);
}

XF float y_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the largest lane; max(a, b) is b where a is NaN, and best starts at -inf */
XF float y_hmax(__m256 v) {
    __attribute__((aligned(32))) float lanes[8];
    _mm256_store_ps(lanes, v);
    float best = -INFINITY;
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    return best;
}

/* ------------------------------------------------------------------ masks */
/* the first n (< 8) lanes set */
XF __m256i y_mask_tail(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* the first min(n, 8) lanes */
XF __m256i y_mask_first(int64_t n) {
    return n >= 8 ? _mm256_set1_epi32(-1) : y_mask_tail(n);
}
XF __m256 y_maskz_load(__m256i m, const float *p) {
    return _mm256_maskload_ps(p, m);
}
XF void y_mask_store(float *p, __m256i m, __m256 v) {
    _mm256_maskstore_ps(p, m, v);
}
XF __m256 y_mask_keep(__m256i m, __m256 v) { /* 0 outside m */
    return _mm256_and_ps(v, _mm256_castsi256_ps(m));
}

/* ------------------------------------------------------------------ exp's steps */
XF __m256 y_ge(__m256 a, __m256 b) {
    return _mm256_cmp_ps(a, b, _CMP_GE_OQ);
}
XF __m256 y_round(__m256 v) { /* to nearest even */
    return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* p * 2^n where live, else 0: 2^n built in the exponent bits (n in [-126, 127]) */
XF __m256 y_ldexp_live(__m256 p, __m256 n, __m256 live) {
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

/* ------------------------------------------------------------------ conversions */
XF __m256 y_u8_ps(__m128i v) { /* low 8 bytes */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}
XF __m256 y_i8_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}
/* 16 unsigned / signed bytes -> two float vectors */
XF void y_u8x16(__m128i v, __m256 *out) {
    out[0] = y_u8_ps(v);
    out[1] = y_u8_ps(_mm_unpackhi_epi64(v, v));
}
XF void y_i8x16(__m128i v, __m256 *out) {
    out[0] = y_i8_ps(v);
    out[1] = y_i8_ps(_mm_unpackhi_epi64(v, v));
}
/* 8 signed bytes at p, widened straight from memory */
XF __m256 y_i8_load(const int8_t *p) {
    return y_i8_ps(_mm_loadl_epi64((const __m128i *)p));
}
XF __m128i y_lo128(__m256i v) {
    return _mm256_castsi256_si128(v);
}
XF __m128i y_hi128(__m256i v) {
    return _mm256_extracti128_si256(v, 1);
}
XF __m256 y_load_f16(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
XF __m256 y_load_bf16(const uint8_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
XF __m256 y_load_f32(const uint8_t *p) {
    return _mm256_loadu_ps((const float *)p);
}
static inline float y_half_at(const uint8_t *p) { /* one f16, for the tails */
    return lm_f16(p);
}

/* ------------------------------------------------------------------ int16 products */
XF __m256i y_loadu_i(const int16_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}
XF __m256i y_madd(__m256i a, __m256i b) { /* int16 pairs multiplied, summed into int32 */
    return _mm256_madd_epi16(a, b);
}
XF __m256i y_add_i32(__m256i a, __m256i b) {
    return _mm256_add_epi32(a, b);
}
XF __m256 y_cvt_i32(__m256i v) {
    return _mm256_cvtepi32_ps(v);
}
/* 32 signed bytes (lo: 0..15, hi: 16..31) as int16, two vectors */
XF void y_i8x32_i16(__m128i lo, __m128i hi, __m256i w[2]) {
    w[0] = _mm256_cvtepi8_epi16(lo);
    w[1] = _mm256_cvtepi8_epi16(hi);
}

XF __m128 y_half_zero(void) {
    return _mm_setzero_ps();
}
/* the sum of the odd lanes of off (the products of the mins when pair) */
XF float y_odd_sum(__m128 off, int pair) {
    (void)pair; /* 0 in off's lanes otherwise */
    const __m128 o = _mm_add_ps(off, _mm_movehl_ps(off, off));
    return _mm_cvtss_f32(_mm_movehdup_ps(o));
}

/* ------------------------------------------------------------------ kernel pieces */
/* 32 bits -> 32 bytes, byte i = 16 if bit i is set, else 0 */
XF __m256i y_bits_to_16(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* 5-bit values of a Q5_0/Q5_1 block as 32 bytes (element i in byte i). */
XF __m256i y_q5_bytes(const uint8_t *qs, const uint8_t *qhp) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    uint32_t qh;
    memcpy(&qh, qhp, sizeof qh);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4),
                                         _mm_and_si128(q, m4));
    return _mm256_or_si256(nib, y_bits_to_16(qh));
}

/* A Q5_0/Q5_1 block's 32 values minus off (0 or 16) as floats: bytes, then widened. */
XF void y_q5_ps(const uint8_t *qs, const uint8_t *qh, int off, __m256 w[4]) {
    __m256i q = y_q5_bytes(qs, qh);
    if (off) {
        q = _mm256_sub_epi8(q, _mm256_set1_epi8((char)off));
        y_i8x16(y_lo128(q), w);
        y_i8x16(y_hi128(q), w + 2);
    } else {
        y_u8x16(y_lo128(q), w);
        y_u8x16(y_hi128(q), w + 2);
    }
}

/* K-quant scales: the sixteen unpacked (lm_kq_unpack) times d (eight) and dmin (eight). */
XF void y_scales_kq(const uint8_t u[16], float d, float dmin, float *s) {
    const __m128i v = _mm_loadu_si128((const __m128i *)u);
    _mm256_storeu_ps(s, _mm256_mul_ps(y_u8_ps(v), _mm256_set1_ps(d)));
    _mm256_storeu_ps(s + 8, _mm256_mul_ps(y_u8_ps(_mm_unpackhi_epi64(v, v)), _mm256_set1_ps(dmin)));
}

/* ------------------------------------------------------------------ attention */
/* The four sums of a[0..3] in one vector, each lane-summed in the same order. */
XF __m128 y_sum4(const __m256 a[4]) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
/* the 8 elements from element i of a K or V cache (f16 rows widened by F16C, exactly) */
XF __m256 y_ld_kv(const void *base, int64_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)))
                : _mm256_loadu_ps((const float *)base + i);
}
/* elements d .. d + 7 of the key at element i of a K cache, a vector per key */
#define X_KEYS 1
XF __m256 y_ld_keys(const void *k, int64_t i, int64_t ks, int half) {
    (void)ks;
    return y_ld_kv(k, i, half);
}
/* a query's elements d .. d + 7, for every key of a vector */
XF __m256 y_ld_q8(const float *q) {
    return _mm256_loadu_ps(q);
}
