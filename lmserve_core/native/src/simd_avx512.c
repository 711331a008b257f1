/*
 * AVX-512 (F, BW, VL) kernels. Compiled with per-function target attributes so the same
 * binary runs on any x86-64; dispatch.c installs them only when the CPU has the features.
 *
 * Every type decodes 32-element groups into two 16-lane vectors with the same float
 * operations as the portable decoder (so decoded weights are bit-identical); dot products
 * then FMA the decoded weights with x.
 */
#include "lm_internal.h"

#if LM_HAVE_X86
#include <immintrin.h>

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
#define AFFINE(q, d, m, fused)                                                                 \
    ((fused) ? _mm512_fmadd_ps((q), (d), (m)) : _mm512_add_ps(_mm512_mul_ps((q), (d)), (m)))
#define AFFINE_SUB(q, d, m, fused)                                                             \
    ((fused) ? _mm512_fmsub_ps((q), (d), (m)) : _mm512_sub_ps(_mm512_mul_ps((d), (q)), (m)))

T512 static inline void z_dec_q4_0(const block_q4_0 *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    (void)g;
    (void)fused;
    const __m128i m4 = _mm_set1_epi8(0x0F), off = _mm_set1_epi8(8);
    const __m128i q = _mm_loadu_si128((const __m128i *)b->qs);
    const __m512 d = _mm512_set1_ps(s[0]);
    w[0] = _mm512_mul_ps(z_i8_ps(_mm_sub_epi8(_mm_and_si128(q, m4), off)), d);
    w[1] = _mm512_mul_ps(z_i8_ps(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), off)), d);
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

/* 5th bits: bit i of qh belongs to element i. */
T512 static inline void z_q5_ints(const uint8_t *qs, const uint8_t *qhp, __m512i out[2]) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    uint32_t qh;
    memcpy(&qh, qhp, sizeof qh);
    const __m512i b16 = _mm512_set1_epi32(16);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, m4));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4));
    out[0] = _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xFFFFu), lo, b16);
    out[1] = _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, b16);
}

T512 static inline void z_dec_q5_0(const block_q5_0 *b, int g, const float *s, __m512 w[2],
                                   int fused) {
    (void)g;
    (void)fused;
    __m512i q[2];
    z_q5_ints(b->qs, b->qh, q);
    const __m512i off = _mm512_set1_epi32(16);
    const __m512 d = _mm512_set1_ps(s[0]);
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q[0], off)), d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q[1], off)), d);
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

/* dot and dequantize over whole blocks of `qk` elements made of qk/32 groups */
#define DEF_BLOCK_KERNELS(name, blk, qk)                                                       \
    T512 static float z_dot_##name(const void *row, const float *x, int64_t n) {              \
        const blk *b = row;                                                                  \
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                           \
        float s[16];                                                                         \
        for (int64_t i = 0; i < n / (qk); i++) {                                             \
            const float *xb = x + i * (qk);                                                  \
            lm_scales_##name(b + i, s);                                                          \
            for (int g = 0; g < (qk) / 32; g++) {                                            \
                __m512 w[2];                                                                 \
                z_dec_##name(b + i, g, s, w, 1);                                             \
                a0 = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + 32 * g), a0);                \
                a1 = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 32 * g + 16), a1);           \
            }                                                                                \
        }                                                                                    \
        return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                                  \
    }                                                                                        \
    T512 static void z_deq_##name(const void *src, float *dst, int64_t n) {                   \
        const blk *b = src;                                                                  \
        float s[16];                                                                         \
        for (int64_t i = 0; i < n / (qk); i++) {                                             \
            lm_scales_##name(b + i, s);                                                          \
            for (int g = 0; g < (qk) / 32; g++) {                                            \
                __m512 w[2];                                                                 \
                z_dec_##name(b + i, g, s, w, 0);                                             \
                _mm512_storeu_ps(dst + i * (qk) + 32 * g, w[0]);                             \
                _mm512_storeu_ps(dst + i * (qk) + 32 * g + 16, w[1]);                        \
            }                                                                                \
        }                                                                                    \
    }

/* Several tokens per decoded block: two accumulators per token (latency), NT <= 8. */
#define DEF_MULTI_KERNELS(name, blk, qk)                                                       \
    T512 static inline __attribute__((always_inline)) void z_dotn_body_##name(              \
        const blk *b, const float *x, int64_t ldx, int64_t n, const int NT, float *out,      \
        int64_t ldo) {                                                                       \
        __m512 acc[8][2];                                                                    \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                              \
            acc[t][0] = _mm512_setzero_ps();                                                 \
            acc[t][1] = _mm512_setzero_ps();                                                 \
        }                                                                                    \
        float s[16];                                                                         \
        for (int64_t i = 0; i < n / (qk); i++) {                                             \
            lm_scales_##name(b + i, s);                                                      \
            for (int g = 0; g < (qk) / 32; g++) {                                            \
                __m512 w[2];                                                                 \
                z_dec_##name(b + i, g, s, w, 1);                                             \
                const float *xb = x + i * (qk) + 32 * g;                                     \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                      \
                    acc[t][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + t * ldx), acc[t][0]); \
                    acc[t][1] =                                                              \
                        _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + t * ldx + 16), acc[t][1]); \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                              \
            out[t * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));        \
        }                                                                                    \
    }                                                                                        \
    T512 static void z_dotn_##name(const void *row, const float *x, int64_t ldx, int64_t n,   \
                                   int nt, float *out, int64_t ldo) {                        \
        const blk *b = row;                                                                  \
        switch (nt) {                                                                        \
        case 1: z_dotn_body_##name(b, x, ldx, n, 1, out, ldo); break;                        \
        case 2: z_dotn_body_##name(b, x, ldx, n, 2, out, ldo); break;                        \
        case 3: z_dotn_body_##name(b, x, ldx, n, 3, out, ldo); break;                        \
        case 4: z_dotn_body_##name(b, x, ldx, n, 4, out, ldo); break;                        \
        case 5: z_dotn_body_##name(b, x, ldx, n, 5, out, ldo); break;                        \
        case 6: z_dotn_body_##name(b, x, ldx, n, 6, out, ldo); break;                        \
        case 7: z_dotn_body_##name(b, x, ldx, n, 7, out, ldo); break;                        \
        default: z_dotn_body_##name(b, x, ldx, n, 8, out, ldo); break;                       \
        }                                                                                    \
    }

DEF_BLOCK_KERNELS(q4_0, block_q4_0, QK)
DEF_BLOCK_KERNELS(q4_1, block_q4_1, QK)
DEF_BLOCK_KERNELS(q5_0, block_q5_0, QK)
DEF_BLOCK_KERNELS(q5_1, block_q5_1, QK)
DEF_BLOCK_KERNELS(q8_0, block_q8_0, QK)
DEF_BLOCK_KERNELS(q4_K, block_q4_K, QKK)
DEF_BLOCK_KERNELS(q5_K, block_q5_K, QKK)
DEF_BLOCK_KERNELS(q6_K, block_q6_K, QKK)
DEF_MULTI_KERNELS(q4_0, block_q4_0, QK)
DEF_MULTI_KERNELS(q4_1, block_q4_1, QK)
DEF_MULTI_KERNELS(q5_0, block_q5_0, QK)
DEF_MULTI_KERNELS(q5_1, block_q5_1, QK)
DEF_MULTI_KERNELS(q8_0, block_q8_0, QK)
DEF_MULTI_KERNELS(q4_K, block_q4_K, QKK)
DEF_MULTI_KERNELS(q5_K, block_q5_K, QKK)
DEF_MULTI_KERNELS(q6_K, block_q6_K, QKK)

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

#define DEF_ELEM_KERNELS(name, esize, conv)                                                    \
    T512 static float z_dot_##name(const void *row, const float *x, int64_t n) {                \
        const uint8_t *p = row;                                                              \
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                           \
        int64_t i = 0;                                                                       \
        for (; i + 32 <= n; i += 32) {                                                       \
            a0 = _mm512_fmadd_ps(z_load_##name(p + (esize) * i), _mm512_loadu_ps(x + i), a0);  \
            a1 = _mm512_fmadd_ps(z_load_##name(p + (esize) * (i + 16)),                        \
                                 _mm512_loadu_ps(x + i + 16), a1);                           \
        }                                                                                    \
        float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                               \
        for (; i < n; i++) {                                                                 \
            float v;                                                                         \
            conv;                                                                            \
            s += v * x[i];                                                                   \
        }                                                                                    \
        return s;                                                                            \
    }                                                                                        \
    T512 static void z_deq_##name(const void *src, float *dst, int64_t n) {                     \
        const uint8_t *p = src;                                                              \
        int64_t i = 0;                                                                       \
        for (; i + 16 <= n; i += 16) {                                                       \
            _mm512_storeu_ps(dst + i, z_load_##name(p + (esize) * i));                         \
        }                                                                                    \
        for (; i < n; i++) {                                                                 \
            float v;                                                                         \
            conv;                                                                            \
            dst[i] = v;                                                                      \
        }                                                                                    \
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

T512 static void z_vaxpy_f32(float *y, float a, const float *x, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        const __m512 r =
            _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, r);
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
#define STEP(t)                                                                                \
    do {                                                                                       \
        const __m512 bt = _mm512_set1_ps(bp[t]);                                              \
        c##t##a = _mm512_fmadd_ps(a0, bt, c##t##a);                                           \
        c##t##b = _mm512_fmadd_ps(a1, bt, c##t##b);                                           \
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
#define OUT(t)                                                                                 \
    do {                                                                                       \
        _mm512_storeu_ps(c + (t) * Z_MR, c##t##a);                                              \
        _mm512_storeu_ps(c + (t) * Z_MR + 16, c##t##b);                                         \
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

void lm_kernels_avx512(lm_kernels *k) {
    k->dequant[LM_F32] = z_deq_f32;
    k->dequant[LM_F16] = z_deq_f16;
    k->dequant[LM_BF16] = z_deq_bf16;
    k->dequant[LM_Q4_0] = z_deq_q4_0;
    k->dequant[LM_Q4_1] = z_deq_q4_1;
    k->dequant[LM_Q5_0] = z_deq_q5_0;
    k->dequant[LM_Q5_1] = z_deq_q5_1;
    k->dequant[LM_Q8_0] = z_deq_q8_0;
    k->dequant[LM_Q4_K] = z_deq_q4_K;
    k->dequant[LM_Q5_K] = z_deq_q5_K;
    k->dequant[LM_Q6_K] = z_deq_q6_K;
    k->dot[LM_F32] = z_dot_f32;
    k->dot[LM_F16] = z_dot_f16;
    k->dot[LM_BF16] = z_dot_bf16;
    k->dot[LM_Q4_0] = z_dot_q4_0;
    k->dot[LM_Q4_1] = z_dot_q4_1;
    k->dot[LM_Q5_0] = z_dot_q5_0;
    k->dot[LM_Q5_1] = z_dot_q5_1;
    k->dot[LM_Q8_0] = z_dot_q8_0;
    k->dot[LM_Q4_K] = z_dot_q4_K;
    k->dot[LM_Q5_K] = z_dot_q5_K;
    k->dot[LM_Q6_K] = z_dot_q6_K;
    k->dotn[LM_Q4_0] = z_dotn_q4_0;
    k->dotn[LM_Q4_1] = z_dotn_q4_1;
    k->dotn[LM_Q5_0] = z_dotn_q5_0;
    k->dotn[LM_Q5_1] = z_dotn_q5_1;
    k->dotn[LM_Q8_0] = z_dotn_q8_0;
    k->dotn[LM_Q4_K] = z_dotn_q4_K;
    k->dotn[LM_Q5_K] = z_dotn_q5_K;
    k->dotn[LM_Q6_K] = z_dotn_q6_K;
    k->gemm = z_gemm_32x12;
    k->mr = Z_MR;
    k->nr = Z_NR;
    k->dot_f32 = z_vdot_f32;
    k->axpy_f32 = z_vaxpy_f32;
    k->scale_f32 = z_vscale_f32;
}
#undef T512
#undef AFFINE
#undef AFFINE_SUB
#undef Z_MR
#undef Z_NR
#undef DEF_BLOCK_KERNELS
#undef DEF_ELEM_KERNELS
#undef DEF_MULTI_KERNELS
#endif /* LM_HAVE_X86 */
