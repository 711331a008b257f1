/*
 * AVX2 + FMA + F16C kernels. Compiled with per-function target attributes so the same
 * binary runs on any x86-64; dispatch.c installs them only when the CPU has the features.
 *
 * Same scheme as the AVX-512 path with 8 lanes: each 32-element group decodes into four
 * vectors (bit-identical to the portable decoder when fused = 0); dot products FMA them
 * with x.
 */
#include "lm_internal.h"

#if LM_HAVE_X86
#include <immintrin.h>
#include <math.h>

#define T256 __attribute__((target("avx2,fma,f16c")))

/* ------------------------------------------------------------------ helpers */
T256 static inline __m256 y_u8_ps(__m128i v) { /* low 8 bytes */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

T256 static inline __m256 y_i8_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

/* 16 unsigned / signed bytes -> two float vectors */
T256 static inline void y_u8x16_ps(__m128i v, __m256 *out) {
    out[0] = y_u8_ps(v);
    out[1] = y_u8_ps(_mm_unpackhi_epi64(v, v));
}

T256 static inline void y_i8x16_ps(__m128i v, __m256 *out) {
    out[0] = y_i8_ps(v);
    out[1] = y_i8_ps(_mm_unpackhi_epi64(v, v));
}

T256 static inline __m128i y_lo128(__m256i v) {
    return _mm256_castsi256_si128(v);
}

T256 static inline __m128i y_hi128(__m256i v) {
    return _mm256_extracti128_si256(v, 1);
}

/* 32 bits -> 32 bytes, byte i = 16 if bit i is set, else 0 */
T256 static inline __m256i y_bits_to_16(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

#define AFFINE(q, d, m, fused)                                                                     \
    ((fused) ? _mm256_fmadd_ps((q), (d), (m)) : _mm256_add_ps(_mm256_mul_ps((q), (d)), (m)))
#define AFFINE_SUB(q, d, m, fused)                                                                 \
    ((fused) ? _mm256_fmsub_ps((q), (d), (m)) : _mm256_sub_ps(_mm256_mul_ps((d), (q)), (m)))

/* ------------------------------------------------------------------ 32-element groups
 * y_dec_<type>(b, g, s, w, fused) decodes group g into w[0..3]; s holds the block's scales
 * from lm_scales_<type>. */
/* Scale-only encodings (Q4_0, Q5_0, Q8_0): y_raw_<type> gives the block's integers as
 * floats; the decoded weights are those times the block scale. */
T256 static inline void y_raw_q4_0(const block_q4_0 *b, __m256 w[4]) {
    const __m128i m4 = _mm_set1_epi8(0x0F), off = _mm_set1_epi8(8);
    const __m128i q = _mm_loadu_si128((const __m128i *)b->qs);
    y_i8x16_ps(_mm_sub_epi8(_mm_and_si128(q, m4), off), w);
    y_i8x16_ps(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), off), w + 2);
}

T256 static inline void y_scale4(__m256 w[4], float s) {
    const __m256 d = _mm256_set1_ps(s);
    w[0] = _mm256_mul_ps(w[0], d);
    w[1] = _mm256_mul_ps(w[1], d);
    w[2] = _mm256_mul_ps(w[2], d);
    w[3] = _mm256_mul_ps(w[3], d);
}

T256 static inline void y_dec_q4_0(const block_q4_0 *b, int g, const float *s, __m256 w[4],
                                   int fused) {
    (void)g;
    (void)fused;
    y_raw_q4_0(b, w);
    y_scale4(w, s[0]);
}

T256 static inline void y_dec_q4_1(const block_q4_1 *b, int g, const float *s, __m256 w[4],
                                   int fused) {
    (void)g;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)b->qs);
    const __m256 d = _mm256_set1_ps(s[0]);
    const __m256 m = _mm256_set1_ps(s[1]);
    y_u8x16_ps(_mm_and_si128(q, m4), w);
    y_u8x16_ps(_mm_and_si128(_mm_srli_epi16(q, 4), m4), w + 2);
    for (int i = 0; i < 4; i++) {
        w[i] = AFFINE(w[i], d, m, fused);
    }
}

/* 5-bit values of a Q5_0/Q5_1 block as 32 bytes (element i in byte i). */
T256 static inline __m256i y_q5_bytes(const uint8_t *qs, const uint8_t *qhp) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    uint32_t qh;
    memcpy(&qh, qhp, sizeof qh);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4),
                                         _mm_and_si128(q, m4));
    return _mm256_or_si256(nib, y_bits_to_16(qh));
}

T256 static inline void y_raw_q5_0(const block_q5_0 *b, __m256 w[4]) {
    const __m256i q = _mm256_sub_epi8(y_q5_bytes(b->qs, b->qh), _mm256_set1_epi8(16));
    y_i8x16_ps(y_lo128(q), w);
    y_i8x16_ps(y_hi128(q), w + 2);
}

T256 static inline void y_dec_q5_0(const block_q5_0 *b, int g, const float *s, __m256 w[4],
                                   int fused) {
    (void)g;
    (void)fused;
    y_raw_q5_0(b, w);
    y_scale4(w, s[0]);
}

T256 static inline void y_dec_q5_1(const block_q5_1 *b, int g, const float *s, __m256 w[4],
                                   int fused) {
    (void)g;
    const __m256i q = y_q5_bytes(b->qs, b->qh);
    const __m256 d = _mm256_set1_ps(s[0]);
    const __m256 m = _mm256_set1_ps(s[1]);
    y_u8x16_ps(y_lo128(q), w);
    y_u8x16_ps(y_hi128(q), w + 2);
    for (int i = 0; i < 4; i++) {
        w[i] = AFFINE(w[i], d, m, fused);
    }
}

T256 static inline void y_raw_q8_0(const block_q8_0 *b, __m256 w[4]) {
    for (int i = 0; i < 4; i++) { /* widened straight from memory, 8 bytes at a time */
        w[i] = y_i8_ps(_mm_loadl_epi64((const __m128i *)(b->qs + 8 * i)));
    }
}

T256 static inline void y_dec_q8_0(const block_q8_0 *b, int g, const float *s, __m256 w[4],
                                   int fused) {
    (void)g;
    (void)fused;
    y_raw_q8_0(b, w);
    y_scale4(w, s[0]);
}

/* Group g (0..7) of a Q4_K/Q5_K super-block: bytes qs[32 (g/2) ..], nibble g%2, scale g. */
T256 static inline __m256i y_nibbles(const uint8_t *p, int g) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (g & 1))),
                            _mm256_set1_epi8(0x0F));
}

T256 static inline void y_kq_affine(__m256i q, const float *s, int g, __m256 w[4], int fused) {
    const __m256 ds = _mm256_set1_ps(s[g]);
    const __m256 ms = _mm256_set1_ps(s[8 + g]);
    y_u8x16_ps(y_lo128(q), w);
    y_u8x16_ps(y_hi128(q), w + 2);
    for (int i = 0; i < 4; i++) {
        w[i] = AFFINE_SUB(w[i], ds, ms, fused);
    }
}

T256 static inline void y_dec_q4_K(const block_q4_K *b, int g, const float *s, __m256 w[4],
                                   int fused) {
    y_kq_affine(y_nibbles(b->qs + 32 * (g / 2), g), s, g, w, fused);
}

T256 static inline void y_dec_q5_K(const block_q5_K *b, int g, const float *s, __m256 w[4],
                                   int fused) {
    const __m256i qh = _mm256_loadu_si256((const __m256i *)b->qh);
    const __m256i h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(g)),
                                       _mm256_set1_epi8(1));
    const __m256i q = _mm256_or_si256(y_nibbles(b->qs + 32 * (g / 2), g), _mm256_slli_epi16(h, 4));
    y_kq_affine(q, s, g, w, fused);
}

/* Group g (0..7): half n = g/4, then gg = g%4 picks the ql half (gg&1), the nibble (gg>>1)
 * and the 2-bit field 2*gg of qh; sixteen elements per scale. */
T256 static inline __m256i y_q6_bytes(const block_q6_K *b, int g) { /* signed, -32..31 */
    const int n = g / 4, gg = g % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * n + 32 * (gg & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * n));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (gg >> 1))),
                                        _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * gg)),
                                        _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}

T256 static inline void y_dec_q6_K(const block_q6_K *b, int g, const float *s, __m256 w[4],
                                   int fused) {
    (void)fused;
    const int n = g / 4, gg = g % 4;
    const __m256i q = y_q6_bytes(b, g);
    const float *sc = s + 8 * n + 2 * gg;
    const __m256 d0 = _mm256_set1_ps(sc[0]), d1 = _mm256_set1_ps(sc[1]);
    y_i8x16_ps(y_lo128(q), w);
    y_i8x16_ps(y_hi128(q), w + 2);
    w[0] = _mm256_mul_ps(d0, w[0]);
    w[1] = _mm256_mul_ps(d0, w[1]);
    w[2] = _mm256_mul_ps(d1, w[2]);
    w[3] = _mm256_mul_ps(d1, w[3]);
}

/* Q2_0 / Q2_0_128: the 32 codes of a group (the 8 bytes at p), element i in byte i of lo
 * (i < 16) or of hi (i - 16): the four 2-bit fields of every byte split apart, then
 * interleaved back into element order (byte k holds elements 4k .. 4k + 3). */
T256 static inline void y_q2_codes(const uint8_t *p, __m128i *lo, __m128i *hi) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p), m3 = _mm_set1_epi8(3);
    const __m128i c0 = _mm_and_si128(v, m3);
    const __m128i c1 = _mm_and_si128(_mm_srli_epi16(v, 2), m3);
    const __m128i c2 = _mm_and_si128(_mm_srli_epi16(v, 4), m3);
    const __m128i c3 = _mm_and_si128(_mm_srli_epi16(v, 6), m3);
    const __m128i a = _mm_unpacklo_epi8(c0, c1), b = _mm_unpacklo_epi8(c2, c3);
    *lo = _mm_unpacklo_epi16(a, b);
    *hi = _mm_unpackhi_epi16(a, b);
}

/* the group's signed integers, code - 1 (-1 .. 2) */
T256 static inline void y_q2_ints8(const uint8_t *p, __m128i *lo, __m128i *hi) {
    const __m128i one = _mm_set1_epi8(1);
    y_q2_codes(p, lo, hi);
    *lo = _mm_sub_epi8(*lo, one);
    *hi = _mm_sub_epi8(*hi, one);
}

T256 static inline void y_raw_q2(const uint8_t *p, __m256 w[4]) {
    __m128i lo, hi;
    y_q2_ints8(p, &lo, &hi);
    y_i8x16_ps(lo, w);
    y_i8x16_ps(hi, w + 2);
}

T256 static inline void y_dec_q2_0(const block_q2_0 *b, int g, const float *s, __m256 w[4],
                                   int fused) {
    (void)fused;
    y_raw_q2(b->qs + 8 * g, w);
    y_scale4(w, s[0]);
}

T256 static inline void y_dec_q2_0_128(const block_q2_0_128 *b, int g, const float *s,
                                       __m256 w[4], int fused) {
    (void)fused;
    y_raw_q2(b->qs + 8 * g, w);
    y_scale4(w, s[0]);
}

/* K-quant scales: unpack, then widen and scale all sixteen at once. */
T256 static inline void y_scales_kq(const uint8_t *scales, float d, float dmin, float *s) {
    uint8_t u[16];
    lm_kq_unpack(scales, u);
    const __m128i v = _mm_loadu_si128((const __m128i *)u);
    _mm256_storeu_ps(s, _mm256_mul_ps(y_u8_ps(v), _mm256_set1_ps(d)));
    _mm256_storeu_ps(s + 8, _mm256_mul_ps(y_u8_ps(_mm_unpackhi_epi64(v, v)), _mm256_set1_ps(dmin)));
}

T256 static inline void y_scales_q4_K(const block_q4_K *b, float *s) {
    y_scales_kq(b->scales, lm_f16(&b->d), lm_f16(&b->dmin), s);
}

T256 static inline void y_scales_q5_K(const block_q5_K *b, float *s) {
    y_scales_kq(b->scales, lm_f16(&b->d), lm_f16(&b->dmin), s);
}

T256 static inline void y_scales_q6_K(const block_q6_K *b, float *s) {
    __m256 f[2];
    y_i8x16_ps(_mm_loadu_si128((const __m128i *)b->scales), f);
    const __m256 d = _mm256_set1_ps(lm_f16(&b->d));
    _mm256_storeu_ps(s, _mm256_mul_ps(d, f[0]));
    _mm256_storeu_ps(s + 8, _mm256_mul_ps(d, f[1]));
}

#define y_scales_q4_0 lm_scales_q4_0
#define y_scales_q4_1 lm_scales_q4_1
#define y_scales_q5_0 lm_scales_q5_0
#define y_scales_q5_1 lm_scales_q5_1
#define y_scales_q8_0 lm_scales_q8_0
#define y_scales_q2_0 lm_scales_q2_0
#define y_scales_q2_0_128 lm_scales_q2_0_128

/* y_grp_<type>(b, g, s, w): group g's 32 values into w[0..3], returning the factor they still
 * need. The scale-only encodings hand over their integers and the block scale, so a dot
 * product multiplies by the scale once per group instead of once per weight (decode is
 * bound by these instructions); the others are decoded to their values (factor 1, and an
 * FMA by 1 adds exactly). */
T256 static inline float y_grp_q4_0(const block_q4_0 *b, int g, const float *s, __m256 w[4]) {
    (void)g;
    y_raw_q4_0(b, w);
    return s[0];
}

T256 static inline float y_grp_q5_0(const block_q5_0 *b, int g, const float *s, __m256 w[4]) {
    (void)g;
    y_raw_q5_0(b, w);
    return s[0];
}

T256 static inline float y_grp_q8_0(const block_q8_0 *b, int g, const float *s, __m256 w[4]) {
    (void)g;
    y_raw_q8_0(b, w);
    return s[0];
}

T256 static inline float y_grp_q2_0(const block_q2_0 *b, int g, const float *s, __m256 w[4]) {
    y_raw_q2(b->qs + 8 * g, w);
    return s[0];
}

T256 static inline float y_grp_q2_0_128(const block_q2_0_128 *b, int g, const float *s,
                                        __m256 w[4]) {
    y_raw_q2(b->qs + 8 * g, w);
    return s[0];
}

#define Y_GRP_DECODED(name, blk)                                                                   \
    T256 static inline float y_grp_##name(const blk *b, int g, const float *s, __m256 w[4]) {      \
        y_dec_##name(b, g, s, w, 1);                                                               \
        return 1.0f;                                                                               \
    }
Y_GRP_DECODED(q4_1, block_q4_1)
Y_GRP_DECODED(q5_1, block_q5_1)
Y_GRP_DECODED(q4_K, block_q4_K)
Y_GRP_DECODED(q5_K, block_q5_K)
Y_GRP_DECODED(q6_K, block_q6_K)

/* sum over one group of w[v] * x[8v ..]: one product chain per group */
T256 static inline __m256 y_grp_dot(const __m256 w[4], const float *x) {
    __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
    p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), p);
    p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), p);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), p);
}

#define DEF_BLOCK_KERNELS(name, blk, qk)                                                           \
    T256 static inline __m256 y_grp_acc_##name(const blk *b, int g, const float *s,                \
                                               const float *x, __m256 acc) {                       \
        __m256 w[4];                                                                               \
        const float f = y_grp_##name(b, g, s, w);                                                  \
        return _mm256_fmadd_ps(_mm256_set1_ps(f), y_grp_dot(w, x + 32 * g), acc);                  \
    }                                                                                              \
    T256 static float y_dot_##name(const void *row, const float *x, int64_t n) {                   \
        const blk *b = row;                                                                        \
        const int64_t nb = n / (qk);                                                               \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0; /* two groups in flight */                       \
        float s[16], s1[16];                                                                       \
        if ((qk) / 32 >= 2) {                                                                      \
            for (int64_t i = 0; i < nb; i++) {                                                     \
                y_scales_##name(b + i, s);                                                         \
                for (int g = 0; g < (qk) / 32; g += 2) {                                           \
                    a0 = y_grp_acc_##name(b + i, g, s, x + i * (qk), a0);                          \
                    a1 = y_grp_acc_##name(b + i, g + 1, s, x + i * (qk), a1);                      \
                }                                                                                  \
            }                                                                                      \
        } else {                                                                                   \
            int64_t i = 0;                                                                         \
            for (; i + 2 <= nb; i += 2) {                                                          \
                y_scales_##name(b + i, s);                                                         \
                y_scales_##name(b + i + 1, s1);                                                    \
                a0 = y_grp_acc_##name(b + i, 0, s, x + i * (qk), a0);                              \
                a1 = y_grp_acc_##name(b + i + 1, 0, s1, x + (i + 1) * (qk), a1);                   \
            }                                                                                      \
            if (i < nb) {                                                                          \
                y_scales_##name(b + i, s);                                                         \
                a0 = y_grp_acc_##name(b + i, 0, s, x + i * (qk), a0);                              \
            }                                                                                      \
        }                                                                                          \
        return y_hsum(_mm256_add_ps(a0, a1));                                                      \
    }                                                                                              \
    T256 static void y_deq_##name(const void *src, float *dst, int64_t n) {                        \
        const blk *b = src;                                                                        \
        float s[16];                                                                               \
        for (int64_t i = 0; i < n / (qk); i++) {                                                   \
            y_scales_##name(b + i, s);                                                             \
            for (int g = 0; g < (qk) / 32; g++) {                                                  \
                __m256 w[4];                                                                       \
                y_dec_##name(b + i, g, s, w, 0);                                                   \
                for (int v = 0; v < 4; v++) {                                                      \
                    _mm256_storeu_ps(dst + i * (qk) + 32 * g + 8 * v, w[v]);                       \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

T256 static inline float y_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Several tokens per decoded block, NT <= 8: one accumulator per token (16 registers). */
#define DEF_MULTI_KERNELS(name, blk, qk)                                                           \
    T256 static inline __attribute__((always_inline)) void y_dotn_body_##name(                     \
        const blk *b, const float *x, int64_t ldx, int64_t n, const int NT, float *out,            \
        int64_t ldo) {                                                                             \
        __m256 acc[8];                                                                             \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            acc[t] = _mm256_setzero_ps();                                                          \
        }                                                                                          \
        float s[16];                                                                               \
        for (int64_t i = 0; i < n / (qk); i++) {                                                   \
            y_scales_##name(b + i, s);                                                             \
            for (int g = 0; g < (qk) / 32; g++) {                                                  \
                __m256 w[4];                                                                       \
                const __m256 f = _mm256_set1_ps(y_grp_##name(b + i, g, s, w));                     \
                const float *xb = x + i * (qk) + 32 * g;                                           \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                             \
                    acc[t] = _mm256_fmadd_ps(f, y_grp_dot(w, xb + t * ldx), acc[t]);               \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            out[t * ldo] = y_hsum(acc[t]);                                                         \
        }                                                                                          \
    }                                                                                              \
    T256 static void y_dotn_##name(const void *row, const float *x, int64_t ldx, int64_t n,        \
                                   int nt, float *out, int64_t ldo) {                              \
        const blk *b = row;                                                                        \
        switch (nt) {                                                                              \
        case 1: y_dotn_body_##name(b, x, ldx, n, 1, out, ldo); break;                              \
        case 2: y_dotn_body_##name(b, x, ldx, n, 2, out, ldo); break;                              \
        case 3: y_dotn_body_##name(b, x, ldx, n, 3, out, ldo); break;                              \
        case 4: y_dotn_body_##name(b, x, ldx, n, 4, out, ldo); break;                              \
        case 5: y_dotn_body_##name(b, x, ldx, n, 5, out, ldo); break;                              \
        case 6: y_dotn_body_##name(b, x, ldx, n, 6, out, ldo); break;                              \
        case 7: y_dotn_body_##name(b, x, ldx, n, 7, out, ldo); break;                              \
        default: y_dotn_body_##name(b, x, ldx, n, 8, out, ldo); break;                             \
        }                                                                                          \
    }

#define DEF_KERNELS(name, type, blk, qk) DEF_BLOCK_KERNELS(name, blk, qk) DEF_MULTI_KERNELS(name, blk, qk)
LM_BLOCK_TYPES(DEF_KERNELS)
#undef DEF_KERNELS

/* ------------------------------------------------------------------ element types */
T256 static inline __m256 y_load_f16(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

T256 static inline __m256 y_load_bf16(const uint8_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

T256 static inline __m256 y_load_f32(const uint8_t *p) {
    return _mm256_loadu_ps((const float *)p);
}

#define DEF_ELEM_KERNELS(name, esize, conv)                                                        \
    T256 static float y_dot_##name(const void *row, const float *x, int64_t n) {                   \
        const uint8_t *p = row;                                                                    \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                 \
        int64_t i = 0;                                                                             \
        for (; i + 16 <= n; i += 16) {                                                             \
            a0 = _mm256_fmadd_ps(y_load_##name(p + (esize) * i), _mm256_loadu_ps(x + i), a0);      \
            a1 = _mm256_fmadd_ps(y_load_##name(p + (esize) * (i + 8)),                             \
                                 _mm256_loadu_ps(x + i + 8), a1);                                  \
        }                                                                                          \
        float s = y_hsum(_mm256_add_ps(a0, a1));                                                   \
        for (; i < n; i++) {                                                                       \
            float v;                                                                               \
            conv;                                                                                  \
            s += v * x[i];                                                                         \
        }                                                                                          \
        return s;                                                                                  \
    }                                                                                              \
    T256 static void y_deq_##name(const void *src, float *dst, int64_t n) {                        \
        const uint8_t *p = src;                                                                    \
        int64_t i = 0;                                                                             \
        for (; i + 8 <= n; i += 8) {                                                               \
            _mm256_storeu_ps(dst + i, y_load_##name(p + (esize) * i));                             \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            float v;                                                                               \
            conv;                                                                                  \
            dst[i] = v;                                                                            \
        }                                                                                          \
    }

DEF_ELEM_KERNELS(f16, 2, v = lm_f16(p + 2 * i))
DEF_ELEM_KERNELS(bf16, 2, v = lm_bf16_to_float(lm_load_half(p + 2 * i)))
DEF_ELEM_KERNELS(f32, 4, memcpy(&v, p + 4 * i, 4))

/* ------------------------------------------------------------------ f32 vector helpers */
T256 static float y_vdot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    }
    float s = y_hsum(acc);
    for (; i < n; i++) {
        s += a[i] * b[i];
    }
    return s;
}

T256 static void y_vaxpy_f32(float *y, float a, const float *x, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 r = _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i));
        _mm256_storeu_ps(y + i, r);
    }
    for (; i < n; i++) {
        y[i] += a * x[i];
    }
}

T256 static void y_scale_axpy_f32(float *y, float a, float b, float *z, int64_t n) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 s = _mm256_mul_ps(va, _mm256_loadu_ps(y + i));
        _mm256_storeu_ps(y + i, s);
        _mm256_storeu_ps(z + i, _mm256_fmadd_ps(vb, s, _mm256_loadu_ps(z + i)));
    }
    for (; i < n; i++) {
        y[i] *= a;
        z[i] += b * y[i];
    }
}

T256 static void y_axpy2_f32(float *y, float a, const float *x, float b, float *z, int64_t n) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 s = _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i));
        _mm256_storeu_ps(y + i, s);
        _mm256_storeu_ps(z + i, _mm256_fmadd_ps(vb, s, _mm256_loadu_ps(z + i)));
    }
    for (; i < n; i++) {
        y[i] += a * x[i];
        z[i] += b * y[i];
    }
}

T256 static void y_vscale_f32(float *y, float a, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    }
    for (; i < n; i++) {
        y[i] *= a;
    }
}

/* max_ps(v, m) is m where v is NaN: NaNs are skipped, as the portable loop skips them */
T256 static float y_scale_max(float *y, float a, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_mul_ps(va, _mm256_loadu_ps(y + i));
        _mm256_storeu_ps(y + i, v);
        mx = _mm256_max_ps(v, mx);
    }
    __attribute__((aligned(32))) float lanes[8];
    _mm256_store_ps(lanes, mx);
    float best = -INFINITY;
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    for (; i < n; i++) {
        y[i] *= a;
        best = y[i] > best ? y[i] : best;
    }
    return best;
}

/* ------------------------------------------------------------------ exp and activations
 * Same expf as the AVX-512 path; 2^n is built in the exponent bits (n in [-126, 127]). */
T256 static inline __m256 y_exp(__m256 x) {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

/* the first n (< 8) lanes set */
T256 static inline __m256i y_tail_mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

T256 static float y_exp_sum(float *x, int64_t n, float mx) {
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i m = n - i >= 8 ? _mm256_set1_epi32(-1) : y_tail_mask(n - i);
        const __m256 e = y_exp(_mm256_sub_ps(_mm256_maskload_ps(x + i, m), vm));
        _mm256_maskstore_ps(x + i, m, e);
        acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
    }
    return y_hsum(acc);
}

T256 static inline void y_sigmoid_mul(float *out, const float *gate, const float *up, int64_t n,
                                      int gelu) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i m = n - i >= 8 ? _mm256_set1_epi32(-1) : y_tail_mask(n - i);
        const __m256 g = _mm256_maskload_ps(gate + i, m);
        __m256 a;
        if (gelu) {
            const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
            a = _mm256_mul_ps(_mm256_set1_ps(-2.0f * 0.7978845608028654f),
                              _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
        } else {
            a = _mm256_sub_ps(_mm256_setzero_ps(), g);
        }
        const __m256 num = _mm256_mul_ps(g, _mm256_maskload_ps(up + i, m));
        _mm256_maskstore_ps(out + i, m, _mm256_div_ps(num, _mm256_add_ps(one, y_exp(a))));
    }
}

T256 static void y_silu_mul(float *out, const float *gate, const float *up, int64_t n) {
    y_sigmoid_mul(out, gate, up, n, 0);
}

T256 static void y_gelu_mul(float *out, const float *gate, const float *up, int64_t n) {
    y_sigmoid_mul(out, gate, up, n, 1);
}

/* ------------------------------------------------------------------ attention rows
 * K / V rows are f32 or f16 (widened by F16C on load, exactly); `half` is a constant at every
 * call, so each variant compiles to its own loop, and both run the same float operations:
 * rows converted to f32 beforehand give the same bits as the f16 rows. */
T256 static inline __m256 y_ld_kv(const void *base, int64_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)))
                : _mm256_loadu_ps((const float *)base + i);
}

static inline float y_kv_at(const void *base, int64_t i, int half) {
    return half ? lm_f16((const uint16_t *)base + i) : ((const float *)base)[i];
}

/* The four sums of (a0, a1, a2, a3) in one vector, each lane-summed in the same order. */
T256 static inline __m128 y_sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of keys j .. j + nk - 1 (nk 4 or 8) into s; returns vmx with their maximum. */
T256 static inline __attribute__((always_inline)) __m128 y_qk_block(
    const float *q, const void *k, int64_t j, int64_t ks, int hd, __m128 vs, float *s,
    __m128 vmx, int half, const int nk) {
    __m256 a[8];
    for (int r = 0; r < nk; r++) a[r] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int r = 0; r < nk; r++) {
            a[r] = _mm256_fmadd_ps(qv, y_ld_kv(k, (j + r) * ks + d, half), a[r]);
        }
    }
    for (int r = 0; r < nk; r += 4) {
        const __m128 sc = _mm_mul_ps(y_sum4(a[r], a[r + 1], a[r + 2], a[r + 3]), vs);
        vmx = _mm_max_ps(vmx, sc);
        _mm_storeu_ps(s + j + r, sc);
    }
    return vmx;
}

/* Rows this far ahead of the one being read are prefetched: a kv head's rows are strided
 * (every kv head of a position is one cache row), which the hardware prefetchers follow
 * too late for a decode step's attention over a long context. */
#define KV_AHEAD 16

/* The hd elements of a K or V row, from element i of the cache, on their way to L1. */
static inline void kv_prefetch(const void *base, int64_t i, int hd, int half) {
    const char *at = (const char *)base + i * (half ? 2 : 4);
    for (int off = 0; off < hd * (half ? 2 : 4); off += 64) __builtin_prefetch(at + off, 0, 3);
}

/* The rows of keys j + KV_AHEAD .. j + KV_AHEAD + 3 (of nb, ks elements apart) on their way
 * to L1, ahead of a block of four keys. */
static inline void kv_prefetch_four(const void *k, int64_t j, int64_t nb, int64_t ks, int hd,
                                    int half) {
    if (j + KV_AHEAD + 4 <= nb) {
        for (int r = 0; r < 4; r++) kv_prefetch(k, (j + KV_AHEAD + r) * ks, hd, half);
    }
}

/* The largest lane of vmx, the maximum of the scores it has seen. */
T256 static inline float y_max4(__m128 vmx) {
    vmx = _mm_max_ps(vmx, _mm_movehl_ps(vmx, vmx));
    vmx = _mm_max_ss(vmx, _mm_movehdup_ps(vmx));
    return _mm_cvtss_f32(vmx);
}

/* Scores of keys j .. n - 1 one at a time (the keys after the blocks of four, or all of them
 * when hd is not a multiple of eight); returns the maximum of mx and theirs. */
T256 static inline float y_qk_singles(const float *q, const void *k, int64_t ks, int64_t j,
                                      int64_t n, int hd, float scale, float *s, float mx,
                                      int half) {
    for (; j < n; j++) {
        __m256 acc = _mm256_setzero_ps();
        int d = 0;
        for (; d + 8 <= hd; d += 8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), y_ld_kv(k, j * ks + d, half), acc);
        }
        float dot = y_hsum(acc);
        for (; d < hd; d++) {
            dot += q[d] * y_kv_at(k, j * ks + d, half);
        }
        s[j] = dot * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    return mx;
}

T256 static inline float y_qk_scores_kv(const float *q, const void *k, int64_t ks, int64_t n,
                                        int hd, float scale, float *s, int half) {
    float mx = -INFINITY;
    int64_t j = 0;
    if (hd % 8 == 0) {
        const __m128 vs = _mm_set1_ps(scale);
        __m128 vmx = _mm_set1_ps(-INFINITY);
        /* eight keys at a time (eight FMA chains in flight), then four */
        for (; j + 8 <= n; j += 8) vmx = y_qk_block(q, k, j, ks, hd, vs, s, vmx, half, 8);
        for (; j + 4 <= n; j += 4) vmx = y_qk_block(q, k, j, ks, hd, vs, s, vmx, half, 4);
        mx = y_max4(vmx);
    }
    return y_qk_singles(q, k, ks, j, n, hd, scale, s, mx, half);
}

/* The blocks of four keys of NQ (1..3) queries: each key row is read (and widened) once for
 * all of them, and each score gets the operations y_qk_block gives it. */
T256 static inline __attribute__((always_inline)) void y_qk_group(
    const float *const *q, const void *k, int64_t ks, int64_t nb, int hd, __m128 vs,
    float *const *s, __m128 *vmx, int half, const int NQ) {
    for (int64_t j = 0; j < nb; j += 4) {
        kv_prefetch_four(k, j, nb, ks, hd, half);
        __m256 a[3][4];
        for (int t = 0; t < NQ; t++) {
            for (int r = 0; r < 4; r++) a[t][r] = _mm256_setzero_ps();
        }
        for (int d = 0; d < hd; d += 8) {
            for (int r = 0; r < 4; r++) {
                const __m256 kv = y_ld_kv(k, (j + r) * ks + d, half);
                for (int t = 0; t < NQ; t++) {
                    a[t][r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[t] + d), kv, a[t][r]);
                }
            }
        }
        for (int t = 0; t < NQ; t++) {
            const __m128 sc = _mm_mul_ps(y_sum4(a[t][0], a[t][1], a[t][2], a[t][3]), vs);
            vmx[t] = _mm_max_ps(vmx[t], sc);
            _mm_storeu_ps(s[t] + j, sc);
        }
    }
}

/* y_qk_scores_kv for nq queries over the same keys, three at a time. */
T256 static void y_qk_scores_n(const float *const *q, int nq, const void *k, int half, int64_t ks,
                               int64_t n, int hd, float scale, float *const *s, float *mx) {
    if (hd % 8 != 0) {
        for (int i = 0; i < nq; i++) mx[i] = y_qk_scores_kv(q[i], k, ks, n, hd, scale, s[i], half);
        return;
    }
    const __m128 vs = _mm_set1_ps(scale);
    const int64_t nb = n / 4 * 4;
    for (int i = 0; i < nq; i += 3) {
        __m128 vmx[3] = {_mm_set1_ps(-INFINITY), _mm_set1_ps(-INFINITY), _mm_set1_ps(-INFINITY)};
        const int nt = nq - i < 3 ? nq - i : 3;
        if (nt == 3) {
            y_qk_group(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 3);
        } else if (nt == 2) {
            y_qk_group(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 2);
        } else {
            y_qk_group(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 1);
        }
        for (int t = 0; t < nt; t++) {
            mx[i + t] =
                y_qk_singles(q[i + t], k, ks, nb, n, hd, scale, s[i + t], y_max4(vmx[t]), half);
        }
    }
}

/* out[d0 .. d0 + 8 nv) = sum_j p[j] v[j][...]: nv FMA chains, each dim summed over the keys
 * in order (so a pass's width changes no bits). */
T256 static inline __attribute__((always_inline)) void y_pv_pass(const float *p, const void *v,
                                                                 int64_t vs, int64_t n, int d0,
                                                                 float *out, int half,
                                                                 const int nv) {
    __m256 o[8];
    for (int r = 0; r < nv; r++) o[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const int64_t row = j * vs + d0;
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int r = 0; r < nv; r++) {
            o[r] = _mm256_fmadd_ps(pj, y_ld_kv(v, row + 8 * r, half), o[r]);
        }
    }
    for (int r = 0; r < nv; r++) _mm256_storeu_ps(out + d0 + 8 * r, o[r]);
}

T256 static inline void y_pv_sum_kv(const float *p, const void *v, int64_t vs, int64_t n, int hd,
                                    float *out, int half) {
    int d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) y_pv_pass(p, v, vs, n, d0, out, half, 8);
    for (; d0 + 32 <= hd; d0 += 32) y_pv_pass(p, v, vs, n, d0, out, half, 4);
    for (; d0 + 8 <= hd; d0 += 8) y_pv_pass(p, v, vs, n, d0, out, half, 1);
    for (; d0 < hd; d0++) {
        float o = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            o += p[j] * y_kv_at(v, j * vs + d0, half);
        }
        out[d0] = o;
    }
}

/* out[t][d0 .. d0 + 16) for NQ (1..4) queries: each value row is read (and widened) once for
 * all of them, each dimension summed over the keys in order as y_pv_pass sums it. */
T256 static inline __attribute__((always_inline)) void y_pv_group(
    const float *const *p, const void *v, int64_t vs, int64_t n, int hd, int d0,
    float *const *out, int half, const int NQ) {
    __m256 o[4][2];
    for (int t = 0; t < NQ; t++) o[t][0] = o[t][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        if (d0 == 0 && j + KV_AHEAD < n) kv_prefetch(v, (j + KV_AHEAD) * vs, hd, half);
        const __m256 v0 = y_ld_kv(v, j * vs + d0, half), v1 = y_ld_kv(v, j * vs + d0 + 8, half);
        for (int t = 0; t < NQ; t++) {
            const __m256 pj = _mm256_set1_ps(p[t][j]);
            o[t][0] = _mm256_fmadd_ps(pj, v0, o[t][0]);
            o[t][1] = _mm256_fmadd_ps(pj, v1, o[t][1]);
        }
    }
    for (int t = 0; t < NQ; t++) {
        _mm256_storeu_ps(out[t] + d0, o[t][0]);
        _mm256_storeu_ps(out[t] + d0 + 8, o[t][1]);
    }
}

/* y_pv_sum_kv for nq queries over the same values, four at a time. */
T256 static void y_pv_sum_n(const float *const *p, int nq, const void *v, int half, int64_t vs,
                            int64_t n, int hd, float *const *out) {
    if (hd % 16 != 0) {
        for (int i = 0; i < nq; i++) y_pv_sum_kv(p[i], v, vs, n, hd, out[i], half);
        return;
    }
    for (int i = 0; i < nq; i += 4) {
        const int nt = nq - i < 4 ? nq - i : 4;
        for (int d0 = 0; d0 < hd; d0 += 16) {
            switch (nt) {
            case 4: y_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 4); break;
            case 3: y_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 3); break;
            case 2: y_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 2); break;
            default: y_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 1); break;
            }
        }
    }
}

T256 static float y_qk_scores(const float *q, const float *k, int64_t ks, int64_t n, int hd,
                              float scale, float *s) {
    return y_qk_scores_kv(q, k, ks, n, hd, scale, s, 0);
}

T256 static float y_qk_scores_f16(const float *q, const uint16_t *k, int64_t ks, int64_t n,
                                  int hd, float scale, float *s) {
    return y_qk_scores_kv(q, k, ks, n, hd, scale, s, 1);
}

T256 static void y_pv_sum(const float *p, const float *v, int64_t vs, int64_t n, int hd,
                          float *out) {
    y_pv_sum_kv(p, v, vs, n, hd, out, 0);
}

T256 static void y_pv_sum_f16(const float *p, const uint16_t *v, int64_t vs, int64_t n, int hd,
                              float *out) {
    y_pv_sum_kv(p, v, vs, n, hd, out, 1);
}

T256 static void y_f16_to_f32(const uint16_t *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    }
    for (; i < n; i++) {
        y[i] = lm_f16(x + i);
    }
}

T256 static void y_f32_to_f16(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(y + i), h);
    }
    for (; i < n; i++) {
        y[i] = lm_float_to_half(x[i]);
    }
}

/* ------------------------------------------------------------------ int16 activations
 * (the integer path of dotq.c). A group's weights widen to two vectors of 16 int16, madd
 * multiplies them with the activations' int16 in pairs, and the int32 sums (exact) take the
 * group's float factors. */
T256 static void y_quant_x16(const float *x, int64_t n, int16_t *q, float *ds) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < n / 32; g++) {
        const float *xg = x + 32 * g;
        const __m256 v0 = _mm256_loadu_ps(xg), v1 = _mm256_loadu_ps(xg + 8);
        const __m256 v2 = _mm256_loadu_ps(xg + 16), v3 = _mm256_loadu_ps(xg + 24);
        const __m256 a = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
            _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float amax = _mm_cvtss_f32(m);
        const float sum = y_hsum(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
        int16_t *qg = q + 32 * g;
        if (!isfinite(sum) || !isfinite(amax)) {
            ds[2 * g] = ds[2 * g + 1] = NAN;
            memset(qg, 0, 32 * sizeof *qg);
            continue;
        }
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
        /* packs works per 128-bit lane: put the quarters back in order */
        _mm256_storeu_si256((__m256i *)qg,
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8));
        _mm256_storeu_si256((__m256i *)(qg + 16),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8));
        ds[2 * g] = amax / 32767.0f;
        ds[2 * g + 1] = sum;
    }
}

/* ------------------------------------------------------------------ group factors
 * Blocks of 32: the f16 fields, lane 0 the scale and lane 1 the min (F16C). */
T256 static inline __m128 y_half1(const lm_half *p) {
    return _mm_cvtph_ps(_mm_cvtsi32_si128(lm_load_half(p)));
}

T256 static inline __m128 y_half2(const lm_half *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)v));
}

#define y_fac_q4_0(b) y_half1(&(b)->d)
#define y_fac_q4_1(b) y_half2(&(b)->d) /* the min follows the scale */
#define y_fac_q5_0(b) y_half1(&(b)->d)
#define y_fac_q5_1(b) y_half2(&(b)->d)
#define y_fac_q8_0(b) y_half1(&(b)->d)

/* Super-blocks: y_gfac8_<type>(b, fa, fb, fm) gives the eight groups' factors: fa the scale
 * (of the first sixteen for Q6_K), fb Q6_K's scale of the second sixteen, fm the offset. */
T256 static inline void y_deinterleave(const float *p, __m256 *even, __m256 *odd) {
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    /* shuffle works per 128-bit lane: put the 64-bit quarters back in order */
    *even = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *odd = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

/* Q4_K / Q5_K: fa = d * scale_g, fm = -dmin * min_g. */
#define DEF_GFAC_KQ(name, blk)                                                                     \
    T256 static inline void y_gfac8_##name(const blk *b, __m256 *fa, __m256 *fb, __m256 *fm) {     \
        uint8_t u[16];                                                                             \
        lm_kq_unpack(b->scales, u);                                                                \
        *fa = _mm256_mul_ps(y_u8_ps(_mm_loadl_epi64((const __m128i *)u)),                          \
                            _mm256_set1_ps(lm_f16(&b->d)));                                        \
        *fb = _mm256_setzero_ps();                                                                 \
        *fm = _mm256_mul_ps(y_u8_ps(_mm_loadl_epi64((const __m128i *)(u + 8))),                    \
                            _mm256_set1_ps(-lm_f16(&b->dmin)));                                    \
    }
DEF_GFAC_KQ(q4_K, block_q4_K)
DEF_GFAC_KQ(q5_K, block_q5_K)
#undef DEF_GFAC_KQ

/* Q6_K: group g's sixteens use scales 2g and 2g + 1. */
T256 static inline void y_gfac8_q6_K(const block_q6_K *b, __m256 *fa, __m256 *fb, __m256 *fm) {
    float s[16];
    y_scales_q6_K(b, s);
    y_deinterleave(s, fa, fb);
    *fm = _mm256_setzero_ps();
}

/* ------------------------------------------------------------------ group integers
 * y_ints_<type>(b, g, w): group g of block b as int16, elements 0..15 in w[0], 16..31 in w[1]. */
T256 static inline void y_ints_u8(__m128i lo, __m128i hi, __m256i w[2]) {
    w[0] = _mm256_cvtepu8_epi16(lo);
    w[1] = _mm256_cvtepu8_epi16(hi);
}

T256 static inline void y_ints_i8(__m128i lo, __m128i hi, __m256i w[2]) {
    w[0] = _mm256_cvtepi8_epi16(lo);
    w[1] = _mm256_cvtepi8_epi16(hi);
}

/* 16 bytes widened to int16: the low nibbles of each are elements 0..15, the high ones
 * 16..31, separated by one and / one shift. */
T256 static inline __m256i y_bytes_u16(const uint8_t *p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
}

T256 static inline void y_ints_q4_0(const block_q4_0 *b, int g, __m256i w[2]) {
    (void)g;
    const __m256i v = y_bytes_u16(b->qs), off = _mm256_set1_epi16(8);
    w[0] = _mm256_sub_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x0F)), off);
    w[1] = _mm256_sub_epi16(_mm256_srli_epi16(v, 4), off);
}

T256 static inline void y_ints_q4_1(const block_q4_1 *b, int g, __m256i w[2]) {
    (void)g;
    const __m256i v = y_bytes_u16(b->qs);
    w[0] = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    w[1] = _mm256_srli_epi16(v, 4);
}

T256 static inline void y_ints_q5_0(const block_q5_0 *b, int g, __m256i w[2]) {
    (void)g;
    const __m256i q = _mm256_sub_epi8(y_q5_bytes(b->qs, b->qh), _mm256_set1_epi8(16));
    y_ints_i8(y_lo128(q), y_hi128(q), w);
}

T256 static inline void y_ints_q5_1(const block_q5_1 *b, int g, __m256i w[2]) {
    (void)g;
    const __m256i q = y_q5_bytes(b->qs, b->qh);
    y_ints_u8(y_lo128(q), y_hi128(q), w);
}

T256 static inline void y_ints_q8_0(const block_q8_0 *b, int g, __m256i w[2]) {
    (void)g;
    y_ints_i8(_mm_loadu_si128((const __m128i *)b->qs),
              _mm_loadu_si128((const __m128i *)(b->qs + 16)), w);
}

/* Group g of a Q4_K/Q5_K super-block from its 32 bytes (low nibbles for even g, high for
 * odd), widened to int16 before the nibble is picked. */
T256 static inline void y_kq_nibbles16(const uint8_t *qs, int g, __m256i w[2]) {
    const __m256i lo = y_bytes_u16(qs + 32 * (g / 2)), hi = y_bytes_u16(qs + 32 * (g / 2) + 16);
    if (g & 1) {
        w[0] = _mm256_srli_epi16(lo, 4);
        w[1] = _mm256_srli_epi16(hi, 4);
    } else {
        w[0] = _mm256_and_si256(lo, _mm256_set1_epi16(0x0F));
        w[1] = _mm256_and_si256(hi, _mm256_set1_epi16(0x0F));
    }
}

T256 static inline void y_ints_q4_K(const block_q4_K *b, int g, __m256i w[2]) {
    y_kq_nibbles16(b->qs, g, w);
}

T256 static inline void y_ints_q5_K(const block_q5_K *b, int g, __m256i w[2]) {
    /* bit g of each qh byte, moved to bit 4 */
    const __m256i h0 = y_bytes_u16(b->qh), h1 = y_bytes_u16(b->qh + 16);
    const __m256i bit = _mm256_set1_epi16((short)(1 << g));
    y_kq_nibbles16(b->qs, g, w);
    w[0] = _mm256_or_si256(w[0], _mm256_srli_epi16(_mm256_slli_epi16(_mm256_and_si256(h0, bit), 4), g));
    w[1] = _mm256_or_si256(w[1], _mm256_srli_epi16(_mm256_slli_epi16(_mm256_and_si256(h1, bit), 4), g));
}

T256 static inline void y_ints_q6_K(const block_q6_K *b, int g, __m256i w[2]) {
    const __m256i q = y_q6_bytes(b, g);
    y_ints_i8(y_lo128(q), y_hi128(q), w);
}

/* Q2_0 / Q2_0_128: group g is the codes of qs[8 g .. 8 g + 8), minus 1 */
T256 static inline void y_ints_q2(const uint8_t *p, __m256i w[2]) {
    __m128i lo, hi;
    y_q2_ints8(p, &lo, &hi);
    y_ints_i8(lo, hi, w);
}

/* How a type's group factors apply: 0 one scale; 1 a scale and an offset; 2 a scale per
 * sixteen (Q6_K). */
#define Y_FAC_q4_0 0
#define Y_FAC_q4_1 1
#define Y_FAC_q5_0 0
#define Y_FAC_q5_1 1
#define Y_FAC_q8_0 0
#define Y_FAC_q4_K 1
#define Y_FAC_q5_K 1
#define Y_FAC_q6_K 2

T256 static inline __m256 y_lane0(__m128 v) {
    return _mm256_broadcastss_ps(v);
}

/* Every token below runs the same sequence of operations whatever the number of tokens, so
 * a token's result does not depend on the batch it is computed in. */

/* Blocks of 32, two at a time (G and G + 1). A token's integer sums of the two blocks are
 * folded into one vector, block G's four in the low half and G + 1's in the high half, so
 * that one convert and one FMA by the pair's factors (lanes 0 and 2 of p, spread over the
 * halves) serve both; the offsets of Q4_1 / Q5_1 gather in lanes 1 and 3 of off[t]. The
 * weights' integers and factors are prepared once for the NT <= LM_DOTQ_TOKENS tokens.
 * Against a group at a time, this halves the per-token factor work (one load, multiply and
 * spread per pair), which with the two products per group is what several tokens cost:
 * about 10% off the products of a verify or batch pass of up to 8 rows. One accumulator per
 * token: the pair's work covers the FMA's latency. */
#define DEF_DOTQ_32(name, blk)                                                                     \
    T256 static inline __attribute__((always_inline)) void y_dotq_pair_##name(                     \
        const blk *b, int64_t G, const int NT, const int16_t *const *xq, const float *const *ds,   \
        __m256 *acc, __m128 *off) {                                                                \
        __m256i u[2], v[2];                                                                        \
        y_ints_##name(b, 0, u);                                                                    \
        y_ints_##name(b + 1, 0, v);                                                                \
        const __m128 fw = _mm_movelh_ps(y_fac_##name(b), y_fac_##name(b + 1));                     \
        const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);                         \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            const __m256i *x = (const __m256i *)(xq[t] + 32 * G);                                 \
            const __m256i sg = _mm256_add_epi32(_mm256_madd_epi16(u[0], _mm256_loadu_si256(x)),    \
                                                _mm256_madd_epi16(u[1], _mm256_loadu_si256(x + 1))); \
            const __m256i sh = _mm256_add_epi32(_mm256_madd_epi16(v[0], _mm256_loadu_si256(x + 2)), \
                                                _mm256_madd_epi16(v[1], _mm256_loadu_si256(x + 3))); \
            const __m256i s = _mm256_add_epi32(_mm256_blend_epi32(sg, sh, 0xF0),                   \
                                               _mm256_permute2x128_si256(sg, sh, 0x21));           \
            const __m128 p = _mm_mul_ps(fw, _mm_loadu_ps(ds[t] + 2 * G));                          \
            acc[t] = _mm256_fmadd_ps(                                                              \
                _mm256_cvtepi32_ps(s),                                                             \
                _mm256_permutevar8x32_ps(_mm256_castps128_ps256(p), spread), acc[t]);            \
            if (Y_FAC_##name == 1) off[t] = _mm_add_ps(off[t], p);                                 \
        }                                                                                          \
    }                                                                                              \
    /* the last block of a row of an odd count, alone */                                       \
    T256 static inline __attribute__((always_inline)) void y_dotq_last_##name(                     \
        const blk *b, int64_t G, const int NT, const int16_t *const *xq, const float *const *ds,   \
        __m256 *acc, __m128 *off) {                                                                \
        __m256i u[2];                                                                              \
        y_ints_##name(b, 0, u);                                                                    \
        const __m128 fw = y_fac_##name(b);                                                         \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            const __m256i *x = (const __m256i *)(xq[t] + 32 * G);                                 \
            const __m256i sg = _mm256_add_epi32(_mm256_madd_epi16(u[0], _mm256_loadu_si256(x)),    \
                                                _mm256_madd_epi16(u[1], _mm256_loadu_si256(x + 1))); \
            const __m128 p = _mm_mul_ps(                                                           \
                fw, _mm_castpd_ps(_mm_load_sd((const double *)(ds[t] + 2 * G))));                 \
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sg), y_lane0(p), acc[t]);                  \
            if (Y_FAC_##name == 1) off[t] = _mm_add_ps(off[t], p);                                 \
        }                                                                                          \
    }                                                                                              \
    T256 static inline __attribute__((always_inline)) void y_dotq_body_##name(                     \
        const blk *b, const lm_xq *x, int64_t t0, const int NT, float *out, int64_t ldo) {         \
        const int64_t n = x->n, nb = n / 32;                                                       \
        __m256 acc[LM_DOTQ_TOKENS];                                                                \
        __m128 off[LM_DOTQ_TOKENS];                                                                \
        const int16_t *xq[LM_DOTQ_TOKENS];                                                         \
        const float *ds[LM_DOTQ_TOKENS];                                                           \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            acc[t] = _mm256_setzero_ps();                                                          \
            off[t] = _mm_setzero_ps();                                                             \
            xq[t] = x->q + (t0 + t) * n;                                                           \
            ds[t] = x->ds + (t0 + t) * (n / 16);                                                   \
        }                                                                                          \
        int64_t i = 0;                                                                             \
        for (; i + 2 <= nb; i += 2) y_dotq_pair_##name(b + i, i, NT, xq, ds, acc, off);            \
        if (i < nb) y_dotq_last_##name(b + i, i, NT, xq, ds, acc, off);                            \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            const __m128 o = _mm_add_ps(off[t], _mm_movehl_ps(off[t], off[t]));                    \
            out[t * ldo] = y_hsum(acc[t]) + _mm_cvtss_f32(_mm_movehdup_ps(o));                     \
        }                                                                                          \
    }

/* Super-blocks: each token's factors for the super-block's eight groups are multiplied out
 * first, cf[g] = fa[g] * d_g (Q6_K: cf[2g], cf[2g + 1] for its two sixteens), with the
 * offsets' fm[g] * sum_g into off; a group's per-token work is then two madd, one add, one
 * convert and one FMA. */
T256 static inline __attribute__((always_inline)) void y_fold8(const float *ds, __m256 fa,
                                                               __m256 fb, __m256 fm,
                                                               const int fac, float *cf,
                                                               __m256 *off) {
    __m256 d, s;
    y_deinterleave(ds, &d, &s);
    const __m256 f = _mm256_mul_ps(fa, d);
    if (fac == 2) {
        const __m256 h = _mm256_mul_ps(fb, d);
        const __m256 lo = _mm256_unpacklo_ps(f, h), hi = _mm256_unpackhi_ps(f, h);
        _mm256_storeu_ps(cf, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(cf + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    } else {
        _mm256_storeu_ps(cf, f);
    }
    if (fac == 1) *off = _mm256_fmadd_ps(fm, s, *off);
}

#define DEF_DOTQ_KQ(name, blk)                                                                     \
    T256 static inline __attribute__((always_inline)) void y_dotq_grp_##name(                      \
        const blk *b, int g, int64_t G, const int NT, const int16_t *const *xq,                    \
        float (*cf)[16], __m256 *acc) {                                                            \
        __m256i w[2];                                                                              \
        y_ints_##name(b, g, w);                                                                    \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            const __m256i p0 =                                                                     \
                _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)(xq[t] + 32 * G)));    \
            const __m256i p1 = _mm256_madd_epi16(                                                  \
                w[1], _mm256_loadu_si256((const __m256i *)(xq[t] + 32 * G + 16)));                 \
            if (Y_FAC_##name == 2) {                                                               \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0),                                   \
                                         _mm256_broadcast_ss(cf[t] + 2 * g), acc[t]);              \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),                                   \
                                         _mm256_broadcast_ss(cf[t] + 2 * g + 1), acc[t]);          \
            } else {                                                                               \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),             \
                                         _mm256_broadcast_ss(cf[t] + g), acc[t]);                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    T256 static inline __attribute__((always_inline)) void y_dotq_body_##name(                     \
        const blk *b, const lm_xq *x, int64_t t0, const int NT, float *out, int64_t ldo) {         \
        const int64_t n = x->n, nb = n / 256;                                                      \
        __m256 a0[LM_DOTQ_TOKENS], a1[LM_DOTQ_TOKENS], off[LM_DOTQ_TOKENS];                        \
        const int16_t *xq[LM_DOTQ_TOKENS];                                                         \
        const float *ds[LM_DOTQ_TOKENS];                                                           \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            a0[t] = a1[t] = off[t] = _mm256_setzero_ps();                                          \
            xq[t] = x->q + (t0 + t) * n;                                                           \
            ds[t] = x->ds + (t0 + t) * (n / 16);                                                   \
        }                                                                                          \
        float cf[LM_DOTQ_TOKENS][16];                                                              \
        for (int64_t i = 0; i < nb; i++) {                                                         \
            __m256 fa, fb, fm;                                                                     \
            y_gfac8_##name(b + i, &fa, &fb, &fm);                                                  \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                 \
                y_fold8(ds[t] + 16 * i, fa, fb, fm, Y_FAC_##name, cf[t], &off[t]);                 \
            }                                                                                      \
            _Pragma("GCC unroll 8") for (int g = 0; g < 8; g += 2) {                               \
                y_dotq_grp_##name(b + i, g, 8 * i + g, NT, xq, cf, a0);                            \
                y_dotq_grp_##name(b + i, g + 1, 8 * i + g + 1, NT, xq, cf, a1);                    \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            out[t * ldo] = y_hsum(_mm256_add_ps(a0[t], a1[t])) + y_hsum(off[t]);                   \
        }                                                                                          \
    }

/* Q2_0 / Q2_0_128: one scale per block of 2 or 4 groups; per token and group, two madd, one
 * add, one convert and one FMA by the block's scale times the group's step. */
#define DEF_DOTQ_Q2(name, blk, qk)                                                                 \
    T256 static inline __attribute__((always_inline)) void y_dotq_body_##name(                     \
        const blk *b, const lm_xq *x, int64_t t0, const int NT, float *out, int64_t ldo) {         \
        const int64_t n = x->n, nb = n / (qk);                                                     \
        __m256 acc[LM_DOTQ_TOKENS];                                                                \
        const int16_t *xq[LM_DOTQ_TOKENS];                                                         \
        const float *ds[LM_DOTQ_TOKENS];                                                           \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            acc[t] = _mm256_setzero_ps();                                                          \
            xq[t] = x->q + (t0 + t) * n;                                                           \
            ds[t] = x->ds + (t0 + t) * (n / 16);                                                   \
        }                                                                                          \
        for (int64_t i = 0; i < nb; i++) {                                                         \
            const float d = lm_f16(&b[i].d);                                                       \
            for (int g = 0; g < (qk) / 32; g++) {                                                  \
                const int64_t G = i * ((qk) / 32) + g;                                             \
                __m256i w[2];                                                                      \
                y_ints_q2(b[i].qs + 8 * g, w);                                                     \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                             \
                    const __m256i *xg = (const __m256i *)(xq[t] + 32 * G);                        \
                    const __m256i sg =                                                             \
                        _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(xg)),          \
                                         _mm256_madd_epi16(w[1], _mm256_loadu_si256(xg + 1)));     \
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sg),                               \
                                             _mm256_set1_ps(d * ds[t][2 * G]), acc[t]);            \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            out[t * ldo] = y_hsum(acc[t]);                                                         \
        }                                                                                          \
    }

#define DEF_DOTQ_ENTRY(name, blk)                                                                  \
    T256 static void y_dotq_##name(const void *row, const lm_xq *x, int64_t t0, int nt,            \
                                   float *out, int64_t ldo) {                                      \
        const blk *b = row;                                                                        \
        switch (nt) {                                                                              \
        case 1: y_dotq_body_##name(b, x, t0, 1, out, ldo); break;                                  \
        case 2: y_dotq_body_##name(b, x, t0, 2, out, ldo); break;                                  \
        case 3: y_dotq_body_##name(b, x, t0, 3, out, ldo); break;                                  \
        case 4: y_dotq_body_##name(b, x, t0, 4, out, ldo); break;                                  \
        case 5: y_dotq_body_##name(b, x, t0, 5, out, ldo); break;                                  \
        case 6: y_dotq_body_##name(b, x, t0, 6, out, ldo); break;                                  \
        case 7: y_dotq_body_##name(b, x, t0, 7, out, ldo); break;                                  \
        default: y_dotq_body_##name(b, x, t0, 8, out, ldo); break;                                 \
        }                                                                                          \
    }
#define DEF_DOTQ_KERNELS(name, type, blk, qk)                                                      \
    _Static_assert((qk) == 32 || (qk) == 256 || (qk) == QK2 || (qk) == QK2L,                       \
                   "integer products of an unknown block size");                                   \
    DEF_DOTQ_ENTRY(name, blk)
DEF_DOTQ_32(q4_0, block_q4_0)
DEF_DOTQ_32(q4_1, block_q4_1)
DEF_DOTQ_32(q5_0, block_q5_0)
DEF_DOTQ_32(q5_1, block_q5_1)
DEF_DOTQ_32(q8_0, block_q8_0)
DEF_DOTQ_KQ(q4_K, block_q4_K)
DEF_DOTQ_KQ(q5_K, block_q5_K)
DEF_DOTQ_KQ(q6_K, block_q6_K)
DEF_DOTQ_Q2(q2_0, block_q2_0, QK2)
DEF_DOTQ_Q2(q2_0_128, block_q2_0_128, QK2L)
LM_BLOCK_TYPES(DEF_DOTQ_KERNELS)
#undef DEF_DOTQ_KERNELS
#undef DEF_DOTQ_ENTRY
#undef DEF_DOTQ_32
#undef DEF_DOTQ_KQ
#undef DEF_DOTQ_Q2

/* ------------------------------------------------------------------ GEMM micro-kernel
 * 16 weight rows (two vectors) x 6 tokens (broadcasts): 12 accumulators of 16 registers. */
#define Y_MR 16
#define Y_NR 6

T256 static void y_gemm_16x6(const float *a, const float *b, int64_t k, float *c) {
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a;
    __m256 c3a = c0a, c3b = c0a, c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
    for (int64_t p = 0; p < k; p++) {
        const __m256 a0 = _mm256_load_ps(a + p * Y_MR);
        const __m256 a1 = _mm256_load_ps(a + p * Y_MR + 8);
        const float *bp = b + p * Y_NR;
#define STEP(t)                                                                                    \
    do {                                                                                           \
        const __m256 bt = _mm256_broadcast_ss(bp + (t));                                           \
        c##t##a = _mm256_fmadd_ps(a0, bt, c##t##a);                                                \
        c##t##b = _mm256_fmadd_ps(a1, bt, c##t##b);                                                \
    } while (0)
        STEP(0);
        STEP(1);
        STEP(2);
        STEP(3);
        STEP(4);
        STEP(5);
#undef STEP
    }
#define OUT(t)                                                                                     \
    do {                                                                                           \
        _mm256_storeu_ps(c + (t) * Y_MR, c##t##a);                                                 \
        _mm256_storeu_ps(c + (t) * Y_MR + 8, c##t##b);                                             \
    } while (0)
    OUT(0);
    OUT(1);
    OUT(2);
    OUT(3);
    OUT(4);
    OUT(5);
#undef OUT
}

void lm_kernels_avx2(lm_kernels *k) {
#define SET_ELEM(name, type)                                                                       \
    k->dequant[type] = y_deq_##name;                                                               \
    k->dot[type] = y_dot_##name;
#define SET_BLOCK(name, type, blk, qk)                                                             \
    SET_ELEM(name, type)                                                                           \
    k->dotn[type] = y_dotn_##name;
    LM_ELEM_TYPES(SET_ELEM)
    LM_BLOCK_TYPES(SET_BLOCK)
#undef SET_BLOCK
#undef SET_ELEM
    k->gemm = y_gemm_16x6;
    k->mr = Y_MR;
    k->nr = Y_NR;
    k->dot_f32 = y_vdot_f32;
    k->axpy_f32 = y_vaxpy_f32;
    k->scale_axpy_f32 = y_scale_axpy_f32;
    k->axpy2_f32 = y_axpy2_f32;
    k->scale_f32 = y_vscale_f32;
    k->scale_max = y_scale_max;
    k->exp_sum = y_exp_sum;
    k->silu_mul = y_silu_mul;
    k->gelu_mul = y_gelu_mul;
    k->qk_scores = y_qk_scores;
    k->pv_sum = y_pv_sum;
    k->qk_scores_f16 = y_qk_scores_f16;
    k->pv_sum_f16 = y_pv_sum_f16;
    k->qk_scores_n = y_qk_scores_n;
    k->pv_sum_n = y_pv_sum_n;
    k->f32_to_f16 = y_f32_to_f16;
    k->f16_to_f32 = y_f16_to_f32;
    k->quant_x16 = y_quant_x16;
#define SET_DOTQ(name, type, blk, qk) k->dotq[type] = y_dotq_##name;
    LM_BLOCK_TYPES(SET_DOTQ)
#undef SET_DOTQ
}

#undef T256
#undef y_scales_q4_0
#undef y_scales_q4_1
#undef y_scales_q5_0
#undef y_scales_q5_1
#undef y_scales_q8_0
#undef y_scales_q2_0
#undef y_scales_q2_0_128
#undef AFFINE
#undef AFFINE_SUB
#undef DEF_BLOCK_KERNELS
#undef DEF_ELEM_KERNELS
#undef DEF_MULTI_KERNELS
#undef Y_GRP_DECODED
#undef Y_MR
#undef Y_NR
#undef Y_FAC_q4_0
#undef y_fac_q4_0
#undef Y_FAC_q4_1
#undef y_fac_q4_1
#undef Y_FAC_q5_0
#undef y_fac_q5_0
#undef Y_FAC_q5_1
#undef y_fac_q5_1
#undef Y_FAC_q8_0
#undef y_fac_q8_0
#undef Y_FAC_q4_K
#undef Y_FAC_q5_K
#undef Y_FAC_q6_K
#endif /* LM_HAVE_X86 */
