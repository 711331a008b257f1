/*
 * AVX-512 (F, BW, VL) kernels. Compiled with per-function target attributes so the same
 * binary runs on any x86-64; dispatch.c installs them only when the CPU has the features.
 *
 * Every type decodes 32-element groups into two 16-lane vectors. Dequantization (and so the
 * GEMM panels) uses the portable decoder's float operations, bit for bit; dot products fold
 * the scale and offset into one FMA, then FMA the decoded weights with x. Attention rows keep
 * the AVX2 kernels, whose f32 and f16 variants run the same float operations.
 */
#include "lm_internal.h"

#if LM_HAVE_X86
#include <immintrin.h>
#include <math.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* ------------------------------------------------------------------ helpers */
T512 static inline float z_half1(lm_half h) {
    return _cvtsh_ss(h);
}

T512 static inline __m512 z_u8_ps(__m128i v) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}

T512 static inline __m512 z_i8_ps(__m128i v) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

T512 static inline __m128i z_lo128(__m256i v) {
    return _mm256_castsi256_si128(v);
}

T512 static inline __m128i z_hi128(__m256i v) {
    return _mm256_extracti128_si256(v, 1);
}

/* ------------------------------------------------------------------ 32-element groups
 * lm_scales_<type>(b, s) reads a block's scales into floats (SIMD code broadcasts them straight
 * from memory, which keeps the shuffle port free); z_dec_<type>(b, g, s, w, fused) decodes group g
 * into w[0..1]. fused = 0 rounds exactly like the portable decoder (dequantize, GEMM panels);
 * fused = 1 folds "q * d + m" into one FMA (dot products: one op less, one rounding less). */
#define AFFINE(q, d, m, fused)                                                                     \
    ((fused) ? _mm512_fmadd_ps((q), (d), (m)) : _mm512_add_ps(_mm512_mul_ps((q), (d)), (m)))
#define AFFINE_SUB(q, d, m, fused)                                                                 \
    ((fused) ? _mm512_fmsub_ps((q), (d), (m)) : _mm512_sub_ps(_mm512_mul_ps((d), (q)), (m)))

T512 static inline void z_dec_q4_0(const block_q4_0 *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    (void)g;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)b->qs);
    const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
    const __m512 d = _mm512_set1_ps(s[0]);
    if (fused) { /* q * d - 8 d */
        const __m512 m = _mm512_set1_ps(s[1]);
        w[0] = _mm512_fmadd_ps(z_u8_ps(lo), d, m);
        w[1] = _mm512_fmadd_ps(z_u8_ps(hi), d, m);
    } else {
        const __m128i off = _mm_set1_epi8(8);
        w[0] = _mm512_mul_ps(z_i8_ps(_mm_sub_epi8(lo, off)), d);
        w[1] = _mm512_mul_ps(z_i8_ps(_mm_sub_epi8(hi, off)), d);
    }
}

T512 static inline void z_dec_q4_1(const block_q4_1 *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    (void)g;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)b->qs);
    const __m512 d = _mm512_set1_ps(s[0]);
    const __m512 m = _mm512_set1_ps(s[1]);
    w[0] = AFFINE(z_u8_ps(_mm_and_si128(q, m4)), d, m, fused);
    w[1] = AFFINE(z_u8_ps(_mm_and_si128(_mm_srli_epi16(q, 4), m4)), d, m, fused);
}

/* Q5: the 16 bytes widened once to 32-bit lanes; nibbles then split with one op each. */
T512 static inline void z_nib_ints(const uint8_t *qs, __m512i out[2]) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    out[0] = _mm512_and_si512(v, _mm512_set1_epi32(0x0F));
    out[1] = _mm512_srli_epi32(v, 4);
}

/* 5th bits: bit i of qh belongs to element i. */
T512 static inline void z_q5_ints(const uint8_t *qs, const uint8_t *qhp, __m512i out[2]) {
    uint32_t qh;
    memcpy(&qh, qhp, sizeof qh);
    const __m512i b16 = _mm512_set1_epi32(16);
    z_nib_ints(qs, out);
    out[0] = _mm512_mask_or_epi32(out[0], (__mmask16)(qh & 0xFFFFu), out[0], b16);
    out[1] = _mm512_mask_or_epi32(out[1], (__mmask16)(qh >> 16), out[1], b16);
}

T512 static inline void z_dec_q5_0(const block_q5_0 *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    (void)g;
    __m512i q[2];
    z_q5_ints(b->qs, b->qh, q);
    const __m512 d = _mm512_set1_ps(s[0]);
    if (fused) { /* q * d - 16 d */
        const __m512 m = _mm512_set1_ps(s[1]);
        w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[0]), d, m);
        w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[1]), d, m);
    } else {
        const __m512i off = _mm512_set1_epi32(16);
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q[0], off)), d);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q[1], off)), d);
    }
}

T512 static inline void z_dec_q5_1(const block_q5_1 *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    (void)g;
    __m512i q[2];
    z_q5_ints(b->qs, b->qh, q);
    const __m512 d = _mm512_set1_ps(s[0]);
    const __m512 m = _mm512_set1_ps(s[1]);
    w[0] = AFFINE(_mm512_cvtepi32_ps(q[0]), d, m, fused);
    w[1] = AFFINE(_mm512_cvtepi32_ps(q[1]), d, m, fused);
}

T512 static inline void z_dec_q8_0(const block_q8_0 *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    (void)g;
    (void)fused;
    const __m512 d = _mm512_set1_ps(s[0]);
    w[0] = _mm512_mul_ps(z_i8_ps(_mm_loadu_si128((const __m128i *)b->qs)), d);
    w[1] = _mm512_mul_ps(z_i8_ps(_mm_loadu_si128((const __m128i *)(b->qs + 16))), d);
}

/* Group g (0..7) of a Q4_K/Q5_K super-block: bytes qs[32 (g/2) ..], nibble g%2, scale g. */
T512 static inline __m256i z_nibbles(const uint8_t *p, int g) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (g & 1))),
                            _mm256_set1_epi8(0x0F));
}

T512 static inline void z_kq_affine(__m256i q, const float *s, int g, __m512 w[2], int fused) {
    const __m512 ds = _mm512_set1_ps(s[g]);
    const __m512 ms = _mm512_set1_ps(s[8 + g]);
    w[0] = AFFINE_SUB(z_u8_ps(z_lo128(q)), ds, ms, fused);
    w[1] = AFFINE_SUB(z_u8_ps(z_hi128(q)), ds, ms, fused);
}

T512 static inline void z_dec_q4_K(const block_q4_K *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    z_kq_affine(z_nibbles(b->qs + 32 * (g / 2), g), s, g, w, fused);
}

T512 static inline void z_dec_q5_K(const block_q5_K *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    const __m256i qh = _mm256_loadu_si256((const __m256i *)b->qh);
    const __m256i h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(g)),
                                       _mm256_set1_epi8(1));
    const __m256i q = _mm256_or_si256(z_nibbles(b->qs + 32 * (g / 2), g), _mm256_slli_epi16(h, 4));
    z_kq_affine(q, s, g, w, fused);
}

/* Group g (0..7): half n = g/4, then gg = g%4 picks the ql half (gg&1), the nibble (gg>>1)
 * and the 2-bit field 2*gg of qh. */
T512 static inline void z_dec_q6_K(const block_q6_K *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    (void)fused;
    const int n = g / 4, gg = g % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * n + 32 * (gg & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * n));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (gg >> 1))),
                                        _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * gg)),
                                        _mm256_set1_epi8(3));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)),
                                      _mm256_set1_epi8(32));
    const float *sc = s + 8 * n + 2 * gg;
    w[0] = _mm512_mul_ps(_mm512_set1_ps(sc[0]), z_i8_ps(z_lo128(q)));
    w[1] = _mm512_mul_ps(_mm512_set1_ps(sc[1]), z_i8_ps(z_hi128(q)));
}

/* Q2_0 / Q2_0_128: group g is the codes of qs[8 g .. 8 g + 8), minus 1 (y_q2_ints8), times
 * the block scale: exact, so fused or not gives the portable decoder's bits. */
T512 static inline void z_dec_q2(const uint8_t *qs, int g, float d, __m512 w[2]) {
    __m128i lo, hi;
    y_q2_ints8(qs + 8 * g, &lo, &hi);
    const __m512 vd = _mm512_set1_ps(d);
    w[0] = _mm512_mul_ps(z_i8_ps(lo), vd);
    w[1] = _mm512_mul_ps(z_i8_ps(hi), vd);
}

T512 static inline void z_dec_q2_0(const block_q2_0 *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    (void)fused;
    z_dec_q2(b->qs, g, s[0], w);
}

T512 static inline void z_dec_q2_0_128(const block_q2_0_128 *b, int g, const float *s,
                                       __m512 w[2], int fused) {
    (void)fused;
    z_dec_q2(b->qs, g, s[0], w);
}

/* K-quant scales: unpack, then widen and scale all sixteen at once. */
T512 static inline void z_scales_kq(const uint8_t *scales, float d, float dmin, float *s) {
    uint8_t u[16];
    lm_kq_unpack(scales, u);
    const __m512 f = z_u8_ps(_mm_loadu_si128((const __m128i *)u));
    const __m512 dm = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castps_pd(_mm512_set1_ps(d)), _mm256_castps_pd(_mm256_set1_ps(dmin)), 1));
    _mm512_storeu_ps(s, _mm512_mul_ps(f, dm));
}

T512 static inline void z_scales_q4_K(const block_q4_K *b, float *s) {
    z_scales_kq(b->scales, lm_f16(&b->d), lm_f16(&b->dmin), s);
}

T512 static inline void z_scales_q5_K(const block_q5_K *b, float *s) {
    z_scales_kq(b->scales, lm_f16(&b->d), lm_f16(&b->dmin), s);
}

T512 static inline void z_scales_q6_K(const block_q6_K *b, float *s) {
    const __m512 f = z_i8_ps(_mm_loadu_si128((const __m128i *)b->scales));
    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_set1_ps(lm_f16(&b->d)), f));
}

#define z_scales_q4_0 lm_scales_q4_0
#define z_scales_q4_1 lm_scales_q4_1
#define z_scales_q5_0 lm_scales_q5_0
#define z_scales_q5_1 lm_scales_q5_1
#define z_scales_q8_0 lm_scales_q8_0
#define z_scales_q2_0 lm_scales_q2_0
#define z_scales_q2_0_128 lm_scales_q2_0_128

/* dot and dequantize over whole blocks of `qk` elements made of qk/32 groups */
#define DEF_BLOCK_KERNELS(name, blk, qk)                                                           \
    /* four accumulators (two groups in flight) hide the FMA latency */                            \
    T512 static float z_dot_##name(const void *row, const float *x, int64_t n) {                   \
        const blk *b = row;                                                                        \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                \
        float s[16], s2[16];                                                                       \
        const int64_t nb = n / (qk);                                                               \
        int64_t i = 0;                                                                             \
        if ((qk) == 32) {                                                                          \
            for (; i + 2 <= nb; i += 2) {                                                          \
                __m512 w[2], v[2];                                                                 \
                z_scales_##name(b + i, s);                                                         \
                z_scales_##name(b + i + 1, s2);                                                    \
                z_dec_##name(b + i, 0, s, w, 1);                                                   \
                z_dec_##name(b + i + 1, 0, s2, v, 1);                                              \
                const float *xb = x + i * 32;                                                      \
                a0 = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb), a0);                               \
                a1 = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 16), a1);                          \
                a2 = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(xb + 32), a2);                          \
                a3 = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(xb + 48), a3);                          \
            }                                                                                      \
        }                                                                                          \
        for (; i < nb; i++) {                                                                      \
            const float *xb = x + i * (qk);                                                        \
            z_scales_##name(b + i, s);                                                             \
            for (int g = 0; g < (qk) / 32; g += 2) {                                               \
                __m512 w[2];                                                                       \
                z_dec_##name(b + i, g, s, w, 1);                                                   \
                a0 = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + 32 * g), a0);                      \
                a1 = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 32 * g + 16), a1);                 \
                if (g + 1 < (qk) / 32) {                                                           \
                    z_dec_##name(b + i, g + 1, s, w, 1);                                           \
                    a2 = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + 32 * g + 32), a2);             \
                    a3 = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 32 * g + 48), a3);             \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));  \
    }                                                                                              \
    T512 static void z_deq_##name(const void *src, float *dst, int64_t n) {                        \
        const blk *b = src;                                                                        \
        float s[16];                                                                               \
        for (int64_t i = 0; i < n / (qk); i++) {                                                   \
            z_scales_##name(b + i, s);                                                             \
            for (int g = 0; g < (qk) / 32; g++) {                                                  \
                __m512 w[2];                                                                       \
                z_dec_##name(b + i, g, s, w, 0);                                                   \
                _mm512_storeu_ps(dst + i * (qk) + 32 * g, w[0]);                                   \
                _mm512_storeu_ps(dst + i * (qk) + 32 * g + 16, w[1]);                              \
            }                                                                                      \
        }                                                                                          \
    }

/* Several tokens per decoded block: two accumulators per token (latency), NT <= 8. */
#define DEF_MULTI_KERNELS(name, blk, qk)                                                           \
    T512 static inline __attribute__((always_inline)) void z_dotn_body_##name(                     \
        const blk *b, const float *x, int64_t ldx, int64_t n, const int NT, float *out,            \
        int64_t ldo) {                                                                             \
        __m512 acc[8][2];                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            acc[t][0] = _mm512_setzero_ps();                                                       \
            acc[t][1] = _mm512_setzero_ps();                                                       \
        }                                                                                          \
        float s[16];                                                                               \
        for (int64_t i = 0; i < n / (qk); i++) {                                                   \
            z_scales_##name(b + i, s);                                                             \
            for (int g = 0; g < (qk) / 32; g++) {                                                  \
                __m512 w[2];                                                                       \
                z_dec_##name(b + i, g, s, w, 1);                                                   \
                const float *xb = x + i * (qk) + 32 * g;                                           \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                             \
                    acc[t][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + t * ldx), acc[t][0]);   \
                    acc[t][1] =                                                                    \
                        _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + t * ldx + 16), acc[t][1]);      \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            out[t * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));              \
        }                                                                                          \
    }                                                                                              \
    T512 static void z_dotn_##name(const void *row, const float *x, int64_t ldx, int64_t n,        \
                                   int nt, float *out, int64_t ldo) {                              \
        const blk *b = row;                                                                        \
        switch (nt) {                                                                              \
        case 1: z_dotn_body_##name(b, x, ldx, n, 1, out, ldo); break;                              \
        case 2: z_dotn_body_##name(b, x, ldx, n, 2, out, ldo); break;                              \
        case 3: z_dotn_body_##name(b, x, ldx, n, 3, out, ldo); break;                              \
        case 4: z_dotn_body_##name(b, x, ldx, n, 4, out, ldo); break;                              \
        case 5: z_dotn_body_##name(b, x, ldx, n, 5, out, ldo); break;                              \
        case 6: z_dotn_body_##name(b, x, ldx, n, 6, out, ldo); break;                              \
        case 7: z_dotn_body_##name(b, x, ldx, n, 7, out, ldo); break;                              \
        default: z_dotn_body_##name(b, x, ldx, n, 8, out, ldo); break;                             \
        }                                                                                          \
    }

#define DEF_KERNELS(name, type, blk, qk) DEF_BLOCK_KERNELS(name, blk, qk) DEF_MULTI_KERNELS(name, blk, qk)
LM_BLOCK_TYPES(DEF_KERNELS)
#undef DEF_KERNELS

/* ------------------------------------------------------------------ element types */
T512 static inline __m512 z_load_f16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

T512 static inline __m512 z_load_bf16(const uint8_t *p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

T512 static inline __m512 z_load_f32(const uint8_t *p) {
    return _mm512_loadu_ps((const float *)p);
}

#define DEF_ELEM_KERNELS(name, esize, conv)                                                        \
    T512 static float z_dot_##name(const void *row, const float *x, int64_t n) {                   \
        const uint8_t *p = row;                                                                    \
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                                 \
        int64_t i = 0;                                                                             \
        for (; i + 32 <= n; i += 32) {                                                             \
            a0 = _mm512_fmadd_ps(z_load_##name(p + (esize) * i), _mm512_loadu_ps(x + i), a0);      \
            a1 = _mm512_fmadd_ps(z_load_##name(p + (esize) * (i + 16)),                            \
                                 _mm512_loadu_ps(x + i + 16), a1);                                 \
        }                                                                                          \
        float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                                     \
        for (; i < n; i++) {                                                                       \
            float v;                                                                               \
            conv;                                                                                  \
            s += v * x[i];                                                                         \
        }                                                                                          \
        return s;                                                                                  \
    }                                                                                              \
    T512 static void z_deq_##name(const void *src, float *dst, int64_t n) {                        \
        const uint8_t *p = src;                                                                    \
        int64_t i = 0;                                                                             \
        for (; i + 16 <= n; i += 16) {                                                             \
            _mm512_storeu_ps(dst + i, z_load_##name(p + (esize) * i));                             \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            float v;                                                                               \
            conv;                                                                                  \
            dst[i] = v;                                                                            \
        }                                                                                          \
    }

DEF_ELEM_KERNELS(f16, 2, v = z_half1(lm_load_half(p + 2 * i)))
DEF_ELEM_KERNELS(bf16, 2, v = lm_bf16_to_float(lm_load_half(p + 2 * i)))
DEF_ELEM_KERNELS(f32, 4, memcpy(&v, p + 4 * i, 4))

/* ------------------------------------------------------------------ f32 vector helpers */
T512 static float z_vdot_f32(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i),
                              acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* ------------------------------------------------------------------ attention rows */
/* The AVX2 attention kernels' float operations on twice the width: a score vector holds two
 * keys' eight-lane sums (reduced as y_qk_block reduces them), a value vector sixteen
 * dimensions, each lane summed over the keys in order. Every output has the AVX2 bits. */

/* Elements d .. d + 7 of rows a and b of a K or V cache, as the two halves of one vector. */
T512 static inline __m512 z_ld_kv2(const void *base, int64_t a, int64_t b, int half) {
    if (half) {
        const uint16_t *h = base;
        const __m256i both = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(h + a))),
            _mm_loadu_si128((const __m128i *)(h + b)), 1);
        return _mm512_cvtph_ps(both);
    }
    const float *f = base;
    return _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(f + a))),
        _mm256_castps_pd(_mm256_loadu_ps(f + b)), 1));
}

T512 static inline __m256 z_hi256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* y_qk_group for NQ (1..6) queries, keys j, j + 1 and j + 2, j + 3 in the halves of two
 * vectors. */
T512 static inline __attribute__((always_inline)) void z_qk_group(
    const float *const *q, const void *k, int64_t ks, int64_t nb, int hd, __m128 vs,
    float *const *s, __m128 *vmx, int half, const int NQ) {
    for (int64_t j = 0; j < nb; j += 4) {
        kv_prefetch_four(k, j, nb, ks, hd, half);
        __m512 a[6][2];
        for (int t = 0; t < NQ; t++) a[t][0] = a[t][1] = _mm512_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            const __m512 k01 = z_ld_kv2(k, j * ks + d, (j + 1) * ks + d, half);
            const __m512 k23 = z_ld_kv2(k, (j + 2) * ks + d, (j + 3) * ks + d, half);
            for (int t = 0; t < NQ; t++) {
                const __m512 qv = _mm512_castpd_ps(
                    _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q[t] + d))));
                a[t][0] = _mm512_fmadd_ps(qv, k01, a[t][0]);
                a[t][1] = _mm512_fmadd_ps(qv, k23, a[t][1]);
            }
        }
        for (int t = 0; t < NQ; t++) {
            const __m128 sc = _mm_mul_ps(y_sum4(_mm512_castps512_ps256(a[t][0]), z_hi256(a[t][0]),
                                                _mm512_castps512_ps256(a[t][1]), z_hi256(a[t][1])),
                                         vs);
            vmx[t] = _mm_max_ps(vmx[t], sc);
            _mm_storeu_ps(s[t] + j, sc);
        }
    }
}

T512 static void z_qk_scores_n(const float *const *q, int nq, const void *k, int half, int64_t ks,
                               int64_t n, int hd, float scale, float *const *s, float *mx) {
    if (hd % 8 != 0) {
        y_qk_scores_n(q, nq, k, half, ks, n, hd, scale, s, mx);
        return;
    }
    const __m128 vs = _mm_set1_ps(scale);
    const int64_t nb = n / 4 * 4;
    for (int i = 0; i < nq; i += 6) {
        __m128 vmx[6];
        for (int t = 0; t < 6; t++) vmx[t] = _mm_set1_ps(-INFINITY);
        const int nt = nq - i < 6 ? nq - i : 6;
        switch (nt) {
        case 6: z_qk_group(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 6); break;
        case 5: z_qk_group(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 5); break;
        case 4: z_qk_group(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 4); break;
        case 3: z_qk_group(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 3); break;
        case 2: z_qk_group(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 2); break;
        default: z_qk_group(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 1); break;
        }
        for (int t = 0; t < nt; t++) {
            mx[i + t] =
                y_qk_singles(q[i + t], k, ks, nb, n, hd, scale, s[i + t], y_max4(vmx[t]), half);
        }
    }
}

T512 static inline __m512 z_ld_kv(const void *base, int64_t i, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)))
                : _mm512_loadu_ps((const float *)base + i);
}

/* y_pv_group for NQ (1..4) queries and 16 NV dimensions from d0. */
T512 static inline __attribute__((always_inline)) void z_pv_group(
    const float *const *p, const void *v, int64_t vs, int64_t n, int hd, int d0,
    float *const *out, int half, const int NQ, const int NV) {
    __m512 o[4][4];
    for (int t = 0; t < NQ; t++) {
        for (int r = 0; r < NV; r++) o[t][r] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < n; j++) {
        if (d0 == 0 && j + KV_AHEAD < n) kv_prefetch(v, (j + KV_AHEAD) * vs, hd, half);
        __m512 vr[4];
        for (int r = 0; r < NV; r++) vr[r] = z_ld_kv(v, j * vs + d0 + 16 * r, half);
        for (int t = 0; t < NQ; t++) {
            const __m512 pj = _mm512_set1_ps(p[t][j]);
            for (int r = 0; r < NV; r++) o[t][r] = _mm512_fmadd_ps(pj, vr[r], o[t][r]);
        }
    }
    for (int t = 0; t < NQ; t++) {
        for (int r = 0; r < NV; r++) _mm512_storeu_ps(out[t] + d0 + 16 * r, o[t][r]);
    }
}

T512 static void z_pv_sum_n(const float *const *p, int nq, const void *v, int half, int64_t vs,
                            int64_t n, int hd, float *const *out) {
    if (hd % 16 != 0) {
        y_pv_sum_n(p, nq, v, half, vs, n, hd, out);
        return;
    }
    for (int i = 0; i < nq; i += 4) {
        const int nt = nq - i < 4 ? nq - i : 4;
        int d0 = 0;
        for (; d0 + 64 <= hd; d0 += 64) {
            switch (nt) {
            case 4: z_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 4, 4); break;
            case 3: z_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 3, 4); break;
            case 2: z_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 2, 4); break;
            default: z_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 1, 4); break;
            }
        }
        for (; d0 < hd; d0 += 16) {
            switch (nt) {
            case 4: z_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 4, 1); break;
            case 3: z_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 3, 1); break;
            case 2: z_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 2, 1); break;
            default: z_pv_group(p + i, v, vs, n, hd, d0, out + i, half, 1, 1); break;
            }
        }
    }
}

T512 static void z_vaxpy_f32(float *y, float a, const float *x, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 r = _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i));
        _mm512_storeu_ps(y + i, r);
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        const __m512 r =
            _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, r);
    }
}

T512 static void z_scale_axpy_f32(float *y, float a, float b, float *z, int64_t n) {
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 s = _mm512_mul_ps(va, _mm512_loadu_ps(y + i));
        _mm512_storeu_ps(y + i, s);
        _mm512_storeu_ps(z + i, _mm512_fmadd_ps(vb, s, _mm512_loadu_ps(z + i)));
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        const __m512 s = _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, s);
        _mm512_mask_storeu_ps(z + i, m, _mm512_fmadd_ps(vb, s, _mm512_maskz_loadu_ps(m, z + i)));
    }
}

T512 static void z_axpy2_f32(float *y, float a, const float *x, float b, float *z, int64_t n) {
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 s = _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i));
        _mm512_storeu_ps(y + i, s);
        _mm512_storeu_ps(z + i, _mm512_fmadd_ps(vb, s, _mm512_loadu_ps(z + i)));
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        const __m512 s =
            _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, s);
        _mm512_mask_storeu_ps(z + i, m, _mm512_fmadd_ps(vb, s, _mm512_maskz_loadu_ps(m, z + i)));
    }
}

T512 static void z_vscale_f32(float *y, float a, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm512_storeu_ps(y + i, _mm512_mul_ps(va, _mm512_loadu_ps(y + i)));
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, y + i)));
    }
}

/* max_ps(v, m) is m where v is NaN: NaNs are skipped, as the portable loop skips them */
T512 static float z_scale_max(float *y, float a, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_mul_ps(va, _mm512_loadu_ps(y + i));
        _mm512_storeu_ps(y + i, v);
        mx = _mm512_max_ps(v, mx);
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, v);
        mx = _mm512_mask_max_ps(mx, m, v, mx);
    }
    return _mm512_reduce_max_ps(mx);
}

/* ------------------------------------------------------------------ exp and activations
 * Cephes-style expf: n = round(x log2 e), r = x - n ln 2 (two-part), degree-6 polynomial,
 * times 2^n; about 1 ulp. Inputs below -87.3 give exactly 0 (masked logits stay 0). */
T512 static inline __m512 z_exp(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(live, p, n);
}

T512 static float z_exp_sum(float *x, int64_t n, float mx) {
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 e = z_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vm));
        _mm512_mask_storeu_ps(x + i, m, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(acc);
}

/* out = gate * up / (1 + exp(-k * a(gate))), a = identity (silu) or the gelu_tanh argument */
T512 static inline void z_sigmoid_mul(float *out, const float *gate, const float *up, int64_t n,
                                      int gelu) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
        __m512 a;
        if (gelu) {
            const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
            a = _mm512_mul_ps(_mm512_set1_ps(-2.0f * 0.7978845608028654f),
                              _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
        } else {
            a = _mm512_sub_ps(_mm512_setzero_ps(), g);
        }
        const __m512 num = _mm512_mul_ps(g, _mm512_maskz_loadu_ps(m, up + i));
        _mm512_mask_storeu_ps(out + i, m, _mm512_div_ps(num, _mm512_add_ps(one, z_exp(a))));
    }
}

T512 static void z_silu_mul(float *out, const float *gate, const float *up, int64_t n) {
    z_sigmoid_mul(out, gate, up, n, 0);
}

T512 static void z_gelu_mul(float *out, const float *gate, const float *up, int64_t n) {
    z_sigmoid_mul(out, gate, up, n, 1);
}

/* ------------------------------------------------------------------ GEMM micro-kernel
 * 32 weight rows (two vectors) x 12 tokens (broadcasts): 24 accumulators of 32 registers. */
#define Z_MR 32
#define Z_NR 12

T512 static void z_gemm_32x12(const float *a, const float *b, int64_t k, float *c) {
    __m512 c0a = _mm512_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a;
    __m512 c3a = c0a, c3b = c0a, c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
    __m512 c6a = c0a, c6b = c0a, c7a = c0a, c7b = c0a, c8a = c0a, c8b = c0a;
    __m512 c9a = c0a, c9b = c0a, c10a = c0a, c10b = c0a, c11a = c0a, c11b = c0a;
    for (int64_t p = 0; p < k; p++) {
        const __m512 a0 = _mm512_load_ps(a + p * Z_MR);
        const __m512 a1 = _mm512_load_ps(a + p * Z_MR + 16);
        const float *bp = b + p * Z_NR;
#define STEP(t)                                                                                    \
    do {                                                                                           \
        const __m512 bt = _mm512_set1_ps(bp[t]);                                                   \
        c##t##a = _mm512_fmadd_ps(a0, bt, c##t##a);                                                \
        c##t##b = _mm512_fmadd_ps(a1, bt, c##t##b);                                                \
    } while (0)
        STEP(0);
        STEP(1);
        STEP(2);
        STEP(3);
        STEP(4);
        STEP(5);
        STEP(6);
        STEP(7);
        STEP(8);
        STEP(9);
        STEP(10);
        STEP(11);
#undef STEP
    }
#define OUT(t)                                                                                     \
    do {                                                                                           \
        _mm512_storeu_ps(c + (t) * Z_MR, c##t##a);                                                 \
        _mm512_storeu_ps(c + (t) * Z_MR + 16, c##t##b);                                            \
    } while (0)
    OUT(0);
    OUT(1);
    OUT(2);
    OUT(3);
    OUT(4);
    OUT(5);
    OUT(6);
    OUT(7);
    OUT(8);
    OUT(9);
    OUT(10);
    OUT(11);
#undef OUT
}

/* The Z_MR rows of tile (row i at tile + i * cols) into the k-major panel a[k * Z_MR + i]:
 * 16 x 16 blocks transposed in registers, the columns past the last whole block one by one. */
T512 static void z_transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + e]: element e of each lane, rows i .. i + 3 */
        for (int j = 0; j < 2; j++) {
            const __m512d lo = _mm512_castps_pd(t[i + j]), hi = _mm512_castps_pd(t[i + j + 2]);
            r[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
            r[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
        }
    }
    for (int i = 0; i < 8; i++) {
        const int lo = (i & 3) + (i & 4) * 2; /* rows 0-3, 8-11 */
        t[i] = _mm512_shuffle_f32x4(r[lo], r[lo + 4], 0x88);
        t[i + 8] = _mm512_shuffle_f32x4(r[lo], r[lo + 4], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 4], 0x88);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 8], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 4], 0xDD);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 8], t[i + 12], 0xDD);
    }
}

T512 static void z_panel_32(const float *tile, int64_t cols, float *a) {
    const int64_t whole = cols & ~(int64_t)15;
    for (int64_t k0 = 0; k0 < whole; k0 += 16) {
        for (int h = 0; h < Z_MR; h += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(tile + (h + i) * cols + k0);
            z_transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(a + (k0 + i) * Z_MR + h, r[i]);
        }
    }
    for (int64_t k = whole; k < cols; k++)
        for (int i = 0; i < Z_MR; i++) a[k * Z_MR + i] = tile[i * cols + k];
}

/* Up to Z_NR rows of n values into a token panel, dst[i * Z_NR + j] = src[j * ld + i] (rows
 * past `rows` zero): 16 columns at a time through the 16 x 16 transposition. */
T512 static void z_pack_nr(const float *src, int64_t ld, int rows, int64_t n, float *dst) {
    const int64_t whole = n & ~(int64_t)15;
    for (int64_t i0 = 0; i0 < whole; i0 += 16) {
        __m512 r[16];
        for (int j = 0; j < 16; j++)
            r[j] = j < rows ? _mm512_loadu_ps(src + j * ld + i0) : _mm512_setzero_ps();
        z_transpose16(r);
        for (int i = 0; i < 16; i++)
            _mm512_mask_storeu_ps(dst + (i0 + i) * Z_NR, (__mmask16)((1u << Z_NR) - 1), r[i]);
    }
    for (int64_t i = whole; i < n; i++)
        for (int j = 0; j < Z_NR; j++) dst[i * Z_NR + j] = j < rows ? src[j * ld + i] : 0.0f;
}

/* ------------------------------------------------------------------ int16 products, VNNI
 * Four groups of 32 at once. x's quads (lm_quads_x16_fn) and the weights of four blocks put
 * elements 8k..8k+7 of group j in the 128-bit lane j of vector k, so that four dpwssd (the
 * int16 pairs multiplied and summed into int32 lanes, exactly) leave each group's sum in its
 * own four lanes: one convert and one FMA by the four groups' factors finish a token's quad.
 * A lane's eight products are the ones the AVX2 kernels sum into the same lane, so the
 * integer sums are theirs; the float sums run in another order. */
#define TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

TVNNI static void z_quads_x16(const int16_t *q, int64_t n, int16_t *q4) {
    const int64_t ng = n / 32;
    for (int64_t g = 0; g < ng; g += 4) {
        __m512i v[4];
        for (int j = 0; j < 4; j++) {
            v[j] = g + j < ng ? _mm512_loadu_si512(q + 32 * (g + j)) : _mm512_setzero_si512();
        }
        /* a 4 x 4 transpose of 128-bit lanes */
        const __m512i t0 = _mm512_shuffle_i64x2(v[0], v[1], 0x44);
        const __m512i t1 = _mm512_shuffle_i64x2(v[0], v[1], 0xEE);
        const __m512i t2 = _mm512_shuffle_i64x2(v[2], v[3], 0x44);
        const __m512i t3 = _mm512_shuffle_i64x2(v[2], v[3], 0xEE);
        int16_t *o = q4 + 32 * g;
        _mm512_storeu_si512(o, _mm512_shuffle_i64x2(t0, t2, 0x88));
        _mm512_storeu_si512(o + 32, _mm512_shuffle_i64x2(t0, t2, 0xDD));
        _mm512_storeu_si512(o + 64, _mm512_shuffle_i64x2(t1, t3, 0x88));
        _mm512_storeu_si512(o + 96, _mm512_shuffle_i64x2(t1, t3, 0xDD));
    }
}

/* 16 bytes at p, p + stride, ... of nb (1..4) blocks in the four 128-bit lanes, zeros past nb */
TVNNI static inline __m512i z_gather16(const uint8_t *p, size_t stride, int nb) {
    __m512i v = _mm512_inserti32x4(_mm512_setzero_si512(), _mm_loadu_si128((const __m128i *)p), 0);
    if (nb > 1) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + stride)), 1);
    if (nb > 2) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 2 * stride)), 2);
    if (nb > 3) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 3 * stride)), 3);
    return v;
}

/* The 32-bit words at p, p + stride, ... of nb blocks (zeros past nb); half: their low 16 bits */
TVNNI static inline __m128i z_gather32(const uint8_t *p, size_t stride, int nb, int half) {
    uint32_t u[4] = {0, 0, 0, 0};
    for (int j = 0; j < nb; j++) {
        if (half) {
            uint16_t h;
            memcpy(&h, p + j * stride, sizeof h);
            u[j] = h;
        } else {
            memcpy(&u[j], p + j * stride, sizeof u[j]);
        }
    }
    return _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]);
}

/* The blocks' factors as 8 floats: the scale of block j in lane 2j, its min (Q4_1 / Q5_1) or
 * 0 in lane 2j + 1. */
#define z_fac4(b, nb, pair) \
    _mm256_cvtph_ps(z_gather32((const uint8_t *)&(b)->d, sizeof *(b), (nb), !(pair)))

/* Nibbles of 16 bytes per lane: w[0] the low ones of bytes 0..7, w[1] of 8..15, w[2] and w[3]
 * the high ones: elements 0..7, 8..15, 16..23, 24..31 of a Q4 / Q5 block. */
TVNNI static inline void z_nibbles4(__m512i q, __m512i w[4]) {
    const __m512i z = _mm512_setzero_si512(), m4 = _mm512_set1_epi16(0x0F);
    const __m512i lo = _mm512_unpacklo_epi8(q, z), hi = _mm512_unpackhi_epi8(q, z);
    w[0] = _mm512_and_si512(lo, m4);
    w[1] = _mm512_and_si512(hi, m4);
    w[2] = _mm512_srli_epi16(lo, 4);
    w[3] = _mm512_srli_epi16(hi, 4);
}

/* Q5: bit 4 of element i of block j is bit i of its qh */
TVNNI static inline void z_q5_high4(__m128i qh, __m512i w[4]) {
    const __m512i words = _mm512_castsi128_si512(qh);
    /* lane 8j + l: the low (lo) or high (hi) half of block j's qh */
    const __m512i lo = _mm512_permutexvar_epi16(
        _mm512_set_epi16(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2,
                         0, 0, 0, 0, 0, 0, 0, 0),
        words);
    const __m512i hi = _mm512_permutexvar_epi16(
        _mm512_set_epi16(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5, 3, 3, 3, 3, 3, 3, 3, 3,
                         1, 1, 1, 1, 1, 1, 1, 1),
        words);
    const __m512i b0 = _mm512_set_epi16(
        128, 64, 32, 16, 8, 4, 2, 1, 128, 64, 32, 16, 8, 4, 2, 1, 128, 64, 32, 16, 8, 4, 2, 1, 128,
        64, 32, 16, 8, 4, 2, 1);
    const __m512i b8 = _mm512_slli_epi16(b0, 8);
    const __m512i h = _mm512_set1_epi16(16);
    w[0] = _mm512_mask_add_epi16(w[0], _mm512_test_epi16_mask(lo, b0), w[0], h);
    w[1] = _mm512_mask_add_epi16(w[1], _mm512_test_epi16_mask(lo, b8), w[1], h);
    w[2] = _mm512_mask_add_epi16(w[2], _mm512_test_epi16_mask(hi, b0), w[2], h);
    w[3] = _mm512_mask_add_epi16(w[3], _mm512_test_epi16_mask(hi, b8), w[3], h);
}

/* z_ints4_<type>(b, nb, w): the integers of blocks b[0..nb) in quad order */
TVNNI static inline void z_ints4_q4_0(const block_q4_0 *b, int nb, __m512i w[4]) {
    z_nibbles4(z_gather16(b->qs, sizeof *b, nb), w);
    for (int k = 0; k < 4; k++) w[k] = _mm512_sub_epi16(w[k], _mm512_set1_epi16(8));
}

TVNNI static inline void z_ints4_q4_1(const block_q4_1 *b, int nb, __m512i w[4]) {
    z_nibbles4(z_gather16(b->qs, sizeof *b, nb), w);
}

TVNNI static inline void z_ints4_q5_0(const block_q5_0 *b, int nb, __m512i w[4]) {
    z_nibbles4(z_gather16(b->qs, sizeof *b, nb), w);
    z_q5_high4(z_gather32(b->qh, sizeof *b, nb, 0), w);
    for (int k = 0; k < 4; k++) w[k] = _mm512_sub_epi16(w[k], _mm512_set1_epi16(16));
}

TVNNI static inline void z_ints4_q5_1(const block_q5_1 *b, int nb, __m512i w[4]) {
    z_nibbles4(z_gather16(b->qs, sizeof *b, nb), w);
    z_q5_high4(z_gather32(b->qh, sizeof *b, nb, 0), w);
}

/* int8 widened by unpacking a byte with itself and shifting it down arithmetically */
TVNNI static inline void z_ints4_q8_0(const block_q8_0 *b, int nb, __m512i w[4]) {
    const __m512i a = z_gather16((const uint8_t *)b->qs, sizeof *b, nb);
    const __m512i c = z_gather16((const uint8_t *)b->qs + 16, sizeof *b, nb);
    w[0] = _mm512_srai_epi16(_mm512_unpacklo_epi8(a, a), 8);
    w[1] = _mm512_srai_epi16(_mm512_unpackhi_epi8(a, a), 8);
    w[2] = _mm512_srai_epi16(_mm512_unpacklo_epi8(c, c), 8);
    w[3] = _mm512_srai_epi16(_mm512_unpackhi_epi8(c, c), 8);
}

#define Z_PAIR_q4_0 0
#define Z_PAIR_q4_1 1
#define Z_PAIR_q5_0 0
#define Z_PAIR_q5_1 1
#define Z_PAIR_q8_0 0

/* Every token runs the same operations whatever the number of tokens (see the AVX2 kernels). */
#define DEF_ZDOTQ_32(name, blk)                                                                    \
    TVNNI static inline __attribute__((always_inline)) void z_dotq_quad_##name(                    \
        const blk *b, int64_t G, const int nb, const int NT, const int16_t *const *x4,            \
        const float *const *ds, __m512 *acc, __m256 *off) {                                        \
        __m512i w[4];                                                                              \
        z_ints4_##name(b, nb, w);                                                                  \
        const __m256 fw = z_fac4(b, nb, Z_PAIR_##name);                                            \
        const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);  \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            const __m512i *x = (const __m512i *)(x4[t] + 32 * G);                                 \
            __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w[0], _mm512_loadu_si512(x));  \
            s = _mm512_dpwssd_epi32(s, w[1], _mm512_loadu_si512(x + 1));                           \
            s = _mm512_dpwssd_epi32(s, w[2], _mm512_loadu_si512(x + 2));                           \
            s = _mm512_dpwssd_epi32(s, w[3], _mm512_loadu_si512(x + 3));                           \
            const __m256 d = nb == 4 ? _mm256_loadu_ps(ds[t] + 2 * G)                              \
                                     : _mm256_maskz_loadu_ps((__mmask8)((1u << (2 * nb)) - 1),    \
                                                             ds[t] + 2 * G);                       \
            const __m256 p = _mm256_mul_ps(fw, d);                                                 \
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),                                        \
                                     _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(p)),     \
                                     acc[t]);                                                      \
            if (Z_PAIR_##name) off[t] = _mm256_add_ps(off[t], p);                                  \
        }                                                                                          \
    }                                                                                              \
    TVNNI static inline __attribute__((always_inline)) void z_dotq_body_##name(                    \
        const blk *b, const lm_xq *x, int64_t t0, const int NT, float *out, int64_t ldo) {         \
        const int64_t n = x->n, nb = n / 32;                                                       \
        __m512 acc[LM_DOTQ_TOKENS];                                                                \
        __m256 off[LM_DOTQ_TOKENS];                                                                \
        const int16_t *x4[LM_DOTQ_TOKENS];                                                         \
        const float *ds[LM_DOTQ_TOKENS];                                                           \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            acc[t] = _mm512_setzero_ps();                                                          \
            off[t] = _mm256_setzero_ps();                                                          \
            x4[t] = x->q4 + (t0 + t) * LM_QUAD_COLS(n);                                            \
            ds[t] = x->ds + (t0 + t) * (n / 16);                                                   \
        }                                                                                          \
        int64_t i = 0;                                                                             \
        for (; i + 4 <= nb; i += 4) z_dotq_quad_##name(b + i, i, 4, NT, x4, ds, acc, off);         \
        if (i < nb) z_dotq_quad_##name(b + i, i, (int)(nb - i), NT, x4, ds, acc, off);             \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            float o = 0.0f;                                                                        \
            if (Z_PAIR_##name) { /* the mins' products, in the odd lanes */                        \
                __m128 v = _mm_add_ps(_mm256_castps256_ps128(off[t]),                              \
                                      _mm256_extractf128_ps(off[t], 1));                           \
                v = _mm_add_ps(v, _mm_movehl_ps(v, v));                                            \
                o = _mm_cvtss_f32(_mm_movehdup_ps(v));                                             \
            }                                                                                      \
            out[t * ldo] = _mm512_reduce_add_ps(acc[t]) + o;                                       \
        }                                                                                          \
    }                                                                                              \
    TVNNI static void z_dotq_##name(const void *row, const lm_xq *x, int64_t t0, int nt,           \
                                    float *out, int64_t ldo) {                                     \
        const blk *b = row;                                                                        \
        switch (nt) {                                                                              \
        case 1: z_dotq_body_##name(b, x, t0, 1, out, ldo); break;                                  \
        case 2: z_dotq_body_##name(b, x, t0, 2, out, ldo); break;                                  \
        case 3: z_dotq_body_##name(b, x, t0, 3, out, ldo); break;                                  \
        case 4: z_dotq_body_##name(b, x, t0, 4, out, ldo); break;                                  \
        case 5: z_dotq_body_##name(b, x, t0, 5, out, ldo); break;                                  \
        case 6: z_dotq_body_##name(b, x, t0, 6, out, ldo); break;                                  \
        case 7: z_dotq_body_##name(b, x, t0, 7, out, ldo); break;                                  \
        default: z_dotq_body_##name(b, x, t0, 8, out, ldo); break;                                 \
        }                                                                                          \
    }
DEF_ZDOTQ_32(q4_0, block_q4_0)
DEF_ZDOTQ_32(q4_1, block_q4_1)
DEF_ZDOTQ_32(q5_0, block_q5_0)
DEF_ZDOTQ_32(q5_1, block_q5_1)
DEF_ZDOTQ_32(q8_0, block_q8_0)
#undef DEF_ZDOTQ_32

/* ------------------------------------------------------------------ int16 products, Q2_0
 * A group's 32 integers (code - 1) widened to one vector of int16; per token, one madd of
 * the group's int16 activations, one convert and one FMA by the block scale times the
 * group's step (AVX-512 BW; x's groups read in order). */
#define DEF_ZDOTQ_Q2(name, blk, qk)                                                                \
    T512 static inline __attribute__((always_inline)) void z_dotq_body_##name(                     \
        const blk *b, const lm_xq *x, int64_t t0, const int NT, float *out, int64_t ldo) {         \
        const int64_t n = x->n, nb = n / (qk);                                                     \
        __m512 acc[LM_DOTQ_TOKENS];                                                                \
        const int16_t *xq[LM_DOTQ_TOKENS];                                                         \
        const float *ds[LM_DOTQ_TOKENS];                                                           \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            acc[t] = _mm512_setzero_ps();                                                          \
            xq[t] = x->q + (t0 + t) * n;                                                           \
            ds[t] = x->ds + (t0 + t) * (n / 16);                                                   \
        }                                                                                          \
        for (int64_t i = 0; i < nb; i++) {                                                         \
            const float d = lm_f16(&b[i].d);                                                       \
            for (int g = 0; g < (qk) / 32; g++) {                                                  \
                const int64_t G = i * ((qk) / 32) + g;                                             \
                __m128i lo, hi;                                                                    \
                y_q2_ints8(b[i].qs + 8 * g, &lo, &hi);                                             \
                const __m512i w = _mm512_cvtepi8_epi16(_mm256_set_m128i(hi, lo));                  \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                             \
                    const __m512i sg = _mm512_madd_epi16(w, _mm512_loadu_si512(xq[t] + 32 * G));   \
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sg),                               \
                                             _mm512_set1_ps(d * ds[t][2 * G]), acc[t]);            \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            out[t * ldo] = _mm512_reduce_add_ps(acc[t]);                                           \
        }                                                                                          \
    }                                                                                              \
    T512 static void z_dotq_##name(const void *row, const lm_xq *x, int64_t t0, int nt,            \
                                   float *out, int64_t ldo) {                                      \
        const blk *b = row;                                                                        \
        switch (nt) {                                                                              \
        case 1: z_dotq_body_##name(b, x, t0, 1, out, ldo); break;                                  \
        case 2: z_dotq_body_##name(b, x, t0, 2, out, ldo); break;                                  \
        case 3: z_dotq_body_##name(b, x, t0, 3, out, ldo); break;                                  \
        case 4: z_dotq_body_##name(b, x, t0, 4, out, ldo); break;                                  \
        case 5: z_dotq_body_##name(b, x, t0, 5, out, ldo); break;                                  \
        case 6: z_dotq_body_##name(b, x, t0, 6, out, ldo); break;                                  \
        case 7: z_dotq_body_##name(b, x, t0, 7, out, ldo); break;                                  \
        default: z_dotq_body_##name(b, x, t0, 8, out, ldo); break;                                 \
        }                                                                                          \
    }
DEF_ZDOTQ_Q2(q2_0, block_q2_0, QK2)
DEF_ZDOTQ_Q2(q2_0_128, block_q2_0_128, QK2L)
#undef DEF_ZDOTQ_Q2

/* With VNNI, the products of the blocks of 32 read x's quads; the super-blocks keep the AVX2
 * kernels, which read x's groups in order. */
static void z_install_vnni(lm_kernels *k) {
    k->quads_x16 = z_quads_x16;
    k->dotq[LM_Q4_0] = z_dotq_q4_0;
    k->dotq[LM_Q4_1] = z_dotq_q4_1;
    k->dotq[LM_Q5_0] = z_dotq_q5_0;
    k->dotq[LM_Q5_1] = z_dotq_q5_1;
    k->dotq[LM_Q8_0] = z_dotq_q8_0;
    lm_kernels_r16_avx512(k);
}

void lm_kernels_avx512(lm_kernels *k) {
#define SET_ELEM(name, type)                                                                       \
    k->dequant[type] = z_deq_##name;                                                             \
    k->dot[type] = z_dot_##name;
#define SET_BLOCK(name, type, blk, qk)                                                             \
    SET_ELEM(name, type)                                                                           \
    k->dotn[type] = z_dotn_##name;
    LM_ELEM_TYPES(SET_ELEM)
    LM_BLOCK_TYPES(SET_BLOCK)
#undef SET_BLOCK
#undef SET_ELEM
    k->gemm = z_gemm_32x12;
    k->panel = z_panel_32;
    k->pack_nr = z_pack_nr;
    k->mr = Z_MR;
    k->nr = Z_NR;
    k->dot_f32 = z_vdot_f32;
    k->axpy_f32 = z_vaxpy_f32;
    k->scale_axpy_f32 = z_scale_axpy_f32;
    k->axpy2_f32 = z_axpy2_f32;
    k->scale_f32 = z_vscale_f32;
    k->scale_max = z_scale_max;
    k->exp_sum = z_exp_sum;
    k->qk_scores_n = z_qk_scores_n;
    k->pv_sum_n = z_pv_sum_n;
    k->silu_mul = z_silu_mul;
    k->gelu_mul = z_gelu_mul;
    k->dotq[LM_Q2_0] = z_dotq_q2_0;
    k->dotq[LM_Q2_0_128] = z_dotq_q2_0_128;
    if (__builtin_cpu_supports("avx512vnni")) z_install_vnni(k);
}
#undef T512
#undef TVNNI
#undef z_fac4
#undef z_scales_q4_0
#undef z_scales_q4_1
#undef z_scales_q5_0
#undef z_scales_q5_1
#undef z_scales_q8_0
#undef z_scales_q2_0
#undef z_scales_q2_0_128
#undef AFFINE
#undef AFFINE_SUB
#undef Z_MR
#undef Z_NR
#undef DEF_BLOCK_KERNELS
#undef DEF_ELEM_KERNELS
#undef DEF_MULTI_KERNELS
#endif /* LM_HAVE_X86 */
