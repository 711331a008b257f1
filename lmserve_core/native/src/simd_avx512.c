/*
 * AVX-512 (F, BW, VL) kernels: simd_x86_body.h over vecf_avx512.h, and the kernels only
 * this ISA has (the GEMM panels' transpositions, and with VNNI the integer products of the
 * blocks of 32). Compiled with per-function target attributes so the same binary runs on
 * any x86-64; dispatch.c installs them only when the CPU has the features, over the AVX2
 * table: the entries that neither this file nor the body defines keep their AVX2 kernels
 * (the attention rows, the f16 conversions, the int16 activations, the super-blocks'
 * integer products).
 */
#include "lm_internal.h"

#if LM_HAVE_X86
#include <immintrin.h>
#include <math.h>

#include "vecf_avx512.h"
#include "simd_x86_body.h"

#define Z_MR (2 * LANES) /* the GEMM tile: rows */
#define Z_NR X_GEMM_NR /* tokens */

/* ------------------------------------------------------------------ GEMM panels */
/* The Z_MR rows of tile (row i at tile + i * cols) into the k-major panel a[k * Z_MR + i]:
 * 16 x 16 blocks transposed in registers, the columns past the last whole block one by one. */
XFN void z_transpose16(__m512 r[16]) {
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

XFN void z_panel_32(const float *tile, int64_t cols, float *a) {
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
XFN void z_pack_nr(const float *src, int64_t ld, int rows, int64_t n, float *dst) {
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
#define z_fac4(b, nb, pair)                                                                        \
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
        const blk *b, int64_t G, const int nb, const int NT, const int16_t *const *x4,             \
        const float *const *ds, __m512 *acc, __m256 *off) {                                        \
        __m512i w[4];                                                                              \
        z_ints4_##name(b, nb, w);                                                                  \
        const __m256 fw = z_fac4(b, nb, Z_PAIR_##name);                                            \
        const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);  \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            const __m512i *x = (const __m512i *)(x4[t] + 32 * G);                                  \
            __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w[0], _mm512_loadu_si512(x));  \
            s = _mm512_dpwssd_epi32(s, w[1], _mm512_loadu_si512(x + 1));                           \
            s = _mm512_dpwssd_epi32(s, w[2], _mm512_loadu_si512(x + 2));                           \
            s = _mm512_dpwssd_epi32(s, w[3], _mm512_loadu_si512(x + 3));                           \
            const __m256 d = nb == 4 ? _mm256_loadu_ps(ds[t] + 2 * G)                              \
                                     : _mm256_maskz_loadu_ps((__mmask8)((1u << (2 * nb)) - 1),     \
                                                             ds[t] + 2 * G);                       \
            const __m256 p = _mm256_mul_ps(fw, d);                                                 \
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),                                        \
                                     _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(p)),     \
                                     acc[t]);                                                      \
            if (Z_PAIR_##name) off[t] = _mm256_add_ps(off[t], p);                                  \
        }                                                                                          \
    }                                                                                              \
    DEF_DOTQ32(TVNNI, name, blk, x->q4, LM_QUAD_COLS(n), 4, z_dotq_quad_##name,                    \
               z_dotq_quad_##name, Z_PAIR_##name)
DEF_ZDOTQ_32(q4_0, block_q4_0)
DEF_ZDOTQ_32(q4_1, block_q4_1)
DEF_ZDOTQ_32(q5_0, block_q5_0)
DEF_ZDOTQ_32(q5_1, block_q5_1)
DEF_ZDOTQ_32(q8_0, block_q8_0)
#undef DEF_ZDOTQ_32

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
    z_kernels_body(k);
    k->panel = z_panel_32;
    k->pack_nr = z_pack_nr;
    if (__builtin_cpu_supports("avx512vnni")) z_install_vnni(k);
}

#undef TVNNI
#undef Z_MR
#undef Z_NR
#undef z_fac4
#undef Z_PAIR_q4_0
#undef Z_PAIR_q4_1
#undef Z_PAIR_q5_0
#undef Z_PAIR_q5_1
#undef Z_PAIR_q8_0
#undef X_NT_SWITCH
#undef DEF_DOTQ32
#include "vecf_end.h"
#endif /* LM_HAVE_X86 */
