/*
 * AVX-512 VNNI products of the interleaved layouts (rows16.c).
 *
 * A tile row's 64 bytes (elements 4R .. 4R + 3 of 16 rows) are widened to words in two
 * vectors (rows 0..7 and 8..15, two lanes a row) and dpwssd'd with the row's four x values
 * broadcast; a block's two vectors of lane pairs fold into one vector of the 16 rows' exact
 * integer sums. The factors are then applied to 16 outputs at once, exactly as the portable
 * products apply them to one: each output has the portable kernels' bits.
 *
 * Up to Z_R16_BYTE_TOKENS tokens, the tile rows are multiplied as bytes instead (dpbusd,
 * four products a lane: each lane is one row's four elements, so there is neither widening
 * nor fold). x = 256 hi + lo (lm_bytes_x16_fn): the low bytes are the unsigned operand
 * against the weights; the high bytes are signed, so against them the weights are made
 * unsigned by an offset C (8 for Q4_0's nibbles, 128 for Q8_0's bytes, none for Q4_1's)
 * that the group's sum of hi takes back out. The sums are the same integers, so the outputs
 * have the same bits. A plain decode step's products (one token) no longer widen the
 * weights, and no token's sums need the fold's shuffles.
 */
#include <math.h>
#include <stdlib.h>

#include "lm_internal.h"

#if LM_HAVE_X86
#include <immintrin.h>

#define TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* tile rows 2c, 2c + 1 of a column as bytes: Q4 from 64 packed bytes, Q8 as they are */
TVNNI static inline void z_r16_rows_q4(const uint8_t *qs, int c, __m512i *r0, __m512i *r1) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i p = _mm512_loadu_si512(qs + 64 * c);
    const __m512i lo = _mm512_and_si512(p, m4), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
    *r0 = _mm512_unpacklo_epi8(lo, hi);
    *r1 = _mm512_unpackhi_epi8(lo, hi);
}

TVNNI static inline void z_r16_rows_q4_0(const void *col, int c, __m512i *r0, __m512i *r1) {
    z_r16_rows_q4(((const r16_q4_0 *)col)->qs, c, r0, r1);
    *r0 = _mm512_sub_epi8(*r0, _mm512_set1_epi8(8));
    *r1 = _mm512_sub_epi8(*r1, _mm512_set1_epi8(8));
}

TVNNI static inline void z_r16_rows_q4_1(const void *col, int c, __m512i *r0, __m512i *r1) {
    z_r16_rows_q4(((const r16_q4_1 *)col)->qs, c, r0, r1);
}

TVNNI static inline void z_r16_rows_q8_0(const void *col, int c, __m512i *r0, __m512i *r1) {
    const int8_t *qs = ((const r16_q8_0 *)col)->qs;
    *r0 = _mm512_loadu_si512(qs + 128 * c);
    *r1 = _mm512_loadu_si512(qs + 128 * c + 64);
}

/* Every line of the column R16_AHEAD bytes on: one thread's stream alone does not keep
 * enough reads in flight to approach the memory bandwidth. */
#define R16_AHEAD 8192
static inline void z_r16_prefetch(const void *col, size_t bytes) {
    const char *at = (const char *)col + R16_AHEAD / bytes * bytes;
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(at + off, 0, 3);
}

/* lane pairs (2n, 2n + 1) of a (rows 0..7) and b (rows 8..15) summed: the 16 rows' sums */
TVNNI static inline __m512i z_r16_fold(__m512i a, __m512i b) {
    const __m512i even =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd =
        _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b),
                            _mm512_permutex2var_epi32(a, odd, b));
}

/* A token's x as bytes (lm_bytes_x16_fn). */
TVNNI static void z_bytes_x16(const int16_t *q, int64_t n, uint8_t *b) {
    int32_t *hsum = (int32_t *)(b + 2 * n);
    for (int64_t g = 0; g < n / 32; g++) {
        const __m512i v = _mm512_loadu_si512(q + 32 * g);
        const __m512i hi = _mm512_srai_epi16(v, 8);
        _mm256_storeu_si256((__m256i *)(b + 32 * g), _mm512_cvtepi16_epi8(v));
        _mm256_storeu_si256((__m256i *)(b + n + 32 * g), _mm512_cvtepi16_epi8(hi));
        hsum[g] = _mm512_reduce_add_epi32(_mm512_madd_epi16(hi, _mm512_set1_epi16(1)));
    }
}

/* tile rows 2c, 2c + 1 as bytes for dpbusd: s0, s1 the weights' integers (signed), u0, u1
 * the same plus the type's Z_R16_C (unsigned) */
TVNNI static inline void z_r16_brows_q4_0(const void *col, int c, __m512i *s0, __m512i *s1,
                                          __m512i *u0, __m512i *u1) {
    z_r16_rows_q4(((const r16_q4_0 *)col)->qs, c, u0, u1);
    *s0 = _mm512_sub_epi8(*u0, _mm512_set1_epi8(8));
    *s1 = _mm512_sub_epi8(*u1, _mm512_set1_epi8(8));
}

TVNNI static inline void z_r16_brows_q4_1(const void *col, int c, __m512i *s0, __m512i *s1,
                                          __m512i *u0, __m512i *u1) {
    z_r16_rows_q4(((const r16_q4_1 *)col)->qs, c, s0, s1);
    *u0 = *s0;
    *u1 = *s1;
}

TVNNI static inline void z_r16_brows_q8_0(const void *col, int c, __m512i *s0, __m512i *s1,
                                          __m512i *u0, __m512i *u1) {
    z_r16_rows_q8_0(col, c, s0, s1);
    *u0 = _mm512_xor_si512(*s0, _mm512_set1_epi8((char)0x80));
    *u1 = _mm512_xor_si512(*s1, _mm512_set1_epi8((char)0x80));
}

#define Z_R16_C_q4_0 8
#define Z_R16_C_q4_1 0
#define Z_R16_C_q8_0 128
/* Most tokens whose products are made of bytes: past 4 the words' kernel was the faster
 * (on SmolLM2's matrices, 2 threads), keeping two sums a token where the bytes keep four. */
#define Z_R16_BYTE_TOKENS 4

static inline int32_t z_r16_quad(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define Z_R16_MINS_q4_0 0
#define Z_R16_MINS_q4_1 1
#define Z_R16_MINS_q8_0 0
#define Z_R16_M_q4_0(c) _mm512_setzero_ps()
#define Z_R16_M_q4_1(c) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c)->m))
#define Z_R16_M_q8_0(c) _mm512_setzero_ps()
/* row n's min as a float (types with mins) */
#define Z_R16_M1_q4_0(c, n) 0.0f
#define Z_R16_M1_q4_1(c, n) lm_f16(&(c)->m[n])
#define Z_R16_M1_q8_0(c, n) 0.0f

#define DEF_ZR16(name, col_t)                                                                      \
    TVNNI static inline __attribute__((always_inline)) void z_r16_body_##name(                     \
        const col_t *w, int64_t ng, const lm_xq *x, int64_t t0, const int NT, float *y,           \
        int64_t ldy) {                                                                             \
        const int64_t K = x->n, nb = K / 32;                                                       \
        const int16_t *xq[LM_DOTQ_TOKENS];                                                         \
        const float *ds[LM_DOTQ_TOKENS];                                                           \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            xq[t] = x->q + (t0 + t) * K;                                                           \
            ds[t] = x->ds + (t0 + t) * (K / 16);                                                   \
        }                                                                                          \
        for (int64_t g = 0; g < ng; g++) {                                                         \
            __m512 acc[LM_DOTQ_TOKENS];                                                            \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();     \
            for (int64_t b = 0; b < nb; b++) {                                                     \
                const col_t *c = w + g * nb + b;                                                   \
                z_r16_prefetch(c, sizeof *c);                                                      \
                __m512i lo[LM_DOTQ_TOKENS], hi[LM_DOTQ_TOKENS];                                    \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                             \
                    lo[t] = _mm512_setzero_si512();                                                \
                    hi[t] = _mm512_setzero_si512();                                                \
                }                                                                                  \
                _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {                              \
                    __m512i r0, r1;                                                                \
                    z_r16_rows_##name(c, k, &r0, &r1);                                             \
                    const __m512i w00 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(r0));          \
                    const __m512i w01 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(r0, 1));    \
                    const __m512i w10 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(r1));          \
                    const __m512i w11 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(r1, 1));    \
                    _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                         \
                        int64_t q0, q1;                                                            \
                        memcpy(&q0, xq[t] + 32 * b + 8 * k, sizeof q0);                            \
                        memcpy(&q1, xq[t] + 32 * b + 8 * k + 4, sizeof q1);                        \
                        const __m512i x0 = _mm512_set1_epi64(q0), x1 = _mm512_set1_epi64(q1);      \
                        lo[t] = _mm512_dpwssd_epi32(lo[t], w00, x0);                               \
                        hi[t] = _mm512_dpwssd_epi32(hi[t], w01, x0);                               \
                        lo[t] = _mm512_dpwssd_epi32(lo[t], w10, x1);                               \
                        hi[t] = _mm512_dpwssd_epi32(hi[t], w11, x1);                               \
                    }                                                                              \
                }                                                                                  \
                const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));       \
                const __m512 m = Z_R16_M_##name(c);                                                \
                (void)m;                                                                           \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                             \
                    const __m512 sum = _mm512_cvtepi32_ps(z_r16_fold(lo[t], hi[t]));               \
                    acc[t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(f, _mm512_set1_ps(ds[t][2 * b])),  \
                                             acc[t]);                                              \
                    if (Z_R16_MINS_##name)                                                         \
                        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(ds[t][2 * b + 1]), acc[t]);     \
                }                                                                                  \
            }                                                                                      \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                   \
                _mm512_storeu_ps(y + t * ldy + 16 * g, acc[t]);                                    \
        }                                                                                          \
    }                                                                                              \
    TVNNI static inline __attribute__((always_inline)) void z_r16_bytes_##name(                    \
        const col_t *w, int64_t ng, const lm_xq *x, int64_t t0, const int NT, float *y,           \
        int64_t ldy) {                                                                             \
        const int64_t K = x->n, nb = K / 32;                                                       \
        const uint8_t *lo[Z_R16_BYTE_TOKENS], *hi[Z_R16_BYTE_TOKENS];                              \
        const int32_t *hs[Z_R16_BYTE_TOKENS];                                                      \
        const float *ds[Z_R16_BYTE_TOKENS];                                                        \
        _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++) {                                     \
            lo[t] = x->b + (t0 + t) * LM_BYTE_COLS(K);                                             \
            hi[t] = lo[t] + K;                                                                     \
            hs[t] = (const int32_t *)(lo[t] + 2 * K);                                              \
            ds[t] = x->ds + (t0 + t) * (K / 16);                                                   \
        }                                                                                          \
        for (int64_t g = 0; g < ng; g++) {                                                         \
            __m512 acc[Z_R16_BYTE_TOKENS];                                                         \
            _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();     \
            for (int64_t b = 0; b < nb; b++) {                                                     \
                const col_t *c = w + g * nb + b;                                                   \
                z_r16_prefetch(c, sizeof *c);                                                      \
                /* two sums of each kind a token, for chains of four dependent products */        \
                __m512i l0[Z_R16_BYTE_TOKENS], l1[Z_R16_BYTE_TOKENS];                              \
                __m512i h0[Z_R16_BYTE_TOKENS], h1[Z_R16_BYTE_TOKENS];                              \
                _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++) {                             \
                    l0[t] = l1[t] = h0[t] = h1[t] = _mm512_setzero_si512();                        \
                }                                                                                  \
                _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {                              \
                    __m512i s0, s1, u0, u1;                                                        \
                    z_r16_brows_##name(c, k, &s0, &s1, &u0, &u1);                                  \
                    _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++) {                         \
                        const int64_t e = 32 * b + 8 * k;                                          \
                        l0[t] = _mm512_dpbusd_epi32(l0[t], _mm512_set1_epi32(z_r16_quad(lo[t] + e)), s0); \
                        l1[t] = _mm512_dpbusd_epi32(l1[t], _mm512_set1_epi32(z_r16_quad(lo[t] + e + 4)), s1); \
                        h0[t] = _mm512_dpbusd_epi32(h0[t], u0, _mm512_set1_epi32(z_r16_quad(hi[t] + e))); \
                        h1[t] = _mm512_dpbusd_epi32(h1[t], u1, _mm512_set1_epi32(z_r16_quad(hi[t] + e + 4))); \
                    }                                                                              \
                }                                                                                  \
                const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));       \
                const __m512 m = Z_R16_M_##name(c);                                                \
                (void)m;                                                                           \
                _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++) {                             \
                    __m512i h = _mm512_add_epi32(h0[t], h1[t]);                                    \
                    if (Z_R16_C_##name)                                                            \
                        h = _mm512_sub_epi32(h, _mm512_set1_epi32(Z_R16_C_##name * hs[t][b]));     \
                    const __m512i isum =                                                           \
                        _mm512_add_epi32(_mm512_slli_epi32(h, 8), _mm512_add_epi32(l0[t], l1[t])); \
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),                             \
                                             _mm512_mul_ps(f, _mm512_set1_ps(ds[t][2 * b])), acc[t]); \
                    if (Z_R16_MINS_##name)                                                         \
                        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(ds[t][2 * b + 1]), acc[t]);     \
                }                                                                                  \
            }                                                                                      \
            _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++)                                   \
                _mm512_storeu_ps(y + t * ldy + 16 * g, acc[t]);                                    \
        }                                                                                          \
    }                                                                                              \
    TVNNI static void z_dotq_r16_##name(const void *w, int64_t ng, const lm_xq *x, int64_t t0,    \
                                        int nt, float *y, int64_t ldy) {                           \
        const col_t *c = w;                                                                        \
        if (x->b != NULL && nt <= Z_R16_BYTE_TOKENS) {                                             \
            switch (nt) {                                                                          \
            case 1: z_r16_bytes_##name(c, ng, x, t0, 1, y, ldy); return;                           \
            case 2: z_r16_bytes_##name(c, ng, x, t0, 2, y, ldy); return;                           \
            case 3: z_r16_bytes_##name(c, ng, x, t0, 3, y, ldy); return;                           \
            default: z_r16_bytes_##name(c, ng, x, t0, 4, y, ldy); return;                          \
            }                                                                                      \
        }                                                                                          \
        switch (nt) {                                                                              \
        case 1: z_r16_body_##name(c, ng, x, t0, 1, y, ldy); break;                                 \
        case 2: z_r16_body_##name(c, ng, x, t0, 2, y, ldy); break;                                 \
        case 3: z_r16_body_##name(c, ng, x, t0, 3, y, ldy); break;                                 \
        case 4: z_r16_body_##name(c, ng, x, t0, 4, y, ldy); break;                                 \
        case 5: z_r16_body_##name(c, ng, x, t0, 5, y, ldy); break;                                 \
        case 6: z_r16_body_##name(c, ng, x, t0, 6, y, ldy); break;                                 \
        case 7: z_r16_body_##name(c, ng, x, t0, 7, y, ldy); break;                                 \
        default: z_r16_body_##name(c, ng, x, t0, 8, y, ldy); break;                                \
        }                                                                                          \
    }                                                                                              \
    /* row n: its four bytes of each tile row gathered, widened, times the factor (+ min) */     \
    TVNNI static void z_deq_r16_##name(const void *w, int64_t cols, int n, float *dst) {          \
        const col_t *col = w;                                                                      \
        __attribute__((aligned(64))) uint8_t tile[512];                                            \
        const __m256i at = _mm256_add_epi32(                                                       \
            _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448), _mm256_set1_epi32(4 * n));    \
        for (int64_t b = 0; b < cols / 32; b++) {                                                  \
            const col_t *c = col + b;                                                              \
            for (int k = 0; k < 4; k++) {                                                          \
                __m512i r0, r1;                                                                    \
                z_r16_rows_##name(c, k, &r0, &r1);                                                 \
                _mm512_store_si512(tile + 128 * k, r0);                                            \
                _mm512_store_si512(tile + 128 * k + 64, r1);                                       \
            }                                                                                      \
            const __m256i q = _mm256_i32gather_epi32((const int *)tile, at, 1);                    \
            const __m512 f = _mm512_set1_ps(lm_f16(&c->d[n]));                                     \
            __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                     \
                                          _mm256_castsi256_si128(q))), f);                         \
            __m512 v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                     \
                                          _mm256_extracti128_si256(q, 1))), f);                    \
            if (Z_R16_MINS_##name) {                                                               \
                const __m512 m = _mm512_set1_ps(Z_R16_M1_##name(c, n));                          \
                v0 = _mm512_add_ps(v0, m);                                                         \
                v1 = _mm512_add_ps(v1, m);                                                         \
            }                                                                                      \
            _mm512_storeu_ps(dst + 32 * b, v0);                                                    \
            _mm512_storeu_ps(dst + 32 * b + 16, v1);                                               \
        }                                                                                          \
    }
DEF_ZR16(q4_0, r16_q4_0)
DEF_ZR16(q4_1, r16_q4_1)
DEF_ZR16(q8_0, r16_q8_0)
#undef DEF_ZR16

/* The 16 rows of a column group straight into the k-major panel of the GEMM: element k of
 * row n at a[k * lda + n]. A tile row's bytes (16 rows x 4 elements) are permuted to 4 x 16
 * (vpermb), and each quarter is widened, converted and scaled like deq_r16 (q * f, then + m):
 * the same values, without a row's gather or the transposition after it. */
#define TVBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")))
#define DEF_ZPANEL(name, col_t)                                                                    \
    TVBMI static void z_panel_r16_##name(const void *w, int64_t cols, float *a, int64_t lda) {    \
        const col_t *col = w;                                                                      \
        const __m512i idx = _mm512_set_epi8(                                                       \
            63, 59, 55, 51, 47, 43, 39, 35, 31, 27, 23, 19, 15, 11, 7, 3,                          \
            62, 58, 54, 50, 46, 42, 38, 34, 30, 26, 22, 18, 14, 10, 6, 2,                          \
            61, 57, 53, 49, 45, 41, 37, 33, 29, 25, 21, 17, 13, 9, 5, 1,                           \
            60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);                          \
        for (int64_t b = 0; b < cols / 32; b++) {                                                  \
            const col_t *c = col + b;                                                              \
            const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));          \
            const __m512 m = Z_R16_M_##name(c);                                                    \
            float *out = a + 32 * b * lda;                                                         \
            for (int k = 0; k < 4; k++) {                                                          \
                __m512i r[2];                                                                      \
                z_r16_rows_##name(c, k, &r[0], &r[1]);                                             \
                for (int h = 0; h < 2; h++) {                                                      \
                    const __m512i t = _mm512_permutexvar_epi8(idx, r[h]);                          \
                    float *at = out + (8 * k + 4 * h) * lda;                                       \
                    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                          \
                        const __m128i q = _mm512_extracti32x4_epi32(t, j);                         \
                        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), f);  \
                        if (Z_R16_MINS_##name) v = _mm512_add_ps(v, m);                            \
                        _mm512_storeu_ps(at + j * lda, v);                                         \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
DEF_ZPANEL(q4_0, r16_q4_0)
DEF_ZPANEL(q4_1, r16_q4_1)
DEF_ZPANEL(q8_0, r16_q8_0)
#undef DEF_ZPANEL

/* ------------------------------------------------------------------ super-blocks
 * Q4_K and Q6_K multiply bytes for every token count: a sub-block's tile rows are unpacked
 * once for the pass's tokens, and each token's sums are of four products a lane, with no
 * fold. Q4_K's nibbles are unsigned, so they need no offset; Q6_K's 6 bits u = q + 32 are
 * multiplied as they are and 32 times the sub-block's sum of x taken back out (the low
 * sums start from it). A sub-block's sums are exact, and its factors apply as rows16.c's. */

/* 16 rows' scale j (0..7) or min j (8..15) of a Q4_K column, from its words unpacked as
 * lm_kq_unpack: o[0] scales 0..3, o[1] scales 4..7, o[2] mins 0..3, o[3] mins 4..7 */
TVNNI static inline void z_q4K_unpack(const r16_q4_K *c, __m512i o[4]) {
    const __m512i w0 = _mm512_loadu_si512(c->sc[0]), w1 = _mm512_loadu_si512(c->sc[1]);
    const __m512i w2 = _mm512_loadu_si512(c->sc[2]);
    const __m512i m6 = _mm512_set1_epi32(0x3f3f3f3f), m4 = _mm512_set1_epi32(0x0f0f0f0f);
    const __m512i m2 = _mm512_set1_epi32(0x03030303);
    o[0] = _mm512_and_si512(w0, m6);
    o[1] = _mm512_or_si512(_mm512_and_si512(w2, m4),
                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), m2), 4));
    o[2] = _mm512_and_si512(w1, m6);
    o[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), m4),
                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), m2), 4));
}

TVNNI static inline __m512 z_q4K_byte(const __m512i o[4], int j, __m512 scale) {
    const __m512i v = _mm512_and_si512(_mm512_srlv_epi32(o[j / 4], _mm512_set1_epi32(8 * (j % 4))),
                                       _mm512_set1_epi32(0xFF));
    return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(v));
}

/* tile rows 4i + 2h, 4i + 2h + 1 of a Q6_K column as their 6-bit values u (0..63) */
TVNNI static inline void z_q6K_rows(const r16_q6_K *c, __m512i qh, int i, int h, __m512i *u0,
                                    __m512i *u1) {
    const __m512i m = _mm512_set1_epi8(0x30);
    z_r16_rows_q4(c->ql, 2 * i + h, u0, u1);
    const __m512i a = h ? qh : _mm512_slli_epi16(qh, 4);
    const __m512i b = h ? _mm512_srli_epi16(qh, 2) : _mm512_slli_epi16(qh, 2);
    *u0 = _mm512_ternarylogic_epi32(*u0, a, m, 0xF8); /* u0 | (a & m) */
    *u1 = _mm512_ternarylogic_epi32(*u1, b, m, 0xF8);
}

#define Z_DOTQ_NT_SWITCH(body)                                                                     \
    switch (nt) {                                                                                  \
    case 1: body(c, ng, x, t0, 1, y, ldy); break;                                                  \
    case 2: body(c, ng, x, t0, 2, y, ldy); break;                                                  \
    case 3: body(c, ng, x, t0, 3, y, ldy); break;                                                  \
    case 4: body(c, ng, x, t0, 4, y, ldy); break;                                                  \
    case 5: body(c, ng, x, t0, 5, y, ldy); break;                                                  \
    case 6: body(c, ng, x, t0, 6, y, ldy); break;                                                  \
    case 7: body(c, ng, x, t0, 7, y, ldy); break;                                                  \
    default: body(c, ng, x, t0, 8, y, ldy); break;                                                 \
    }

/* A token's sums: two of each kind up to 4 tokens (chains of dependent products half as
 * long), one past that (the registers) */
#define Z_K_SPLIT(NT) ((NT) <= 4)

/* Up to Z_R16_BYTE_TOKENS tokens a pass the sums come from bytes; past that from the nibbles
 * widened to words (vpdpwssd, as the blocks of 32: half the broadcasts a token, the 16 rows'
 * sums folded from lane pairs). The integer sums are the same, so are the outputs. */
TVNNI static inline __attribute__((always_inline)) void
z_q4K_body(const r16_q4_K *w, int64_t ng, const lm_xq *x, int64_t t0, const int NT, float *y,
           int64_t ldy) {
    const int64_t K = x->n, nb = K / QKK;
    const int words = NT > Z_R16_BYTE_TOKENS;
    const uint8_t *lo[8], *hi[8];
    const int16_t *xq[8];
    const float *ds[8];
    for (int t = 0; t < NT; t++) {
        lo[t] = x->b + (t0 + t) * LM_BYTE_COLS(K);
        hi[t] = lo[t] + K;
        xq[t] = x->q + (t0 + t) * K;
        ds[t] = x->ds + (t0 + t) * (K / 16);
    }
    for (int64_t g = 0; g < ng; g++) {
        __m512 acc[8];
        for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const r16_q4_K *c = w + g * nb + b;
            z_r16_prefetch(c, sizeof *c);
            __m512i o[4];
            z_q4K_unpack(c, o);
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));
            const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->dmin));
            for (int j = 0; j < 8; j++) {
                __m512i l0[8], l1[8], h0[8], h1[8];
                for (int t = 0; t < NT; t++) {
                    l0[t] = l1[t] = h0[t] = h1[t] = _mm512_setzero_si512();
                }
                for (int k = 0; k < 4; k++) {
                    __m512i r0, r1;
                    z_r16_rows_q4(c->qs + 256 * j, k, &r0, &r1);
                    const int64_t e = QKK * b + 32 * j + 8 * k;
                    if (words) { /* l0: rows 0..7 by lane pairs, h0: rows 8..15 */
                        const __m512i w00 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(r0));
                        const __m512i w01 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(r0, 1));
                        const __m512i w10 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(r1));
                        const __m512i w11 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(r1, 1));
                        for (int t = 0; t < NT; t++) {
                            int64_t q0, q1;
                            memcpy(&q0, xq[t] + e, sizeof q0);
                            memcpy(&q1, xq[t] + e + 4, sizeof q1);
                            const __m512i x0 = _mm512_set1_epi64(q0), x1 = _mm512_set1_epi64(q1);
                            l0[t] = _mm512_dpwssd_epi32(l0[t], w00, x0);
                            h0[t] = _mm512_dpwssd_epi32(h0[t], w01, x0);
                            l0[t] = _mm512_dpwssd_epi32(l0[t], w10, x1);
                            h0[t] = _mm512_dpwssd_epi32(h0[t], w11, x1);
                        }
                        continue;
                    }
                    for (int t = 0; t < NT; t++) {
                        const __m512i x0 = _mm512_set1_epi32(z_r16_quad(lo[t] + e));
                        const __m512i x1 = _mm512_set1_epi32(z_r16_quad(lo[t] + e + 4));
                        const __m512i y0 = _mm512_set1_epi32(z_r16_quad(hi[t] + e));
                        const __m512i y1 = _mm512_set1_epi32(z_r16_quad(hi[t] + e + 4));
                        l0[t] = _mm512_dpbusd_epi32(l0[t], x0, r0);
                        h0[t] = _mm512_dpbusd_epi32(h0[t], r0, y0);
                        l1[t] = _mm512_dpbusd_epi32(l1[t], x1, r1);
                        h1[t] = _mm512_dpbusd_epi32(h1[t], r1, y1);
                    }
                }
                const __m512 f = z_q4K_byte(o, j, d), m = z_q4K_byte(o, 8 + j, dm);
                const int64_t G = 8 * b + j;
                for (int t = 0; t < NT; t++) {
                    const __m512i isum =
                        words ? z_r16_fold(l0[t], h0[t])
                              : _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0[t], h1[t]), 8),
                                                 _mm512_add_epi32(l0[t], l1[t]));
                    const __m512 fd = _mm512_mul_ps(f, _mm512_set1_ps(ds[t][2 * G]));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), fd, acc[t]);
                    acc[t] = _mm512_fnmadd_ps(m, _mm512_set1_ps(ds[t][2 * G + 1]), acc[t]);
                }
            }
        }
        for (int t = 0; t < NT; t++) _mm512_storeu_ps(y + t * ldy + 16 * g, acc[t]);
    }
}

TVNNI static void z_dotq_r16_q4_K(const void *w, int64_t ng, const lm_xq *x, int64_t t0, int nt,
                                  float *y, int64_t ldy) {
    const r16_q4_K *c = w; /* x->b: this table quantizes x with its bytes */
    Z_DOTQ_NT_SWITCH(z_q4K_body)
}

TVNNI static inline __attribute__((always_inline)) void
z_q6K_body(const r16_q6_K *w, int64_t ng, const lm_xq *x, int64_t t0, const int NT, float *y,
           int64_t ldy) {
    const int64_t K = x->n, nb = K / QKK;
    const uint8_t *lo[8], *hi[8];
    const float *ds[8];
    /* -32 times each token's sum of x over each sub-block of 16 (rows up to 16384 columns
     * on the stack) */
    int32_t stack[8 * 1024];
    const size_t n_xs = (size_t)NT * (size_t)(K / 16);
    int32_t(*xs)[K / 16] = n_xs <= 8 * 1024 ? (void *)stack : malloc(n_xs * sizeof(int32_t));
    if (xs == NULL) {
        for (int t = 0; t < NT; t++)
            for (int64_t r = 0; r < 16 * ng; r++) y[t * ldy + r] = NAN;
        return;
    }
    for (int t = 0; t < NT; t++) {
        lo[t] = x->b + (t0 + t) * LM_BYTE_COLS(K);
        hi[t] = lo[t] + K;
        ds[t] = x->ds + (t0 + t) * (K / 16);
        const int16_t *q = x->q + (t0 + t) * K;
        for (int64_t i = 0; i < K / 16; i++) {
            int32_t sum = 0;
            for (int e = 0; e < 16; e++) sum += q[16 * i + e];
            xs[t][i] = -32 * sum;
        }
    }
    for (int64_t g = 0; g < ng; g++) {
        __m512 acc[8];
        for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const r16_q6_K *c = w + g * nb + b;
            z_r16_prefetch(c, sizeof *c);
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));
            for (int i = 0; i < QKK / 16; i++) {
                const __m512i qh = _mm512_loadu_si512(c->qh[i]);
                __m512i l0[8], l1[8], h0[8], h1[8];
                for (int t = 0; t < NT; t++) {
                    l0[t] = _mm512_set1_epi32(xs[t][16 * b + i]);
                    l1[t] = h0[t] = h1[t] = _mm512_setzero_si512();
                }
                for (int h = 0; h < 2; h++) {
                    __m512i u0, u1;
                    z_q6K_rows(c, qh, i, h, &u0, &u1);
                    const int64_t e = QKK * b + 16 * i + 8 * h;
                    for (int t = 0; t < NT; t++) {
                        const __m512i x0 = _mm512_set1_epi32(z_r16_quad(lo[t] + e));
                        const __m512i x1 = _mm512_set1_epi32(z_r16_quad(lo[t] + e + 4));
                        const __m512i y0 = _mm512_set1_epi32(z_r16_quad(hi[t] + e));
                        const __m512i y1 = _mm512_set1_epi32(z_r16_quad(hi[t] + e + 4));
                        l0[t] = _mm512_dpbusd_epi32(l0[t], x0, u0);
                        h0[t] = _mm512_dpbusd_epi32(h0[t], u0, y0);
                        if (Z_K_SPLIT(NT)) {
                            l1[t] = _mm512_dpbusd_epi32(l1[t], x1, u1);
                            h1[t] = _mm512_dpbusd_epi32(h1[t], u1, y1);
                        } else {
                            l0[t] = _mm512_dpbusd_epi32(l0[t], x1, u1);
                            h0[t] = _mm512_dpbusd_epi32(h0[t], u1, y1);
                        }
                    }
                }
                const __m512 f = _mm512_mul_ps(
                    d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                           _mm_loadu_si128((const __m128i *)c->sc[i]))));
                const int64_t G = 8 * b + i / 2;
                for (int t = 0; t < NT; t++) {
                    __m512i h = h0[t], l = l0[t];
                    if (Z_K_SPLIT(NT)) {
                        h = _mm512_add_epi32(h, h1[t]);
                        l = _mm512_add_epi32(l, l1[t]);
                    }
                    const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
                    const __m512 fd = _mm512_mul_ps(f, _mm512_set1_ps(ds[t][2 * G]));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), fd, acc[t]);
                }
            }
        }
        for (int t = 0; t < NT; t++) _mm512_storeu_ps(y + t * ldy + 16 * g, acc[t]);
    }
    if ((void *)xs != (void *)stack) free(xs);
}

TVNNI static void z_dotq_r16_q6_K(const void *w, int64_t ng, const lm_xq *x, int64_t t0, int nt,
                                  float *y, int64_t ldy) {
    const r16_q6_K *c = w; /* x->b: this table quantizes x with its bytes */
    Z_DOTQ_NT_SWITCH(z_q6K_body)
}
#undef Z_K_SPLIT

/* tile bytes of 16 rows x 4 elements (t: element j of the 16 rows in 128-bit lane j) into
 * 4 rows of the panel from `at`: q * f, then - m for Q4_K */
TVBMI static inline void z_panel_tile(__m512i t, __m512 f, __m512 m, int mins, float *at,
                                      int64_t lda) {
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
        const __m128i q = _mm512_extracti32x4_epi32(t, j);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), f);
        if (mins) v = _mm512_sub_ps(v, m);
        _mm512_storeu_ps(at + j * lda, v);
    }
}

#define Z_PANEL_IDX                                                                                \
    _mm512_set_epi8(63, 59, 55, 51, 47, 43, 39, 35, 31, 27, 23, 19, 15, 11, 7, 3, 62, 58, 54, 50,  \
                    46, 42, 38, 34, 30, 26, 22, 18, 14, 10, 6, 2, 61, 57, 53, 49, 45, 41, 37, 33,  \
                    29, 25, 21, 17, 13, 9, 5, 1, 60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16,   \
                    12, 8, 4, 0)

TVBMI static void z_panel_r16_q4_K(const void *w, int64_t cols, float *a, int64_t lda) {
    const r16_q4_K *col = w;
    const __m512i idx = Z_PANEL_IDX;
    for (int64_t b = 0; b < cols / QKK; b++) {
        const r16_q4_K *c = col + b;
        __m512i o[4];
        z_q4K_unpack(c, o);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->dmin));
        for (int j = 0; j < 8; j++) {
            const __m512 f = z_q4K_byte(o, j, d), m = z_q4K_byte(o, 8 + j, dm);
            for (int k = 0; k < 4; k++) {
                __m512i r[2];
                z_r16_rows_q4(c->qs + 256 * j, k, &r[0], &r[1]);
                for (int h = 0; h < 2; h++) {
                    z_panel_tile(_mm512_permutexvar_epi8(idx, r[h]), f, m, 1,
                                 a + (QKK * b + 32 * j + 8 * k + 4 * h) * lda, lda);
                }
            }
        }
    }
}

TVBMI static void z_panel_r16_q6_K(const void *w, int64_t cols, float *a, int64_t lda) {
    const r16_q6_K *col = w;
    const __m512i idx = Z_PANEL_IDX;
    const __m512i off = _mm512_set1_epi8(32);
    for (int64_t b = 0; b < cols / QKK; b++) {
        const r16_q6_K *c = col + b;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));
        for (int i = 0; i < QKK / 16; i++) {
            const __m512 f = _mm512_mul_ps(
                d, _mm512_cvtepi32_ps(
                       _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c->sc[i]))));
            const __m512i qh = _mm512_loadu_si512(c->qh[i]);
            for (int h = 0; h < 2; h++) {
                __m512i r[2];
                z_q6K_rows(c, qh, i, h, &r[0], &r[1]);
                for (int s = 0; s < 2; s++) {
                    const __m512i q = _mm512_sub_epi8(r[s], off);
                    z_panel_tile(_mm512_permutexvar_epi8(idx, q), f, f, 0,
                                 a + (QKK * b + 16 * i + 8 * h + 4 * s) * lda, lda);
                }
            }
        }
    }
}
#undef Z_PANEL_IDX

void lm_kernels_r16_avx512(lm_kernels *k) {
    k->dotq_r16[LM_Q4_0_R16] = z_dotq_r16_q4_0;
    k->dotq_r16[LM_Q4_1_R16] = z_dotq_r16_q4_1;
    k->dotq_r16[LM_Q8_0_R16] = z_dotq_r16_q8_0;
    k->deq_r16[LM_Q4_0_R16] = z_deq_r16_q4_0;
    k->deq_r16[LM_Q4_1_R16] = z_deq_r16_q4_1;
    k->deq_r16[LM_Q8_0_R16] = z_deq_r16_q8_0;
    if (__builtin_cpu_supports("avx512vbmi")) {
        k->panel_r16[LM_Q4_0_R16] = z_panel_r16_q4_0;
        k->panel_r16[LM_Q4_1_R16] = z_panel_r16_q4_1;
        k->panel_r16[LM_Q8_0_R16] = z_panel_r16_q8_0;
        k->panel_r16[LM_Q4_K_R16] = z_panel_r16_q4_K;
        k->panel_r16[LM_Q6_K_R16] = z_panel_r16_q6_K;
    }
    k->dotq_r16[LM_Q4_K_R16] = z_dotq_r16_q4_K;
    k->dotq_r16[LM_Q6_K_R16] = z_dotq_r16_q6_K;
    k->bytes_x16 = z_bytes_x16;
    k->r16_tokens = LM_DOTQ_TOKENS;
    k->r16_fast = 1;
    k->r16_prefill = 1;
}

#undef TVNNI
#undef TVBMI
#undef R16_AHEAD
#undef Z_R16_BYTE_TOKENS
#undef Z_R16_C_q4_0
#undef Z_R16_C_q4_1
#undef Z_R16_C_q8_0
#undef Z_R16_MINS_q4_0
#undef Z_R16_MINS_q4_1
#undef Z_R16_MINS_q8_0
#undef Z_R16_M_q4_0
#undef Z_R16_M_q4_1
#undef Z_R16_M_q8_0
#undef Z_R16_M1_q4_0
#undef Z_R16_M1_q4_1
#undef Z_R16_M1_q8_0
#endif /* LM_HAVE_X86 */
